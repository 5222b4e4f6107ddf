"""flows/evaluate_head.py: the one evaluation of a head, wired as each caller's plan says (fake stages, no model).

Purpose: `evaluate_head` runs ours, vLLM's and the load sweep in that order, only those its `EvalPlan` names; vLLM's
stage gets our report and the champion only where the gate is vLLM's τ, the sweep gets vLLM's report and its own
levels; each stage's report file is what `fresh` is told (the flow refreshes a task's cache when it is missing);
`EvalPlan.of_run` is the `train-head` flow's plan and flows/command_runs.py's is the `evaluate` command's.
Run: `python -m pytest tests/test_evaluate_head.py` (about a second: no model, no engine, no Prefect).
Not here: the stages themselves (tests/test_evaluate_register.py, tests/test_vllm.py, tests/test_load_sweep.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from components.config.pipeline import PipelineConfig
from components.evaluate.stage import HeadEval
from flows.evaluate_head import EvalPlan, EvalStages, evaluate_head
from infra.settings import Settings


class _Result:
    def __init__(self, report_file: str, metrics: dict[str, float]) -> None:
        self.report_file, self._metrics = report_file, metrics

    def metrics(self) -> dict[str, float]:
        return self._metrics


def _stages(calls: list, done: list) -> EvalStages:
    def local(cfg, head, trust):
        calls.append(("local", head.head_dir, head.baseline_dir, head.history_file, trust))
        return _Result("ours.json", {"tau": 2.0})

    def engine(cfg, head, local_report, settings, engines):
        calls.append(("engine", head.head_dir, head.baseline_dir, local_report, engines is not None))
        return _Result("vllm.json", {"tau_vllm": 1.9})

    def sweep(cfg, head, settings, engines, evaluation):
        calls.append(("sweep", head.head_dir, head.baseline_dir, cfg.load.concurrency, evaluation))
        return _Result("load.json", {"speedup_at_4": 1.5})

    return EvalStages(local, engine, sweep, lambda stage, path: done.append(path.as_posix()) or stage)


def _head(tmp_path: Path) -> HeadEval:
    # a head vLLM loads as it is (components/targets/servable.py `is_servable`): served unconverted
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}))
    (head / "model.safetensors").write_bytes(b"")
    return HeadEval("target", str(head), "heldout.jsonl", str(tmp_path / "eval"), "champion", "history.jsonl")


def test_each_stage_runs_as_the_plan_says_with_the_reports_before_it(tmp_path):
    cfg = PipelineConfig.tiny().override(
        {"evaluate": {"engine": "vllm", "load": {"concurrency": [1, 4]}}, "register": {"gate_tau": "engine"}}
    )
    head, settings = _head(tmp_path), Settings.local(tmp_path, trust_remote_code=True)
    calls, done = [], []
    fig = evaluate_head(cfg, head, settings, EvalPlan(True, True, cfg.evaluate.load), _stages(calls, done))
    assert calls == [
        ("local", head.head_dir, "champion", "history.jsonl", True),
        ("engine", head.head_dir, "champion", "ours.json", True),  # the gate is vLLM's: champion too
        ("sweep", head.head_dir, None, (1, 4), "vllm.json"),
    ]
    assert [Path(p).relative_to(tmp_path / "eval").as_posix() for p in done] == [
        "evaluation.json",
        "vllm/engine_evaluation.json",
        "load/load_sweep.json",
    ]
    # and how vLLM ran where it was measured (eager: `evaluate.compiled` false), for the registry's tag `compiled`
    assert fig.metrics == {"tau": 2.0, "tau_vllm": 1.9, "speedup_at_4": 1.5, "engine_compiled": 0.0}
    assert (fig.local.report_file, fig.engine.report_file, fig.sweep.report_file) == (
        "ours.json",
        "vllm.json",
        "load.json",
    )
    local_gate = cfg.override({"register": {"gate_tau": "local"}})
    calls.clear()
    evaluate_head(local_gate, head, settings, EvalPlan(False, True), _stages(calls, []))
    assert calls == [("engine", head.head_dir, None, None, True)]  # no ours: no report; the gate is ours: no champion
    calls.clear()
    fig = evaluate_head(local_gate, head, settings, EvalPlan(True, False), _stages(calls, []))
    assert [c[0] for c in calls] == ["local"] and fig.engine is None and fig.sweep is None


def test_the_flows_plan_follows_the_runtime_and_the_commands_its_flags(tmp_path):
    from flows.command_runs import _evaluate_plan

    tiny = PipelineConfig.tiny()
    assert EvalPlan.of_run(tiny, str(tmp_path)) == EvalPlan(True, False, None, False)
    served = tiny.override({"target": {"runtime": "vllm"}, "evaluate": {"load": {"concurrency": [1, 2]}}})
    plan = EvalPlan.of_run(served, str(tmp_path))  # the target never loaded here: vLLM's figures alone
    assert (plan.local, plan.engine, plan.sweep) == (False, True, served.evaluate.load)
    assert _evaluate_plan(served, load=False) == EvalPlan(True, True, None)  # the command always measures ours
    default_levels = PipelineConfig.preset("default").evaluate.load
    assert _evaluate_plan(tiny, load=True) == EvalPlan(True, False, default_levels)  # --load: default levels
