"""Export -> import round trip, the engine config and tensor names, the probe, and refusal of a wrong target;
what vLLM and SGLang read from an exported head (weights glob, fused layer ids, vocabulary map, dtype), and the
folding of heads whose draft config repeats a layer id."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from eagle.config import DraftConfig, default_aux_layer_ids
from eagle.draft import Eagle3Draft
from eagle.export import (
    HeadFileError,
    HeadMismatchError,
    export_head,
    fold_duplicate_aux,
    load_head,
    sglang_capture_layers,
    verify_probe,
    vllm_capture_layers,
)
from eagle.features import target_forward


def _target(kind="llama", hidden=64, layers=6, vocab=256):
    torch.manual_seed(0)
    if kind == "qwen3":
        c = Qwen3Config(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
        return Qwen3ForCausalLM(c).eval()
    c = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(c).eval()


def _head(target, vd=100):
    d = Eagle3Draft(DraftConfig.from_target(target.config, vd))
    d.set_draft_vocab(torch.arange(0, 2 * vd, 2))
    d.init_from_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    with torch.no_grad():
        for p in d.midlayer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return d


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_round_trip_is_bit_identical(tmp_path, kind):
    target = _target(kind)
    d = _head(target)
    out = export_head(d, tmp_path / "head", lineage={"target": "t@1"})
    back = load_head(out, target)
    a, b = d.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert verify_probe(back, out) == 0.0


def test_engine_format(tmp_path):
    target = _target()
    d = _head(target)
    out = export_head(d, tmp_path / "head", dtype=torch.bfloat16)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["norm_before_residual"] is False
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["hidden_size"]) == (256, 100, 64)
    assert cfg["max_position_embeddings"] >= target.config.max_position_embeddings
    t = load_file(str(out / "model.safetensors"))
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{n}.weight"
        for n in [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "hidden_norm",
            "post_attention_layernorm",
        ]
    }
    assert set(t) == expected
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    assert t["fc.weight"].shape == (64, 192) and t["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert t["lm_head.weight"].dtype == torch.bfloat16
    assert (t["d2t"] + torch.arange(100)).tolist() == list(range(0, 200, 2))
    assert int(t["t2d"].sum()) == 100


def test_head_for_another_target_is_refused(tmp_path):
    out = export_head(_head(_target()), tmp_path / "head")
    with pytest.raises(HeadMismatchError, match="hidden_size: head expects 64, target has 96"):
        load_head(out, _target(hidden=96))
    with pytest.raises(HeadMismatchError, match="num_hidden_layers"):
        load_head(out, _target(layers=8))
    with pytest.raises(HeadMismatchError, match="vocab_size"):
        load_head(out, _target(vocab=300))


def test_reexport_replaces_atomically_and_bad_dirs_are_refused(tmp_path):
    target = _target()
    out = export_head(_head(target), tmp_path / "head")
    export_head(_head(target, vd=50), out)
    assert load_head(out, target).cfg.draft_vocab_size == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]  # no temp dirs left behind
    with pytest.raises(HeadFileError, match="not an exported EAGLE-3 head"):
        load_head(tmp_path)


# ---- what the engines read ---------------------------------------------------------------------------------------


def test_default_layer_ids_are_three_distinct_ascending_ids_for_every_depth():
    for n in range(4, 13):
        ids = default_aux_layer_ids(n)
        assert len(ids) == 3 and 1 <= ids[0] < ids[1] < ids[2] <= n - 1, (n, ids)
    assert [default_aux_layer_ids(n) for n in (4, 5, 6, 7, 8, 32)] == [
        (1, 2, 3),
        (1, 2, 4),
        (1, 3, 5),
        (2, 3, 4),
        (2, 4, 5),
        (2, 16, 29),
    ]
    with pytest.raises(ValueError, match="at least 4 decoder layers"):
        default_aux_layer_ids(3)


@pytest.mark.parametrize("ids", [(2, 3, 3), (3, 2, 4), (0, 2, 4), (1, 2, 6), (1, 2)])
def test_draft_config_refuses_bad_layer_ids(ids):
    base = DraftConfig.tiny()  # a 6-layer target
    with pytest.raises(
        ValueError,
        match=r"aux_layer_ids \[.*\] are not three distinct ascending .* 1\.\.5 "
        r"\(the target has 6 decoder layers\)",
    ):
        DraftConfig(**{**base.to_dict(), "aux_layer_ids": ids})


def test_only_the_weights_match_the_engines_glob(tmp_path):
    target = _target()
    d = _head(target)
    out = export_head(d, tmp_path / "head")
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert (out / "probe" / "probe.safetensors").is_file()
    back = load_head(out, target)
    assert verify_probe(back, out) == 0.0
    (out / "probe" / "probe.safetensors").rename(out / "probe.safetensors")  # a head with the probe beside it
    assert verify_probe(load_head(out, target), out) == 0.0


@pytest.mark.parametrize("layers", [4, 6, 9])
def test_both_engines_fuse_the_layers_the_head_was_trained_on(tmp_path, layers):
    target = _target(layers=layers)
    d = _head(target)
    out = export_head(d, tmp_path / "head")
    cfg = json.loads((out / "config.json").read_text())
    ids = list(d.cfg.aux_layer_ids)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == ids and cfg["num_aux_hidden_states"] == 3
    assert cfg["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
        "use_aux_hidden_state": True,
    }
    assert vllm_capture_layers(cfg, layers) == ids == sglang_capture_layers(cfg, layers)
    x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = target(x, output_hidden_states=True).hidden_states  # hs[k]: the input of decoder layer k
        ours = target_forward(target, x, d.cfg.aux_layer_ids).aux_BT3H
    sglang = torch.cat([hs[k] for k in sglang_capture_layers(cfg, layers)], dim=-1)
    torch.testing.assert_close(sglang, ours, atol=0, rtol=0)


def test_legacy_head_with_a_repeated_layer_id_is_folded_losslessly(tmp_path):
    target = _target()  # 6 layers: the head was trained on the inputs of layers 2, 3, 3
    d = _head(target)
    with torch.no_grad():
        d.fc.weight.normal_(0, 0.05)
    out = export_head(d, tmp_path / "legacy")
    meta = json.loads((out / "eagle_head.json").read_text())
    meta["draft_config"]["aux_layer_ids"] = [2, 3, 3]
    (out / "eagle_head.json").write_text(json.dumps(meta))
    folded = load_head(out, target)
    assert folded.cfg.aux_layer_ids == (1, 2, 3) and folded.fc.weight.shape == (64, 192)
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12)[None].expand(2, -1)
    with torch.no_grad():
        hs = target(x, output_hidden_states=True).hidden_states
        _, want = d(x, d.fuse(torch.cat([hs[2], hs[3], hs[3]], -1)), pos)  # the legacy computation
        _, got = folded(x, folded.fuse(target_forward(target, x, folded.cfg.aux_layer_ids).aux_BT3H), pos)
    assert torch.allclose(got, want, atol=1e-5)
    again = export_head(folded, tmp_path / "refolded")
    assert json.loads((again / "eagle_head.json").read_text())["draft_config"]["aux_layer_ids"] == [1, 2, 3]
    assert json.loads((again / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


def test_fold_sorts_and_fills_with_zero_blocks():
    H = 4
    fc = torch.arange(H * 3 * H, dtype=torch.float32).reshape(H, 3 * H)
    cfg, t = fold_duplicate_aux(
        {"hidden_size": H, "target_num_layers": 8, "aux_layer_ids": [5, 2, 5]}, {"fc.weight": fc}
    )
    assert cfg["aux_layer_ids"] == [1, 2, 5]
    blocks = t["fc.weight"].split(H, dim=1)
    assert torch.equal(blocks[0], torch.zeros(H, H)) and torch.equal(blocks[1], fc[:, H : 2 * H])
    assert torch.equal(blocks[2], fc[:, :H] + fc[:, 2 * H :])
    same = {"hidden_size": H, "target_num_layers": 8, "aux_layer_ids": [2, 4, 5]}
    assert fold_duplicate_aux(same, {"fc.weight": fc}) == (same, {"fc.weight": fc})


def test_full_draft_vocabulary_has_no_vocab_map(tmp_path):
    target = _target()
    d = Eagle3Draft(DraftConfig.from_target(target.config, 256))
    d.init_from_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    out = export_head(d, tmp_path / "head")
    t = load_file(str(out / "model.safetensors"))
    assert "d2t" not in t and "t2d" not in t
    back = load_head(out, target)
    assert torch.equal(back.draft_ids(), torch.arange(256)) and bool(back.t2d.all())
    assert verify_probe(back, out) == 0.0
    partial = export_head(_head(target, vd=50), tmp_path / "partial")  # Vd < V: the map is required
    t = load_file(str(partial / "model.safetensors"))
    save_file({k: v for k, v in t.items() if k != "d2t"}, str(partial / "model.safetensors"))
    with pytest.raises(ValueError, match=r"\['d2t'\] missing or unexpected"):
        load_head(partial, target)


def test_exported_in_the_targets_dtype_unless_told(tmp_path):
    torch.manual_seed(0)
    c = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        dtype="bfloat16",
    )
    target = LlamaForCausalLM(c).float().eval()  # a bf16 target, run here in fp32
    target.config.dtype = torch.bfloat16
    d = _head(target)
    assert d.cfg.target_dtype == "bfloat16"
    out = export_head(d, tmp_path / "head")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    t = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in t.values() if v.is_floating_point())
    assert verify_probe(load_head(out, target), out) < 1e-5  # the probe is of the weights as written
    fp32 = export_head(d, tmp_path / "fp32", dtype=torch.float32)
    assert json.loads((fp32 / "config.json").read_text())["torch_dtype"] == "float32"
    assert load_file(str(fp32 / "model.safetensors"))["lm_head.weight"].dtype == torch.float32
    assert (
        DraftConfig.from_dict({k: v for k, v in d.cfg.to_dict().items() if k != "target_dtype"}).target_dtype
        == "float32"
    )


def test_eagle3_1_head_exports_vllms_keys_and_round_trips(tmp_path):
    """eagle3.1 = vLLM 0.32's `fc_norm` (an RMSNorm per fused state before fc, weights fc_norm.{0,1,2}) and
    `norm_output` (the next step reads norm(output)); eagle3 writes both false. The forward is checked against
    vLLM's form of it (llama_eagle3.py: combine_hidden_states, then LlamaModel.forward's aux_output)."""
    from eagle.train import as_variant

    target = _target()
    plain = _head(target)
    d = as_variant(plain, "eagle3.1")
    with torch.no_grad():
        for n in d.fc_norm:
            n.weight.add_(0.1 * torch.randn_like(n.weight))
    out = export_head(d, tmp_path / "head")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["fc_norm"], cfg["norm_output"], cfg["norm_before_fc"], cfg["norm_before_residual"]) == (
        True,
        True,
        False,
        False,
    )
    base = json.loads((export_head(plain, tmp_path / "plain") / "config.json").read_text())
    assert (base["fc_norm"], base["norm_output"], base["norm_before_fc"]) == (False, False, False)
    t = load_file(str(out / "model.safetensors"))
    assert {k for k in t if k.startswith("fc_norm")} == {f"fc_norm.{i}.weight" for i in range(3)}
    back = load_head(out, target)
    assert back.cfg.variant == "eagle3.1" and verify_probe(back, out) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), back.state_dict().values()))
    aux, ids, pos = torch.randn(1, 5, 192), torch.randint(0, 256, (1, 5)), torch.arange(5)[None]
    eps = d.cfg.rms_norm_eps

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    with torch.no_grad():
        fused = d.fc(torch.cat([rms(c, n.weight) for c, n in zip(aux.chunk(3, -1), d.fc_norm)], -1))
        torch.testing.assert_close(d.fuse(aux), fused)
        carried, logits = d(ids, fused, pos)
        raw, logits_plain = plain(ids, fused, pos)  # the same layer weights: only the carried state differs
        torch.testing.assert_close(carried, rms(raw, d.norm.weight))
        torch.testing.assert_close(logits, logits_plain)
