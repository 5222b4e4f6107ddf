"""Evaluating a head: the one path that both `train-head` (flows/train_head.py) and `eagle-heads evaluate` take.

Purpose: `evaluate_head(cfg, head, settings, plan, stages) -> Figures`: the head on held-out traffic in this process
(components/evaluate/stage.py; `plan.local`), served by vLLM on the same prompts (components/evaluate/engine.py;
`plan.engine`), and under load (components/evaluate/load_sweep.py; `plan.sweep`, the levels), in that order, the
evaluation's plain/speculative pair going on running for the sweep (infra/engine_pool.py `EnginePool`). vLLM serves the
head as `servable_head` makes it (itself when the engines load it as it is). What differs between the callers is said,
not guessed: the flow's plan follows where its runtime runs the target (`EvalPlan.of_run`: ours only where this process
loads the target, the sweep where `evaluate.load` has levels, the pair started before ours where ours is untimed on a
CPU engine), and its stages are the Prefect tasks of flows/tasks.py with their caches (`stages=TASKS` there); the
command's plan is its flags, and its stages the bare functions here (`EvalStages()`: no Prefect).
Run: through the flow or the command. Not here: the measurements themselves (components/), the gate (register).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from components.evaluate.stage import HeadEval

if TYPE_CHECKING:
    from components.config.pipeline import PipelineConfig
    from components.evaluate.engine import EngineEvalResult
    from components.evaluate.load_config import LoadConfig
    from components.evaluate.stage import EvaluateConfig, EvaluateResult


@dataclass(frozen=True)
class EvalPlan:
    """Which evaluations run: ours (`local`), vLLM's (`engine`), the load sweep at `sweep`'s levels (None: no sweep),
    and whether vLLM's pair is launched before ours (`early`), for its start to overlap it."""

    local: bool
    engine: bool
    sweep: LoadConfig | None = None
    early: bool = False

    @classmethod
    def of_run(cls, cfg: PipelineConfig, eval_dir: str) -> EvalPlan:
        """The `train-head` flow's: ours where this process loads the target, vLLM's where the runtime evaluates in
        the engine, then the sweep when `evaluate.load` has levels."""
        rt = cfg.runtime
        sweep = cfg.evaluate.load if rt.evaluates_in_engine and cfg.evaluate.load.enabled else None
        return cls(rt.loads_target, rt.evaluates_in_engine, sweep, start_pair_early(cfg, eval_dir))


@dataclass(frozen=True)
class Figures:
    """What the evaluation stages measured: ours (`local`; None when not run), vLLM's (`engine`), the load sweep's
    (`sweep`), and the metrics the registry gets from them."""

    local: EvaluateResult | None
    engine: EngineEvalResult | None
    sweep: Any
    metrics: dict[str, float]


def evaluate_locally(cfg: EvaluateConfig, head: HeadEval, trust_remote_code: bool = False) -> EvaluateResult:
    """Ours: components/evaluate/stage.py `evaluate`."""
    from components.evaluate.stage import evaluate

    return evaluate(cfg, head, trust_remote_code=trust_remote_code)


def evaluate_served(
    cfg: EvaluateConfig, head: HeadEval, local_report: str | None, settings, engines=None
) -> EngineEvalResult:
    """vLLM's, into `out_dir/vllm`: compared with our outputs (`local_report`, our evaluation's report; None: not
    run); `engines` (infra/engine_pool.py) keeps the pair running for the sweep."""
    from components.evaluate.engine import evaluate_in_vllm, our_outputs

    ours = our_outputs(local_report) if local_report else None
    return evaluate_in_vllm(
        cfg, dataclasses.replace(head, out_dir=str(Path(head.out_dir) / "vllm")), settings, ours=ours, engines=engines
    )


def sweep_load(cfg: EvaluateConfig, head: HeadEval, settings, engines=None, evaluation: str | None = None):
    """Throughput by concurrency in vLLM, into `out_dir/load`: the servers taken from `engines` when they are the
    sweep's, vLLM's evaluation (`evaluation`, its report) standing for concurrency 1."""
    from components.evaluate.load_sweep import load_sweep

    return load_sweep(
        cfg,
        dataclasses.replace(head, out_dir=str(Path(head.out_dir) / "load")),
        settings,
        engines=engines,
        evaluation=evaluation,
    )


def pick_served_depth(cfg: EvaluateConfig, head: HeadEval, settings):
    """The K at batch size 1 by measurement in vLLM, into `out_dir/depth` (components/evaluate/depth_pick.py)."""
    from components.evaluate.depth_pick import pick_depth

    return pick_depth(cfg, dataclasses.replace(head, out_dir=str(Path(head.out_dir) / "depth")), settings)


def _as_is(stage: Callable, done: Path) -> Callable:
    return stage


