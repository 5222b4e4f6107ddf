"""`target.runtime: vllm`: the whole pipeline with the target run by vLLM only, never loaded by our process.

Purpose: the `train-head` flow (tiny preset, the tiny embedded target trained 400 steps) with `{"target": {"runtime":
"vllm"}}` and nothing else about engines, while every way this process could load the target's weights
(`components.targets.target.load_target`, the names modules imported it under, transformers' `from_pretrained` of any
model class) raises. Regeneration goes through a vLLM the stage starts (greedy, so that the data and the head's
figures are the same in every run), extraction through the engine, evaluation in
vLLM only; the head trains (draft vocabulary from the regenerated tokens, embedding / final norm / lm_head read by
tensor name), registers on vLLM's τ, and the registered figures are the ones vLLM's counters gave
(`engine_evaluation.json`). Four engine starts: regenerate, extract, the evaluation's plain/speculative pair.
Also bench/runtime_memory.py --quick: the pipeline process's peak memory with either runtime (one engine start).
Run: `python -m pytest tests/test_runtime_vllm.py` (about 1-2 minutes on 2 cores). Needs vLLM's venv (`make vllm`).
Not here: the config rules of `target` (tests/test_engine_scale.py), the engine's features against ours
(tests/test_extract_engine.py), serving (tests/test_vllm.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.settings import Settings
from infra.vllm_server import vllm_python
from tests.helpers import state_dir_env

pytestmark = [pytest.mark.slow, pytest.mark.engine]


class TargetLoaded(AssertionError):
    """Raised by every patched loader: the target must never be loaded with target.runtime vllm."""


def _refuse(*args, **kwargs):
    raise TargetLoaded(f"the target was loaded by our process: {args[:1]}")


@pytest.fixture(scope="module")
def runtime_run(engine_target, prefect_harness, tmp_path_factory):
    import transformers
    from transformers.modeling_utils import PreTrainedModel

    import components.extract.stage
    import components.targets.target

    state = tmp_path_factory.mktemp("runtime-vllm") / ".eagle"
    vllm_python(Settings.local(state))  # a missing vLLM venv fails here with the line that says how to make it
    cfg = state.parent / "pipeline.json"
    # greedy answers: sampled ones through vLLM differ from run to run (vLLM 0.32's CPU worker crashes on a seeded
    # request whose prefill is chunked, "CPU Generator does not use offset"), and the 60-step head trained on them
    # read vLLM tau 1.0 to 3.6 over five runs, once with no draft accepted at all
    cfg.write_text(
        json.dumps(
            {
                "target": {"runtime": "vllm"},
                "regenerate": {"temperature": 0.0},
                "train": {"steps": 60},
                "evaluate": {"limit": 6, "spec": {"depth": 3, "max_new_tokens": 24}},
            }
        )
    )
    with state_dir_env(state), pytest.MonkeyPatch.context() as mp:
        for owner in (components.targets.target, components.extract.stage):
            mp.setattr(owner, "load_target", _refuse)
        mp.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _refuse)
        mp.setattr(PreTrainedModel, "from_pretrained", classmethod(_refuse))
        from flows.train_head import train_head

        run = train_head(
            str(engine_target.target_dir),
            str(engine_target.target_traffic.train),
            str(engine_target.target_traffic.heldout),
            "tiny",
            str(cfg),
            "runtime-tiny",
        )
    yield run, Settings.local(state)


def test_the_target_is_never_loaded_and_the_head_registers_on_the_engines_figures(runtime_run):
    from infra.mlflow_store import MlflowStore

    run, settings = runtime_run
    work = Path(run.work_dir)
    assert run.created and run.alias == "champion" and run.vllm is not None
    assert not (work / "evaluate" / "evaluation.json").exists(), "no local evaluation: it would load the target"
    assert json.loads((work / "extract" / "manifest.json").read_text())["engine"] == "vllm"
    assert run.regenerate.ok > 0 and run.train.final_metrics
    report = json.loads((work / "evaluate" / "vllm" / "engine_evaluation.json").read_text())["result"]
    assert report["identical_to_plain"] is True and report["identical_to_ours"] is None
    assert sum(report["accepted_per_pos"]) > 0, "a head that never gets a draft accepted proves little"

    name, version = run.head_uri.split("/")[1:]
    tags = MlflowStore.connect(settings).get_version(name, int(version)).tags
    assert tags["gate_tau"] == "engine" and tags["gate"].startswith("vLLM tau")
    assert "tau" not in tags and tags["target_runtime"] == "vllm"
    assert tags["tau_vllm"] == f"{report['tau']:.4f}" == f"{run.tau_vllm:.4f}"
    assert tags["acceptance_vllm"] == " ".join(f"{a:.4f}" for a in report["acceptance"])
    assert tags["identical_vllm"] == "true"
    drafts = report["drafts"]
    assert report["tau"] == pytest.approx(1 + sum(report["accepted_per_pos"]) / drafts)  # vLLM's own counters
    summary = json.loads((work / "summary.json").read_text())
    assert summary["vllm"]["tau"] == report["tau"] and summary["tau_vllm"] == report["tau"]


def test_runtime_memory_bench_quick(tmp_path):
    """bench/runtime_memory.py --quick: both runtimes measured in fresh processes, a row each."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "runtime_memory.py"), "--quick", "--cache", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = json.loads((tmp_path / "results-quick" / "runtime_memory.json").read_text())
    rows = {r["runtime"]: r for r in result["rows"]}
    assert set(rows) == {"local", "vllm"} and rows["local"]["tokens"] == rows["vllm"]["tokens"] > 0
    assert all(r["peak_mib"] >= r["floor_mib"] > 0 for r in rows.values()), rows  # the tiny target: too small to
    # tell the runtimes apart reliably; the embedded default's figures are in bench/results/runtime_memory.json
    print(proc.stdout)
