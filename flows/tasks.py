"""Prefect tasks: thin wrappers of the stage components, with retries, timeouts and result caching.

Purpose: each task calls one component and carries the orchestration concerns only (the evaluation tasks are
flows/evaluate_head.py's stage functions, which the `evaluate` command runs bare; `TASKS` are the flow's). Results
are cached on INPUTS + TASK_SOURCE and persisted (under the state dir's Prefect home), so a re-run of the same run
skips the stages that finished; `fresh_if_missing` refreshes a stage's cache when its output files are gone, so a
cached path never points at nothing. Regeneration and registration retry (endpoint and tracking-server hiccups), but
never on bad input (`eagle.errors.BadInput`: traffic, target, config, features), which fails at once with its
message; any other error (a plain `ValueError` too) may be an outage and is retried.
`trust_remote_code` comes from the settings (EAGLE_TRUST_REMOTE_CODE) and reaches every model load.
Not here: the wiring (flows/train_head.py) or any algorithm (components/, eagle/).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from components.extract.stage import ExtractConfig, ExtractResult, extract
from components.regenerate.stage import RegenerateConfig, RegenerateResult, regenerate
from components.targets.runtime import StageContext, TargetRuntime
from components.train.stage import TrainConfig, TrainResult, TrainSetup, train
from eagle.errors import BadInput
from flows.evaluate_head import EvalStages, evaluate_locally, evaluate_served, pick_served_depth, sweep_load

CACHE = INPUTS + TASK_SOURCE


def transient(task_obj, task_run, state) -> bool:
    """Retry condition: retry a failure unless it is bad input (`BadInput`, the same class the CLI maps to exit 2:
    its message names what to fix, and a retry would fail the same way)."""
    try:
        state.result()
    except BadInput:
        return False
    except BaseException:  # noqa: BLE001 (any other failure may pass)
        return True
    return True


def fresh_if_missing(task_obj, *paths: str | Path):
    """The task with its cache refreshed when any of `paths` does not exist."""
    missing = any(not Path(p).exists() for p in paths)
    return task_obj.with_options(refresh_cache=missing) if missing else task_obj


@task(
    name="regenerate",
    cache_policy=CACHE - "ray_settings" - "runtime",
    persist_result=True,
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=transient,
)
def regenerate_task(
    cfg: RegenerateConfig,
    target_dir: str,
    traffic: str,
    out_dir: str,
    trust_remote_code: bool = False,
    ray_settings=None,
    runtime: TargetRuntime | None = None,
) -> RegenerateResult:
    """`ray_settings` (the flow's Settings) say where Ray workers run when `cfg.num_workers` >= 1; `runtime` (the
    run's) whether an engine answers. Neither is in the cache key: the run's directory, `out_dir`, already names what
    the runtime decides (components/config/pipeline.py `fingerprint`), and the engine's scale changes no answer. The
    stage gets them in its `StageContext` (components/targets/runtime.py), built here: they stay out of the key."""
    return regenerate(
        cfg,
        target_dir,
        traffic,
        out_dir,
        context=StageContext(trust_remote_code, settings=ray_settings, runtime=runtime),
    )


@task(name="extract", cache_policy=CACHE - "ray_settings" - "runtime", persist_result=True)
def extract_task(
    cfg: ExtractConfig,
    target_dir: str,
    regen_dir: str,
    out_dir: str,
    trust_remote_code: bool = False,
    ray_settings=None,
    runtime: TargetRuntime | None = None,
) -> ExtractResult:
    """As `regenerate_task`: `runtime` says whether the engine computes the features (its manifest says which did)."""
    return extract(
        cfg,
        target_dir,
        regen_dir,
        out_dir,
        context=StageContext(trust_remote_code, settings=ray_settings, runtime=runtime),
    )


@dataclass(frozen=True)
class TrainJob:
    """One training of a run: on the features in `extract_dir` (of `target_dir`), into `out_dir`, with the run's
    `lineage`, warm-started from `init_head_dir` (None: a fresh head)."""

    extract_dir: str
    out_dir: str
    target_dir: str
    lineage: dict
    init_head_dir: str | None = None


@task(name="train", cache_policy=CACHE - "sinks", persist_result=True)
def train_task(cfg: TrainConfig, job: TrainJob, ray_settings, sinks: tuple = ()) -> TrainResult:
    trust = ray_settings.trust_remote_code
    if cfg.ray.num_workers == 0:
        return train(
            cfg,
            job.extract_dir,
            job.out_dir,
            job.target_dir,
            job.lineage,
            sinks,
            TrainSetup(job.init_head_dir, trust_remote_code=trust),
        )
    from infra.ray_cluster import ray_session

    with ray_session(ray_settings):
        return train(
            cfg,
            job.extract_dir,
            job.out_dir,
            job.target_dir,
            job.lineage,
            sinks,
            TrainSetup(job.init_head_dir, str(ray_settings.ray_storage_dir), trust),
        )


# the evaluation stages of flows/evaluate_head.py, as tasks: cached on their inputs; `settings` and `engines` (the
# running servers) are not in the key, the run directory names what they decide
evaluate_task = task(name="evaluate", cache_policy=CACHE, persist_result=True)(evaluate_locally)
engine_eval_task = task(
    name="evaluate-in-vllm",
    cache_policy=CACHE - "settings" - "engines",
    persist_result=True,
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=transient,
)(evaluate_served)
load_sweep_task = task(
    name="load-sweep",
    cache_policy=CACHE - "settings" - "engines",
    persist_result=True,
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=transient,
)(sweep_load)
pick_depth_task = task(
    name="pick-depth",
    cache_policy=CACHE - "settings",
    persist_result=True,
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=transient,
)(pick_served_depth)
# what `evaluate_head` runs in a flow: these tasks, each with its cache refreshed when its report is missing
TASKS = EvalStages(evaluate_task, engine_eval_task, load_sweep_task, fresh_if_missing, pick_depth_task)