def _servable(head: HeadEval, settings) -> str:
    """The head's directory as vLLM loads it: itself, or its lossless re-export under the state dir."""
    from components.targets.servable import servable_head

    return str(
        servable_head(head.head_dir, head.target_dir, settings.state_dir / "servable", settings.trust_remote_code)
    )


def _pool(plan: EvalPlan):
    """An `EnginePool` for the stages that run vLLM (none needed when no stage does)."""
    if not (plan.early or plan.engine or plan.sweep is not None):
        return contextlib.nullcontext()
    from infra.engine_pool import EnginePool

    return EnginePool()


@dataclass(frozen=True)
class EvalStages:
    """How `evaluate_head` runs each stage: `fresh(stage, done_file)` gives the callable to run (the flow's: the
    Prefect task, its cache refreshed when `done_file` is missing); the defaults are the bare functions above."""

    local: Callable = evaluate_locally
    engine: Callable = evaluate_served
    sweep: Callable = sweep_load
    fresh: Callable[[Callable, Path], Callable] = _as_is
    pick: Callable = pick_served_depth


def evaluate_head(
    cfg: PipelineConfig, head: HeadEval, settings, plan: EvalPlan, stages: EvalStages = EvalStages()
) -> Figures:
    """The head against `head.baseline_dir` on the held-out traffic: ours, vLLM's, the sweep, as `plan` says (see the
    module doc). `settings` carry the target's scale (`cfg.runtime.engine_settings`); the engines started here are
    compiled as `evaluate.compiled` says."""
    from components.evaluate.engine import REPORT

    ev, engine, sweep, metrics, out = None, None, None, {}, Path(head.out_dir)
    # every engine timed here runs as `serve` will run the head: compiled or eager (`evaluate.compiled`)
    settings = dataclasses.replace(settings, engine_compiled=cfg.evaluate.compiled)
    if plan.engine:
        metrics["engine_compiled"] = float(cfg.evaluate.compiled)

    @functools.cache
    def served() -> HeadEval:  # vLLM's: the head as the engines load it, the champion only where the gate is vLLM's
        return dataclasses.replace(
            head,
            head_dir=_servable(head, settings),
            history_file=None,
            baseline_dir=head.baseline_dir if cfg.runtime.gate_on_engine else None,
        )

    if plan.engine and cfg.evaluate.pick.enabled:  # first the K it drafts at batch size 1, measured in vLLM
        from components.evaluate.depth_pick import REPORT as PICKED, applied

        picked = stages.fresh(stages.pick, out / "depth" / PICKED)(
            cfg.evaluate, dataclasses.replace(served(), baseline_dir=None), settings
        )
        cfg = dataclasses.replace(cfg, evaluate=applied(cfg.evaluate, picked.depth))
        plan = dataclasses.replace(plan, sweep=cfg.evaluate.load if plan.sweep is not None else None)
        metrics.update(picked.metrics())
    with _pool(plan) as engines:  # the evaluation's plain/speculative pair goes on running for the sweep
        if plan.early:
            from components.evaluate.engine import eval_pair

            engines.launch(*eval_pair(cfg.evaluate, head.target_dir, served().head_dir, head.heldout, settings))
        if plan.local:
            ev = stages.fresh(stages.local, out / "evaluation.json")(cfg.evaluate, head, settings.trust_remote_code)
            metrics = ev.metrics() | metrics
        if plan.engine:  # the head as production serves it: in vLLM, on the same prompts
            engine = stages.fresh(stages.engine, out / "vllm" / REPORT)(
                cfg.evaluate, served(), ev.report_file if ev else None, settings, engines
            )
            metrics.update(engine.metrics())
        if plan.sweep is not None:  # throughput by load, the K schedule
            sweep = stages.fresh(stages.sweep, out / "load" / "load_sweep.json")(
                dataclasses.replace(cfg.evaluate, load=plan.sweep),
                dataclasses.replace(served(), baseline_dir=None),
                settings,
                engines,
                engine.report_file if engine else None,
            )
            metrics.update(sweep.metrics())
    return Figures(ev, engine, sweep, metrics)


def start_pair_early(cfg: PipelineConfig, eval_dir: str) -> bool:
    """Whether vLLM's evaluation pair starts before our evaluation instead of after it: where our decoder is not
    timed (`evaluate.time_local` false: nothing timed runs beside the start), the engine runs on the CPU (on a GPU
    the memory is the in-process target's while ours runs) and the engine's evaluation is still to run. On 2 cores
    the pair's start (~20 s) then overlaps ours (~10-15 s on one core)."""
    from components.evaluate.engine import REPORT
    from infra.vllm_engine_spec import EngineSpec

    return (
        cfg.runtime.evaluates_in_engine
        and not cfg.evaluate.time_local
        and EngineSpec("", None, method=None).resolved_device() == "cpu"
        and not (Path(eval_dir) / "vllm" / REPORT).exists()
    )
