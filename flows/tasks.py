"""Prefect tasks: thin wrappers of the stage components, with retries, timeouts and result caching.

Purpose: each task calls one component and carries the orchestration concerns only. Results are cached on
INPUTS + TASK_SOURCE and persisted (under the state dir's Prefect home), so a re-run of the same run skips the
stages that finished; `fresh_if_missing` refreshes a stage's cache when its output files are gone, so a cached
path never points at nothing. Regeneration and registration retry (endpoint and tracking-server hiccups), but
never on bad input (`eagle.errors.BadInput`: traffic, target, config, features), which fails at once with its
message; any other error (a plain `ValueError` too) may be an outage and is retried.
`trust_remote_code` comes from the settings (EAGLE_TRUST_REMOTE_CODE) and reaches every model load.
Not here: the wiring (flows/train_head.py) or any algorithm (components/, eagle/).
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from components.evaluate_engine import EngineEvalResult
from components.evaluate import EvaluateConfig, EvaluateResult, evaluate
from components.extract import ExtractConfig, ExtractResult, extract
from components.regenerate import RegenerateConfig, RegenerateResult, regenerate
from components.target_runtime import TargetRuntime
from components.train import TrainConfig, TrainResult, train
from eagle.errors import BadInput

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


@task(name="regenerate", cache_policy=CACHE - "ray_settings" - "runtime", persist_result=True, retries=2,
      retry_delay_seconds=5, retry_condition_fn=transient)
def regenerate_task(cfg: RegenerateConfig, target_dir: str, traffic: str, out_dir: str,
                    trust_remote_code: bool = False, ray_settings=None,
                    runtime: TargetRuntime | None = None) -> RegenerateResult:
    """`ray_settings` (the flow's Settings) say where Ray workers run when `cfg.num_workers` >= 1; `runtime` (the
    run's) whether an engine answers. Neither is in the cache key: the run's directory, `out_dir`, already names what
    the runtime decides (components/pipeline_config.py `fingerprint`), and the engine's scale changes no answer."""
    return regenerate(cfg, target_dir, traffic, out_dir, trust_remote_code=trust_remote_code,
                      ray_settings=ray_settings, runtime=runtime)


@task(name="extract", cache_policy=CACHE - "ray_settings" - "runtime", persist_result=True)
def extract_task(cfg: ExtractConfig, target_dir: str, regen_dir: str, out_dir: str,
                 trust_remote_code: bool = False, ray_settings=None,
                 runtime: TargetRuntime | None = None) -> ExtractResult:
    """As `regenerate_task`: `runtime` says whether the engine computes the features (its manifest says which did)."""
    return extract(cfg, target_dir, regen_dir, out_dir, trust_remote_code=trust_remote_code,
                   ray_settings=ray_settings, runtime=runtime)


@task(name="train", cache_policy=CACHE - "sinks", persist_result=True)
def train_task(cfg: TrainConfig, extract_dir: str, out_dir: str, target_dir: str, lineage: dict,
               ray_settings, sinks: tuple = (), init_head_dir: str | None = None) -> TrainResult:
    trust = ray_settings.trust_remote_code
    if cfg.ray.num_workers == 0:
        return train(cfg, extract_dir, out_dir, target_dir, lineage, sinks, trust_remote_code=trust,
                     init_head_dir=init_head_dir)
    from infra.ray_cluster import ray_session

    with ray_session(ray_settings):
        return train(cfg, extract_dir, out_dir, target_dir, lineage, sinks,
                     storage_dir=str(ray_settings.ray_storage_dir), trust_remote_code=trust,
                     init_head_dir=init_head_dir)


@task(name="evaluate", cache_policy=CACHE, persist_result=True)
def evaluate_task(cfg: EvaluateConfig, target_dir: str, head_dir: str, heldout: str, out_dir: str,
                  baseline_head_dir: str | None, history_file: str | None,
                  trust_remote_code: bool = False) -> EvaluateResult:
    return evaluate(cfg, target_dir, head_dir, heldout, out_dir, baseline_head_dir, history_file,
                    trust_remote_code=trust_remote_code)


@task(name="evaluate-in-vllm", cache_policy=CACHE - "settings" - "engines", persist_result=True, retries=1,
      retry_delay_seconds=5, retry_condition_fn=transient)
def engine_eval_task(cfg: EvaluateConfig, target_dir: str, head_dir: str, heldout: str, out_dir: str,
                     local_report: str | None, settings, baseline_head_dir: str | None = None,
                     engines=None) -> EngineEvalResult:
    """The head served by vLLM on the same prompts; compared with the local evaluation's outputs (`local_report`;
    None when vLLM runs the target: no local evaluation); the champion's head (`baseline_head_dir`) served on them
    too, for a gate on the engine's τ; `engines` (infra/engine_pool.py) keeps the pair running for the sweep."""
    from components.evaluate_engine import evaluate_in_vllm, our_outputs

    ours = our_outputs(local_report) if local_report else None
    return evaluate_in_vllm(cfg, target_dir, head_dir, heldout, out_dir, settings, ours=ours,
                            baseline_head_dir=baseline_head_dir, engines=engines)


@task(name="load-sweep", cache_policy=CACHE - "settings" - "engines", persist_result=True, retries=1,
      retry_delay_seconds=5, retry_condition_fn=transient)
def load_sweep_task(cfg: EvaluateConfig, target_dir: str, head_dir: str, heldout: str, out_dir: str, settings,
                    engines=None, evaluation: str | None = None):
    """Throughput by concurrency in vLLM (plain, each K, the derived schedule) with vLLM's own load client; the
    evaluation's servers taken from `engines` when they are the sweep's, and its rounds (`evaluation`, its report)
    for concurrency 1."""
    from components.load_sweep import load_sweep

    return load_sweep(cfg, target_dir, head_dir, heldout, out_dir, settings, engines=engines, evaluation=evaluation)
