"""Live Prefect: the deployments of prefect.yaml on a real `prefect server start` and a process worker, no mocks.

Purpose: run the commands of README "Running the deployments" as a user would, against a server on a free loopback
port with its own Prefect home and database under tmp_path: create the `eagle-local` pool, `prefect deploy --all`
(a copy of prefect.yaml with `preset: tiny`), start `prefect worker start --pool eagle-local`, register version 1 of
a target (the tiny embedded default) in a SQLite MLflow under a tmp EAGLE_HOME, run `eagle-heads watch --once`;
the event it emits must fire the `on-new-finetune` trigger, and the worker must run that flow to COMPLETED and
register the head. Then version 2 goes through `prefect deployment run train-head/train-head`, and a run of the
`watch-registry` deployment completes with nothing left to announce.
The server's scheduler service is off (PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED=false) so that the interval
`watch-registry` deployment does not start runs of its own in the middle; the schedules are checked as declared.
Every process started here (server, worker, the worker's flow runs) is stopped at the end, pass or fail.
Run: `python -m pytest tests/test_prefect_server.py` (about 1 minute on 2 cores; needs only loopback).
Not here: the flows' logic (tests/test_flows.py), prefect.yaml's static checks (tests/test_deployments.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TARGET = "stdlib-llama"
RUN_TIMEOUT_S = 240.0
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (Linux /proc), including those in their own session (the worker's runs)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process and all its descendants, SIGKILL whatever is left after 10 s."""
    pids = [proc.pid, *_descendants(proc.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
        if not any(Path(f"/proc/{p}").exists() and _is_alive(p) for p in pids):
            return


def _is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class LivePrefect:
    """A running `prefect server` (and later a worker) with the environment every command here runs in."""

    api_url: str
    env: dict[str, str]
    logs: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        proc = subprocess.Popen(args, cwd=ROOT, env=self.env if env is None else env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        log.close()
        self.procs[name] = proc
        return proc

    def tail(self, lines: int = 40) -> str:
        out = []
        for name in self.procs:
            text = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()
            out.append(f"----- {name} log (last {lines} lines) -----\n" + "\n".join(text[-lines:]))
        return "\n".join(out)

    def fail(self, what: str) -> None:
        pytest.fail(f"{what}\n{self.tail()}", pytrace=False)

    def cli(self, *args: str, timeout: float = 120.0) -> str:
        """Run a command to the end in the live environment; fail with its output (and the logs) unless rc 0."""
        try:
            res = subprocess.run(args, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout,
                                 stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            output = "\n".join(o.decode(errors="replace") if isinstance(o, bytes) else o or ""
                               for o in (e.stdout, e.stderr))
            self.fail(f"`{' '.join(args)}` still running after {timeout:.0f} s; output:\n{output}")
        if res.returncode != 0:
            self.fail(f"`{' '.join(args)}` exited {res.returncode}:\n{res.stdout}\n{res.stderr}")
        return res.stdout + res.stderr

    def api(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.api_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"null")

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs["server"].poll() is not None:
                self.fail(f"prefect server exited with {self.procs['server'].returncode} before it was healthy")
            try:
                if self.api("GET", "/health") is True:
                    return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.5)
        self.fail(f"prefect server not healthy at {self.api_url}/health after {timeout:.0f} s")

    def deployment(self, flow: str, name: str) -> dict:
        return self.api("GET", f"/deployments/name/{flow}/{name}")

    def runs_of(self, deployment_id: str) -> list[dict]:
        return self.api("POST", "/flow_runs/filter", {"deployments": {"id": {"any_": [deployment_id]}}})

    def wait_run(self, deployment_id: str, what: str, timeout: float = RUN_TIMEOUT_S) -> dict:
        """The deployment's single flow run once it is terminal; fails on timeout or on a non-COMPLETED end."""
        deadline = time.monotonic() + timeout
        runs: list[dict] = []
        while time.monotonic() < deadline:
            if self.procs["worker"].poll() is not None:
                self.fail(f"the worker exited with {self.procs['worker'].returncode} while waiting for {what}")
            runs = self.runs_of(deployment_id)
            if runs and runs[0]["state"]["type"] in TERMINAL:
                break
            time.sleep(1.0)
        else:
            state = runs[0]["state"]["type"] if runs else "no flow run created"
            self.fail(f"{what}: not finished after {timeout:.0f} s (state: {state})")
        assert len(runs) == 1, f"{what}: expected one flow run, got {len(runs)}"
        state = runs[0]["state"]
        if state["type"] != "COMPLETED":
            self.fail(f"{what}: flow run {runs[0]['name']} ended {state['type']}: {state.get('message')}")
        return runs[0]


def _live_env(home: Path, eagle_home: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "RAY_"))}
    env.update({
        "PWD": str(ROOT),  # prefect.yaml's pull step is `{{ $PWD }}` at deploy time; subprocess cwd= does not set it
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
        "PREFECT_CLI_PROMPT": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "1",
        "EAGLE_HOME": str(eagle_home),
        "RAY_AUTH_MODE": "disabled",
        "OMP_WAIT_POLICY": "PASSIVE",
        "OMP_NUM_THREADS": "1",
    })
    return env


@pytest.fixture
def live_prefect(tmp_path: Path, mlflow_settings):
    """`prefect server start` on a free port (not yet waited for: call `wait_healthy`); stops it and the worker."""
    port = _free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    live = LivePrefect(f"http://127.0.0.1:{port}/api", _live_env(tmp_path / "prefect-home", mlflow_settings.state_dir,
                                                                  port), logs)
    server_env = {k: v for k, v in live.env.items() if k != "PREFECT_API_URL"}
    live.start("server", str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port),
               "--no-ui", env=server_env)
    try:
        yield live
    finally:
        for name in reversed(list(live.procs)):
            _stop(live.procs[name])


