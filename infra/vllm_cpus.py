"""Which CPUs a vLLM engine's worker is bound to on the CPU build, and where a second engine beside it should go.

Purpose: vLLM's CPU build binds its worker's OpenMP threads to CPUs (`VLLM_CPU_OMP_THREADS_BIND`, default `auto`: one
logical CPU per physical core, the last reserved for its other processes; on 2 cores the worker gets CPU 0). The
binding reaches the worker through the OpenMP runtime's environment, so the spawned worker is pinned from its first
import on. Two engines with the default binding therefore put their workers on the same CPUs. Beside a worker that
keeps its CPU busy (a serving engine under load), the second engine's worker got almost no CPU time on these
machines (a few milliseconds in a minute, runnable all the while) and never became healthy: a swap or a rollback
under load could not start its engine. `bound_cpus(log_path)` reads the CPUs an engine's worker was bound to from
vLLM's own log line ("local_rank=0, core ids=[0]"); `beside(bound, allowed)` is the binding for a second engine:
the allowed CPUs the first one's worker does not hold, when they are at least half as many as it holds (so a host
with many cores does not trade a serving engine's speed for its start: there the default binding stays, None).
Run: imported by components/serving/live.py (the swap) and infra/vllm_server.py; no side effects.
Not here: starting engines (infra/vllm_server.py); what a swap does (components/serving/live.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_CORE_IDS = re.compile(r"local_rank=0, core ids=\[([0-9, ]*)\]")


def bound_cpus(log_path: Path) -> list[int] | None:
    """The CPUs vLLM bound the engine's (first) worker to, from its log; None when it did not say (a GPU, `nobind`, an
    engine not started yet, a log that is gone)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    found = _CORE_IDS.findall(text)
    if not found:
        return None
    return [int(c) for c in found[-1].replace(" ", "").split(",") if c]


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity: a container's or a taskset's limit, else every one)."""
    return sorted(os.sched_getaffinity(0))


def beside(bound: list[int] | None, allowed: list[int]) -> str | None:
    """`VLLM_CPU_OMP_THREADS_BIND` for an engine started beside one whose worker holds `bound`: the allowed CPUs it does
    not hold ("1", "8-15"), or None (vLLM's default) when its binding is unknown or they are fewer than half of it."""
    if not bound:
        return None
    free = [c for c in allowed if c not in set(bound)]
    if not free or 2 * len(free) < len(bound):
        return None
    return ",".join(_ranges(free))


def _ranges(cpus: list[int]) -> list[str]:
    """[0, 1, 2, 5] -> ["0-2", "5"] (vLLM's CPU list syntax)."""
    out: list[str] = []
    start = prev = cpus[0]
    for c in cpus[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return out
