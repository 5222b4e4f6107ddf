"""Ray adapter: a session on a local Ray or a cluster.

Purpose: `with ray_session(settings): ...` connects to `settings.ray_address`, or starts a local Ray (2 CPUs,
no dashboard) when there is none, and shuts down only what it started; an unreachable address fails in
seconds with an error that says what to do, instead of Ray's minutes of retries. `probe_ray(settings)` is that
check alone (preflight, before any work).

Quiet by configuration: the driver's `ray` logger at WARNING (no "Started a local Ray instance" line), and on a
local Ray no preemption watcher, no placement-group cleaner warnings and no autoscaling-request warnings (see
LOCAL_WORKER_ENV, PG_CLEANER_LOGGER, AUTOSCALER_LOGGER);
workers get the libraries' quiet settings (infra/quiet.py). Our workers' `print`s reach the driver once.
Side by side: each worker's RAY_ADDRESS names its own Ray (ADDRESS_ENV), so two local sessions on one machine (two
pipelines, or a pipeline and the tests) never look each other up (tests/test_ray_side_by_side.py).
Shared paths: `check_shared_paths({...})` refuses, before training, a local path that Ray Train workers on several
hosts must all see (checkpoint storage, output dir) but that some host does not (`storage_refusal` decides).
Run: `python -m infra.ray_cluster` starts a local session, prints its resources and stops it.
Not here: training loops (components), choosing hardware. Ray imports lazily: importing this module is cheap.
A local Ray's core services listen on all interfaces (Ray 2.60 has no loopback-only switch); its dashboard is
off, and its token auth stays on unless `RAY_AUTH_MODE` says otherwise (the tests set it to `disabled`); Ray's note
that it turned token auth on, and how to opt out, is not shown (AUTH_LOGGER). Before each local Ray the process's
Ray reads the mode and its token again (`_reread_auth_mode`): Ray alone reads them once per process.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence
from urllib.parse import urlsplit

from eagle.errors import BadInput
from infra.quiet import quiet_env
from infra.settings import Settings

LOCAL_NUM_CPUS = 2
# Ray Train's workers route `print` to a logger *and*, because Ray wraps their stdout, to stdout as well, so each
# progress line would reach the driver twice. Without the patch a print is forwarded once.
WORKER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
# A local Ray is one node that nothing drains: Ray Train's preemption watcher has nothing to watch there, and
# starting it logs a core-worker error (its actor's arguments live in the object store and it may restart).
LOCAL_WORKER_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
# Without a dashboard (a local Ray has none) Ray's State API is not served: Ray Train's placement-group cleaner
# cannot ask whether the controller lives and warns about it every second, for the whole run.
PG_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
# On a local Ray nothing autoscales, yet Ray Train's controller asks the autoscaling coordinator for its workers'
# resources; when the cores are busy (two pipelines side by side) the 5 s answer comes late and it logs the timeout
# with a traceback at WARNING ("safe to ignore"): on a local Ray, off.
AUTOSCALER_LOGGER = "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"
# A new local Ray turns token auth on by itself when RAY_AUTH_MODE is unset and says so, with how to opt out, at
# WARNING (and that it saved a token, at INFO). We keep token auth on by design; the note is not for our users.
# (Setting RAY_AUTH_MODE=token ourselves would not do: Ray reads it at import, and only its default path re-reads it.)
AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
# Ray Train's worker context logs "Reporting training result <n>: <the whole report>" at INFO for every checkpoint,
# on a logger named after its file, so its `LoggingConfig` (for `ray.train.*` loggers) does not reach it.
REPORT_LOGGER_MODULE = "ray.train.v2._internal.execution.context"
# Where Ray finds "the" Ray when a call names none. Each worker of ours gets its own Ray's address here (see
# `_pin_own_address`): with two local Rays on one machine (two pipelines, or a pipeline beside the tests), Ray's
# auto-detection would otherwise see both and raise in a worker, and its traceback would reach the driver's output.
ADDRESS_ENV = "RAY_ADDRESS"


class RayUnreachable(ConnectionError):
    """The Ray cluster named by the settings does not answer."""


@dataclass(frozen=True)
class RaySessionInfo:
    address: str  # the GCS address of the cluster this process is connected to
    started: bool  # True when this session started a local Ray (and will shut it down)


def _pin_own_address(force: bool) -> None:
    """RAY_ADDRESS in this worker names the Ray it belongs to, so that Ray's address look-ups here (the State API
    that Ray Train's placement-group cleaner asks about its controller) find that Ray, never another one on the
    machine ("Found multiple active Ray instances"). `force`: also over an inherited value (a local Ray's raylet
    has its starter's environment, whose RAY_ADDRESS, if any, names some other Ray)."""
    import ray

    own = ray.get_runtime_context().gcs_address
    if force:
        os.environ[ADDRESS_ENV] = own
    else:
        os.environ.setdefault(ADDRESS_ENV, own)


def _errors_only(record: logging.LogRecord) -> bool:
    """A logging filter: ERROR and above pass."""
    return record.levelno >= logging.ERROR


def _quiet_report_logger() -> None:
    """Ray Train's per-report INFO line off, in this process."""
    import importlib

    try:
        module = importlib.import_module(REPORT_LOGGER_MODULE)
    except ImportError:  # another Ray layout: nothing to quiet
        return
    logging.getLogger(module.__file__).setLevel(logging.WARNING)


def _quiet_worker() -> None:
    """Runs in each worker process of a cluster as it starts (`worker_process_setup_hook`): Ray Train's per-report
    INFO line off; RAY_ADDRESS its own cluster unless the cluster's environment already names one."""
    _pin_own_address(force=False)
    _quiet_report_logger()


def _quiet_local_worker() -> None:
    """The same in each worker of a local Ray, with RAY_ADDRESS this Ray's own whatever was inherited, and the
    placement-group cleaner's warnings (a local Ray serves no State API) and the autoscaling requests' off."""
    _pin_own_address(force=True)
    _quiet_report_logger()
    for name in (PG_CLEANER_LOGGER, AUTOSCALER_LOGGER):  # a filter, not a level: Ray Train's logging setup in the
        logging.getLogger(name).addFilter(_errors_only)  # controller resets the levels of `ray.train.*` loggers


def _runtime_env(local: bool, auth: str | None = None) -> dict:
    """The runtime env of our Ray jobs: worker variables, the libraries' quiet settings, and for a local Ray its
    quiet switches and the auth mode its processes must agree on."""
    env = {**quiet_env(), **WORKER_ENV}
    if not local:
        return {"env_vars": env, "worker_process_setup_hook": _quiet_worker}
    env |= {**LOCAL_WORKER_ENV, **({"RAY_AUTH_MODE": auth} if auth else {})}
    return {"env_vars": env, "worker_process_setup_hook": _quiet_local_worker}


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


class StorageNotShared(BadInput):
    """Training workers may run on several hosts, and a local path they all need is not seen by every host."""


def is_local_path(path: str) -> bool:
    """True for a filesystem path (`/x`, `file:///x`); False for an object-store URI (`s3://b/x`, `gs://b/x`)."""
    scheme = urlsplit(str(path)).scheme
    return scheme in ("", "file") or len(scheme) == 1  # one letter: a Windows drive


def _worker_hosts(nodes: Sequence[dict]) -> dict[str, dict]:
    """One alive node that can run a worker (CPU > 0) per host address."""
    hosts: dict[str, dict] = {}
    for node in nodes:
        if node.get("Alive") and node.get("Resources", {}).get("CPU", 0) > 0:
            hosts.setdefault(node["NodeManagerAddress"], node)
    return hosts


def storage_refusal(paths: Mapping[str, str], nodes: Sequence[dict], sees: Callable[[dict, str], bool]) -> str | None:
    """Why workers on `nodes` (`ray.nodes()` entries) cannot share `paths` (what -> path), or None when they can.

    Fine: all alive worker nodes (CPU > 0) on one host; an object-store URI; a local path that `sees(node, path)`
    on one node of every host (a shared filesystem mounted at the same path). `sees` is asked only for the hosts."""
    hosts = _worker_hosts(nodes)
    if len(hosts) < 2:
        return None
    problems = []
    for what, path in paths.items():
        blind = [ip for ip, node in sorted(hosts.items()) if is_local_path(path) and not sees(node, path)]
        if blind:
            problems.append(f"{what} {path} is a local path that host {', '.join(blind)} does not see")
    if not problems:
        return None
    return (
        f"Ray Train workers may run on any of {len(hosts)} hosts ({', '.join(sorted(hosts))}), but "
        f"{'; '.join(problems)}. Put it on a shared filesystem mounted at the same path on every node (e.g. "
        "EAGLE_HOME on NFS), or give the checkpoint storage as an object-store URI (s3://..., gs://...)"
    )


def _node_sees(node: dict, path: str) -> bool:
    """Whether `path` exists on `node`, asked by a zero-CPU task pinned there."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pinned = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
    return bool(
        ray.get(ray.remote(num_cpus=0)(os.path.exists).options(scheduling_strategy=pinned).remote(path), timeout=120)
    )


def check_shared_paths(paths: Mapping[str, str]) -> None:
    """`StorageNotShared` when the connected cluster spans hosts and one of `paths` (local directories, made here
    when missing) is not seen by all of them: each gets a marker file that a task on every host looks for."""
    import ray

    if not ray.is_initialized():
        return  # Ray Train would start a local Ray: one host
    nodes = ray.nodes()
    if len(_worker_hosts(nodes)) < 2 or not any(is_local_path(p) for p in paths.values()):
        return  # one host, or only URIs: nothing to probe
    markers = {}
    try:
        for what, path in paths.items():
            if is_local_path(path):
                local = Path(urlsplit(path).path if path.startswith("file:") else path)
                local.mkdir(parents=True, exist_ok=True)
                markers[path] = local / f".shared-probe-{uuid.uuid4().hex}"
                markers[path].write_text("")
        refusal = storage_refusal(paths, nodes, lambda node, path: _node_sees(node, str(markers[path])))
    finally:
        for marker in markers.values():
            marker.unlink(missing_ok=True)
    if refusal:
        raise StorageNotShared(refusal)


@contextmanager
def _logger_level(name: str, level: int) -> Iterator[None]:
    """Logger `name` at `level` for the duration of the block, then as it was."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def _reread_auth_mode() -> None:
    """Make this process's Ray read RAY_AUTH_MODE (and its token) again before a local Ray starts. Ray reads them
    once, at import, and again only when it turns token auth on by itself (the variable unset), setting the variable
    for good. So a process whose earlier local Ray ran with token auth would keep demanding a token of a later Ray
    started with `disabled`: that GCS sends none, this driver turns its calls away, and the GCS takes the driver for
    dead and drops every actor it creates (Ray Train's controller: "The actor never ran - it was cancelled before
    it started running"); the other way round, the driver sends no token to a GCS that wants one."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


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
def ray_session(settings: Settings, num_cpus: int | None = None, timeout_s: float = 5.0) -> Iterator[RaySessionInfo]:
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
            ray.init(address=address, runtime_env=_runtime_env(local=False), logging_level=logging.WARNING)
        except ConnectionError as err:
            raise _unreachable(address, err) from err
        try:
            yield RaySessionInfo(address=ray.get_runtime_context().gcs_address, started=False)
        finally:
            ray.shutdown()  # disconnects this driver; the cluster keeps running
        return
    auth = settings.ray_auth_mode
    with _env_var("RAY_AUTH_MODE", auth), _logger_level(AUTH_LOGGER, logging.ERROR):  # workers agree with the GCS
        _reread_auth_mode()
        # address "local": a new Ray of this process's own, even where `ray start` left a cluster on the machine
        # (ray.init would otherwise join that one)
        ray.init(
            address="local",
            num_cpus=num_cpus or LOCAL_NUM_CPUS,
            include_dashboard=False,
            runtime_env=_runtime_env(True, auth),
            logging_level=logging.WARNING,
        )
        try:
            yield RaySessionInfo(address=ray.get_runtime_context().gcs_address, started=True)
        finally:
            ray.shutdown()


if __name__ == "__main__":
    with ray_session(Settings.from_env()) as info:
        import ray

        print(info, ray.cluster_resources())