def _tiny_prefect_yaml(dest: Path) -> Path:
    text = (ROOT / "prefect.yaml").read_text()
    assert text.count("preset: default") == 2, "prefect.yaml: expected `preset: default` in retrain and the trigger"
    out = dest / "prefect.yaml"
    out.write_text(text.replace("preset: default", "preset: tiny"))
    return out


def _register(store, emb_dir: Path, traffic, role: str, base_model: str = "") -> int:
    from components.register import register_target
    from components.targets import weights_sha256

    ref = register_target(store, TARGET, str(emb_dir), role=role, base_model=base_model,
                          weights_sha256=weights_sha256(emb_dir),
                          extra_tags={"traffic_train": str(traffic.train), "traffic_heldout": str(traffic.heldout)})
    return ref.version


def _head_version(store, version: int):
    from components.register import TargetRef, head_model_name

    versions = store.list_versions(head_model_name(TargetRef(TARGET, version, "", "")))
    assert len(versions) == 1, f"head of {TARGET} v{version}: expected one registered version, got {versions}"
    assert versions[0].tags["target_version"] == str(version)
    return versions[0]


def test_deployments_on_a_live_server_and_process_worker(live_prefect, tiny_embedded, mlflow_store, tmp_path):
    live = live_prefect
    emb = tiny_embedded
    v1 = _register(mlflow_store, emb.target_dir, emb.target_traffic, "base")  # while the server starts
    live.wait_healthy()
    prefect = str(BIN / "prefect")
    live.cli(prefect, "work-pool", "create", "eagle-local", "--type", "process")
    live.cli(prefect, "deploy", "--all", "--prefect-file", str(_tiny_prefect_yaml(tmp_path)), timeout=180)
    retrain = live.deployment("retrain", "retrain")
    assert retrain["work_pool_name"] == "eagle-local" and retrain["parameters"] == {"preset": "tiny"}
    assert retrain["schedules"][0]["schedule"]["cron"] == "0 3 * * *"
    watch = live.deployment("watch-registry", "watch-registry")
    assert watch["schedules"][0]["schedule"]["interval"] == 300
    on_new = live.deployment("on-new-finetune", "on-new-finetune")
    (pull,) = on_new["pull_steps"]
    assert pull["prefect.deployments.steps.set_working_directory"]["directory"] == str(ROOT)
    train = live.deployment("train-head", "train-head")
    live.start("worker", prefect, "worker", "start", "--pool", "eagle-local")

    out = live.cli(str(BIN / "eagle-heads"), "watch", "--once", timeout=180)
    assert "1 version(s) announced" in out, out
    run = live.wait_run(on_new["id"], f"on-new-finetune for {TARGET} v{v1} (fired by the event trigger)")
    assert run["parameters"]["model_name"] == TARGET and int(run["parameters"]["version"]) == v1
    assert run["parameters"]["preset"] == "tiny"
    head1 = _head_version(mlflow_store, v1)

    v2 = _register(mlflow_store, emb.finetune_dir, emb.finetune_traffic, "finetune", f"{TARGET}/{v1}")
    t = emb.finetune_traffic
    live.cli(prefect, "deployment", "run", "train-head/train-head", "--param", f"target=models:/{TARGET}/{v2}",
             "--param", f"traffic={t.train}", "--param", f"heldout={t.heldout}", "--param", "preset=tiny")
    live.wait_run(train["id"], f"train-head for {TARGET} v{v2} (prefect deployment run)")
    head2 = _head_version(mlflow_store, v2)
    assert head1.tags["run_key"] != head2.tags["run_key"]

    live.cli(prefect, "deployment", "run", "watch-registry/watch-registry")  # every version has its head now
    live.wait_run(watch["id"], "watch-registry (prefect deployment run)")
    announced = json.loads((Path(live.env["EAGLE_HOME"]) / "watcher" / "announced.json").read_text())
    assert announced == [f"{TARGET}/{v1}"], "watch-registry announced a version that already had its head"
    assert len(live.runs_of(on_new["id"])) == 1, "the trigger fired again, but no version was left without a head"
