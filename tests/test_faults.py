"""Faults: `kill -9` at every stage, a store that fails at registration, two runs at once, a Ray worker killed.

Purpose: the pipeline runs unattended, so it must survive a kill at any moment and a flaky store. These tests
run the real CLI (`python -m flows.cli train --preset tiny ...`) as subprocesses on the tiny embedded default,
one EAGLE_HOME per scenario:
- `reference`: two runs started at once on a fresh home, in the default local mode (each starts Prefect's
  temporary API on the shared Prefect home; one trains and registers, the other waits for the per-target lock
  and finds the run registered): one target version, one head version, both exit 0. Its artifacts are the
  uninterrupted run the chain is compared with. The first killed run is in local mode too: its temporary API
  server must not outlive it. The other runs share one Prefect test API (faster).
- `chain`: one home, one run killed (`kill -9`) in each stage, in order, each time resumed by the next run:
  mid-regeneration (a shard's temp file half written), mid-extraction (a feature shard half written),
  mid-training (checkpoint 10 written but not yet renamed into place), the store failing every registration
  attempt (a clear error, exit 2), mid-registration (version created, alias not yet set), then a run to the
  end. The result must equal the reference: the same regenerated and feature shards (sha256), the same head
  weights, one registry version with its alias, no lost, duplicated or half-written file.
The kill points come from tests/faultinject/sitecustomize.py: the child stops itself (SIGSTOP) at the chosen
write or call and prints where; the test checks the disk at that moment, then sends SIGKILL. Deterministic,
and the project has no fault hook of its own.
- A Ray Train worker process SIGKILLed mid-training: FailureConfig restarts the group, which resumes from the
  last checkpoint.
Run: `python -m pytest tests/test_faults.py` (about 2-3 minutes on 2 cores; all marked slow, run in CI).
Not here: bad input (tests/test_bad_input.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FAULTS = Path(__file__).resolve().parent / "faultinject"
HEAD = "t-v1-eagle3"
STRAY = re.compile(r"(^\..*\.tmp$)|(^\.tmp-step-)|(^\.head\.)|(\.partial-)")


@dataclass
class Run:
    rc: int
    out: str
    paused: str | None = None  # the FAULT-PAUSE line, if the run was stopped and killed
    at_pause: dict = field(default_factory=dict)  # what the test saw on disk while it was stopped
    orphans: list[str] = field(default_factory=list)  # child processes still alive 10 s after the kill


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _work(home: Path) -> Path:
    (work,) = (home / "runs" / "t-v1").iterdir()
    return work


def _child_env(home: Path, api_url: str | None, fault: dict | None) -> dict[str, str]:
    drop = ("PREFECT_", "MLFLOW_", "EAGLE_", "RAY_ADDRESS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(
        EAGLE_HOME=str(home),
        RAY_AUTH_MODE="disabled",
        PYTHONUNBUFFERED="1",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    if api_url:  # else Prefect's temporary local API, started by each process, as a user without a server gets
        env["PREFECT_API_URL"] = api_url
    if fault:
        env["PYTHONPATH"] = os.pathsep.join([str(FAULTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["EAGLE_TEST_FAULT"] = json.dumps(fault)
    return env


class Cli:
    """The train command of one tiny target, run as a subprocess; `start` + `finish` or `run`."""

    def __init__(self, emb, api_url: str):
        self.emb, self.api_url = emb, api_url

    def start(
        self, home: Path, fault: dict | None = None, shared_api: bool = True
    ) -> tuple[subprocess.Popen, list[str], threading.Event, threading.Thread]:
        t = self.emb.target_traffic
        cmd = [
            sys.executable,
            "-m",
            "flows.cli",
            "train",
            "--preset",
            "tiny",
            "--target",
            str(self.emb.target_dir),
            "--traffic",
            str(t.train),
            "--heldout",
            str(t.heldout),
            "--name",
            "t",
        ]
        env = _child_env(home, self.api_url if shared_api else None, fault)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        paused = threading.Event()

        def read():
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.append(line)
                if line.startswith("FAULT-PAUSE"):
                    paused.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        return proc, lines, paused, reader

    def finish(self, proc, lines, paused, reader, look=None, timeout: float = 240) -> Run:
        _wait_until(lambda: proc.poll() is not None or paused.is_set(), timeout)
        seen, kids = {}, []
        if paused.is_set():
            pause = next(x for x in lines if x.startswith("FAULT-PAUSE"))
            pid = int(re.search(r"pid=(\d+)", pause)[1])  # it stops itself (SIGSTOP) right after printing the line
            stopped = _wait_until(lambda: _state(pid) == "T", 30)
            seen = look() if look and stopped else {}  # a child that never stopped: nothing seen, its test fails
            kids = _children(proc.pid)  # e.g. Prefect's temporary API server in local mode
            os.kill(proc.pid, signal.SIGKILL)
        elif proc.poll() is None:
            proc.kill()
        proc.wait(30)
        orphans = _outlive(kids, 10.0)
        reader.join(30)  # the pipe is at its end once the child and what it started are gone
        out = "".join(lines)
        pause = next((x.strip() for x in lines if x.startswith("FAULT-PAUSE")), None)
        return Run(proc.returncode, out, pause, seen, orphans)

    def run(self, home: Path, fault: dict | None = None, look=None, shared_api: bool = True) -> Run:
        return self.finish(*self.start(home, fault, shared_api), look=look)


def _wait_until(done, timeout: float) -> bool:
    """Poll `done()` until it is true (True) or `timeout` seconds have passed (False)."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _state(pid: int) -> str:
    """The process's state letter in /proc (R, S, T for stopped, Z for a zombie...); "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _children(pid: int) -> list[int]:
    found = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _outlive(pids: list[int], timeout: float) -> list[str]:
    """The command lines of `pids` still running after `timeout` seconds (those are then killed: no leak)."""

    def alive(p: int) -> bool:
        return _state(p) not in ("", "Z")

    _wait_until(lambda: not any(alive(p) for p in pids), timeout)
    left = [p for p in pids if alive(p)]
    names = [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120] for p in left]
    for p in left:
        os.kill(p, signal.SIGKILL)
    return names


@pytest.fixture(scope="module")
def cli(tiny_embedded, prefect_harness) -> Cli:
    from prefect.settings import get_current_settings

    return Cli(tiny_embedded, str(get_current_settings().api.url))


def _store(home: Path):
    from infra.mlflow_store import MlflowStore
    from infra.settings import Settings

    return MlflowStore.connect(Settings.local(home))


@pytest.fixture(scope="module")
def reference(cli, tmp_path_factory):
    """Two runs for the same new target started at the same time, on a fresh home, each with Prefect's local API."""
    home = tmp_path_factory.mktemp("reference") / ".eagle"
    a, b = cli.start(home, shared_api=False), cli.start(home, shared_api=False)
    return home, [cli.finish(*a), cli.finish(*b)]


