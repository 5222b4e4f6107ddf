"""Faults of extraction through the engine: vLLM killed mid-run, targets whose weights the engine path must read right.

Purpose:
- the engine `kill -9`ed (its whole process group, as the OOM killer or a lost node would) while extraction sends a
  shard's sequences: the stage fails with one line naming the dead engine, the shards written before stay, and a
  re-run resumes at the shard it was on: the finished shard is kept byte for byte, the others are written once, the
  tokens of all shards are exactly the sequences of an uninterrupted (local) extraction (nothing duplicated or lost)
  and their features equal it within 1e-5; the killed engine's hidden-state files are cleared;
- a target with tied embeddings (no `lm_head` in its safetensors, `tie_word_embeddings` true) gets its `lm_head`
  from the embedding; one without `lm_head` that does not tie it is one clear line; a sharded target's embedding,
  `lm_head` and final norm are read through its `model.safetensors.index.json`.
Run: `python -m pytest tests/test_engine_faults.py` (about 2.5 minutes on 2 cores for the kill: two engine starts;
the tied-weights test alone takes a second). Needs vLLM's venv (`make vllm`) for the kill.
Not here: kills of the whole pipeline process (tests/test_faults.py), an engine that cannot start and a layer id out
of range (tests/test_extract_engine.py), an architecture vLLM does not run (tests/test_engine_scale.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from components.extract.stage import ExtractConfig, extract
from components.targets.runtime import StageContext
import infra.vllm_extract as vllm_extract
from infra.settings import Settings
from infra.vllm_server import EngineError, vllm_python

CFG = ExtractConfig(max_len=192, dtype="float32", seqs_per_shard=8)
QUIET = dict(progress=lambda s: None)
ENGINE = "vllm.entrypoints.openai.api_server"


def _our_engines() -> list[int]:
    """PIDs of the vLLM servers this process started (its children running vLLM's API server)."""
    me, found = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me and ENGINE in cmd:
            found.append(int(d.name))
    return found


def _killing_on_next_shard(request, after: threading.Event, killed: list[int]):
    """`request_hidden_states` that, once shard 1 is written (`after`), SIGKILLs the engines' process groups right
    after the next shard's first request is answered: the rest of that shard's requests are in flight or not sent.
    In the request threads themselves, so the kill cannot come too late on busy cores (a watcher thread polling the
    engine's files once missed a whole tiny shard)."""
    lock = threading.Lock()

    def wrapped(server, ids, *args, **kw):
        path = request(server, ids, *args, **kw)
        with lock:
            if after.is_set() and not killed:
                for pid in _our_engines():
                    os.killpg(pid, signal.SIGKILL)
                    killed.append(pid)
        return path

    return wrapped


@pytest.mark.slow
@pytest.mark.engine
def test_engine_killed_mid_extraction_resumes_at_the_shard_it_was_on(tiny_embedded, tmp_path, monkeypatch):
    from components.regenerate.stage import RegenerateConfig, regenerate

    settings = Settings.local(tmp_path / ".eagle")
    vllm_python(settings)
    regen, out, ref = tmp_path / "regen", tmp_path / "vllm", tmp_path / "local"
    regenerate(
        RegenerateConfig(max_new_tokens=32, batch_size=8, shard_size=8, limit=24),
        tiny_embedded.target_dir,
        str(tiny_embedded.target_traffic.train),
        str(regen),
        **QUIET,
    )
    extract(CFG, tiny_embedded.target_dir, str(regen), str(ref), **QUIET)  # the uninterrupted reference
    cfg = dataclasses.replace(CFG, engine="vllm")
    first, killed = threading.Event(), []
    monkeypatch.setattr(
        vllm_extract,
        "request_hidden_states",
        _killing_on_next_shard(vllm_extract.request_hidden_states, first, killed),
    )

    def progress(line: str) -> None:
        if line.startswith("extract: shard 1/"):
            first.set()

    with pytest.raises(EngineError) as e:
        extract(
            cfg,
            tiny_embedded.target_dir,
            str(regen),
            str(out),
            progress=progress,
            context=StageContext(settings=settings),
        )
    assert killed, "the engine was not killed"
    assert "\n" not in str(e.value) and "vLLM" in str(e.value)
    manifest = json.loads((out / "manifest.json").read_text())
    done = [s["file"] for s in manifest["shards"]]
    assert done and len(done) < 3, done  # killed while a later shard was in flight
    kept = {f: (out / f).read_bytes() for f in done}
    assert sorted(p.name for p in out.glob("features-*.safetensors")) == done  # no half-written shard

    monkeypatch.undo()
    lines: list[str] = []
    extract(
        cfg,
        tiny_embedded.target_dir,
        str(regen),
        str(out),
        progress=lines.append,
        context=StageContext(settings=settings),
    )
    written = [ln for ln in lines if ln.startswith("extract: shard ")]
    assert len(written) == 3 - len(done), lines  # resumed at the shard it was on: each other shard written once
    assert all((out / f).read_bytes() == b for f, b in kept.items())
    assert not (out / "engine-hidden-states").exists() and not _our_engines()
    a = [load_file(str(p)) for p in sorted(ref.glob("features-*.safetensors"))]
    b = [load_file(str(p)) for p in sorted(out.glob("features-*.safetensors"))]
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        for k in ("input_ids", "loss_mask", "offsets"):  # the same sequences: none lost, none twice
            assert torch.equal(x[k], y[k]), k
        for k in ("aux_hidden_states", "last_hidden_state"):
            assert float((x[k] - y[k]).abs().max() / x[k].abs().max()) < 1e-5, k
    m_ref, m = (json.loads((d / "manifest.json").read_text()) for d in (ref, out))
    assert [s["tokens_sha256"] for s in m["shards"]] == [s["tokens_sha256"] for s in m_ref["shards"]]
    assert m["n_seqs"] == m_ref["n_seqs"] == sum(s["n_seqs"] for s in m["shards"])


def _tiny_target(root: Path, tied: bool, drop_lm_head: bool) -> tuple[Path, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(root)
    if drop_lm_head:
        from safetensors.torch import save_file

        tensors = load_file(str(root / "model.safetensors"))
        tensors.pop("lm_head.weight", None)
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root, model


def test_tied_embeddings_give_lm_head_and_a_missing_untied_one_is_one_line(tmp_path):
    from components.extract.engine import target_heads
    from components.targets.target import TargetError

    root, model = _tiny_target(tmp_path / "tied", tied=True, drop_lm_head=True)
    assert "lm_head.weight" not in load_file(str(root / "model.safetensors"))
    heads = target_heads(str(root), model.config)
    assert torch.equal(heads["lm_head"], model.get_output_embeddings().weight.float())
    assert torch.equal(heads["lm_head"], heads["embed_tokens"])

    root, model = _tiny_target(tmp_path / "untied", tied=False, drop_lm_head=True)
    with pytest.raises(TargetError) as e:
        target_heads(str(root), model.config)
    msg = str(e.value)
    assert "\n" not in msg and "lm_head.weight" in msg and "tie_word_embeddings" in msg


def test_heads_and_final_norm_of_a_sharded_target_are_read_through_its_index(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from components.extract.engine import target_final_norm, target_heads

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    heads = target_heads(str(tmp_path), config)
    assert torch.equal(heads["embed_tokens"], model.get_input_embeddings().weight)
    assert torch.equal(heads["lm_head"], model.get_output_embeddings().weight)
    assert torch.equal(target_final_norm(str(tmp_path), config).weight_H, model.model.norm.weight)
