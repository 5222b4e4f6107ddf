"""The embedded default: the tiny preset builds end to end, loads with the Auto classes, and is cached."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from components.data.traffic_io import load_traffic
from embedded import EmbeddedConfig, build_embedded, build_hash, load_domains, load_result
from embedded.config import CorpusConfig
from embedded.corpus import SourceFile, function_pairs, raw_chunks, split_domain
from embedded.lm_train import pack_windows
from embedded.tokenizer import render_chat


@pytest.fixture(scope="module")
def built(tiny_embedded):
    """(cache root, result) of the run's tiny build (`tiny_embedded` in conftest.py builds it once per run: in this
    process, or found cached when another worker built it)."""
    return tiny_embedded.build_dir.parent, tiny_embedded


def test_tiny_build_loads_with_auto_classes(built):
    _, result = built
    assert (result.build_dir / "report.json").is_file()
    for model_dir in (result.target_dir, result.finetune_dir):
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        assert model.config.model_type == "llama" and model.config.num_hidden_layers == 6
        assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|end|>") == tok.eos_token_id
        ids = tok.apply_chat_template(
            [{"role": "user", "content": "def f(x):"}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        assert out.shape[1] > ids.shape[1]
        (weights,) = model_dir.glob("*.safetensors")
        key = "target" if model_dir == result.target_dir else "finetune"
        assert result.weights_sha256[key][weights.name] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert AutoTokenizer.from_pretrained(result.tokenizer_dir).chat_template


def test_report_round_trips_and_has_metrics(built):
    _, result = built
    assert load_result(result.build_dir, cached=result.cached) == result
    m = result.metrics
    assert m.heldout_perplexity == pytest.approx(torch.tensor(m.heldout_loss).exp().item(), rel=1e-6)
    assert set(m.top1_agreement) == {"stdlib", "stdlib-tests"}
    assert m.target_train.tokens_per_second > 0 and len(m.continuations) == 2
    report = json.loads((result.build_dir / "report.json").read_text())
    assert report["target_dir"] == "target" and report["config"] == EmbeddedConfig.tiny().to_dict()


def test_second_build_is_cached_with_the_same_hash(built):
    root, first = built
    again = build_embedded(EmbeddedConfig.tiny(), root, progress=False)
    assert again.cached and again.build_hash == first.build_hash and again.build_dir == first.build_dir
    assert again.metrics == first.metrics
    other = dataclasses.replace(EmbeddedConfig.tiny(), seed=1)
    assert build_hash(other, *load_domains(other)) != first.build_hash


def test_rebuild_from_scratch_is_bitwise_identical(built, tmp_path):
    _, first = built
    again = build_embedded(EmbeddedConfig.tiny(), tmp_path, force=True, progress=False)
    assert not again.cached and again.build_hash == first.build_hash
    assert again.weights_sha256 == first.weights_sha256
    assert (again.target_traffic.train_sha256, again.finetune_traffic.heldout_sha256) == (
        first.target_traffic.train_sha256,
        first.finetune_traffic.heldout_sha256,
    )
    tok = "tokenizer.json"
    assert (again.tokenizer_dir / tok).read_bytes() == (first.tokenizer_dir / tok).read_bytes()


def test_chat_template_round_trips(built):
    _, result = built
    tok = AutoTokenizer.from_pretrained(result.tokenizer_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b\n"},
        {"role": "user", "content": "and sub?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == render_chat(messages)
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == text + "<|assistant|>" and prompt == render_chat(messages, add_generation_prompt=True)
    enc = tok.apply_chat_template(messages[:3], return_dict=True, return_assistant_tokens_mask=True)
    marked = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(marked) == "    return a + b\n<|end|>"
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_traffic_splits_share_no_source_file(built):
    _, result = built
    tests_dir = "test/" if result.domains[1].name == "stdlib-tests" else ""
    for files, domain_dir in ((result.target_traffic, ""), (result.finetune_traffic, tests_dir)):
        train = load_traffic(files.train).conversations
        held = load_traffic(files.heldout).conversations
        assert len(train) == files.train_conversations and len(held) == files.heldout_conversations
        train_src, held_src = {c.source_file for c in train}, {c.source_file for c in held}
        assert train_src and held_src and not train_src & held_src
        assert all(s.startswith(domain_dir) for s in train_src | held_src)
        assert {"complete", "continue"} <= {c.segment for c in train + held}
        assert all(c.messages[-1].role == "assistant" and c.messages[-1].content for c in train + held)


def test_finetune_differs_from_base(built):
    _, result = built
    assert result.weights_sha256["target"] != result.weights_sha256["finetune"]
    base = AutoModelForCausalLM.from_pretrained(result.target_dir)
    tuned = AutoModelForCausalLM.from_pretrained(result.finetune_dir)
    tok = AutoTokenizer.from_pretrained(result.target_dir)
    ids = tok("    def test_add(self):\n        self.assertEqual(", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        diff = (base(input_ids=ids).logits - tuned(input_ids=ids).logits).abs().max().item()
    assert diff > 1e-2
    assert result.metrics.loss["finetune"]["stdlib-tests"]["raw"] < result.metrics.loss["target"]["stdlib-tests"]["raw"]


def test_config_loading_is_strict():
    cfg = EmbeddedConfig.tiny()
    assert EmbeddedConfig.from_dict(cfg.to_dict()) == cfg
    assert EmbeddedConfig.from_dict({"train": {"steps": 3}}).train.steps == 3
    with pytest.raises(ValueError, match=r"EmbeddedConfig.train: unknown keys \['stpes'\]"):
        EmbeddedConfig.from_dict({"train": {"stpes": 3}})
    with pytest.raises(ValueError, match="unknown keys"):
        EmbeddedConfig.from_dict({"colour": "red"})
    with pytest.raises(ValueError, match="expected"):
        EmbeddedConfig.from_dict({"train": {"steps": "many"}})
    with pytest.raises(ValueError, match="unknown preset"):
        EmbeddedConfig.preset("huge")


SOURCE = '''import os


@staticmethod
def double(x):
    """Return twice x.

    Really.
    """
    # the obvious way
    y = x * 2
    return y


class Box:
    def get(self, key,
            default=None):
        value = self.data.get(key)
        return value if value is not None else default

    def one_liner(self): return 1
'''


def test_function_pairs_cut_signature_docstring_and_body():
    f = SourceFile("pkg/mod.py", SOURCE, "0")
    double, get = function_pairs(f, CorpusConfig())
    assert double.qualname == "double" and get.qualname == "Box.get"
    assert double.signature == "@staticmethod\ndef double(x):\n"
    assert double.docstring == "Return twice x.\n\nReally."
    assert double.header.endswith('    Really.\n    """\n')
    assert double.body == "    # the obvious way\n    y = x * 2\n    return y\n"
    assert get.signature == "def get(self, key,\n        default=None):\n" and get.docstring is None
    assert get.body.startswith("    value = self.data.get(key)\n")
    assert "".join(raw_chunks(f, 5)) == SOURCE.lstrip("\n")


