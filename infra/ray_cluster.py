"""Ray adapter: a session on a local Ray or a cluster, and the Ray Train configs built from one small dataclass.

Purpose: `with ray_session(settings): ...` connects to `settings.ray_address`, or starts a local Ray (2 CPUs,
no dashboard) when there is none, and shuts down only what it started; an unreachable address fails in
seconds with an error that says what to do, instead of Ray's minutes of retries. `train_run_configs` turns a
`RayTrainConfig` (workers, GPU or not, CPUs per worker, failures tolerated) into Ray Train's
`ScalingConfig` and `RunConfig` with the run's storage under the state dir, so that re-running with the same
run name resumes from the latest checkpoint.

Run: `python -m infra.ray_cluster` starts a local session, prints its resources and stops it.
Not here: training loops (components), choosing hardware. Ray imports lazily: importing this module is cheap.
A local Ray's core services listen on all interfaces (Ray 2.60 has no loopback-only switch); its dashboard is
off, and its token auth stays on unless `RAY_AUTH_MODE` says otherwise (the tests set it to `disabled`).
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator
from urllib.parse import urlsplit

from infra.settings import Settings

if TYPE_CHECKING:
    from ray.train import RunConfig, ScalingConfig

LOCAL_NUM_CPUS = 2
# Ray Train's workers route `print` to a logger *and*, because Ray wraps their stdout, to stdout as well: every
# progress line reached the driver twice (Ray 2.60). Without the patch a print is forwarded once.
WORKER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}


class RayUnreachable(ConnectionError):
    """The Ray cluster named by the settings does not answer."""


@dataclass(frozen=True)
class RaySessionInfo:
    address: str  # the GCS address of the cluster this process is connected to
    started: bool  # True when this session started a local Ray (and will shut it down)


@dataclass(frozen=True)
class RayTrainConfig:
    """How a training run is spread over Ray: `num_workers=0` runs in the driver process (tests)."""

    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    max_failures: int = 0
    checkpoints_to_keep: int | None = None  # None keeps all; Ray deletes the others, so copy before registering

    def __post_init__(self) -> None:
        if self.num_workers < 0 or self.cpus_per_worker <= 0 or self.max_failures < -1:
            raise ValueError(f"invalid {self}: need num_workers >= 0, cpus_per_worker > 0, max_failures >= -1")
        if self.checkpoints_to_keep is not None and self.checkpoints_to_keep < 1:
            raise ValueError(f"checkpoints_to_keep must be None or >= 1, got {self.checkpoints_to_keep}")

    @classmethod
    def tiny(cls) -> RayTrainConfig:
        return cls(num_workers=0)


def train_run_configs(cfg: RayTrainConfig, run_name: str, settings: Settings) -> tuple[ScalingConfig, RunConfig]:
    """Ray Train configs for run `run_name`, stored under `<state>/ray_results/<run_name>`."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    scaling = ScalingConfig(
        num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, resources_per_worker={"CPU": cfg.cpus_per_worker}
    )
    run = RunConfig(
        name=run_name,
        storage_path=str(settings.ray_storage_dir),
        failure_config=FailureConfig(max_failures=cfg.max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoints_to_keep),
    )
    return scaling, run


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a `host:port` or `ray://host:port` address; None for `auto` and other forms."""
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parts.port or (10001 if parts.scheme == "ray" else None)
    except ValueError:
        return None
    return (parts.hostname, port) if parts.hostname and port else None


def _unreachable(address: str, reason: object) -> RayUnreachable:
    return RayUnreachable(
        f"Ray cluster at {address} is unreachable ({reason}). Start it (`ray start --head`) or fix RAY_ADDRESS; "
        "unset RAY_ADDRESS to run on a local Ray started by this process."
    )


def _probe(address: str, timeout_s: float) -> None:
    target = _host_port(address)
    if target is None:
        return
    try:
        socket.create_connection(target, timeout=timeout_s).close()
    except OSError as err:
        raise _unreachable(address, err) from err


def probe_ray(settings: Settings, timeout_s: float = 5.0) -> None:
    """`RayUnreachable` now if `settings.ray_address` names a cluster that does not answer (no address: nothing)."""
    if settings.ray_address is not None:
        _probe(settings.ray_address, timeout_s)


@contextmanager
def _env_var(name: str, value: str | None) -> Iterator[None]:
    """Set `name` for the duration of the block (None: leave it alone), then restore it."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextmanager
def ray_session(
    settings: Settings, num_cpus: int | None = None, timeout_s: float = 5.0
) -> Iterator[RaySessionInfo]:
    """Connected Ray for the block: the cluster at `settings.ray_address`, else a local Ray started here.

    If Ray is already initialised in this process, the block uses it and leaves it running.
    """
    import ray

    address = settings.ray_address
    if address is not None and num_cpus is not None:
        raise ValueError("num_cpus applies to a local Ray only; a cluster at RAY_ADDRESS has its own resources")
    if address is not None:
        _probe(address, timeout_s)
    if ray.is_initialized():
        yield RaySessionInfo(address=ray.get_runtime_context().gcs_address, started=False)
        return
    if address is not None:
        try:
            ray.init(address=address, runtime_env={"env_vars": dict(WORKER_ENV)})
        except ConnectionError as err:
            raise _unreachable(address, err) from err
        try:
            yield RaySessionInfo(address=ray.get_runtime_context().gcs_address, started=False)
        finally:
            ray.shutdown()  # disconnects this driver; the cluster keeps running
        return
    auth = settings.ray_auth_mode
    runtime_env = {"env_vars": {**WORKER_ENV, **({"RAY_AUTH_MODE": auth} if auth else {})}}
    with _env_var("RAY_AUTH_MODE", auth):  # the local processes inherit it: workers must agree with the GCS
        ray.init(num_cpus=num_cpus or LOCAL_NUM_CPUS, include_dashboard=False, runtime_env=runtime_env)
        try:
            yield RaySessionInfo(address=ray.get_runtime_context().gcs_address, started=True)
        finally:
            ray.shutdown()


if __name__ == "__main__":
    with ray_session(Settings.from_env()) as info:
        import ray

        print(info, ray.cluster_resources())
