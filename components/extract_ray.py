"""Extraction on Ray: a run's feature shards computed by Ray actors, one shard per task, the target loaded once each.

Purpose: `run_on_ray(cfg, target_dir, layer_ids, pending, finish, ...)` opens `infra.ray_cluster.ray_session` (the
cluster at RAY_ADDRESS, else a local Ray started and stopped here; a Ray this process already runs is used and left
running), starts `cfg.num_workers` `FeatureWorker` actors (`cfg.cpus_per_worker` CPUs each, plus one GPU each when
`cfg.device` is CUDA: one worker per device), fewer when the cluster has no room for them all, and hands each actor
the next pending shard whenever it returns one (the dispatch of components/regen_ray.py). An actor computes the
shard exactly as the in-process path does (`components.extract.shard_bytes`) and returns its safetensors bytes
(bytes, not tensors: Ray's pickling of torch tensors cannot carry float8); the driver writes each shard as it
arrives (`finish`), with the same code as in-process, so the files and the manifest are byte-identical to a run with
`num_workers` 0, resume works the same, and the workers need no filesystem shared with the driver (only the target
directory). An actor that dies is restarted once and its shard retried; an error inside a shard is raised in the
driver as itself, after the shards finished before it were written.
Run: through `components.extract.extract` with `cfg.num_workers` >= 1; tests/test_extract_scale.py.
Not here: the shard layout, the manifest and the resume rule (components/extract.py).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from components.regen_ray import local_cpus, run_actors

Finish = Callable[[int, bytes, float], None]


class FeatureWorker:
    """A Ray actor's state: the config, the fused layer ids and, from its first shard on, the loaded target."""

    def __init__(self, cfg: Any, target_dir: str, layer_ids: list[int], trust_remote_code: bool):
        self.cfg, self.target_dir, self.layer_ids = cfg, target_dir, layer_ids
        self.trust_remote_code = trust_remote_code
        self.target = None

    def run(self, shard: int, seqs: Sequence[tuple[list[int], list[int]]]) -> bytes:
        from components.extract import shard_bytes
        from components.targets import load_target

        if self.target is None:  # in the first task, so a load error is that task's error, raised as itself
            self.target = load_target(self.target_dir, self.cfg.device, trust_remote_code=self.trust_remote_code)[0]
        return shard_bytes(self.target, self.layer_ids, list(seqs), self.cfg)


def run_on_ray(cfg: Any, target_dir: str, layer_ids: list[int], pending: dict[int, list], finish: Finish,
               trust_remote_code: bool = False, settings: Any = None,
               progress: Callable[[str], None] = print) -> None:
    """Compute every pending shard (index -> sequences (input_ids, loss_mask)) on Ray actors; `finish(shard, bytes,
    seconds)` in the driver as each one returns. `settings`: infra.settings.Settings (None: from the environment)."""
    from infra.ray_cluster import ray_session
    from infra.settings import Settings

    settings = settings or Settings.from_env()
    with ray_session(settings, num_cpus=local_cpus(cfg, settings)):
        run_actors(cfg, FeatureWorker, (target_dir, list(layer_ids), trust_remote_code), pending, finish, "extract",
                   progress)
