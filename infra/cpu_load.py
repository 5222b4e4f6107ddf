"""What else ran on this machine's CPUs during a measurement: the busy CPU time of every process but ours.

Purpose: a timing taken while another job used the cores is a figure of that busy machine, not of the head (on
2 cores a one-thread neighbour moved the speedup ratio by +6% median, +10% at worst: bench/README.md "Does the
registered speedup hold, on quiet cores?"). `OtherLoad.start(own_pgids)` snapshots the machine's busy CPU time
(/proc/stat: user, nice, system, irq, softirq, steal, over every CPU) and our own (this process, its threads, and
every process whose process group is in `own_pgids`, e.g. the vLLM servers being measured, each started in its own
group); `.cores()` is the difference of the two deltas over the wall time since, in cores: 0.0 on a quiet machine,
about 1.0 with one busy neighbour thread. None where /proc is not there (not Linux): nothing is claimed then.
A process of ours that exits during the window takes its CPU time with it, so that share counts as other load
(the measured work does not start or stop processes mid-measurement).
Run: `python -m infra.cpu_load [SECONDS]` prints the other load over that many seconds (default 2).
Not here: judging the figure (components/evaluate/speed.py does, with `speed.max_other_load`).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

PROC = Path("/proc")
MIN_WALL_S = 1.0  # shorter windows say nothing: the kernel counts CPU time in ticks of 10 ms
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal of the `cpu` line (guest is in user)


def _ticks_per_s() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100.0


def machine_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot (all CPUs summed); None without /proc/stat."""
    try:
        with open(PROC / "stat", encoding="ascii") as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    values = [int(v) for v in first[1:]]
    return sum(values[i] for i in _BUSY_FIELDS if i < len(values)) / _ticks_per_s()


def own_busy_s(own_pgids: Iterable[int]) -> float:
    """CPU seconds (user + system) used so far by this process and by every process in the groups `own_pgids`."""
    me, groups = os.getpid(), set(own_pgids)
    total = 0
    for entry in PROC.iterdir() if groups else ():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        fields = _stat_fields(entry / "stat")
        if fields is not None and int(fields[2]) in groups:
            total += int(fields[11]) + int(fields[12])
    mine = _stat_fields(PROC / str(me) / "stat")
    if mine is not None:
        total += int(mine[11]) + int(mine[12])
    return total / _ticks_per_s()


def _stat_fields(path: Path) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state is [0], pgrp [2], utime [11], stime [12]); None when
    the process is gone."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


@dataclass
class OtherLoad:
    """Other processes' CPU use from `start()` on; `cores()` reads it (see the module doc)."""

    own_pgids: tuple[int, ...] = ()
    _t0: float = 0.0
    _machine0: float | None = None
    _own0: float = 0.0

    @classmethod
    def start(cls, own_pgids: Iterable[int] = ()) -> "OtherLoad":
        probe = cls(tuple(own_pgids))
        probe._t0, probe._machine0, probe._own0 = time.monotonic(), machine_busy_s(), own_busy_s(probe.own_pgids)
        return probe

    def cores(self) -> float | None:
        """Mean CPU cores used by processes not ours since `start()`; None without /proc or before MIN_WALL_S."""
        machine = machine_busy_s()
        wall = time.monotonic() - self._t0
        if machine is None or self._machine0 is None or wall < MIN_WALL_S:
            return None
        other = (machine - self._machine0) - (own_busy_s(self.own_pgids) - self._own0)
        return max(other, 0.0) / wall


if __name__ == "__main__":
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    probe = OtherLoad.start()
    time.sleep(seconds)
    cores = probe.cores()
    print(
        "other load: not measurable here (no /proc)"
        if cores is None
        else f"other load: {cores:.2f} of {os.cpu_count()} cores over {seconds:g} s"
    )
