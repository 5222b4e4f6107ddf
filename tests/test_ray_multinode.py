"""Training on a real two-node Ray cluster on loopback, and the rule for where its checkpoints may live.

Purpose: `ray start --head` and a second `ray start --address ...` node (its own `node2` resource), each under
`--block` in a session of its own that the test kills as a whole (Ray's workers move to process groups of their
own, not sessions). A driver process with only `RAY_ADDRESS` (and EAGLE_HOME) set trains as `flows.tasks.train_task`
does, 2 workers of 1 CPU: the workers ran on the two nodes (each records its node id as it unpickles the loop's
arguments); when the second node is killed mid-training (its raylet and workers, after the step-3 checkpoint), the
test starts a new second node, Ray Train's FailureConfig restarts the worker group on it and the run resumes from
step 3 and exports a head whose tensors equal an uninterrupted 2-worker run's, bit for bit. The storage rule
(`infra.ray_cluster.storage_refusal`) is unit-tested with fake node lists: a local path that one of two hosts does
not see is refused by name; one host, a shared mount, an object-store URI are fine.
Run: `python -m pytest tests/test_ray_multinode.py` (150-165 s on 2 busy cores; the unit tests alone: `-m "not
slow"`). Needs `RAY_AUTH_MODE=disabled` like the rest of the suite (.ci/run exports it; the cluster gets it here).
Not here: two real hosts (both nodes share this machine's filesystem and address), GPUs. Never `ray stop`: it would
end every Ray process on the machine; this file ends only the sessions it started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from infra.ray_cluster import StorageNotShared, storage_refusal

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
NODE_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    # a killed node is declared dead in ~2 s instead of ~15 s (Ray's defaults: every 3 s, 5 misses)
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
    "RAY_health_check_initial_delay_ms": "1000",
}


# ---- the storage rule, on fake node lists ---------------------------------------------------------------------


def _node(ip: str, cpus: float = 1, alive: bool = True) -> dict:
    return {"NodeID": f"id-{ip}-{cpus}", "NodeManagerAddress": ip, "Alive": alive, "Resources": {"CPU": cpus}}


def test_a_local_path_that_a_second_host_does_not_see_is_refused_by_name():
    asked = []

    def sees(node, path):  # only the first host has the directory
        asked.append(node["NodeManagerAddress"])
        return node["NodeManagerAddress"] == "10.0.0.1"

    why = storage_refusal(
        {"the checkpoint storage": "/data/ray_results"},
        [_node("10.0.0.1"), _node("10.0.0.1", 2), _node("10.0.0.2")],
        sees,
    )
    assert why is not None
    assert "the checkpoint storage /data/ray_results is a local path that host 10.0.0.2 does not see" in why
    assert "2 hosts (10.0.0.1, 10.0.0.2)" in why
    assert "shared filesystem mounted at the same path on every node" in why and "s3://" in why
    assert sorted(asked) == ["10.0.0.1", "10.0.0.2"]  # one probe per host, not per node


def test_one_host_a_shared_mount_or_an_object_store_uri_is_fine():
    never = lambda node, path: pytest.fail("nothing to probe")  # noqa: E731
    two_hosts = [_node("10.0.0.1"), _node("10.0.0.2")]
    assert storage_refusal({"s": "/tmp/x"}, [_node("10.0.0.1"), _node("10.0.0.1")], never) is None  # one host
    assert storage_refusal({"s": "/tmp/x"}, [_node("10.0.0.1"), _node("10.0.0.2", alive=False)], never) is None
    assert storage_refusal({"s": "/tmp/x"}, [_node("10.0.0.1"), _node("10.0.0.2", cpus=0)], never) is None
    assert storage_refusal({"s": "s3://bucket/ray"}, two_hosts, never) is None
    assert storage_refusal({"s": "gs://bucket/ray"}, two_hosts, never) is None
    assert storage_refusal({"s": "/mnt/nfs/ray"}, two_hosts, lambda node, path: True) is None  # seen everywhere
    assert storage_refusal({"s": "file:///tmp/x"}, two_hosts, lambda node, path: False) is not None  # local too
    assert issubclass(StorageNotShared, ValueError)


def test_check_shared_paths_probes_every_host_with_a_marker_and_removes_it(monkeypatch, tmp_path):
    import ray

    import infra.ray_cluster as rc

    seen = []

    def node_sees(node, path):  # the first host has the directory, the second does not
        seen.append((node["NodeManagerAddress"], Path(path).parent, Path(path).exists()))
        return node["NodeManagerAddress"] == "10.0.0.1" and Path(path).exists()

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [_node("10.0.0.1"), _node("10.0.0.2")])
    monkeypatch.setattr(rc, "_node_sees", node_sees)
    store = tmp_path / "ray_results"
    with pytest.raises(StorageNotShared, match=f"the checkpoint storage {store} is a local path that host 10.0.0.2"):
        rc.check_shared_paths({"the checkpoint storage": str(store), "the object store": "s3://b/ray"})
    assert seen == [("10.0.0.1", store, True), ("10.0.0.2", store, True)]  # a marker in the path, asked per host
    assert list(store.iterdir()) == []  # and removed
    monkeypatch.setattr(rc, "_node_sees", lambda node, path: Path(path).exists())  # a shared mount
    rc.check_shared_paths({"the checkpoint storage": str(store)})
    monkeypatch.setattr(ray, "nodes", lambda: [_node("10.0.0.1"), _node("10.0.0.1")])  # one host: no probe
    monkeypatch.setattr(rc, "_node_sees", lambda node, path: pytest.fail("nothing to probe"))
    rc.check_shared_paths({"the checkpoint storage": str(tmp_path / "elsewhere")})
    assert not (tmp_path / "elsewhere").exists()


# ---- a two-node cluster on loopback -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, session
            pids.append(int(stat.parent.name))
    return pids


def _wait_for(what: str, ok, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout_s:.0f} s")
        time.sleep(0.2)


class Cluster:
    """A head and a second node, each `ray start ... --block` leading a session of its own."""

    def __init__(self, logs: Path):
        self.logs, self.port, self.n_started, self.temp_dirs = logs, _free_port(), 0, []
        self.address = f"127.0.0.1:{self.port}"
        self.head = self._start(["--head", f"--port={self.port}", "--include-dashboard=false", "--disable-usage-stats"])
        self.wait_alive(1, self.head)
        self.node2 = self.start_node2()

    def _start(self, args: list[str]) -> subprocess.Popen:
        """A node with a temp dir of its own (short: Ray's socket paths live there), so that each node's log monitor
        forwards its own workers' lines only."""
        self.n_started += 1
        log = open(self.logs / f"node-{self.n_started}.log", "w")
        temp = tempfile.mkdtemp(prefix="ray-node-", dir="/tmp")
        self.temp_dirs.append(temp)
        return subprocess.Popen(
            [RAY, "start", "--num-cpus=1", f"--temp-dir={temp}", "--block", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **NODE_ENV},
            start_new_session=True,
        )

    def alive_nodes(self) -> int:
        from ray._raylet import GcsClient
        from ray.core.generated import gcs_pb2

        try:
            infos = GcsClient(address=self.address).get_all_node_info(timeout=5).values()
        except Exception:  # the GCS is not up yet
            return 0
        return sum(info.state == gcs_pb2.GcsNodeInfo.ALIVE for info in infos)

    def wait_alive(self, n: int, *procs: subprocess.Popen) -> None:
        """Until the GCS counts `n` alive nodes; fails early when one of `procs` (the nodes meant to live) exits."""

        def ok() -> bool:
            for proc in procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a Ray node exited with {proc.returncode}: see {self.logs}")
            return self.alive_nodes() == n

        _wait_for(f"{n} alive Ray nodes at {self.address}", ok)

    def start_node2(self) -> subprocess.Popen:
        self.node2 = self._start([f"--address={self.address}", '--resources={"node2": 1}'])
        self.wait_alive(2, self.head, self.node2)
        return self.node2

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """SIGKILL every process of the session `proc` leads (its raylet, workers, agents), and wait for them."""
        for pid in _session_pids(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        _wait_for(f"end of Ray session {proc.pid}", lambda: not _session_pids(proc.pid), 30)

    def stop(self) -> None:
        for proc in (self.node2, self.head):
            self.kill(proc)
        for temp in self.temp_dirs:
            shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("ray-nodes"))
    try:
        yield c
    finally:
        c.stop()
    assert not _session_pids(c.head.pid) and not _session_pids(c.node2.pid)


@pytest.fixture(scope="module")
def features(tiny_embedded, tmp_path_factory) -> Path:
    from components.extract.stage import ExtractConfig, extract
    from components.regenerate.stage import RegenerateConfig, regenerate

    out, quiet = tmp_path_factory.mktemp("stages"), dict(progress=lambda s: None)
    regen = RegenerateConfig(max_new_tokens=16, temperature=1.0, batch_size=8, shard_size=8, limit=12, seed=0)
    regenerate(regen, tiny_embedded.target_dir, str(tiny_embedded.target_traffic.train), str(out / "regen"), **quiet)
    extract(
        ExtractConfig(max_len=160, dtype="float32", seqs_per_shard=4, batch_size=3),
        tiny_embedded.target_dir,
        str(out / "regen"),
        str(out / "extract"),
        **quiet,
    )
    return out / "extract"


def _drive(spec_file: str) -> None:
    """The driver, in a process of its own with RAY_ADDRESS set: two 2-worker runs as flows.tasks.train_task makes
    them (ray_session(Settings.from_env()), storage under the settings' ray_storage_dir), the second held at step 4
    until the test has killed the second node."""
    import dataclasses
    from dataclasses import dataclass

    import ray

    from components.train.stage import RayConfig, TrainConfig, TrainSetup, train
    from infra.ray_cluster import _node_sees, ray_session
    from infra.settings import Settings

    @dataclass(frozen=True)
    class WhereAmI:  # unpickled on every worker with the loop's args: records the worker's rank and node there
        path: str

        def __setstate__(self, state):
            object.__setattr__(self, "__dict__", dict(state))
            try:
                import ray.train

                rank = ray.train.get_context().get_world_rank()
            except Exception:  # the driver or the controller, not a worker
                return
            with open(self.path, "a") as f:
                f.write(
                    json.dumps({"rank": rank, "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()})
                    + "\n"
                )

        def log(self, step, metrics):
            pass

    @dataclass(frozen=True)
    class HoldAt:  # rank 0, once, at `step`: says so in `marker` and waits there to be killed with the node
        marker: str
        step: int

        def log(self, step, metrics):
            if step == self.step and not os.path.exists(self.marker):
                Path(self.marker).write_text(str(os.getpid()))
                time.sleep(300)

    spec = json.loads(Path(spec_file).read_text())
    work = Path(spec["work"])
    cfg = dataclasses.replace(
        TrainConfig.tiny(),
        steps=8,
        checkpoint_every=3,
        batch_size=2,
        ray=RayConfig(num_workers=2, cpus_per_worker=1, max_failures=2),
    )
    settings = Settings.from_env()
    out = {"ray_address": settings.ray_address}
    with ray_session(settings):
        out["nodes"] = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        out["sees"] = [_node_sees(n, str(work)) for n in ray.nodes() if n["Alive"]]
        out["sees_missing"] = [_node_sees(n, str(work / "missing")) for n in ray.nodes() if n["Alive"]]
        for run, sinks in (("plain", ()), ("killed", (HoldAt(str(work / "held"), 4),))):
            t0 = time.perf_counter()
            res = train(
                cfg,
                spec["features"],
                str(work / run),
                sinks=(WhereAmI(str(work / f"{run}.where")), *sinks),
                setup=TrainSetup(storage_dir=str(settings.ray_storage_dir)),
            )
            out[run] = {
                "head_dir": res.head_dir,
                "resumed_from_step": res.resumed_from_step,
                "history": res.history_file,
                "seconds": time.perf_counter() - t0,
            }
    Path(spec["result"]).write_text(json.dumps(out))


def _where(path: Path) -> list[dict]:
    """The workers that `WhereAmI` recorded, one per process, in the order they started."""
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return list({w["pid"]: w for w in rows}.values())


@pytest.mark.slow
@pytest.mark.live
def test_two_node_training_spans_both_nodes_and_survives_losing_one(cluster, features, tmp_path):
    """Placement, the node kill, the restart and the equality, as one story (over 60 lines on purpose: each step
    acts on the cluster the previous one left)."""
    from safetensors.torch import load_file

    spec = {"work": str(tmp_path), "features": str(features), "result": str(tmp_path / "result.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {
        **os.environ,
        "RAY_ADDRESS": cluster.address,
        "EAGLE_HOME": str(tmp_path / ".eagle"),
        "RAY_AUTH_MODE": "disabled",
    }
    log = open(tmp_path / "driver.log", "w")
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from tests.test_ray_multinode import _drive; _drive(sys.argv[1])",
            str(tmp_path / "spec.json"),
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    first_node2, killed = cluster.node2, {}

    def kill_and_replace_node2():  # once rank 0 holds at step 4: the second node dies, a new one joins
        while not (tmp_path / "held").exists():
            if driver.poll() is not None:
                return
            time.sleep(0.1)
        killed["at"] = time.monotonic()
        try:
            cluster.kill(cluster.node2)
            cluster.wait_alive(1, cluster.head)  # the GCS has declared it dead (about 2 s)
            cluster.start_node2()
        except Exception as e:  # the driver then fails to place its workers: the assertion below shows why
            killed["error"] = repr(e)
        killed["replaced_after_s"] = time.monotonic() - killed["at"]

    watcher = threading.Thread(target=kill_and_replace_node2, daemon=True)
    watcher.start()
    try:
        rc = driver.wait(timeout=480)
    finally:
        if driver.poll() is None:
            driver.kill()
        watcher.join(timeout=60)
    assert rc == 0, f"{killed}\n" + (tmp_path / "driver.log").read_text()[-6000:]
    result = json.loads(Path(spec["result"]).read_text())
    print(json.dumps({k: result[k] for k in ("plain", "killed")} | {"node2_replaced_after_s": killed}), flush=True)

    assert result["ray_address"] == cluster.address  # the driver found the cluster through RAY_ADDRESS alone
    head = next(i for i, r in result["nodes"].items() if "node:__internal_head__" in r)
    second = next(i for i, r in result["nodes"].items() if "node2" in r)
    assert result["sees"] == [True, True] and result["sees_missing"] == [False, False]  # the shared-path probe

    plain = {w["rank"]: w["node"] for w in _where(tmp_path / "plain.where")}
    assert plain.keys() == {0, 1} and set(plain.values()) == {head, second}  # one worker on each node
    placed = _where(tmp_path / "killed.where")
    assert {w["node"] for w in placed[:2]} == {head, second}  # the first group, on both nodes
    assert first_node2.poll() is not None and "error" not in killed  # the second node really died mid-run
    later = {w["node"] for w in placed[2:]}
    assert head in later and len(later) == 2 and second not in later  # restarted on the head and the new node

    assert result["killed"]["resumed_from_step"] == 0  # the driver started it fresh...
    from eagle.export import read_head_meta

    assert read_head_meta(result["killed"]["head_dir"])["lineage"]["resumed_from_step"] == 3  # ...Ray resumed it
    steps = [json.loads(x)["step"] for x in Path(result["killed"]["history"]).read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 8
    a = load_file(str(Path(result["plain"]["head_dir"]) / "model.safetensors"))
    b = load_file(str(Path(result["killed"]["head_dir"]) / "model.safetensors"))
    assert a.keys() == b.keys()
    diff = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a}
    assert all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a), diff  # bit for bit
