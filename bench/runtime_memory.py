"""The pipeline process's peak memory with the target run by vLLM (`target.runtime: vllm`) against run by us (local).

Run: `python bench/runtime_memory.py [--quick] [--dtype float32]`
The benchmark setup's regenerated training traffic (bench/common.py: the embedded default, `--quick` the tiny one) is
extracted twice, each time in a fresh process: with the target loaded by this project (`extract.engine: local`, what
`target.runtime: local` does; transformers, float32) and with vLLM started by the stage (`extract.engine: vllm`, what
`target.runtime: vllm` does; our process reads only the embedding, final norm and lm_head by tensor name). Extraction
is the stage where the local path holds the whole target and the most else at once (the model, a batch's hidden
states of every layer, a shard's features). Each child reports its resident set after importing the same modules (the
interpreter, torch, transformers: the floor any run pays) and its peak resident set during the stage (VmHWM, reset
after the imports; of itself, not of the vLLM it starts); the table sets both against the target's size (its
safetensors bytes, and float32 bytes of its parameters, what the local path holds).
Prints one row per runtime, then the peak's growth over the floor as a share of the target's float32 size.
Writes runtime_memory.json (bench/results/, or .eagle/bench/results-quick/ with --quick).
Not measured here: the vLLM process's own memory (the engine's business, sized by --gpu-memory-utilization), other
stages (regeneration and evaluation load the target the same way extraction does), targets larger than the embedded
default (where the floor stops dominating: the local path grows by 4 bytes per parameter, the engine path by the
embedding and lm_head only).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)

from common import base_args, prepare, print_table, start, write_results

RUNTIMES = ("local", "vllm")


def _status_mib(key: str) -> float:
    """A memory line of /proc/self/status (VmRSS: now; VmHWM: the peak since start or the last reset), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # no procfs: the peak since start


def _reset_peak() -> None:
    """Start VmHWM afresh (Linux: 5 > /proc/self/clear_refs), so the imports' own peak does not hide the stage's."""
    Path("/proc/self/clear_refs").write_text("5")


def child(runtime: str, target: str, regen: str, out: str, dtype: str, max_len: int, seqs_per_shard: int) -> dict:
    """One extraction from scratch in this (fresh) process: its floor and peak resident set, in MiB."""
    import shutil

    import torch  # noqa: F401  (part of the floor)
    import transformers  # noqa: F401

    from components.extract.stage import ExtractConfig, extract
    from components.targets.runtime import StageContext
    from infra.settings import Settings

    shutil.rmtree(out, ignore_errors=True)
    cfg = ExtractConfig(max_len=max_len, dtype=dtype, seqs_per_shard=seqs_per_shard, engine=runtime)
    _reset_peak()
    floor = _status_mib("VmRSS")
    res = extract(cfg, target, regen, out, progress=lambda s: None, context=StageContext(settings=Settings.from_env()))
    return {"runtime": runtime, "floor_mib": floor, "peak_mib": _status_mib("VmHWM"), "tokens": res.n_tokens}


def target_size(target_dir: Path) -> dict:
    """The target's safetensors bytes and its parameters' float32 bytes (header sizes only: nothing loaded)."""
    from safetensors import safe_open

    files, params = sorted(target_dir.glob("*.safetensors")), 0
    for f in files:
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                params += n
    return {"file_mib": sum(f.stat().st_size for f in files) / 2**20, "fp32_mib": params * 4 / 2**20, "params": params}


def main() -> None:
    if "--child" in sys.argv:
        c = argparse.ArgumentParser()
        for flag in ("--child", "--target", "--regen", "--out", "--dtype", "--result"):
            c.add_argument(flag)
        c.add_argument("--max-len", type=int)
        c.add_argument("--seqs-per-shard", type=int)
        a = c.parse_args()
        row = child(a.child, a.target, a.regen, a.out, a.dtype, a.max_len, a.seqs_per_shard)
        Path(a.result).write_text(json.dumps(row))
        return
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", help="stored feature dtype (default float32)")
    args = p.parse_args()
    load = start(args)
    setup = prepare(args.quick, conversations=args.conversations)
    size = target_size(setup.target_dir)
    ext = setup.preset.extract
    rows = []
    for runtime in RUNTIMES:
        result = setup.work / f"runtime-memory-{runtime}.json"
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                runtime,
                "--target",
                str(setup.target_dir),
                "--regen",
                str(setup.regen_dir),
                "--out",
                str(setup.work / f"runtime-memory-{runtime}"),
                "--dtype",
                args.dtype,
                "--max-len",
                str(ext.max_len),
                "--seqs-per-shard",
                str(ext.seqs_per_shard),
                "--result",
                str(result),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        row = json.loads(result.read_text())
        row["growth_mib"] = row["peak_mib"] - row["floor_mib"]
        row["growth_over_target_fp32"] = row["growth_mib"] / size["fp32_mib"]
        rows.append(row)
    cols = ["runtime", "tokens", "floor_mib", "peak_mib", "growth_mib", "growth_over_target_fp32"]
    print_table(
        rows,
        cols,
        f"pipeline process's resident memory during extraction ({setup.preset.name} preset; "
        f"target {size['params'] / 1e6:.1f}M parameters: {size['file_mib']:.1f} MiB on disk, "
        f"{size['fp32_mib']:.1f} MiB in float32)",
    )
    by = {r["runtime"]: r for r in rows}
    local, vllm = by["local"]["growth_mib"], by["vllm"]["growth_mib"]
    print(f"peak growth over the floor: local {local:.0f} MiB, vLLM {vllm:.0f} MiB ({vllm / max(local, 1e-9):.2f}x)")
    write_results("runtime_memory", args.quick, {"dtype": args.dtype, "target": size, "rows": rows}, load)


if __name__ == "__main__":
    main()
