"""`train.head_init: target-layer`: a fresh head starts as the target's own layer that its highest fused state enters.

Purpose: the extract stage saves that layer and the final norm beside the features (`target_heads.safetensors`; the
engine path reads the same tensors by name, tests/test_extract_engine.py compares the two files); a head started
from it computes, before any training and with its embedding half silenced, exactly the target layer's output on
the fused high state; it trains and exports like any head; features without the layer are refused by name; a bad
value of the setting is refused at config load (tests/test_bad_input_table.py row
`train-config-train-head-init-unknown`).
Run: `python -m pytest tests/test_head_init.py` (seconds: the tiny embedded default, a few regenerated conversations).
Not here: what it buys on the real model (bench/README.md, "A head started from the target's layer").
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from components.train.data import FeatureStoreError, TrainingData
from components.train.loop import LoopArgs, new_head
from components.train.stage import TrainConfig, train
from eagle.train import TARGET_LAYER_PARTS
from tests.test_extract_train import offline_dir, regen_dir  # noqa: F401  (the module's fixtures)

FROM_LAYER = dataclasses.replace(TrainConfig.tiny(), head_init="target-layer")


def test_the_head_starts_as_the_targets_layer(offline_dir, tiny_embedded):
    from components.targets.target import load_target

    data = TrainingData.open(offline_dir)
    assert set(data.target_layer) == set(TARGET_LAYER_PARTS) and data.final_norm is not None
    target = load_target(tiny_embedded.target_dir)[0].eval()
    index = data.manifest["layer_ids"][-1]
    layer = target.model.layers[index]
    assert torch.equal(data.target_layer["self_attn.q_proj.weight"], layer.self_attn.q_proj.weight.float())
    assert torch.equal(data.final_norm, target.model.norm.weight.float())

    seen: dict[str, torch.Tensor] = {}
    hooks = [
        layer.register_forward_pre_hook(
            lambda m, a, kw: seen.__setitem__("in", kw.get("hidden_states", a[0] if a else None)), with_kwargs=True
        ),
        layer.register_forward_hook(
            lambda m, a, out: seen.__setitem__("out", out[0] if isinstance(out, tuple) else out)
        ),
    ]
    ids, _ = data.sequence(0)
    ids_BT = torch.as_tensor(ids, dtype=torch.long)[None, :40]
    with torch.no_grad():
        target(ids_BT)
    for h in hooks:
        h.remove()

    torch.manual_seed(0)
    head = new_head(LoopArgs(FROM_LAYER, str(offline_dir), "", None), data)
    H = head.cfg.hidden_size
    with torch.no_grad():
        for p in ("q_proj", "k_proj", "v_proj"):
            getattr(head.midlayer.self_attn, p).weight[:, :H] = 0  # the token embedding's half, silenced
        aux_BT3H = torch.cat([torch.randn_like(seen["in"]), torch.randn_like(seen["in"]), seen["in"]], dim=-1)
        pos_BT = torch.arange(ids_BT.shape[1])[None]
        carry_BTH, _ = head(ids_BT, head.fuse(aux_BT3H), pos_BT)
    assert torch.allclose(carry_BTH, seen["out"], atol=1e-4, rtol=1e-4), (carry_BTH - seen["out"]).abs().max()
    assert torch.equal(head.norm.weight, data.final_norm)


def test_a_head_started_from_the_layer_trains_and_exports(offline_dir, tmp_path):
    res = train(FROM_LAYER, str(offline_dir), str(tmp_path / "train"))
    assert res.final_metrics["step"] == FROM_LAYER.steps and "heldout_tau" in res.final_metrics
    weights = load_file(f"{res.head_dir}/model.safetensors")
    assert "midlayer.self_attn.q_proj.weight" in weights and not any("embed" in k for k in weights)


def test_features_without_the_target_layer_are_refused_by_name(offline_dir, tmp_path):
    old = tmp_path / "extract"
    shutil.copytree(offline_dir, old)
    heads = load_file(str(old / "target_heads.safetensors"))
    save_file({k: v for k, v in heads.items() if not k.startswith("layer.")}, str(old / "target_heads.safetensors"))
    with pytest.raises(FeatureStoreError, match="needs the target's layer beside the features.*re-run extract"):
        train(FROM_LAYER, str(old), str(tmp_path / "train"))
    with pytest.raises(ValueError, match="head_init must be one of"):
        dataclasses.replace(TrainConfig.tiny(), head_init="target")


def test_a_layer_of_which_nothing_fits_leaves_the_head_as_it_was(offline_dir):
    """An MoE layer's experts, another family's names, another shape: nothing is copied, the norm included."""
    from eagle.train import start_from_target_layer

    data = TrainingData.open(offline_dir)
    torch.manual_seed(0)
    head = new_head(LoopArgs(TrainConfig.tiny(), str(offline_dir), "", None), data)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    q = data.target_layer["self_attn.q_proj.weight"]
    odd = {"mlp.experts.0.gate_proj.weight": q, "self_attn.q_proj.weight": q[:, :-1]}
    assert start_from_target_layer(head, odd, data.final_norm) == []
    assert all(torch.equal(v, before[k]) for k, v in head.state_dict().items())