def test_two_runs_at_once_register_once_and_both_succeed(reference):
    home, runs = reference
    assert [r.rc for r in runs] == [0, 0], "\n\n".join(r.out[-3000:] for r in runs)
    assert all(f"head=models:/{HEAD}/1" in r.out for r in runs)
    assert sorted("nothing to do" in r.out for r in runs) == [False, True]  # one trained, one found it done
    store = _store(home)
    assert [v.version for v in store.list_versions("t")] == [1]  # the target too is registered once
    assert [(v.version, v.aliases) for v in store.list_versions(HEAD)] == [(1, ("champion",))]


# ---- kill -9 in every stage, then resume ------------------------------------------------------------------------


def _look_regenerate(home: Path):
    regen = _work(home) / "regenerate"
    return lambda: {"files": sorted(p.name for p in regen.iterdir())}


def _look_extract(home: Path):
    ext = _work(home) / "extract"
    return lambda: {
        "manifest_shards": [s["file"] for s in json.loads((ext / "manifest.json").read_text())["shards"]],
        "files": sorted(p.name for p in ext.iterdir()),
    }


def _look_train(home: Path):
    ckpt = _work(home) / "train" / "checkpoints"
    return lambda: {"checkpoints": sorted(p.name for p in ckpt.iterdir())}


def _look_registry(home: Path):
    return lambda: {"versions": [(v.version, v.aliases) for v in _store(home).list_versions(HEAD)]}


@pytest.fixture(scope="module")
def chain(cli, reference, tmp_path_factory) -> tuple[Path, dict[str, Run]]:
    home = tmp_path_factory.mktemp("chain") / ".eagle"
    runs: dict[str, Run] = {}
    runs["regenerate"] = cli.run(
        home,
        {"pause_rename": "shard-00001.jsonl", "truncate": True},
        look=lambda: _look_regenerate(home)(),
        shared_api=False,
    )  # local mode
    runs["extract"] = cli.run(
        home, {"pause_rename": "features-00001.safetensors", "truncate": True}, look=lambda: _look_extract(home)()
    )
    runs["train"] = cli.run(home, {"pause_rename": "step-0000010"}, look=lambda: _look_train(home)())
    runs["store_down"] = cli.run(
        home, {"fail_call": "mlflow.tracking.client:MlflowClient.create_model_version", "times": 3}
    )
    runs["register"] = cli.run(
        home,
        {"pause_call": "mlflow.tracking.client:MlflowClient.set_registered_model_alias"},
        look=lambda: _look_registry(home)(),
    )
    runs["final"] = cli.run(home)
    return home, runs


def _killed(run: Run) -> None:
    assert run.paused, f"the run never reached its fault point:\n{run.out[-4000:]}"
    assert run.rc == -signal.SIGKILL


def test_kill_mid_regeneration(chain):
    run = chain[1]["regenerate"]
    _killed(run)
    assert not run.orphans, f"still running after the kill: {run.orphans}"  # Prefect's local API went with it
    files = run.at_pause["files"]
    assert "shard-00000.jsonl" in files and "shard-00001.jsonl" not in files and "shard-00001.json" not in files
    assert any(f.startswith(".shard-00001.jsonl.") for f in files)  # its half-written temp file


