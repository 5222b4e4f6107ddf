"""Export -> import round trip, the engine config and tensor names, the probe, and refusal of a wrong target."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from eagle.config import DraftConfig
from eagle.draft import Eagle3Draft
from eagle.export import HeadMismatchError, export_head, load_head, verify_probe


def _target(kind="llama", hidden=64, layers=6, vocab=256):
    torch.manual_seed(0)
    if kind == "qwen3":
        c = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        return Qwen3ForCausalLM(c).eval()
    c = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2)
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
        f"midlayer.{n}.weight" for n in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                                         "input_layernorm", "hidden_norm", "post_attention_layernorm"]}
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
    with pytest.raises(FileNotFoundError, match="not an exported EAGLE-3 head"):
        load_head(tmp_path)
