"""Extraction through the engine against local extraction: speed and equality of the features, side by side.

Run: `python bench/extract_engine.py [--quick] [--dtype float32] [--repeats 1]`
The benchmark setup's regenerated training traffic (bench/common.py: the embedded default, `--quick` the tiny one) is
extracted twice per repeat, the same sequences into the same shards, in `--dtype` (float32 by default, so the
comparison is of the computation, not of rounding): by this process (`extract.engine: local`, the target loaded
with transformers, torch at `--threads`) and by vLLM started for the run (`extract.engine: vllm`,
components/extract_engine.py; the engine's own threads). Each run starts from an empty directory.
Prints one row per engine: tokens, seconds in all, seconds before the first shard began (loading and tokenising;
for vLLM mostly the engine's start), seconds from the first shard's start to the last one's end, tokens/s over
those, and the features' max relative difference to the local ones (max |a - b| / max |a| over all shards,
aux_hidden_states and last_hidden_state); then the ratio vLLM/local.
Writes extract_engine.json (bench/results/, or .eagle/bench/results-quick/ with --quick).
Not measured here: tau of heads trained on either (same features within 1e-5 in fp32: tests/test_extract_engine.py),
GPU engines, several engine replicas, bf16 targets (the engine then runs in bf16; local extraction in fp32).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from safetensors.torch import load_file

from common import base_args, prepare, print_table, start, write_results
from components.extract import FEATURES, extract
from infra.settings import Settings

SHARD = re.compile(r"shard \d+/\d+, (\d+) tokens \(([\d.]+) s\)")


def run(setup, engine: str, dtype: str, out: Path) -> dict:
    """One extraction from scratch into `out`: its timings from the progress lines."""
    shutil.rmtree(out, ignore_errors=True)
    cfg = dataclasses.replace(setup.preset.extract, engine=engine, dtype=dtype, num_workers=0)
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    res = extract(cfg, str(setup.target_dir), str(setup.regen_dir), str(out),
                  progress=lambda s: lines.append((time.perf_counter(), s)), ray_settings=Settings.from_env())
    total = time.perf_counter() - t0
    shards = [(float(m[2]), t) for t, s in lines if (m := SHARD.search(s))]  # (its seconds; when done)
    first = shards[0][1] - shards[0][0] - t0  # before the first shard began: loading, tokenising, engine start
    shard_s = shards[-1][1] - t0 - first  # from the first shard's start to the last one's end
    return {"engine": engine, "tokens": res.n_tokens, "total_s": total, "start_s": first, "shard_s": shard_s,
            "tokens_per_s": res.n_tokens / max(shard_s, 1e-9)}


def max_rel_diff(a_dir: Path, b_dir: Path) -> float:
    worst = 0.0
    for pa in sorted(a_dir.glob("features-*.safetensors")):
        a, b = load_file(str(pa)), load_file(str(b_dir / pa.name))
        for k in FEATURES:
            x, y = a[k].float(), b[k].float()
            worst = max(worst, float((x - y).abs().max() / x.abs().max()))
    return worst


def main() -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", help="stored feature dtype (default float32)")
    p.add_argument("--repeats", type=int, default=1, help="extractions per engine, interleaved")
    args = p.parse_args()
    load = start(args)
    setup = prepare(args.quick, conversations=args.conversations)
    rows: list[dict] = []
    for r in range(args.repeats):
        for engine in ("local", "vllm"):
            row = run(setup, engine, args.dtype, setup.work / f"extract-engine-{engine}")
            rows.append({**row, "repeat": r})
        diff = max_rel_diff(setup.work / "extract-engine-local", setup.work / "extract-engine-vllm")
        rows[-1]["max_rel_diff"] = f"{diff:.1e}"
    cols = ["repeat", "engine", "tokens", "total_s", "start_s", "shard_s", "tokens_per_s", "max_rel_diff"]
    print_table(rows, cols, f"extraction of {rows[0]['tokens']} tokens in {args.dtype}, local vs vLLM "
                f"({setup.preset.name} preset, torch threads {torch.get_num_threads()})")
    med = {e: sorted(x["tokens_per_s"] for x in rows if x["engine"] == e)[args.repeats // 2]
           for e in ("local", "vllm")}
    ratio = med["vllm"] / med["local"]
    print(f"vLLM/local tokens/s over shards (median): {ratio:.2f}x")
    write_results("extract_engine", args.quick, {"dtype": args.dtype, "rows": rows, "vllm_over_local": ratio}, load)


if __name__ == "__main__":
    main()
