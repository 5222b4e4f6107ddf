"""Timing side by side: every method on every prompt in a rotating order, and a benchmark's rounds in fresh processes.

Purpose: `interleaved(methods, prompts)` runs each method on each prompt, prompt by prompt, the order rotating, so all
see the same machine state (a `Run` per method and prompt; `tokens_per_s` of a method's runs); `fresh_runs(script,
argv, runs, say)` runs a benchmark's `--runs N` as N fresh processes, one after the other, and returns their payloads.
Run: imported by the benchmarks that time decoding (bench/speedup.py, chain_depth.py, target_path.py, ...).
Not here: the shared setup, prompts and result files (bench/common.py, bench/report.py).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from common import argv_without


@dataclass
class Run:
    """What one method produced on one prompt."""

    seconds: float
    tokens: list[int]
    extra: dict


def interleaved(
    methods: dict[str, Callable[[list[int]], tuple[list[int], dict]]], prompts: list[list[int]], warmup: int = 1
) -> dict[str, list[Run]]:
    """Run every method on every prompt, prompt by prompt, rotating the order, so all see the same machine state.

    A method takes prompt ids and returns (new token ids, extra stats). The first `warmup` prompts run once
    untimed per method first (first-call costs out of the timing).
    """
    for ids in prompts[:warmup]:
        for fn in methods.values():
            fn(ids)
    names = list(methods)
    out: dict[str, list[Run]] = {n: [] for n in names}
    for i, ids in enumerate(prompts):
        order = names[i % len(names) :] + names[: i % len(names)]
        for n in order:
            t0 = time.perf_counter()
            toks, extra = methods[n](ids)
            out[n].append(Run(time.perf_counter() - t0, toks, extra))
    return out


def tokens_per_s(runs: list[Run]) -> float:
    return sum(len(r.tokens) for r in runs) / max(sum(r.seconds for r in runs), 1e-9)


def fresh_runs(script: str, argv: list[str], runs: int, say: Callable[[int, dict], None]) -> list[dict]:
    """`--runs N` of a benchmark: `script` with `argv` (its own `--runs` replaced by 1, `--out` added) in N fresh
    processes, one after the other; each child's JSON payload, in order. `say(i, payload)` after each."""
    import subprocess
    import tempfile

    out: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            path = Path(tmp) / f"run{i}.json"
            cmd = [sys.executable, script, *argv_without(argv, "--runs"), "--runs", "1", "--out", str(path)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            out.append(json.loads(path.read_text()))
            say(i, out[-1])
    return out
