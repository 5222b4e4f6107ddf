"""Where a second vLLM engine's worker goes beside a running one (infra/vllm_cpus.py).

Purpose: the binding read from vLLM's own log line, and the rule for an engine started beside it: the allowed CPUs the
running worker does not hold when they are at least half as many as it holds, else vLLM's default (None); the CPU
list in vLLM's syntax.
Run: `python -m pytest tests/test_vllm_cpus.py` (under a second).
Not here: the swap that uses it under load on real engines (bench/rollback_live.py, tests/test_rollback_engine.py).
"""

from __future__ import annotations

from infra.vllm_cpus import _ranges, allowed_cpus, beside, bound_cpus

LOG = """(EngineCore pid=20603) INFO 12-07 07:09:02 [ompmultiprocessing.py:185] OpenMP thread binding info:
(EngineCore pid=20603) INFO 12-07 07:09:02 [ompmultiprocessing.py:185] \tVLLM_CPU_OMP_THREADS_BIND='auto'
(EngineCore pid=20603) INFO 12-07 07:09:02 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1, 2]
(EngineCore pid=20603) INFO 12-07 07:09:02 [ompmultiprocessing.py:185] \treserved_cpus=[3]
"""


def test_the_binding_is_read_from_vllms_log(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(LOG)
    assert bound_cpus(log) == [0, 1, 2]
    log.write_text("$ python -m vllm ...\nINFO Starting vLLM server on http://127.0.0.1:8000\n")
    assert bound_cpus(log) is None  # a GPU engine, `nobind`, or not that far yet
    assert bound_cpus(tmp_path / "gone.log") is None


def test_a_second_engine_takes_the_cpus_the_first_leaves_when_they_are_enough():
    assert beside([0], [0, 1]) == "1"  # 2 cores: the serving worker holds 0, the reserved 1 is free
    assert beside([0, 1], [0, 1, 2, 3]) == "2-3"  # vLLM's range syntax
    assert beside([1, 3, 5, 7, 9, 11, 13], list(range(16))) == "0,2,4,6,8,10,12,14-15"  # SMT siblings left free
    assert beside(list(range(15)), list(range(16))) is None  # 1 free of 15: vLLM's default, not a 1-core engine
    assert beside([0, 1], [0, 1]) is None and beside(None, [0, 1]) is None and beside([], [0, 1]) is None


def test_cpu_lists_in_vllms_syntax():
    assert _ranges([0, 1, 2, 5]) == ["0-2", "5"] and _ranges([7]) == ["7"] and _ranges([1, 3]) == ["1", "3"]
    assert allowed_cpus() and all(isinstance(c, int) for c in allowed_cpus())
