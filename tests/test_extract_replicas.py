"""Extraction through several engine replicas (`extract.engine_replicas`): the shards of one engine, each once.

Purpose: on the tiny embedded target (6 layers, hidden 64, head_dim 32, fp32) the same regenerated conversations are
extracted locally and by two vLLM replicas on a local Ray (one engine per actor, a shard per task), and:
- the two replicas' shards equal local extraction's within 1e-5 relative, with the same token ids, loss masks,
  offsets and manifest (but its `engine`; `engine_replicas` is not part of the files). One engine's shards equal
  local extraction's the same way (tests/test_extract_engine.py), so the replicas' equal one engine's;
- one replica's engine is killed (SIGKILL to its process group) once the first shard is written: its replica is
  restarted with a new engine, the shard it held is redone, and every shard is written exactly once; afterwards no
  engine of the run is left, the engines' hidden-state files are gone, and each engine's log is kept;
- a replica whose engine cannot start (an interpreter without vLLM) is one clear line, raised as itself;
- a bad `extract.engine_replicas` fails at config load, naming its key.
Run: `python -m pytest tests/test_extract_replicas.py` (about 1-2 minutes on 2 cores: three engine starts and a Ray).
Needs vLLM's venv (`make vllm`).
Not here: one engine's faults and the interchangeability of engine and local shards (tests/test_extract_engine.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from components.config.pipeline import ConfigError, PipelineConfig
from components.extract.engine import PID_FILE, STORAGE, _group_exists
from components.extract.stage import ExtractConfig, extract
from components.regenerate.stage import RegenerateConfig, regenerate
from components.targets.runtime import StageContext
from infra.settings import Settings
from infra.vllm_server import EngineError
from tests.test_extract_engine import _rel, _shards

QUIET = dict(progress=lambda s: None)
CFG = ExtractConfig(max_len=192, dtype="float32", seqs_per_shard=4, engine="vllm")  # about 20 sequences: 5 shards
RTOL = 1e-5
SHARD = re.compile(r"^extract: shard (\d+)/(\d+),")


@pytest.fixture(scope="module")
def runs(tiny_embedded, engine_settings, tmp_path_factory) -> dict:
    """Local and two replicas (one engine killed after the first shard) over the same conversations."""
    root = tmp_path_factory.mktemp("extract-replicas")
    regen = root / "regen"
    regenerate(
        RegenerateConfig(max_new_tokens=32, batch_size=8, shard_size=8, limit=24),
        tiny_embedded.target_dir,
        str(tiny_embedded.target_traffic.train),
        str(regen),
        **QUIET,
    )
    out: dict = {"root": root, "killed": [], "seen": set()}
    for name, cfg in (
        ("local", dataclasses.replace(CFG, engine="local")),
        ("two", dataclasses.replace(CFG, engine_replicas=2)),
    ):
        lines: list[str] = []
        target = root / name

        def progress(line: str, lines=lines, target=target, name=name) -> None:
            lines.append(line)
            if name != "two":
                return
            pids = [int(f.read_text()) for f in (target / STORAGE).glob(f"*/{PID_FILE}")]
            out["seen"].update(pids)
            if SHARD.match(line) and not out["killed"] and pids:
                os.killpg(pids[0], signal.SIGKILL)  # a replica's engine dies: its next or current shard fails
                out["killed"].append(pids[0])

        t0 = time.perf_counter()
        res = extract(
            cfg,
            tiny_embedded.target_dir,
            str(regen),
            str(target),
            progress=progress,
            context=StageContext(settings=engine_settings),
        )
        out[name] = (res, time.perf_counter() - t0, lines)
    return out


@pytest.mark.engine
@pytest.mark.live
def test_two_replicas_write_one_engines_shards_each_once(runs, engine_settings):
    dirs = {n: Path(runs[n][0].out_dir) for n in ("local", "two")}
    shards = {n: _shards(d) for n, d in dirs.items()}
    n = len(shards["local"])
    assert n >= 4 and len(shards["two"]) == n  # several shards per replica
    worst: dict[str, float] = {}
    for x, y in zip(shards["local"], shards["two"]):
        assert x.keys() == y.keys()
        for k in ("input_ids", "loss_mask", "offsets"):
            assert torch.equal(x[k], y[k]), k
        for k in ("aux_hidden_states", "last_hidden_state"):
            assert x[k].dtype == y[k].dtype == torch.float32 and x[k].shape == y[k].shape
            worst[k] = max(worst.get(k, 0.0), _rel(x[k], y[k]))
    assert all(v < RTOL for v in worst.values()), worst
    manifests = {n: json.loads((d / "manifest.json").read_text()) for n, d in dirs.items()}
    for m in manifests.values():
        for s in m["shards"]:
            s.pop("sha256")
    assert (manifests["local"].pop("engine"), manifests["two"].pop("engine")) == ("local", "vllm")
    assert manifests["local"] == manifests["two"]  # the replicas are not part of the files

    lines = runs["two"][2]
    done = [int(m[1]) for ln in lines if (m := SHARD.match(ln))]
    assert sorted(done) == list(range(1, n + 1)), lines  # every shard written exactly once, the killed one included
    assert any("2 engine replicas on Ray" in ln for ln in lines), lines
    assert runs["killed"], "an engine was killed after the first shard"
    assert not (dirs["two"] / STORAGE).exists()  # the engines' hidden-state files are gone
    assert not [p for p in runs["seen"] if _group_exists(p)], "every engine of the run is stopped"
    logs = sorted((engine_settings.state_dir / "vllm").glob("vllm-*.log"))
    started = [p for p in logs if "kv-transfer-config" in p.read_text(errors="replace")[:4000]]
    assert len(started) >= 3, [p.name for p in logs]  # two replicas and the killed one's successor
    (_, t_local, _), (res, t_two, _) = runs["local"], runs["two"]
    print(
        f"\nreplicas vs local max relative difference {worst}; {res.n_tokens} tokens: local {t_local:.1f} s, "
        f"two replicas {t_two:.1f} s (engine starts, Ray and one engine's restart included)"
    )


@pytest.mark.parametrize(
    "value, named",
    [
        (0, "extract.engine_replicas must be an integer >= 1, got 0"),
        ("two", "extract.engine_replicas"),
    ],
)
def test_a_bad_engine_replicas_fails_at_config_load(tmp_path, value, named):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"extract": {"engine": "vllm", "engine_replicas": value}}))
    with pytest.raises(ConfigError, match=named):
        PipelineConfig.load(path, preset="tiny")


def test_engine_replicas_need_the_engine(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"extract": {"engine_replicas": 2}}))
    with pytest.raises(ConfigError, match="extract.engine_replicas 2 needs engine 'vllm'"):
        PipelineConfig.load(path, preset="tiny")
    path.write_text(json.dumps({"target": {"runtime": "vllm"}, "extract": {"engine_replicas": 2}}))
    assert PipelineConfig.load(path, preset="tiny").extract.engine_replicas == 2  # the runtime sets the engine
    path.write_text(json.dumps({"extract": {"engine": "vllm", "engine_replicas": 2}}))
    assert PipelineConfig.load(path, preset="tiny").extract.engine_replicas == 2


@pytest.mark.engine
@pytest.mark.live
def test_a_replica_whose_engine_cannot_start_is_one_clear_line(runs, tiny_embedded, tmp_path):
    without = Settings.local(tmp_path / ".eagle", vllm_python=sys.executable)  # a python without vLLM
    with pytest.raises(EngineError) as e:
        extract(
            dataclasses.replace(CFG, engine_replicas=2),
            tiny_embedded.target_dir,
            str(runs["root"] / "regen"),
            str(tmp_path / "out"),
            context=StageContext(settings=without),
            **QUIET,
        )
    msg = str(e.value)
    assert "\n" not in msg and "exited with code" in msg and "vllm" in msg, msg
    assert not list((tmp_path / "out").glob("features-*.safetensors"))
