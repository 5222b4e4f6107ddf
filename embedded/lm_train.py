"""Train, evaluate and save the embedded Llama target (and its fine-tune) with plain PyTorch.

Purpose: `make_target` builds a `LlamaForCausalLM` from a `TargetConfig`; `pack_windows` mixes tokenised chat
samples and raw file chunks into fixed-length windows (documents concatenated, each starting with the bos token);
`train` runs AdamW with warmup + cosine decay under bf16 autocast (CPU or CUDA), with a tqdm bar showing loss and
tokens/s; `compare` (losses and top-1 agreement of two models) and `greedy` measure; `save_target` writes
`save_pretrained` weights, the tokenizer and a generation config whose eos is the end-of-turn token.
Not here: the corpus, the tokenizer's training, caching (`build.py`). No distributed training.

Shape legend: N windows, B batch, T sequence length, V vocabulary.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from eagle.heap import kept_heap
from eagle.target_path import cpu_threads
from embedded.config import LMTrainConfig, TargetConfig


@dataclass(frozen=True)
class TrainStats:
    steps: int
    tokens: int
    seconds: float
    tokens_per_second: float
    first_loss: float
    last_loss: float  # mean of the last 10% of steps


def make_target(cfg: TargetConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> LlamaForCausalLM:
    if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"hidden {cfg.hidden_size} / heads {cfg.num_heads} / kv heads {cfg.num_kv_heads} mismatch")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


def pack_windows(
    chat: Sequence[Sequence[int]],
    raw: Sequence[Sequence[int]],
    n_windows: int,
    seq_len: int,
    raw_fraction: float,
    seed: int,
) -> torch.Tensor:
    """`n_windows` x `seq_len` token ids (int64): raw_fraction of the tokens from `raw` documents, the rest from
    `chat`, each drawn in seeded random order (cycling when a source is short), then shuffled and concatenated."""
    rng = np.random.default_rng(seed)
    budget = n_windows * seq_len
    if not raw:
        raw_fraction = 0.0
    if not chat:
        raw_fraction = 1.0
    docs = _take(raw, math.ceil(budget * raw_fraction), rng) + _take(chat, math.ceil(budget * (1 - raw_fraction)), rng)
    if not docs:
        raise ValueError("no documents to pack")
    order = rng.permutation(len(docs))
    stream = np.concatenate([np.asarray(docs[i], dtype=np.int64) for i in order])
    while stream.size < budget:  # ceil rounding can leave us a few tokens short
        stream = np.concatenate([stream, stream])
    return torch.from_numpy(stream[:budget].reshape(n_windows, seq_len).copy())


def _take(docs: Sequence[Sequence[int]], budget: int, rng: np.random.Generator) -> list[Sequence[int]]:
    out, n = [], 0
    while n < budget and docs:
        for i in rng.permutation(len(docs)):
            out.append(docs[i])
            n += len(docs[i])
            if n >= budget:
                break
    return out


def _lr_factor(step: int, cfg: LMTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _autocast(cfg: LMTrainConfig):
    device_type = torch.device(cfg.device).type
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.bf16_autocast)


def train(
    model: LlamaForCausalLM, windows_NT: torch.Tensor, cfg: LMTrainConfig, seed: int, desc: str, progress: bool = True
) -> TrainStats:
    """`cfg.steps` AdamW steps over consecutive batches of `windows_NT` (needs steps * batch_size windows)."""
    if windows_NT.shape[0] < cfg.steps * cfg.batch_size:
        raise ValueError(f"{windows_NT.shape[0]} windows for {cfg.steps} steps of batch {cfg.batch_size}")
    with cpu_threads(cfg.num_threads), kept_heap(torch.device(cfg.device).type == "cpu"):  # eagle/heap.py
        losses, seconds = _train_loop(model, windows_NT, cfg, seed, desc, progress)
    model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    tokens = cfg.steps * cfg.batch_size * cfg.seq_len
    return TrainStats(cfg.steps, tokens, seconds, tokens / seconds, losses[0], float(np.mean(tail)))


def _train_loop(
    model: LlamaForCausalLM, windows_NT: torch.Tensor, cfg: LMTrainConfig, seed: int, desc: str, progress: bool
) -> tuple[list[float], float]:
    torch.manual_seed(seed)
    model.to(cfg.device).train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg))
    losses: list[float] = []
    start, tokens = time.perf_counter(), 0
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", disable=not progress, mininterval=2.0)
    for step in bar:
        x_BT = windows_NT[step * cfg.batch_size : (step + 1) * cfg.batch_size].to(cfg.device)
        with _autocast(cfg):
            loss = model(input_ids=x_BT, labels=x_BT).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += x_BT.numel()
        rate = tokens / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}", refresh=False)
    return losses, time.perf_counter() - start


@torch.no_grad()
def compare(
    a: LlamaForCausalLM, b: LlamaForCausalLM, windows_NT: torch.Tensor, cfg: LMTrainConfig
) -> tuple[float, float, float]:
    """(mean next-token loss of a, of b, fraction of positions where their argmax tokens agree) on the windows."""
    a.to(cfg.device).eval()
    b.to(cfg.device).eval()
    loss_a, loss_b, same, count = 0.0, 0.0, 0, 0
    for i in range(0, windows_NT.shape[0], cfg.batch_size):
        x_BT = windows_NT[i : i + cfg.batch_size].to(cfg.device)
        with _autocast(cfg):
            logits_a_BTV = a(input_ids=x_BT).logits
            logits_b_BTV = b(input_ids=x_BT).logits
        labels = x_BT[:, 1:].reshape(-1)
        loss_a += F.cross_entropy(
            logits_a_BTV[:, :-1].reshape(-1, logits_a_BTV.shape[-1]).float(), labels, reduction="sum"
        ).item()
        loss_b += F.cross_entropy(
            logits_b_BTV[:, :-1].reshape(-1, logits_b_BTV.shape[-1]).float(), labels, reduction="sum"
        ).item()
        same += int((logits_a_BTV.argmax(-1) == logits_b_BTV.argmax(-1)).sum())
        count += x_BT.numel()
    n_pred = windows_NT.shape[0] * (windows_NT.shape[1] - 1)
    return loss_a / n_pred, loss_b / n_pred, same / count


@torch.no_grad()
def greedy(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int], max_new_tokens: int
) -> str:
    """Greedy continuation (stops at the end-of-turn token), decoded without special tokens."""
    device = next(model.parameters()).device
    x = torch.tensor([list(prompt_ids)], device=device)
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, x.shape[1] :].tolist(), skip_special_tokens=True)


def save_target(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> dict[str, str]:
    """`save_pretrained` of model (fp32 safetensors), tokenizer and generation config; returns
    `weight_file_hashes` of it."""
    model.to("cpu")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return weight_file_hashes(out_dir)


def weight_file_hashes(model_dir: Path) -> dict[str, str]:
    """{file name: sha256 of its bytes} for each safetensors file of a saved model (what `sha256sum` prints)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
