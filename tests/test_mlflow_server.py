"""A live MLflow tracking server: the pipeline registering over REST, the watcher polling it, the server dying.

Purpose: README "Running on a cluster" points MLFLOW_TRACKING_URI at an `mlflow server`; these tests do that on
loopback. tests/live_mlflow.py starts `mlflow server --workers 1` with its own SQLite backend and
`--artifacts-destination` (artifacts proxied); the real CLI (`python -m flows.cli`, tiny preset, tiny embedded
default) runs as a subprocess with MLFLOW_TRACKING_URI=http://127.0.0.1:<port> and a tmp EAGLE_HOME, on the
session's Prefect test API:
- train: target and head are registered through REST (the server logged the creates), their files are in the
  server's artifact directory and no local store was made; a second run reuses the version;
- the registry watcher polls the server: a target version registered there is announced, one with a head is not;
- the server killed during registration: the CLI is paused (tests/faultinject) at `MlflowStore.register`, the
  server SIGKILLed, the CLI resumed; registration retries (its log line) until the server is back, started with
  faultinject inside it, which pauses the server in the create after the version is committed and before the
  answer; the server is SIGKILLed again there and restarted; MLflow's client re-sends the create, and the store
  folds the second version back: exactly one version once the server is back;
- a URI with nothing listening and a stopped server: the CLI exits 2 with one line naming the URI, no traceback.
Run: `python -m pytest tests/test_mlflow_server.py` (about 2.5 minutes on 2 cores, most of it three tiny
training runs; marked slow, run in CI).
Not here: the pipeline on a local SQLite store (tests/test_flows.py, tests/test_faults.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.live_mlflow import live_mlflow, restored_mlflow_uris  # noqa: F401  (the fixture)
from tests.live_prefect import ROOT, _free_port

pytestmark = [pytest.mark.slow, pytest.mark.live, pytest.mark.timeout(900)]

HEAD, FT_HEAD = "t-v1-eagle3", "t-v2-eagle3"
RETRY_LINE = f"registering a version of {FT_HEAD}: try 1 of"
AFTER_COMMIT = {"pause_call": "mlflow.entities.model_registry.model_version:ModelVersion.to_proto"}


def _env(home: Path, uri: str, api_url: str, fault: dict | None = None) -> dict[str, str]:
    """The environment of tests/test_faults.py's runs, with MLFLOW_TRACKING_URI naming the server."""
    drop = ("PREFECT_", "MLFLOW_", "EAGLE_", "RAY_ADDRESS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(
        EAGLE_HOME=str(home),
        MLFLOW_TRACKING_URI=uri,
        PREFECT_API_URL=api_url,
        RAY_AUTH_MODE="disabled",
        PYTHONUNBUFFERED="1",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    if fault:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "faultinject"), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        env["EAGLE_TEST_FAULT"] = json.dumps(fault)
    return env


def _wait_until(done, timeout: float, what: str, out=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout:.0f} s\n{out()[-4000:]}", pytrace=False)
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


