"""A live MLflow tracking server for tests: `mlflow server` on a free loopback port, owned by the test.

Purpose: `live_mlflow` (module fixture) starts `mlflow server --host 127.0.0.1 --port <free> --workers 1
--backend-store-uri sqlite:///<dir>/mlflow.db --artifacts-destination <dir>/artifacts --serve-artifacts` with
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false (one worker, no job runner: about 0.5 GB) in its own session, and waits
for its /health. `LiveMlflow.kill()` SIGKILLs its whole process group (the `mlflow` launcher and its uvicorn
worker), `start()` brings it back on the same port, database and artifact directory (optionally with
tests/faultinject loaded into it: `start(fault={...})`), `stop()` ends it (SIGTERM, then SIGKILL). Whatever
happens, the fixture stops it at the end. `client()` is an `MlflowClient` pointed at it that sets no process-wide
MLflow state; `restored_mlflow_uris()` undoes what `MlflowStore.connect` sets process-wide (MLflow's global URIs
and the MLFLOW_TRACKING_URI/MLFLOW_REGISTRY_URI it writes into os.environ), for tests that connect in-process.
Run: imported by tests/test_mlflow_server.py.
Not here: the tests themselves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.live_prefect import BIN, _free_port

FAULTS = Path(__file__).resolve().parent / "faultinject"
READY_TIMEOUT_S = 180.0


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is `pgid` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


@dataclass
class LiveMlflow:
    """One `mlflow server`, restartable on the same port, backend store and artifact directory."""

    root: Path
    port: int
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def log_path(self) -> Path:
        return self.root / f"server-{self.starts}.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def start(self, fault: dict | None = None) -> None:
        """Start the server and wait until /health answers; `fault`: a tests/faultinject spec loaded into it."""
        assert self.proc is None or self.proc.poll() is not None, "the server is already running"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "EAGLE_TEST_FAULT"))}
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        if fault:
            env["PYTHONPATH"] = os.pathsep.join([str(FAULTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
            env["EAGLE_TEST_FAULT"] = json.dumps(fault)
        self.starts += 1
        cmd = [
            str(BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.artifacts),
            "--serve-artifacts",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=self.root,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.wait_healthy()

    def wait_healthy(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"mlflow server exited {self.proc.returncode} before it was healthy:\n{self.log()[-3000:]}",
                    pytrace=False,
                )
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        pytest.fail(
            f"mlflow server not healthy at {self.uri}/health after {timeout:.0f} s:\n{self.log()[-3000:]}",
            pytrace=False,
        )

    def _signal_group(self, sig: int, wait_s: float) -> bool:
        """Send `sig` to the server's process group; True once the group is gone within `wait_s`."""
        if self.proc is None:
            return True
        pgid = self.proc.pid  # start_new_session: the launcher leads its own group
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            self.proc.poll()
            if self.proc.returncode is not None and not _group_members(pgid):
                return True
            time.sleep(0.05)
        return False

    def kill(self) -> None:
        """SIGKILL the whole server (launcher and worker) and wait until none of it is left."""
        assert self._signal_group(signal.SIGKILL, 30.0), f"mlflow server group {self.proc.pid} survived SIGKILL"

    def stop(self) -> None:
        if not self._signal_group(signal.SIGTERM, 15.0):
            self.kill()

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)


@contextmanager
def restored_mlflow_uris():
    """Undo, on exit, the process-wide tracking/registry URIs (and their environment variables) set inside."""
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    names = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
    saved = tracking_utils._tracking_uri, registry_utils._registry_uri, {k: os.environ.get(k) for k in names}
    try:
        yield
    finally:
        tracking_utils._tracking_uri, registry_utils._registry_uri = saved[0], saved[1]
        for k, v in saved[2].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def live_mlflow(tmp_path_factory: pytest.TempPathFactory):
    live = LiveMlflow(tmp_path_factory.mktemp("mlflow-server"), _free_port())
    try:
        live.start()
        yield live
    finally:
        live.stop()
