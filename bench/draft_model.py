"""The small draft model the benchmarks set against the EAGLE-3 head, sized and trained as a user would.

A Llama of the target's tokenizer with tied embeddings, half the target's width, 2 layers (the default preset:
hidden 128, 2 heads of 64, MLP 384: about 0.2x the target's per-token matrix work, under the 1/4 a user would
aim for), trained on the same regenerated conversations as the head (the target's own answers, from the extract
directory's `tokens.safetensors`) for the same wall time as the head's training at the same torch threads, with
AdamW and a warmup + cosine schedule over that time. Cached per (shape, data, budget) under the setup's shared
directory. Used by `bench/speedup.py` both in our loop (`eagle.drafters.ModelDrafter`) and as transformers'
`assistant_model`.
How to run: `lm_dir, info = draft_model.ensure(setup, head_seconds)`; `per_token_macs(config)` for the sizing.
Not here: distillation against the target's logits (a user with only a chat dataset trains on tokens), a
pretrained small model (none exists for the embedded tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)
import torch

from common import Setup

SEQ_LEN, BATCH, LR, WARMUP_STEPS, SEED = 256, 8, 3e-3, 20, 11


def shape_for(target_cfg):
    """The draft's `TargetConfig`: half the target's width (head_dim kept), 2 layers, MLP 3x, tied embeddings."""
    hidden = target_cfg.hidden_size // 2
    head_dim = target_cfg.hidden_size // target_cfg.num_heads
    heads = max(1, hidden // head_dim)
    return dataclasses.replace(target_cfg, num_layers=2, hidden_size=hidden, intermediate_size=3 * hidden,
                               num_heads=heads, num_kv_heads=heads, tie_word_embeddings=True)


def per_token_macs(config) -> int:
    """Multiply-accumulates of the linear layers per token of a Llama `config` (attention over the context and
    norms left out: they are the same order for both models at these lengths)."""
    h, inter, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return L * (h * (q + 2 * kv) + q * h + 3 * h * inter) + config.vocab_size * h


def head_macs(draft_cfg) -> int:
    """The EAGLE-3 head's per-drafted-token work: its decoder layer on the 2H input and its lm_head over the draft
    vocabulary (the 3H->H fusion runs once per committed token, not per draft)."""
    h, inter = draft_cfg.hidden_size, draft_cfg.intermediate_size
    q, kv = draft_cfg.num_attention_heads * draft_cfg.head_dim, draft_cfg.num_key_value_heads * draft_cfg.head_dim
    return 2 * h * (q + 2 * kv) + q * h + 3 * h * inter + draft_cfg.draft_vocab_size * h


def _windows(ext_dir: Path) -> torch.Tensor:
    """The extracted conversations' token ids, concatenated and cut into windows of SEQ_LEN tokens (fewer when
    the data holds under 2 batches of them) [N, seq_len]."""
    from safetensors.torch import load_file

    ids = load_file(str(ext_dir / "tokens.safetensors"))["input_ids"].long()
    seq_len = min(SEQ_LEN, ids.numel() // (2 * BATCH))  # the quick preset's data holds ~1,400 tokens
    if seq_len < 16:
        raise ValueError(f"{ext_dir}: {ids.numel()} tokens, too few to train a draft model on")
    n = ids.numel() // seq_len
    return ids[:n * seq_len].view(n, seq_len)


def _lr(elapsed: float, budget: float, step: int) -> float:
    if step < WARMUP_STEPS:
        return LR * (step + 1) / WARMUP_STEPS
    return LR * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, elapsed / budget))))


def train_for(model, windows_NT: torch.Tensor, budget_s: float) -> dict:
    """AdamW over shuffled windows until `budget_s` seconds of training have passed."""
    g = torch.Generator().manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    t0, step, losses, order = time.perf_counter(), 0, [], torch.randperm(len(windows_NT), generator=g)
    while (elapsed := time.perf_counter() - t0) < budget_s:
        for group in opt.param_groups:
            group["lr"] = _lr(elapsed, budget_s, step)
        at = (step * BATCH) % max(1, len(order) - BATCH + 1)
        x = windows_NT[order[at:at + BATCH]]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
    model.eval()
    tail = losses[-max(1, len(losses) // 10):]
    return {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "tokens": step * x.numel() if step else 0,
            "loss_first": losses[0] if losses else None, "loss_last": sum(tail) / len(tail) if tail else None,
            "epochs": round(step * BATCH / len(windows_NT), 2)}


def ensure(setup: Setup, budget_s: float) -> tuple[Path, dict]:
    """The draft model for this setup and time budget (trained once, cached): its directory and its record."""
    from transformers import AutoConfig, AutoTokenizer

    from components.embedded import lm_train

    shape = shape_for(setup.emb.config.target)
    budget_s = max(10.0, round(budget_s))
    out = setup.work / f"draft-model-{common.fingerprint(shape, budget_s, SEQ_LEN, BATCH, LR, SEED)}"
    info_path = out / "bench_train.json"
    if (out / "config.json").is_file() and info_path.is_file():
        return out, json.loads(info_path.read_text())
    tokenizer = AutoTokenizer.from_pretrained(setup.emb.tokenizer_dir)
    model = lm_train.make_target(shape, tokenizer, SEED)
    common._say(f"bench: training the draft model ({shape.num_layers} layers, hidden {shape.hidden_size}, tied) "
                f"for {budget_s:.0f} s on {setup.extract_dir}")
    with common.setup_threads():
        stats = train_for(model, _windows(setup.extract_dir), budget_s)
    lm_train.save_target(model, tokenizer, out)
    target_cfg = AutoConfig.from_pretrained(setup.target_dir)
    info = {**stats, "shape": dataclasses.asdict(shape), "budget_s": budget_s,
            "parameters": sum(p.numel() for p in model.parameters()),
            "macs_per_token": per_token_macs(model.config), "target_macs_per_token": per_token_macs(target_cfg),
            "x_target_compute": round(per_token_macs(model.config) / per_token_macs(target_cfg), 3),
            "data": str(setup.extract_dir)}
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    return out, info
