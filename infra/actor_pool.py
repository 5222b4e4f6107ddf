"""A pool of Ray actors answering a stage's shards: one shard per task, the next to whichever actor returns first.

Purpose: `run_on_ray(cfg, worker_cls, args, pending, finish, stage, settings, progress)` opens
`infra.ray_cluster.ray_session` (the cluster at RAY_ADDRESS, else a local Ray started and stopped here; a Ray this
process already runs is used and left running), starts `cfg.num_workers` actors `worker_cls(cfg, *args)`
(`cfg.cpus_per_worker` CPUs each, plus one GPU each when `cfg.device` is CUDA: one worker per device, shown to it
as `cuda`), fewer when the cluster has no room for them all, and hands each actor the next pending shard in shard
order (`actor.run(shard, pending[shard])`) whenever it returns one; `finish(shard, result, seconds)` runs in this
process as each returns, so the driver writes every file and the workers need no filesystem shared with it.
An actor that dies (killed, out of memory) is restarted once and its shard retried; an error inside a shard is raised
here as itself, after the shards finished before it. The actors are ended afterwards, so their CPUs are free for the
next stage. `run_actors` is the same inside a session the caller opened.
`cfg` is any config with `num_workers`, `cpus_per_worker` and `device` (a stage's, or components/extract/engine.py's
`ReplicaPool`).
Run: through the stages with `num_workers` >= 1; tests/test_regenerate_scale.py, tests/test_extract_scale.py.
Not here: what a shard is or what a worker does (the stages' workers: components/regenerate/stage.py `ShardWorker`,
components/extract/stage.py `FeatureWorker`, components/extract/engine.py `EngineReplica`). Ray imports lazily.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

Finish = Callable[[int, Any, float], None]


def uses_gpu(cfg: Any) -> bool:
    return str(cfg.device).startswith("cuda")


def fitting_workers(cfg: Any, wanted: int, available: dict[str, float]) -> int:
    """How many of `wanted` workers the cluster's free resources hold (CPUs, and GPUs for a CUDA device)."""
    room = math.floor(available.get("CPU", 0.0) / cfg.cpus_per_worker + 1e-9)
    if uses_gpu(cfg):
        room = min(room, math.floor(available.get("GPU", 0.0) + 1e-9))
    return min(wanted, room)


def local_cpus(cfg: Any, settings: Any) -> int | None:
    """CPUs of a local Ray started for this run (None on a cluster: it has its own)."""
    if settings.ray_address is not None:
        return None
    from infra.ray_cluster import LOCAL_NUM_CPUS

    return max(LOCAL_NUM_CPUS, cfg.num_workers * cfg.cpus_per_worker)


def run_on_ray(
    cfg: Any,
    worker_cls: type,
    args: tuple,
    pending: dict[int, Any],
    finish: Finish,
    stage: str,
    settings: Any = None,
    progress: Callable[[str], None] = print,
) -> None:
    """`run_actors` in a Ray session of `settings` (infra.settings.Settings; None: from the environment)."""
    from infra.ray_cluster import ray_session
    from infra.settings import Settings

    settings = settings or Settings.from_env()
    with ray_session(settings, num_cpus=local_cpus(cfg, settings)):
        run_actors(cfg, worker_cls, args, pending, finish, stage, progress)


def run_actors(
    cfg: Any,
    worker_cls: type,
    args: tuple,
    pending: dict[int, Any],
    finish: Finish,
    stage: str,
    progress: Callable[[str], None],
    wait_s: float = 30.0,
) -> None:
    """`cfg.num_workers` actors of `worker_cls(worker_cfg, *args)` (fewer if the cluster holds fewer) answer the
    pending shards; the actors are ended afterwards, so their CPUs are free for the next stage. Resources that
    another job (a finished stage's actors, a Ray Train run) is still releasing are waited for up to `wait_s`."""
    import ray

    wanted = min(cfg.num_workers, len(pending))
    need = f"{cfg.cpus_per_worker} CPU" + (" and 1 GPU" if uses_gpu(cfg) else "")
    deadline = time.monotonic() + wait_s
    while (n := fitting_workers(cfg, wanted, ray.available_resources())) < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    if n < 1:
        raise RuntimeError(
            f"the Ray cluster has no room for one {stage} worker ({need}; free: "
            f"{ray.available_resources()}): lower {stage}.cpus_per_worker or free the cluster"
        )
    if n < wanted:
        progress(f"{stage}: the Ray cluster holds {n} of {cfg.num_workers} workers ({need} each); using {n}")
    worker_cfg = dataclasses.replace(cfg, device="cuda") if uses_gpu(cfg) else cfg  # Ray shows it one device
    actor = ray.remote(
        num_cpus=cfg.cpus_per_worker, num_gpus=1 if uses_gpu(cfg) else 0, max_restarts=1, max_task_retries=1
    )(worker_cls)
    actors = [actor.remote(worker_cfg, *args) for _ in range(n)]
    try:
        _dispatch(actors, dict(pending), finish)
    finally:
        for a in actors:
            ray.kill(a)


def _dispatch(actors: list, pending: dict[int, Any], finish: Finish) -> None:
    """One shard per actor at a time, in shard order; the next goes to whichever actor returns first."""
    import ray

    queue = sorted(pending)
    running: dict[Any, tuple[Any, int, float]] = {}

    def give(worker: Any) -> None:
        s = queue.pop(0)
        running[worker.run.remote(s, list(pending[s]))] = (worker, s, time.perf_counter())

    try:
        for worker in actors[: len(queue)]:
            give(worker)
        while running:
            [ref], _ = ray.wait(list(running), num_returns=1)
            worker, s, t0 = running.pop(ref)
            finish(s, ray.get(ref), time.perf_counter() - t0)
            if queue:
                give(worker)
    finally:
        for worker in actors:
            ray.kill(worker)