@dataclass
class Cli:
    """`python -m flows.cli ...` running, its stdout and stderr read line by line into `lines`."""

    proc: subprocess.Popen
    lines: list[str]
    reader: threading.Thread

    @classmethod
    def start(cls, env: dict[str, str], *args: str) -> Cli:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", *args],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        lines: list[str] = []

        def read() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.append(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        return cls(proc, lines, reader)

    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        _wait_until(
            lambda: text in self.out() or self.proc.poll() is not None, timeout, f"{text!r} in the output", self.out
        )
        assert text in self.out(), f"exited {self.proc.returncode} before printing {text!r}:\n{self.out()[-4000:]}"

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the CLI still runs after {timeout:.0f} s:\n{self.out()[-4000:]}", pytrace=False)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()  # also a stopped (SIGSTOP) one
                self.proc.wait(30)
        self.reader.join(30)
        return self.proc.returncode, self.out()


def _train_args(target: str, traffic, name: str | None = None) -> list[str]:
    return [
        "train",
        "--preset",
        "tiny",
        "--target",
        target,
        "--traffic",
        str(traffic.train),
        "--heldout",
        str(traffic.heldout),
        *(["--name", name] if name else []),
    ]


def _versions(client, name: str) -> list:
    return sorted(client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _served_dir(live, client, run_id: str) -> Path:
    """Where the server's proxy stored the run's artifacts: `mlflow-artifacts:/<path>` under --artifacts-destination."""
    uri = client.get_run(run_id).info.artifact_uri
    assert uri.startswith("mlflow-artifacts:/"), f"artifacts not proxied: {uri}"
    return live.artifacts / uri[len("mlflow-artifacts:/") :].lstrip("/")


@pytest.fixture(scope="module")
def api_url(prefect_harness) -> str:
    from prefect.settings import get_current_settings

    return str(get_current_settings().api.url)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rest-home") / ".eagle"


@pytest.fixture(scope="module")
def first_run(live_mlflow, tiny_embedded, api_url, home) -> tuple[int, str]:
    cli = Cli.start(
        _env(home, live_mlflow.uri, api_url),
        *_train_args(str(tiny_embedded.target_dir), tiny_embedded.target_traffic, "t"),
    )
    return cli.finish()


@pytest.fixture(scope="module")
def finetune(first_run, live_mlflow, tiny_embedded, home):
    """The fine-tune registered on the server as target version t/2 (in this process, over REST); returns what
    the watcher's query found without a head just before."""
    from components.registry.register import register_target
    from components.targets.target import weights_sha256
    from flows.watch import versions_without_head
    from infra.mlflow_store import MlflowStore
    from infra.settings import Settings

    ft = tiny_embedded.finetune_traffic
    with restored_mlflow_uris():
        store = MlflowStore.connect(Settings.local(home, mlflow_tracking_uri=live_mlflow.uri))
        before = versions_without_head(store)
        ref = register_target(
            store,
            "t",
            str(tiny_embedded.finetune_dir),
            role="finetune",
            base_model="t/1",
            weights_sha256=weights_sha256(tiny_embedded.finetune_dir),
            extra_tags={"traffic_train": str(ft.train), "traffic_heldout": str(ft.heldout)},
        )
    assert ref.version == 2
    return before


def test_train_registers_the_head_over_rest_with_proxied_artifacts(first_run, live_mlflow, home):
    rc, out = first_run
    assert rc == 0 and f"head=models:/{HEAD}/1" in out, out[-4000:]
    client = live_mlflow.client()
    (v,) = _versions(client, HEAD)
    assert int(v.version) == 1 and v.tags["run_key"] and v.tags["target_name"] == "t"
    assert client.get_model_version(HEAD, "1").aliases == ["champion"]
    assert v.source == f"runs:/{v.run_id}/head"

    served = _served_dir(live_mlflow, client, v.run_id) / "head"
    (work,) = (home / "runs" / "t-v1").iterdir()
    local = work / "train" / "head"
    for name in ("model.safetensors", "config.json", "probe/probe.safetensors"):
        assert (served / name).is_file(), f"{name} not under --artifacts-destination {live_mlflow.artifacts}"
        assert _sha(served / name) == _sha(local / name), name
    (target,) = _versions(client, "t")
    assert (_served_dir(live_mlflow, client, target.run_id) / "target" / "config.json").is_file()

    assert not (home / "mlflow.db").exists() and not (home / "mlartifacts").exists()  # no local store was used
    log = "".join(p.read_text(errors="replace") for p in sorted(live_mlflow.root.glob("server-*.log")))
    assert log.count("POST /api/2.0/mlflow/model-versions/create") == 2  # the target's version, the head's


def test_a_second_run_reuses_the_registered_version(first_run, live_mlflow, tiny_embedded, api_url, home):
    assert first_run[0] == 0
    rc, out = Cli.start(
        _env(home, live_mlflow.uri, api_url),
        *_train_args(str(tiny_embedded.target_dir), tiny_embedded.target_traffic, "t"),
    ).finish()
    assert rc == 0 and f"head=models:/{HEAD}/1" in out and "nothing to do" in out, out[-4000:]
    client = live_mlflow.client()
    assert [int(v.version) for v in _versions(client, HEAD)] == [1]
    assert [int(v.version) for v in _versions(client, "t")] == [1]


def test_the_watcher_polls_the_server_and_sees_a_new_target_version(finetune, live_mlflow, api_url, home):
    assert finetune == []  # before t/2: t/1 has its head, nothing to announce
    rc, out = Cli.start(_env(home, live_mlflow.uri, api_url), "watch", "--once").finish(120)
    assert rc == 0, out[-4000:]
    assert "announced mlflow.model_version.created for models:/t/2" in out and "models:/t/1" not in out
    assert "watch: 1 version(s) announced" in out
    assert json.loads((home / "watcher" / "announced.json").read_text()) == ["t/2"]


def _db_versions(live, name: str) -> list[int]:
    """The versions in the server's SQLite file, read directly (the server itself may be stopped)."""
    with sqlite3.connect(f"file:{live.root / 'mlflow.db'}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT version FROM model_versions WHERE name = ? AND current_stage != "
            "'Deleted_Internal' ORDER BY version",
            (name,),
        ).fetchall()
    return [r[0] for r in rows]


def test_server_killed_during_registration_retries_and_registers_once(
    finetune, live_mlflow, tiny_embedded, api_url, home
):
    env = _env(home, live_mlflow.uri, api_url, {"pause_call": "infra.mlflow_store:MlflowStore.register"})
    cli = Cli.start(env, *_train_args("models:/t/2", tiny_embedded.finetune_traffic))
    try:
        cli.wait_for("FAULT-PAUSE call MlflowStore.register", 300)
        _wait_until(lambda: _state(cli.proc.pid) == "T", 30, "the CLI stopped at the pause")
        assert _versions(live_mlflow.client(), FT_HEAD) == []  # head logged, not yet registered

        live_mlflow.kill()  # 1: the server is gone when registration starts
        os.kill(cli.proc.pid, signal.SIGCONT)
        cli.wait_for(RETRY_LINE, 60)  # it noticed, and waits to try again
        live_mlflow.start(fault=AFTER_COMMIT)  # back, but pausing inside the create once the version is committed
        _wait_until(
            lambda: "FAULT-PAUSE" in live_mlflow.log(),
            120,
            "the server paused in the create",
            lambda: cli.out() + live_mlflow.log(),
        )
        assert _db_versions(live_mlflow, FT_HEAD) == [1]  # committed; the answer never leaves
        live_mlflow.kill()  # 2: the server dies between committing the version and answering
        live_mlflow.start()
        rc, out = cli.finish()
    finally:
        if cli.proc.poll() is None:
            cli.proc.kill()
    assert rc == 0 and f"head=models:/{FT_HEAD}/1" in out, out[-4000:]
    assert out.count(RETRY_LINE) == 1 and "retrying in 1 s" in out
    assert f"{FT_HEAD}: deleting version 2, a second one of run_key" in out  # MLflow re-sent the create
    client = live_mlflow.client()
    (v,) = _versions(client, FT_HEAD)
    assert int(v.version) == 1 and v.tags["target_version"] == "2" and v.tags["init_from"] == f"models:/{HEAD}/1"
    assert client.get_model_version(FT_HEAD, "1").aliases == ["champion"]
    assert _db_versions(live_mlflow, FT_HEAD) == [1]


def _one_clear_line(rc: int, out: str, uri: str) -> None:
    lines = [x for x in out.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("eagle-heads: error:")]
    assert rc == 2 and len(errors) == 1, out[-4000:]
    assert f"MLflow tracking server {uri} is unreachable" in errors[0] and "MLFLOW_TRACKING_URI" in errors[0]
    assert "Traceback" not in out and len(lines) == 1, out[-4000:]


def test_a_wrong_uri_or_a_stopped_server_is_one_clear_line(
    first_run, live_mlflow, tiny_embedded, api_url, home, tmp_path
):
    """Last in this file: it stops the module's server."""
    nobody = f"http://127.0.0.1:{_free_port()}"
    train = _train_args(str(tiny_embedded.target_dir), tiny_embedded.target_traffic, "t")
    _one_clear_line(*Cli.start(_env(tmp_path / ".eagle", nobody, api_url), *train).finish(120), nobody)

    live_mlflow.stop()
    for args in (train, ["watch", "--once"]):
        _one_clear_line(*Cli.start(_env(home, live_mlflow.uri, api_url), *args).finish(120), live_mlflow.uri)
