"""eagle/heap.py: inside `kept_heap` a large tensor made and freed at every step stops faulting its pages in again
(after a few steps: the heap grows until a freed chunk fits the next request, ~7 tensors here, then stays).

Run: `python -m pytest tests/test_heap.py` (a few seconds: the measurement runs in a fresh process).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle.heap import kept_heap

ROOT = Path(__file__).resolve().parents[1]


def _faults_of_steps(steps: int = 6) -> int:
    """Minor page faults of `steps` steps that each make and free a 64 MiB tensor (the target's logits' size)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        x = torch.ones(8, 256, 8192)
        del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


def _measure() -> None:
    """Prints the faults of 6 steps outside the block, of 6 steps inside it (after 12 that grow the heap), and
    the resident MiB at the block's end and after it."""
    outside = _faults_of_steps()
    with kept_heap() as kept:
        assert kept  # glibc
        _faults_of_steps(12)  # the first steps grow the heap until freed chunks fit the next request
        inside = _faults_of_steps()
        held = _rss_mib()
    print(json.dumps([outside, inside, held, _rss_mib()]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_freed_memory_is_reused_inside_the_block_and_handed_back_after():
    # In a fresh process: malloc serves a 64 MiB request from a free chunk that an earlier test left inside the
    # heap, so in a worker that ran other modules first the steps outside the block fault nothing in (CI, stop 55).
    code = "import tests.test_heap as t; t._measure()"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    outside, inside, held, after = json.loads(run.stdout.strip().splitlines()[-1])
    pages = 8 * 256 * 8192 * 4 // 4096
    assert outside > 4 * pages  # each step faults most of its pages in again
    assert inside < pages // 10  # reused: no new pages
    assert after < held - 32  # on exit kept memory goes back to the kernel (malloc_trim)


def test_disabled_changes_nothing():
    with kept_heap(enabled=False) as kept:
        assert not kept
