"""Stage 2 at scale: feature shards computed by Ray workers, written by the driver.

Purpose:
- config: `num_workers` and `cpus_per_worker` are range-checked by name and are not part of a run's fingerprint;
- the driver side without Ray: shards computed by `FeatureWorker`s and finished out of order give the same files and
  manifest, byte for byte, as the in-process run;
- Ray (slow): `num_workers` 2 (a local Ray that extract starts and stops through infra.ray_cluster.ray_session)
  writes every file of the extract directory (feature shards, tokens, target heads, target config, manifest)
  byte-identical (sha256) to the in-process run, for bfloat16 and float8_e4m3fn features; a re-run with 2 workers
  after one shard was deleted rewrites only that shard and leaves the others untouched.
Run: `python -m pytest tests/test_extract_scale.py` (about 1 minute; `-m "not slow"` skips the Ray test).
Not here: the single-process behaviour (tests/test_extract_train.py), fp8 numerics (tests/test_fp8_features.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from components.extract.engine import ENGINE_MARK, marked_processes, stop_engines
from components.extract.stage import ExtractConfig, extract
from components.regenerate.stage import RegenerateConfig, regenerate
from components.targets.runtime import StageContext
from eagle.config_checks import FieldError
from infra.settings import Settings

QUIET = dict(progress=lambda s: None)
BASE = ExtractConfig(max_len=160, dtype="bfloat16", seqs_per_shard=2, batch_size=2)


@pytest.fixture(scope="module")
def regen_dir(tiny_embedded, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("extract-scale") / "regen"
    cfg = RegenerateConfig(max_new_tokens=12, temperature=1.0, batch_size=8, shard_size=8, limit=10, seed=0)
    res = regenerate(cfg, tiny_embedded.target_dir, str(tiny_embedded.target_traffic.train), str(out), **QUIET)
    assert res.ok >= 8
    return str(out)


@pytest.fixture(scope="module")
def local_runs(tiny_embedded, regen_dir, tmp_path_factory) -> dict[str, Path]:
    """The in-process extraction (`num_workers` 0) per dtype: the reference bytes."""
    root = tmp_path_factory.mktemp("extract-scale")
    runs = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        runs[dtype] = root / dtype
        extract(dataclasses.replace(BASE, dtype=dtype), tiny_embedded.target_dir, regen_dir, str(runs[dtype]), **QUIET)
    return runs


def _digests(out: Path) -> dict[str, str]:
    """sha256 of every file of an extract directory, by relative path."""
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def _mtimes(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(out.glob("features-*.safetensors"))}


def test_the_worker_fields_are_checked_and_not_part_of_the_run():
    from components.config.pipeline import PipelineConfig

    with pytest.raises(FieldError, match="num_workers"):
        ExtractConfig(num_workers=-1)
    with pytest.raises(FieldError, match="cpus_per_worker"):
        ExtractConfig(cpus_per_worker=0)
    base = PipelineConfig.tiny()
    faster = dataclasses.replace(base, extract=dataclasses.replace(base.extract, num_workers=2, cpus_per_worker=2))
    assert faster.fingerprint() == base.fingerprint()


def test_workers_finishing_out_of_order_write_what_one_process_writes(
    tiny_embedded, regen_dir, local_runs, tmp_path, monkeypatch
):
    """The driver's side of the Ray path, with `FeatureWorker`s run here, the last shard first."""
    import infra.actor_pool as actor_pool

    calls = []

    def run_here(cfg, worker_cls, args, pending, finish, stage, settings, progress):
        worker = worker_cls(cfg, *args)
        calls.append((worker_cls.__name__, sorted(pending)))
        for k in sorted(pending, reverse=True):
            finish(k, worker.run(k, pending[k]), 0.0)

    monkeypatch.setattr(actor_pool, "run_on_ray", run_here)
    out = tmp_path / "ext"
    extract(
        dataclasses.replace(BASE, dtype="float8_e4m3fn", num_workers=2),
        tiny_embedded.target_dir,
        regen_dir,
        str(out),
        **QUIET,
    )
    assert len(calls) == 1 and calls[0][0] == "FeatureWorker" and len(calls[0][1]) >= 3
    assert _digests(out) == _digests(local_runs["float8_e4m3fn"])