def test_split_is_by_file_and_deterministic():
    files = [SourceFile(f"m{i}.py", "x = 1\n", str(i)) for i in range(40)]
    a, b = split_domain("d", files, 0.25), split_domain("d", list(reversed(files)), 0.25)
    assert a == b and a.heldout and a.train
    assert not {f.rel_path for f in a.train} & {f.rel_path for f in a.heldout}


def test_base_corpus_excludes_tests_and_dropped_packages():
    base, finetune = load_domains(EmbeddedConfig.tiny())
    paths = [f.rel_path for f in base.train + base.heldout]
    assert paths and not any(p.split("/")[0] in {"encodings", "test", "pydoc_data", "ensurepip"} for p in paths)
    if finetune.name == "stdlib-tests":
        assert all(f.rel_path.startswith("test/") for f in finetune.train + finetune.heldout)


def test_pack_windows_mixes_by_token_share():
    chat = [[1] * 10] * 50
    raw = [[2] * 10] * 50
    w = pack_windows(chat, raw, n_windows=10, seq_len=20, raw_fraction=0.3, seed=0)
    assert w.shape == (10, 20)
    assert (w == 2).float().mean().item() == pytest.approx(0.3, abs=0.05)
    assert torch.equal(w, pack_windows(chat, raw, 10, 20, 0.3, seed=0))


def test_build_hash_ignores_prose_not_code():
    """Editing a docstring or a comment of the builder keeps every build (and what is cached under its hash); a
    change of code does not. Every module that shapes what a build writes is hashed."""
    from pathlib import Path

    from embedded import build

    doc = 'def f():\n    """Doc."""\n    return 1  # why\n'
    assert build.code_digest(doc) == build.code_digest('def f():\n    """Other doc."""\n    # note\n    return 1\n')
    assert build.code_digest(doc) != build.code_digest('def f():\n    """Doc."""\n    return 2\n')
    here = Path(build.__file__).parent
    unhashed = {p.name for p in here.glob("*.py")} - set(build.OUTPUT_MODULES)
    # a new module must be listed; real.py keys its own builds (the real model's) by its code
    assert unhashed == {"__init__.py", "__main__.py", "config.py", "real.py"}, unhashed
