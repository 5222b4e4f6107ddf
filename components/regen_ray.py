"""Regeneration on Ray: the shards of a run answered by Ray actors, one shard per task, the target loaded once per actor.

Purpose: `run_on_ray(cfg, target_dir, pending, finish, ...)` opens `infra.ray_cluster.ray_session` (the cluster at
RAY_ADDRESS, else a local Ray started and stopped here; a Ray this process already runs is used and left running),
starts `cfg.num_workers` `ShardWorker` actors (`cfg.cpus_per_worker` CPUs each, plus one GPU each when `cfg.device`
is CUDA: one worker per device), fewer when the cluster has no room for them all, and hands each actor the next
pending shard whenever it returns one. An actor seeds, answers and returns the shard's records exactly as the
in-process path does (`components.regenerate.answer_shard`); the driver writes each shard as it arrives (`finish`),
with the same code as in-process, so the files are byte-identical to a run with `num_workers` 0, resume works the
same, and the workers need no filesystem shared with the driver (only the target directory, and the endpoint when
`cfg.endpoint_url` is set: then each worker keeps up to `cfg.endpoint_concurrency` requests in flight).
An actor that dies (killed, out of memory) is restarted once and its shard retried; an error inside a shard (a
target that cannot be loaded) is raised in the driver as itself, after the shards finished before it were written.
Run: through `components.regenerate.regenerate` with `cfg.num_workers` >= 1; tests/test_regenerate_scale.py.
Not here: the shard files, accounting and seeds (components/regenerate.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

from components.traffic_io import Conversation

Finish = Callable[[int, list[dict[str, Any]], float], None]


class ShardWorker:
    """A Ray actor's state: the config and, from its first shard on, the loaded target (or the endpoint client)."""

    def __init__(self, cfg: Any, target_dir: str, trust_remote_code: bool):
        self.cfg, self.target_dir, self.trust_remote_code = cfg, target_dir, trust_remote_code
        self.respond = None

    def run(self, shard: int, convs: Sequence[Conversation]) -> list[dict[str, Any]]:
        from components.regenerate import answer_shard, responder

        if self.respond is None:  # in the first task, so a load error is that task's error, raised as itself
            self.respond = responder(self.cfg, self.target_dir, self.trust_remote_code)
        return answer_shard(self.cfg, shard, convs, self.respond)


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


def run_on_ray(cfg: Any, target_dir: str, pending: dict[int, Sequence[Conversation]], finish: Finish,
               trust_remote_code: bool = False, settings: Any = None,
               progress: Callable[[str], None] = print) -> None:
    """Answer every pending shard (index -> conversations) on Ray actors; `finish(shard, records, seconds)` in the
    driver as each one returns. `settings`: infra.settings.Settings (None: from the environment)."""
    from infra.ray_cluster import ray_session
    from infra.settings import Settings

    settings = settings or Settings.from_env()
    with ray_session(settings, num_cpus=local_cpus(cfg, settings)):
        run_actors(cfg, ShardWorker, (target_dir, trust_remote_code), pending, finish, "regenerate", progress)


def run_actors(cfg: Any, worker_cls: type, args: tuple, pending: dict[int, Any], finish: Finish, stage: str,
               progress: Callable[[str], None], wait_s: float = 30.0) -> None:
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
        raise RuntimeError(f"the Ray cluster has no room for one {stage} worker ({need}; free: "
                           f"{ray.available_resources()}): lower {stage}.cpus_per_worker or free the cluster")
    if n < wanted:
        progress(f"{stage}: the Ray cluster holds {n} of {cfg.num_workers} workers ({need} each); using {n}")
    worker_cfg = dataclasses.replace(cfg, device="cuda") if uses_gpu(cfg) else cfg  # Ray shows it one device
    actor = ray.remote(num_cpus=cfg.cpus_per_worker, num_gpus=1 if uses_gpu(cfg) else 0,
                       max_restarts=1, max_task_retries=1)(worker_cls)
    actors = [actor.remote(worker_cfg, *args) for _ in range(n)]
    try:
        _dispatch(actors, dict(pending), finish)
    finally:
        for a in actors:
            ray.kill(a)


def _dispatch(actors: list, pending: dict[int, Sequence[Conversation]], finish: Finish) -> None:
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