@pytest.mark.slow
def test_ray_workers_write_what_one_process_writes_and_resume(tiny_embedded, regen_dir, local_runs, tmp_path):
    import ray

    from infra.ray_cluster import ray_session

    was_running = ray.is_initialized()  # the suite's own local Ray, if a test before this one started it
    settings = Settings.local(tmp_path / ".eagle", ray_auth_mode="disabled")
    lines: list[str] = []
    out = tmp_path / "bfloat16"
    res = extract(
        dataclasses.replace(BASE, num_workers=2),
        tiny_embedded.target_dir,
        regen_dir,
        str(out),
        progress=lines.append,
        context=StageContext(settings=settings),
    )
    assert ray.is_initialized() == was_running, "extract left a Ray it started running"
    assert not any("holds" in line for line in lines), lines  # both workers fitted
    local = local_runs["bfloat16"]
    before = _digests(out)
    n_shards = len(list(out.glob("features-*.safetensors")))
    assert n_shards >= 3 and len(lines) == n_shards
    assert before == _digests(local)  # every shard, tokens, heads, target config
    assert (out / "manifest.json").read_bytes() == (local / "manifest.json").read_bytes()  # no field differs
    assert res.n_seqs >= 5 and res.bytes_per_token > 0

    with ray_session(settings, num_cpus=2):  # one Ray for the rest (extract uses it and leaves it running)
        out8 = tmp_path / "float8_e4m3fn"
        extract(
            dataclasses.replace(BASE, dtype="float8_e4m3fn", num_workers=2),
            tiny_embedded.target_dir,
            regen_dir,
            str(out8),
            context=StageContext(settings=settings),
            **QUIET,
        )
        assert ray.is_initialized()
        assert _digests(out8) == _digests(local_runs["float8_e4m3fn"])

        mtimes = _mtimes(out)
        (out / "features-00001.safetensors").unlink()  # an interrupted run: one shard never written
        lines.clear()
        extract(
            dataclasses.replace(BASE, num_workers=2),
            tiny_embedded.target_dir,
            regen_dir,
            str(out),
            progress=lines.append,
            context=StageContext(settings=settings),
        )
        assert [line.split(",")[0] for line in lines] == [f"extract: shard 2/{n_shards}"], lines  # only that one
        assert _digests(out) == before
        assert {k: v for k, v in _mtimes(out).items() if k != "features-00001.safetensors"} == {
            k: v for k, v in mtimes.items() if k != "features-00001.safetensors"
        }
    assert ray.is_initialized() == was_running


def test_stopping_the_engines_kills_what_outlived_its_leader_and_nothing_else(tmp_path):
    """An engine's EngineCore and workers outlive their group's leader when a replica's actor dies mid-run (the
    leader dies with its parent): `stop_engines` finds them by the storage mark in their environment. A process
    marked for another run's storage is left alone."""
    storage = tmp_path / "engine-hidden-states"
    (storage / "replica-1").mkdir(parents=True)
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    ours = subprocess.Popen(
        sleep, env={**os.environ, ENGINE_MARK: str((storage / "replica-1").resolve())}, start_new_session=True
    )
    theirs = subprocess.Popen(
        sleep,
        env={**os.environ, ENGINE_MARK: str((tmp_path / "engine-hidden-states-2").resolve())},
        start_new_session=True,
    )
    try:
        assert marked_processes(storage) == [ours.pid]
        stop_engines(storage, wait_s=10)
        assert ours.wait(10) < 0 and theirs.poll() is None and marked_processes(storage) == []
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()
