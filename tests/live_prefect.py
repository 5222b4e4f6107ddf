"""A live Prefect server (and a process worker) for tests, on a free loopback port with its own home and database.

Purpose: `live_prefect` (fixture) starts `prefect server start` with the environment every command of a test runs
in (`LivePrefect.env`: PREFECT_API_URL, its own PREFECT_HOME and EAGLE_HOME, scheduler service off); the test waits
for it (`wait_healthy`), starts a worker (`start("worker", ...)`), runs commands (`cli`), reads deployments and
flow runs over the REST API and waits for a run to end (`wait_run`). Every process it started, and their
descendants, are stopped at the end, pass or fail.
Run: imported by tests/test_prefect_server.py and tests/test_monitor_vllm.py.
Not here: the tests themselves.
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

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
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
        proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env=self.env if env is None else env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
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
            res = subprocess.run(
                args, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired as e:
            output = "\n".join(
                o.decode(errors="replace") if isinstance(o, bytes) else o or "" for o in (e.stdout, e.stderr)
            )
            self.fail(f"`{' '.join(args)}` still running after {timeout:.0f} s; output:\n{output}")
        if res.returncode != 0:
            self.fail(f"`{' '.join(args)}` exited {res.returncode}:\n{res.stdout}\n{res.stderr}")
        return res.stdout + res.stderr

    def api(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.api_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
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
    env.update(
        {
            "PWD": str(
                ROOT
            ),  # prefect.yaml's pull step is `{{ $PWD }}` at deploy time; subprocess cwd= does not set it
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
        }
    )
    return env


@pytest.fixture
def live_prefect(tmp_path: Path, mlflow_settings):
    """`prefect server start` on a free port (not yet waited for: call `wait_healthy`); stops it and the worker."""
    port = _free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    live = LivePrefect(
        f"http://127.0.0.1:{port}/api", _live_env(tmp_path / "prefect-home", mlflow_settings.state_dir, port), logs
    )
    server_env = {k: v for k, v in live.env.items() if k != "PREFECT_API_URL"}
    live.start(
        "server",
        str(BIN / "prefect"),
        "server",
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-ui",
        env=server_env,
    )
    try:
        yield live
    finally:
        for name in reversed(list(live.procs)):
            _stop(live.procs[name])
