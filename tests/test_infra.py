"""Tests of the `infra/` adapters against real services: SQLite MLflow, a local Ray, a Prefect test API.

Purpose: registration is idempotent per run key, aliases move, a head never lands in a non-head model,
model URIs resolve to downloaded files, settings never print credentials, unreachable services fail fast
with an error that says what to do, Ray sessions start and stop, events reach the Prefect API.
Run: `python -m pytest tests/test_infra.py` (about 30-45 s on 2 cores, most of it Ray and Prefect start-up).
Not here: mocks of the services (a few library calls are replaced by ones that fail the test when reached, to show
that a probe refused first). Nothing is left running: the fixtures stop Ray and the Prefect API.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from infra.settings import Settings, redact_uri

SECRETS = {
    "MLFLOW_TRACKING_TOKEN": "tok-123456",
    "MLFLOW_TRACKING_USERNAME": "alice-user",
    "MLFLOW_TRACKING_PASSWORD": "pw-987654",
    "PREFECT_API_KEY": "pnu_secretkey",
}


def _head_dir(root: Path) -> Path:
    head = root / "head"
    head.mkdir(parents=True)
    (head / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (head / "model.safetensors").write_bytes(b"\x00" * 64)
    return head


# ---- settings ------------------------------------------------------------------------------------------


def test_settings_defaults_live_under_the_state_dir(tmp_path):
    s = Settings.from_env({}, cwd=tmp_path)
    assert s.state_dir == (tmp_path / ".eagle").resolve()
    assert s.mlflow_tracking_uri == f"sqlite:///{s.state_dir / 'mlflow.db'}"
    assert s.mlflow_artifact_location == (s.state_dir / "mlartifacts").as_uri()
    assert (s.ray_address, s.prefect_api_url, s.trust_remote_code) == (None, None, False)

    s = Settings.from_env(
        {
            "EAGLE_HOME": "st",
            "RAY_ADDRESS": "ray://h:10001",
            "EAGLE_TRUST_REMOTE_CODE": "1",
            "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000",
            "PREFECT_API_URL": "http://127.0.0.1:4200/api",
        },
        cwd=tmp_path,
    )
    assert s.state_dir == (tmp_path / "st").resolve()
    assert (s.ray_address, s.trust_remote_code) == ("ray://h:10001", True)
    assert s.mlflow_artifact_location is None  # a server chooses its own artifact store
    with pytest.raises(ValueError, match="EAGLE_TRUST_REMOTE_CODE"):
        Settings.from_env({"EAGLE_TRUST_REMOTE_CODE": "maybe"})


def test_settings_never_print_credentials(tmp_path):
    env = dict(SECRETS, MLFLOW_TRACKING_URI="https://bob:hunter2pass@mlflow.example/")
    s = Settings.from_env(env, cwd=tmp_path)
    assert s.mlflow_tracking_token == "tok-123456"  # read ...
    shown = repr(s) + str(s) + str(s.describe()) + f"{s}"
    for secret in [*SECRETS.values(), "hunter2pass", "bob"]:
        assert secret not in shown  # ... never shown
    assert s.describe()["prefect_api_key"] == "set"
    assert redact_uri("http://u:p@h:5000/x") == "http://***@h:5000/x"


# ---- MLflow --------------------------------------------------------------------------------------------


def test_register_is_idempotent_and_aliases_move(mlflow_store, tmp_path):
    store = mlflow_store
    with store.run("train-head", tags={"target": "tgt"}) as run_id:
        store.log_params(run_id, {f"p{i}": i for i in range(120)})  # more than one batch of params
        store.log_metric_rows(run_id, [(step, {"loss": 1.0 / (step + 1), "acc_0": 0.5}) for step in range(600)])
        assert store.log_dir(run_id, _head_dir(tmp_path), "head") == f"runs:/{run_id}/head"

    v1 = store.register("tgt-eagle3", run_id, "head", run_key="key-1", tags={"target_uri": "models:/tgt/1"})
    again = store.register("tgt-eagle3", run_id, "head", run_key="key-1")
    v2 = store.register("tgt-eagle3", run_id, "head", run_key="key-2")
    assert isinstance(v1.version, int) and again == v1 and v2.version == v1.version + 1
    assert v1.tags == {"target_uri": "models:/tgt/1", "run_key": "key-1"}
    assert [v.version for v in store.find_versions("tgt-eagle3", run_key="key-2")] == [v2.version]
    assert len(store.client.get_metric_history(run_id, "loss")) == 600

    store.set_alias("tgt-eagle3", "champion", v1.version)
    store.set_alias("tgt-eagle3", "challenger", v2.version)
    assert store.get_alias("tgt-eagle3", "champion").version == v1.version
    store.set_alias("tgt-eagle3", "champion", v2.version)
    assert store.get_alias("tgt-eagle3", "champion").version == v2.version
    assert store.get_alias("tgt-eagle3", "nothing") is None
    assert [(v.version, v.aliases) for v in store.list_versions("tgt-eagle3")] == [
        (v1.version, ()),
        (v2.version, ("challenger", "champion")),
    ]
    [model] = store.list_models(kind="eagle3-head")
    assert model.name == "tgt-eagle3" and model.aliases == {"champion": v2.version, "challenger": v2.version}


def test_head_refused_in_a_model_that_is_not_a_head(mlflow_store, tmp_path):
    from infra.mlflow_store import RegistryCollision

    with mlflow_store.run("target") as run_id:
        mlflow_store.log_dir(run_id, _head_dir(tmp_path), "model")
    target = mlflow_store.register("tgt", run_id, "model", run_key="t1", kind=None)  # a target, no kind
    with pytest.raises(RegistryCollision, match="'tgt'.*kind"):
        mlflow_store.register("tgt", run_id, "model", run_key="h1")
    assert [v.version for v in mlflow_store.list_versions("tgt")] == [target.version]


def test_model_uri_resolves_to_downloaded_files(mlflow_store, tmp_path):
    head = _head_dir(tmp_path)
    with mlflow_store.run("train-head") as run_id:
        mlflow_store.log_dir(run_id, head, "head")
    ref = mlflow_store.register("m-eagle3", run_id, "head", run_key="k")
    mlflow_store.set_alias("m-eagle3", "champion", ref.version)

    by_alias = mlflow_store.resolve("models:/m-eagle3@champion")
    assert by_alias.is_relative_to(mlflow_store.settings.models_dir)
    assert sorted(p.name for p in by_alias.iterdir()) == ["config.json", "model.safetensors"]
    assert (by_alias / "model.safetensors").read_bytes() == (head / "model.safetensors").read_bytes()
    assert mlflow_store.resolve(ref.uri) == by_alias  # same version: downloaded once
    assert not [p for p in by_alias.parent.iterdir() if "partial" in p.name]  # no temporary left behind
    with pytest.raises(LookupError, match="no alias"):
        mlflow_store.resolve("models:/m-eagle3@challenger")
    with pytest.raises(ValueError, match="not a model URI"):
        mlflow_store.resolve("runs:/abc/head")


def test_unreachable_tracking_server_fails_fast_and_clearly(tmp_path, monkeypatch):
    import infra.mlflow_store
    from infra.mlflow_store import MlflowStore, TrackingUnreachable

    def no_client(*args, **kwargs):  # MLflow's client retries an unreachable server for minutes
        raise AssertionError("the probe should have refused before any MLflow client was made")

    monkeypatch.setattr(infra.mlflow_store, "MlflowClient", no_client)
    settings = Settings.local(tmp_path, mlflow_tracking_uri="http://user:pw-secret@127.0.0.1:9")
    with pytest.raises(TrackingUnreachable) as err:
        MlflowStore.connect(settings, timeout_s=2.0)
    message = str(err.value)
    assert "127.0.0.1:9" in message and "MLFLOW_TRACKING_URI" in message and "mlflow server" in message
    assert "pw-secret" not in message


# ---- Ray -----------------------------------------------------------------------------------------------


def test_local_ray_session_and_a_nested_one(ray_local, tmp_path):
    import ray

    from infra.quiet import quiet_env
    from infra.ray_cluster import ray_session

    assert ray_local.started and ray.is_initialized()
    assert ray.cluster_resources()["CPU"] == 2
    with ray_session(Settings.local(tmp_path)) as nested:  # already initialised: reuse, do not stop
        assert not nested.started and nested.address == ray_local.address
    assert ray.is_initialized()
    runtime_env = ray.get_runtime_context().runtime_env
    # Ray Train's print patch is off in our workers: it would forward every progress line twice
    assert runtime_env["env_vars"]["RAY_TRAIN_ENABLE_PRINT_PATCH"] == "0"
    # a local Ray: no preemption watcher (nothing drains its one node), the libraries' quiet settings, the setup hook
    assert runtime_env["env_vars"]["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
    assert runtime_env["env_vars"]["HF_HUB_DISABLE_PROGRESS_BARS"] == quiet_env()["HF_HUB_DISABLE_PROGRESS_BARS"]
    assert runtime_env.get("worker_process_setup_hook")


def test_unreachable_ray_address_fails_fast(tmp_path, monkeypatch):
    import ray

    from infra.ray_cluster import RayUnreachable, ray_session

    def no_init(*args, **kwargs):  # ray.init retries an unreachable cluster for minutes
        raise AssertionError("the probe should have refused before ray.init")

    monkeypatch.setattr(ray, "init", no_init)
    with pytest.raises(RayUnreachable, match="127.0.0.1:9.*RAY_ADDRESS"):
        with ray_session(Settings.local(tmp_path, ray_address="127.0.0.1:9"), timeout_s=2.0):
            pass


# ---- Prefect -------------------------------------------------------------------------------------------


def test_prefect_defaults_respect_the_user(tmp_path, monkeypatch):
    from infra.prefect_env import prefect_defaults

    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "true")  # the user's choice stays
    monkeypatch.delenv("PREFECT_HOME", raising=False)
    monkeypatch.delenv("EAGLE_TARGET_PATH_TIMINGS", raising=False)
    settings = Settings.local(tmp_path)
    with prefect_defaults(settings) as applied:
        assert applied["PREFECT_HOME"] == str(tmp_path / "prefect")
        assert applied["EAGLE_TARGET_PATH_TIMINGS"] == str(tmp_path / "target_paths.json")  # kept path timings
        assert "PREFECT_SERVER_ANALYTICS_ENABLED" not in applied
        from prefect.settings import get_current_settings

        assert get_current_settings().server.ephemeral.startup_timeout_seconds == 120
    assert "PREFECT_HOME" not in os.environ
    monkeypatch.setenv("EAGLE_TARGET_PATH_TIMINGS", "")  # set empty: the user turned keeping off
    with prefect_defaults(settings) as applied:
        assert "EAGLE_TARGET_PATH_TIMINGS" not in applied


def test_quiet_defaults_respect_the_user(monkeypatch):
    from infra.quiet import QUIET_ENV, apply_quiet_defaults

    for key in QUIET_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")  # the user's choice stays
    applied = apply_quiet_defaults()
    assert "TRANSFORMERS_VERBOSITY" not in applied and os.environ["TRANSFORMERS_VERBOSITY"] == "info"
    assert applied == {k: v for k, v in QUIET_ENV.items() if k != "TRANSFORMERS_VERBOSITY"}
    assert all(os.environ[k] == v for k, v in applied.items()) and apply_quiet_defaults() == {}


def test_no_event_is_sent_without_a_prefect_api(monkeypatch, caplog):
    import prefect.events
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from infra.prefect_env import emit_event

    def no_emit(*args, **kwargs):  # Prefect would start a throwaway ephemeral server to take the event
        raise AssertionError("Prefect's emit_event was called without an API")

    monkeypatch.setattr(prefect.events, "emit_event", no_emit)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert emit_event("eagle.test", "eagle.nothing") is None
    assert "event eagle.test about eagle.nothing not sent" in caplog.text


def test_emitted_event_reaches_the_prefect_api(prefect_harness):
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    from infra.prefect_env import emit_event

    resource = "mlflow.model-version.tgt.7"
    event_id = emit_event("eagle.target.version-created", resource, payload={"uri": "models:/tgt/7"})
    assert event_id is not None
    wanted = EventFilter(
        event=EventNameFilter(name=["eagle.target.version-created"]), resource=EventResourceFilter(id=[resource])
    )
    deadline = time.monotonic() + 20
    with get_client(sync_client=True) as client:
        while not (events := client.read_events(filter=wanted, limit=10).events) and time.monotonic() < deadline:
            time.sleep(0.5)
    assert [str(e.id) for e in events] == [event_id]
    assert events[0].payload == {"uri": "models:/tgt/7"}


def test_running_starts_servers_at_once_and_stops_all_when_one_fails(tmp_path):
    """`infra.vllm_server.running`: the starts overlap; a failed start still waits for the others, stops every
    server and raises its error; a server stopped while starting ends its wait at once."""
    import threading

    from infra.vllm_engine_spec import EngineSpec
    from infra.vllm_server import EngineError, VllmServer, running

    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    class Timed(VllmServer):  # the orchestration only: start-up stands in for ~30 s of engine imports
        def __init__(self, name: str, seconds: float, fails: bool = False):
            super().__init__(EngineSpec(str(tmp_path), None, method=None), Settings.local(tmp_path / ".eagle"), port=1)
            self.name, self.seconds, self.fails = name, seconds, fails

        def start(self):
            time.sleep(self.seconds)
            with lock:
                events.append(("started", self.name))
            if self.fails:
                raise EngineError(f"{self.name} did not start")
            return self

        def stop(self):
            with lock:
                events.append(("stopped", self.name))

    t0 = time.monotonic()
    with running(Timed("a", 0.6), Timed("b", 0.6)) as (a, b):
        assert (a.name, b.name) == ("a", "b") and time.monotonic() - t0 < 1.0  # overlapped, not 1.2 s
        assert sorted(events) == [("started", "a"), ("started", "b")]
    assert sorted(events[2:]) == [("stopped", "a"), ("stopped", "b")]

    events.clear()
    with pytest.raises(EngineError, match="bad did not start"):
        with running(Timed("bad", 0.05, fails=True), Timed("slow", 0.4)):
            pytest.fail("the block must not run when a server failed to start")
    assert events[:2] == [("started", "bad"), ("started", "slow")]  # the slow one was waited for, then stopped
    assert sorted(events[2:]) == [("stopped", "bad"), ("stopped", "slow")]

    srv = VllmServer(EngineSpec(str(tmp_path), None, method=None), Settings.local(tmp_path / ".eagle"), port=1)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="stopped while starting"):
        srv._wait_healthy()  # proc is None: stop() already ran
    assert time.monotonic() - t0 < 1.0


@pytest.mark.engine
def test_vllm_warm_fills_the_model_info_cache_as_vllm_does(tmp_path):
    """infra/vllm_warm.py (run by `make vllm`) writes vLLM's model-info cache for the project's architectures in one
    process; an unknown architecture is a line, not a failure."""
    import subprocess

    from infra.vllm_server import vllm_python
    from infra.vllm_warm import ARCHITECTURES

    python = vllm_python(Settings.local(tmp_path / ".eagle"))
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "cache")}
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        [str(python), str(root / "infra" / "vllm_warm.py"), *ARCHITECTURES, "NoSuchArch"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "NoSuchArch: not in this vLLM, skipped" in out.stdout
    cached = sorted(p.name for p in (tmp_path / "cache" / "modelinfos").glob("*.json"))
    assert any("llama-LlamaForCausalLM" in n for n in cached) and any("Eagle3LlamaForCausalLM" in n for n in cached)
    assert len(cached) == len(ARCHITECTURES), cached


def test_an_engine_pool_hands_running_servers_on_by_spec_and_stops_the_rest(tmp_path):
    """infra/engine_pool.py: servers parked on a clean exit are taken by a later stage that asks for the same engine
    (a plain engine's K aside), not started again; a stage's `take_each` stops the parked ones it does not take; an
    error stops the stage's servers instead of parking them; one that died while parked is not handed on; one
    launched early (`launch`) is taken by the stage that asks for its engine; closing stops what is parked. Each
    server's process is
    a real `sleep` (the orchestration only: tests/test_load_sweep.py hands real engines on)."""
    import subprocess

    from infra.engine_pool import EnginePool, same_engine
    from infra.vllm_engine_spec import EngineSpec
    from infra.vllm_server import EngineError, VllmServer

    class Sleeper(VllmServer):
        def __init__(self, **spec):
            super().__init__(EngineSpec(str(tmp_path), None, method=None, **spec), Settings.local(tmp_path / ".e"))

        def launch(self):
            self.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)  # stop() ends its group
            return self

        def start(self):
            return self.launch()

        def wait_ready(self):
            if self.proc is None or self.proc.poll() is not None:
                raise EngineError("not running")
            return self

    plain, wider = Sleeper(max_model_len=256), Sleeper(max_model_len=512)
    assert same_engine(plain, Sleeper(max_model_len=256, num_speculative_tokens=3))  # K means nothing to plain
    assert not same_engine(plain, wider) and not same_engine(plain, Sleeper(max_model_len=256, cpu_memory_share=0.5))
    with EnginePool() as pool:
        with pool.running(plain, wider) as up:
            assert up == [plain, wider] and pool.started == 2
        procs = [plain.proc, wider.proc]
        assert all(p.poll() is None for p in procs), "parked, still running"
        again = Sleeper(max_model_len=256)
        with pool.running(again, Sleeper(max_model_len=128)) as (a, b):
            assert a is plain and b is not again and pool.reused == 1 and pool.started == 3
        with pytest.raises(RuntimeError), pool.running(Sleeper(max_model_len=96)) as (c,):
            raise RuntimeError("the stage failed")
        assert c.proc is None and b.proc is not None  # stopped, not parked
        took = pool.take_each([Sleeper(max_model_len=512), Sleeper(max_model_len=64)])
        assert took[0] is wider and took[1] is None and pool.reused == 2
        assert plain.proc is None and b.proc is None, "the parked ones not taken were stopped"
        wider.stop()
        with pool.running(Sleeper(max_model_len=32)) as (d,):
            pass
        d.proc.kill()
        d.proc.wait()  # died while parked: not handed on, a new one started
        with pool.running(Sleeper(max_model_len=32)) as (e,):
            assert e is not d and e.proc.poll() is None and pool.reused == 2 and pool.started == 6
        early = Sleeper(max_model_len=48)
        pool.launch(early)  # started before a stage asks for it, not waited for: the stage takes it
        assert early.proc.poll() is None and pool.started == 7
        with pool.running(Sleeper(max_model_len=48)) as (f,):
            assert f is early and pool.reused == 3 and pool.started == 7
    assert e.proc is None and f.proc is None and all(p.poll() is not None for p in procs)


_OPEN_AT_ONCE = """
import sys, time
from pathlib import Path
from infra.settings import Settings
from infra.mlflow_store import MlflowStore
go = float(sys.argv[2])
while time.time() < go:
    time.sleep(0.005)
MlflowStore.connect(Settings.local(Path(sys.argv[1])))
print("ok")
"""


def test_processes_opening_a_new_sqlite_store_at_once_all_succeed(tmp_path):
    """MLflow creates a new SQLite store's tables in `MlflowClient()` itself: processes that open one at the same
    instant take turns (a CI run lost one of two concurrent trainings to "table ... already exists")."""
    import subprocess
    import sys

    home, go = tmp_path / ".eagle", time.time() + 4.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _OPEN_AT_ONCE, str(home), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parents[1],
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(err[-2000:] for _, err in outs)


def test_rays_lines_in_the_capture_are_not_counted_as_ours(capsys):
    """The suite's shared Ray prints its raylet's warnings into whichever test's capture is open (CI: a disk over
    95 % full); `capsys` (tests/conftest.py) drops them, and nothing else."""
    sys.stderr.write(
        "\x1b[33m(raylet)\x1b[0m [2026-12-06 14:23:58,364 E 25212 25226] file_system_monitor.cc:116: "
        "/tmp/ray/session_x is over 95% full\n"
    )
    sys.stderr.write(
        "(RayTrainWorker pid=123, ip=10.0.0.1) a worker's line\n(pid=5) another\n"
        "eagle-heads: error: x.json: not readable JSON (line 1)\n"
    )
    assert capsys.readouterr().err == "eagle-heads: error: x.json: not readable JSON (line 1)\n"
