"""Pipeline configs: presets, JSON overrides key by key (nested sections too), checks at load that name the key.

Every leaf of every section is reachable from a file; a wrong type, an out-of-range value or an unknown key fails
with the key's path (a moved key suggests its new place); the fingerprint follows what makes a head.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from components.config.pipeline import ConfigError, PipelineConfig
from components.train.stage import TrainConfig


def _load(tmp_path: Path, data, preset: str = "tiny") -> PipelineConfig:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(data))
    return PipelineConfig.load(path, preset)


def test_presets_and_overrides(tmp_path):
    assert PipelineConfig.load(None, "tiny") == PipelineConfig.tiny()
    assert PipelineConfig.load(None, "default") == PipelineConfig.default()
    cfg = _load(tmp_path, {"train": {"steps": 7}, "extract": {"mode": "online"}})
    assert cfg.train.steps == 7 and cfg.extract.mode == "online"
    assert _load(tmp_path, {"extract": {"engine": "vllm"}}).extract.engine == "vllm"
    assert cfg.train.batch_size == PipelineConfig.tiny().train.batch_size  # the rest of the preset stays
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        PipelineConfig.preset("huge")


@pytest.mark.parametrize(
    "data, named",
    [
        ({"trian": {"steps": 1}}, "unknown section 'trian'"),
        ({"train": {"stepz": 1}}, "unknown key train.stepz"),
        ({"train": 5}, "section 'train' must be a mapping"),
        ({"extract": {"mode": "sideways"}}, r"extract.mode must be one of \['offline', 'online'\], got 'sideways'"),
        ({"extract": {"dtype": "int8"}}, "extract.dtype must be one of"),
        ({"extract": {"engine": "sglang"}}, "extract.engine must be one of 'local', 'vllm'"),
        ({"extract": {"engine": "vllm", "mode": "online"}}, "extract.engine 'vllm' needs mode 'offline'"),
        ({"extract": {"engine": "vllm", "num_workers": 2}}, "extract.num_workers must be 0 with engine 'vllm'"),
        ({"train": {"steps": "ten"}}, "train.steps"),
        ({"regenerate": {"limit": 2.5}}, "regenerate.limit"),
        ({"regenerate": {"batch_size": 0}}, "regenerate.batch_size must be an integer >= 1, got 0"),
        ({"train": {"ttt": {"ttt_steps": 0}}}, r"train.ttt.ttt_steps must be an integer >= 1, got 0"),
        ({"train": {"ttt": 3}}, "train.ttt must be a mapping"),
        ({"train": {"optim": {"betas": [0.9, 1.5]}}}, r"train.optim.betas must be two numbers in \[0, 1\)"),
        ({"train": {"optim": {"lr": "fast"}}}, "train.optim.lr: 'fast' is not of type float"),
        ({"train": {"ray": {"num_workers": -1}}}, "train.ray.num_workers must be an integer >= 0, got -1"),
        ({"train": {"lr": 0.001}}, "unknown key train.lr; .*did you mean train.optim.lr"),
        ({"evaluate": {"depth": 4}}, "unknown key evaluate.depth; .*did you mean evaluate.spec.depth"),
        ({"evaluate": {"spec": {"depth": 0}}}, "evaluate.spec.depth must be an integer >= 1, got 0"),
        ({"evaluate": {"spec": {"method": "beam"}}}, "evaluate.spec.method must be one of 'chain', 'tree'"),
        ({"train": {"eval_every": 0}}, "train.select 'best_tau' needs the held-out evaluation"),
        ({"train": {"variant": "eagle4"}}, "train.variant must be one of 'eagle3', 'eagle3.1', 'parallel'"),
        ({"evaluate": {"position_edges": [0, 128, 64]}}, "evaluate.position_edges must be >= 2 ascending integers"),
        (
            {"train": {"variant": "parallel"}, "evaluate": {"spec": {"method": "tree", "topk": 2, "budget": 8}}},
            "train.variant 'parallel' drafts chains .* set evaluate.spec.method to 'chain'",
        ),
    ],
)
def test_bad_config_is_refused_by_name(tmp_path, data, named):
    with pytest.raises(ConfigError, match=named):
        _load(tmp_path, data)


def test_optional_values_accept_null(tmp_path):
    assert _load(tmp_path, {"regenerate": {"limit": None}, "train": {"optim": {"lr": 1}}}).regenerate.limit is None


def _leaves(cfg, path=()):
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        yield from _leaves(v, (*path, f.name)) if dataclasses.is_dataclass(v) else [((*path, f.name), v)]


def test_every_field_is_reachable_from_a_config_file(tmp_path):
    """Each leaf of every section, nested ones included, can be set by key path; the value lands where it says."""
    base = PipelineConfig.default()
    leaves = list(_leaves(base))
    assert {path[:2] for path, _ in leaves} >= {
        ("train", "ttt"),
        ("train", "optim"),
        ("train", "ray"),
        ("evaluate", "spec"),
    }
    for path, value in leaves:
        data = value if not isinstance(value, tuple) else list(value)
        for key in reversed(path):
            data = {key: data}
        assert _load(tmp_path, data, "default") == base, path  # the same value through the file: the same config
    moved = _load(
        tmp_path,
        {
            "train": {
                "ttt": {"attn_chunk": 64},
                "optim": {"min_lr_ratio": 0.5, "weight_decay": 0.1, "betas": [0.8, 0.9]},
            },
            "evaluate": {"spec": {"top_p": 0.9, "min_draft_prob": 0.2, "eos_token_id": [2, 3]}},
        },
    )
    optim = moved.train.optim
    assert (moved.train.ttt.attn_chunk, optim.min_lr_ratio, optim.betas) == (64, 0.5, (0.8, 0.9))
    assert (moved.evaluate.spec.top_p, moved.evaluate.spec.eos_token_id) == (0.9, (2, 3))
    assert moved.train.ttt.ttt_steps == PipelineConfig.tiny().train.ttt.ttt_steps  # siblings keep the preset's


def test_fingerprint_is_stable_and_sensitive(tmp_path):
    a = PipelineConfig.tiny()
    assert a.fingerprint() == PipelineConfig.tiny().fingerprint() == _load(tmp_path, {}).fingerprint()
    assert _load(tmp_path, {"train": {"steps": a.train.steps}}).fingerprint() == a.fingerprint()
    assert _load(tmp_path, {"train": {"steps": a.train.steps + 1}}).fingerprint() != a.fingerprint()
    assert len(a.fingerprint()) == 64 and a.fingerprint() != PipelineConfig.default().fingerprint()
    faster = {"regenerate": {"num_workers": 2, "endpoint_concurrency": 8}}  # the same files, faster: the same run
    assert _load(tmp_path, faster).fingerprint() == a.fingerprint()
    assert _load(tmp_path, {"train": {"ttt": {"ttt_steps": 4}}}).fingerprint() != a.fingerprint()
    assert _load(tmp_path, {"train": {"variant": "eagle3.1"}}).fingerprint() != a.fingerprint()  # another head


def test_an_engine_gate_needs_the_engine(tmp_path):
    assert PipelineConfig.default().register.gate_tau == "engine"
    with pytest.raises(ConfigError, match="register.gate_tau 'engine' needs evaluate.engine 'vllm'"):
        _load(tmp_path, {"evaluate": {"engine": "local"}}, "default")
    cfg = _load(tmp_path, {"evaluate": {"engine": "local"}, "register": {"gate_tau": "local"}}, "default")
    assert cfg.register.gate_tau == "local"
    with pytest.raises(ConfigError, match="register.gate_tau must be one of 'local', 'engine'"):
        _load(tmp_path, {"register": {"gate_tau": "both"}})


def test_autocast_is_bf16_on_a_gpu_and_on_a_cpu_only_where_auto_finds_amx(monkeypatch):
    import torch

    import eagle.train as train

    for amx in (False, True):
        monkeypatch.setattr(train, "cpu_has_bf16_units", lambda amx=amx: amx)
        assert train.autocast_dtype("gpu", "cuda") is torch.bfloat16 and train.autocast_dtype("gpu", "cpu") is None
        assert train.autocast_dtype("auto", "cuda") is torch.bfloat16
        assert train.autocast_dtype("auto", "cpu") is (torch.bfloat16 if amx else None)
        assert train.autocast_dtype("off", "cuda") is None and train.autocast_dtype("off", "cpu") is None
    assert TrainConfig().autocast == "gpu" and PipelineConfig.preset("tiny").train.autocast == "gpu"
    assert PipelineConfig.preset("default").train.autocast == "auto"


@pytest.mark.parametrize(
    "path,value",
    [
        ("steps", 0),
        ("ttt.ttt_steps", 0),
        ("eval_every", -1),
        ("ttt.gamma", 0.0),
        ("ttt.gamma", 1.5),
        ("optim.lr", float("nan")),
        ("holdout_seqs", 0),
        ("select", "x"),
        ("autocast", "bf16"),
        ("batch_size", 0),
        ("keep_checkpoints", 0),
        ("eval_every", 0),
        ("optim.grad_clip", 0.0),
        ("ray.cpus_per_worker", 0),
    ],
)
def test_bad_train_config_values_name_the_field(path, value, tmp_path):
    *sub, field = path.split(".")
    named = "select" if field == "eval_every" and not value else field  # eval_every 0 with select 'best_tau'
    base = TrainConfig.tiny()
    with pytest.raises(ValueError, match=rf"\.{named} "):
        if sub:
            dataclasses.replace(getattr(base, sub[0]), **{field: value})
        else:
            dataclasses.replace(base, **{field: value})
    data = {field: value}
    for key in reversed(sub):
        data = {key: data}
    (tmp_path / "p.json").write_text(json.dumps({"train": data}))
    where = "select" if named == "select" and field == "eval_every" else path
    with pytest.raises(ConfigError, match=rf"p\.json: train\.{where}[ :]"):
        PipelineConfig.load(tmp_path / "p.json", preset="tiny")
