"""Extraction through the engine (`extract.engine: vllm`): vLLM's features equal ours, its shards are ours.

Purpose: on the tiny embedded target (6 layers, hidden 64, head_dim 32, fp32), one vLLM started by the extract stage
(`extract_hidden_states`, the project's CPU hidden-states connector) extracts the same regenerated conversations as
local extraction, and:
- the features equal local extraction's within 1e-5 relative (aux_hidden_states and last_hidden_state), with the
  same token ids, loss masks, offsets, tokens file, target heads, target config and shard sizes; the engine's
  per-request files are gone once the shards are written;
- the engine's output directory is interchangeable with the local one: the dataset reader gives the same TTT batches
  (teacher included) and a few training steps from either reach the same loss;
- a re-run keeps every shard and starts no engine; a layer id out of range, an engine that cannot start (no vLLM
  venv, an interpreter without vLLM) are each one clear line, and a failed start leaves the finished shards in place
  (a bad `extract.engine` value fails at config load: tests/test_config.py).
Run: `python -m pytest tests/test_extract_engine.py` (about 1.5 minutes on 2 cores, most of it the one engine start).
Needs vLLM's venv (`make vllm`).
Not here: the engine's serving of heads (tests/test_vllm.py), extraction on Ray (tests/test_extract_scale.py),
several engine replicas (tests/test_extract_replicas.py).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from components.extract.stage import ExtractConfig, extract
from components.regenerate.stage import RegenerateConfig, regenerate
from components.targets.runtime import StageContext
from infra.settings import Settings
from infra.vllm_server import EngineError

pytestmark = pytest.mark.engine
QUIET = dict(progress=lambda s: None)
CFG = ExtractConfig(max_len=192, dtype="float32", seqs_per_shard=8)
RTOL = 1e-5


@pytest.fixture(scope="module")
def settings(engine_settings):
    return engine_settings


@pytest.fixture(scope="module")
def extracted(tiny_embedded, settings, tmp_path_factory) -> dict:
    """The same regenerated conversations extracted locally and through vLLM (one engine start), with timings."""
    root = tmp_path_factory.mktemp("extract-engine")
    regen = root / "regen"
    regenerate(
        RegenerateConfig(max_new_tokens=32, batch_size=8, shard_size=8, limit=24),
        tiny_embedded.target_dir,
        str(tiny_embedded.target_traffic.train),
        str(regen),
        **QUIET,
    )
    out: dict = {"root": root}
    for engine in ("local", "vllm"):
        t0, lines = time.perf_counter(), []
        res = extract(
            dataclasses.replace(CFG, engine=engine),
            tiny_embedded.target_dir,
            str(regen),
            str(root / engine),
            progress=lines.append,
            context=StageContext(settings=settings),
        )
        out[engine] = (res, time.perf_counter() - t0, lines)
    return out


def _shards(d: Path) -> list[dict]:
    return [load_file(str(p)) for p in sorted(d.glob("features-*.safetensors"))]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / a.float().abs().max())


def test_engine_features_equal_local_features(extracted):
    local, vllm = Path(extracted["local"][0].out_dir), Path(extracted["vllm"][0].out_dir)
    a, b = _shards(local), _shards(vllm)
    assert len(a) == len(b) == 3
    worst = {}
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in ("input_ids", "loss_mask", "offsets"):  # the same token ids, sent as local extraction tokenised
            assert torch.equal(x[k], y[k]), k
        for k in ("aux_hidden_states", "last_hidden_state"):
            assert x[k].dtype == y[k].dtype == torch.float32 and x[k].shape == y[k].shape
            worst[k] = max(worst.get(k, 0.0), _rel(x[k], y[k]))
    assert all(v < RTOL for v in worst.values()), worst
    for name in ("tokens.safetensors", "target_heads.safetensors"):
        ta, tb = load_file(str(local / name)), load_file(str(vllm / name))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), name
    assert json.loads((local / "target_config/config.json").read_text()) == json.loads(
        (vllm / "target_config/config.json").read_text()
    )
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (local, vllm))
    assert (ma.pop("engine"), mb.pop("engine")) == ("local", "vllm")
    for m in (ma, mb):
        for s in m["shards"]:
            s.pop("sha256")
    assert ma == mb  # same layer ids, dtype, sizes, tokens hashes, bytes per token
    assert not (vllm / "engine-hidden-states").exists()  # the engine's files are deleted with their shards
    (_, t_local, _), (res, t_vllm, lines) = extracted["local"], extracted["vllm"]
    print(
        f"\nfeature max relative difference {worst}; {res.n_tokens} tokens: local {t_local:.1f} s, "
        f"vLLM {t_vllm:.1f} s (engine start included); {lines}"
    )


def test_engine_shards_are_interchangeable_with_local_ones(extracted, tiny_embedded):
    from components.train.data import TrainingData, ttt_batch
    from components.train.stage import TrainConfig, train

    local, vllm = (TrainingData.open(extracted[e][0].out_dir) for e in ("local", "vllm"))
    draft_ids = torch.arange(0, 512, 4)
    idx = list(range(min(4, local.n_seqs)))
    x, y = ttt_batch(local, idx, draft_ids, "cpu"), ttt_batch(vllm, idx, draft_ids, "cpu")
    assert torch.equal(x.input_ids_BS, y.input_ids_BS) and torch.equal(x.loss_mask_BS, y.loss_mask_BS)
    assert _rel(x.aux_BS3H, y.aux_BS3H) < RTOL
    assert torch.allclose(x.teacher.probs_BTVd, y.teacher.probs_BTVd, atol=1e-5)
    cfg = dataclasses.replace(TrainConfig.tiny(), steps=4, checkpoint_every=4, eval_every=4)
    root = extracted["root"]
    losses = [
        train(cfg, extracted[e][0].out_dir, str(root / f"train-{e}"), tiny_embedded.target_dir).final_metrics
        for e in ("local", "vllm")
    ]
    key = next(k for k in losses[0] if "loss" in k)
    assert losses[1][key] == pytest.approx(losses[0][key], rel=1e-3), (key, losses)


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg, msg
    return msg


def test_rerun_keeps_shards_and_faults_are_one_clear_line(extracted, tiny_embedded, tmp_path):
    regen, target = str(extracted["root"] / "regen"), tiny_embedded.target_dir
    cfg = dataclasses.replace(CFG, engine="vllm")
    copy = tmp_path / "vllm"
    shutil.copytree(extracted["vllm"][0].out_dir, copy)
    no_vllm = Settings.local(tmp_path / ".eagle", vllm_python=str(tmp_path / "nope" / "python"))
    lines: list[str] = []
    extract(cfg, target, regen, str(copy), progress=lines.append, context=StageContext(settings=no_vllm))
    assert lines == [], "every shard is kept: no engine is started (it could not be)"

    (copy / "features-00001.safetensors").unlink()
    kept = {p.name: p.read_bytes() for p in copy.glob("features-*.safetensors")}
    manifest = (copy / "manifest.json").read_text()
    with pytest.raises(EngineError) as e:
        extract(cfg, target, regen, str(copy), context=StageContext(settings=no_vllm), **QUIET)
    assert "make vllm" in _one_line(e)
    without = Settings.local(tmp_path / ".eagle2", vllm_python=sys.executable)  # a python without vLLM
    with pytest.raises(EngineError) as e:
        extract(cfg, target, regen, str(copy), context=StageContext(settings=without), **QUIET)
    assert "exited with code" in _one_line(e) and "vllm" in str(e.value)
    assert {p.name: p.read_bytes() for p in copy.glob("features-*.safetensors")} == kept
    assert (copy / "manifest.json").read_text() == manifest  # a later run resumes at the missing shard

    with pytest.raises(ValueError) as e:  # before any engine starts
        extract(
            dataclasses.replace(cfg, aux_layer_ids=(2, 4, 6)),
            target,
            regen,
            str(tmp_path / "x"),
            context=StageContext(settings=no_vllm),
            **QUIET,
        )
    assert "extract.aux_layer_ids" in _one_line(e) and "1..5" in str(e.value)