def test_kill_mid_extraction(chain):
    run = chain[1]["extract"]
    _killed(run)
    assert run.at_pause["manifest_shards"] == ["features-00000.safetensors"]
    assert any(f.startswith(".features-00001.safetensors.") for f in run.at_pause["files"])


def test_kill_mid_training(chain):
    run = chain[1]["train"]
    _killed(run)
    assert run.at_pause["checkpoints"] == [".tmp-step-0000010", "step-0000005"]


def test_store_failing_at_registration_fails_clearly(chain):
    home, runs = chain
    run = runs["store_down"]
    assert run.rc == 2, run.out[-4000:]
    assert run.out.count("FAULT-FAIL") == 3  # the register task's two retries, then the flow fails
    last = run.out.strip().splitlines()[-1]
    assert last.startswith("eagle-heads: error: MLflow at sqlite:///") and "database is locked" in last
    assert "re-run the same command" in last


def test_kill_mid_registration(chain):
    run = chain[1]["register"]
    _killed(run)
    assert run.at_pause["versions"] == [(1, ())]  # created, alias not yet set


def test_resumed_run_equals_an_uninterrupted_one(chain, reference):
    home, runs = chain
    ref_home, _ = reference
    final = runs["final"]
    assert final.rc == 0 and f"head=models:/{HEAD}/1" in final.out, final.out[-4000:]
    assert "nothing to do" in final.out  # the killed registration had created the version; its alias is now set
    work, ref = _work(home), _work(ref_home)
    assert work.name == ref.name  # the same run key

    for stage, pattern in [("regenerate", "shard-*"), ("extract", "*.safetensors")]:
        mine = {p.name: _sha(p) for p in sorted((work / stage).glob(pattern))}
        theirs = {p.name: _sha(p) for p in sorted((ref / stage).glob(pattern))}
        assert mine == theirs and mine, stage
    ids = [
        json.loads(x)["id"]
        for p in sorted((work / "regenerate").glob("shard-*.jsonl"))
        for x in p.read_text().splitlines()
    ]
    assert len(ids) == len(set(ids)) > 0  # no conversation twice
    m, r = (json.loads((d / "extract" / "manifest.json").read_text()) for d in (work, ref))
    assert m["shards"] == r["shards"] and m["n_seqs"] == sum(s["n_seqs"] for s in m["shards"])

    for name in ("model.safetensors", "probe/probe.safetensors", "config.json"):
        assert _sha(work / "train" / "head" / name) == _sha(ref / "train" / "head" / name), name
    meta, ref_meta = (json.loads((d / "train" / "head" / "eagle_head.json").read_text()) for d in (work, ref))
    assert meta["lineage"].pop("resumed_from_step") == 5 and ref_meta["lineage"].pop("resumed_from_step") == 0
    assert meta == ref_meta  # the lineage records the resume; everything else is the same
    steps = [json.loads(x)["step"] for x in (work / "train" / "history.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) == [2, 4, 6, 8, 10, 12]

    store, ref_store = _store(home), _store(ref_home)
    assert [v.version for v in store.list_versions("t")] == [1]
    (v,) = store.list_versions(HEAD)
    (rv,) = ref_store.list_versions(HEAD)
    assert v.aliases == ("champion",) and v.tags["tau"] == rv.tags["tau"] and v.tags["promoted"] == "true"
    got, want = store.resolve(v.uri), ref_store.resolve(rv.uri)
    assert _sha(got / "model.safetensors") == _sha(want / "model.safetensors")

    stray = [
        str(p) for p in [*home.joinpath("runs").rglob("*"), *home.joinpath("models").rglob("*")] if STRAY.search(p.name)
    ]
    assert not stray, f"half-written leftovers: {stray}"


# ---- a Ray Train worker process dies ----------------------------------------------------------------------------


def test_a_killed_ray_worker_is_restarted_from_the_last_checkpoint(reference, ray_local, tmp_path):
    from components.train.stage import RayConfig, TrainConfig, TrainSetup, latest_checkpoint, train
    from eagle.export import read_head_meta

    @dataclass(frozen=True)
    class KillWorker:  # a metrics sink (rank 0) that SIGKILLs its own Ray worker process once, at `step`
        marker: str
        step: int

        def log(self, step, metrics):
            if step == self.step and not os.path.exists(self.marker):
                Path(self.marker).write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)

    cfg = dataclasses.replace(
        TrainConfig.tiny(), steps=8, checkpoint_every=3, batch_size=2, ray=RayConfig(num_workers=1, max_failures=1)
    )  # the 2-worker restart: test_extract_train
    marker, out = tmp_path / "killed-pid", tmp_path / "train"
    res = train(
        cfg,
        str(_work(reference[0]) / "extract"),
        str(out),
        sinks=(KillWorker(str(marker), 4),),
        setup=TrainSetup(storage_dir=str(tmp_path / "ray")),
    )
    assert marker.is_file() and int(marker.read_text()) != os.getpid()  # a worker process really died
    assert read_head_meta(res.head_dir)["lineage"]["resumed_from_step"] == 3
    steps = [json.loads(x)["step"] for x in Path(res.history_file).read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == cfg.steps
    assert latest_checkpoint(out).name == f"step-{cfg.steps:07d}"
