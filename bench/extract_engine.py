"""Extraction through the engine against local extraction: speed and equality of the features, side by side.

Run: `python bench/extract_engine.py [--quick] [--dtype float32] [--repeats 1] [--replicas 2] [--seqs-per-shard N]`
The benchmark setup's regenerated training traffic (bench/common.py: the embedded default, `--quick` the tiny one) is
extracted twice per repeat, the same sequences into the same shards, in `--dtype` (float32 by default, so the
comparison is of the computation, not of rounding): by this process (`extract.engine: local`, the target loaded
with transformers, torch at `--threads`) and by vLLM started for the run (`extract.engine: vllm`,
components/extract/engine.py; the engine's own threads); with `--replicas N` (N > 1) a third time by N vLLM
replicas on a local Ray (`extract.engine_replicas`, one engine per actor). Each run starts from an empty directory.
Prints one row per run: tokens, seconds in all, seconds before the first shard began (loading and tokenising;
for vLLM mostly the engine's start), and tokens/s in the steady state: over the shards after the first R (R = the
run's engines, 1 but for replicas, whose first shard each includes its engine's start, as the driver times a
shard from dispatch to return), from the earliest start of those to the last end; and the features' max relative
difference to the local ones (max |a - b| / max |a| over all shards, aux_hidden_states and last_hidden_state); then
the ratios vLLM/local and, with replicas, N replicas / one engine. `--seqs-per-shard` sets the shard size (the
steady state needs several shards per engine).
Writes extract_engine.json (bench/results/, or .eagle/bench/results-quick/ with --quick).
Not measured here: tau of heads trained on either (same features within 1e-5 in fp32: tests/test_extract_engine.py),
GPU engines, replicas on several nodes or devices, bf16 targets (the engine then runs in bf16; local extraction in
fp32).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from safetensors.torch import load_file

from common import base_args, prepare, print_table, start, write_results
from components.extract.feature_shards import FEATURES
from components.extract.stage import extract
from components.targets.runtime import StageContext
from infra.settings import Settings

SHARD = re.compile(r"shard (\d+)/\d+, (\d+) tokens \(([\d.]+) s\)")


def run(setup, engine: str, dtype: str, out: Path, replicas: int = 1, seqs_per_shard: int = 0) -> dict:
    """One extraction from scratch into `out`: its timings from the progress lines."""
    shutil.rmtree(out, ignore_errors=True)
    cfg = dataclasses.replace(
        setup.preset.extract,
        engine=engine,
        dtype=dtype,
        num_workers=0,
        engine_replicas=replicas,
        seqs_per_shard=seqs_per_shard or setup.preset.extract.seqs_per_shard,
    )
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    res = extract(
        cfg,
        str(setup.target_dir),
        str(setup.regen_dir),
        str(out),
        progress=lambda s: lines.append((time.perf_counter(), s)),
        context=StageContext(settings=Settings.from_env()),
    )
    total = time.perf_counter() - t0
    shards = {int(m[1]): (int(m[2]), t - float(m[3]), t) for t, s in lines if (m := SHARD.search(s))}
    first = min(begin for _, begin, _ in shards.values()) - t0  # loading, tokenising, the first engine's start
    steady = [shards[k] for k in sorted(shards)[replicas:]]  # each replica's first shard holds its engine's start
    steady_s = max(end for _, _, end in steady) - min(begin for _, begin, _ in steady)
    label = engine if replicas == 1 else f"{engine} x{replicas}"
    return {
        "engine": label,
        "tokens": res.n_tokens,
        "shards": len(shards),
        "total_s": total,
        "start_s": first,
        "steady_s": steady_s,
        "tokens_per_s": sum(n for n, _, _ in steady) / max(steady_s, 1e-9),
    }


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
    p.add_argument("--replicas", type=int, default=1, help="also extract with this many vLLM replicas (> 1)")
    p.add_argument("--seqs-per-shard", type=int, default=0, help="sequences per shard (0: the preset's)")
    args = p.parse_args()
    load = start(args)
    setup = prepare(args.quick, conversations=args.conversations)
    runs = [("local", 1), ("vllm", 1)] + ([("vllm", args.replicas)] if args.replicas > 1 else [])
    rows: list[dict] = []
    for r in range(args.repeats):
        for engine, n in runs:
            out = setup.work / f"extract-engine-{engine}-{n}"
            row = run(setup, engine, args.dtype, out, n, args.seqs_per_shard)
            if engine == "vllm":
                row["max_rel_diff"] = f"{max_rel_diff(setup.work / 'extract-engine-local-1', out):.1e}"
            rows.append({**row, "repeat": r})
    cols = ["repeat", "engine", "tokens", "shards", "total_s", "start_s", "steady_s", "tokens_per_s", "max_rel_diff"]
    print_table(
        rows,
        cols,
        f"extraction of {rows[0]['tokens']} tokens in {args.dtype}, local vs vLLM "
        f"({setup.preset.name} preset, torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs)",
    )
    med = {
        row["engine"]: sorted(x["tokens_per_s"] for x in rows if x["engine"] == row["engine"])[args.repeats // 2]
        for row in rows
    }
    ratios = {"vllm_over_local": med["vllm"] / med["local"]}
    print(f"vLLM/local tokens/s, steady state (median): {ratios['vllm_over_local']:.2f}x")
    if args.replicas > 1:
        ratios["replicas_over_one"] = med[f"vllm x{args.replicas}"] / med["vllm"]
        print(
            f"{args.replicas} vLLM replicas / one vLLM tokens/s, steady state (median): "
            f"{ratios['replicas_over_one']:.2f}x"
        )
    write_results(
        "extract_engine", args.quick, {"dtype": args.dtype, "replicas": args.replicas, "rows": rows, **ratios}, load
    )


if __name__ == "__main__":
    main()
