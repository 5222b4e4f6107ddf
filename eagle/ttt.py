"""Training-time test (TTT): the EAGLE-3 head unrolls its own drafting for K steps and learns from its own inputs.

Purpose: `ttt_loss(draft, batch, cfg)` returns the weighted loss and per-step metrics for one batch.

Alignment (S positions, tokens x, fused target features f, teacher p_j = target's next-token distribution after
x_0..x_j). At step k and position i the head reads token x_{i+1+k}, RoPE position i+k, and as hidden state f_i
at k = 0 or its own step k-1 output at position i for k > 0 (`draft.carry`: norm(output) for eagle3.1); it is
scored against p_{i+1+k}, weighted by whether x_{i+2+k} is a trained (assistant) token. The step-k query attends
to the step-0 keys causally plus the keys of steps 1..k at its own position (the diagonal), which is what it sees
when drafting at depth k.
Loss = sum_k gamma^k * soft cross-entropy against p restricted to the draft vocabulary (positions whose target
argmax lies outside the draft vocabulary carry no loss but count as misses in the accuracy).

Parallel drafting (variant "parallel", P-EAGLE): step 0 is the same; at every step k >= 1 position i reads the masked
slot's inputs instead (`draft.masked_slots`: token `mask_token_id`, hidden state fuse(mask_hidden), nothing of
step k-1), at RoPE position i+k, with the same attention and the same target p_{i+1+k}. This is vLLM's parallel
pass (v1/spec_decode/llm_base_proposer.py, `set_inputs_first_pass` with `parallel_drafting`): the committed
entries (token x_{j+1}, feature f_j) at positions j <= i, the last of them the "bonus" slot whose output drafts
x_{i+2}, followed by K-1 masked slots at positions i+1..i+K-1 in one causal pass; masked slot k (at i+k) sees the
committed entries up to i (the step-0 keys, causally) and masked slots 1..k (the diagonal) and drafts x_{i+2+k}.
Every position i of a sequence is trained as such an anchor at once, as TTT trains every position. Variant
"eagle3.1-parallel" trains the same way with eagle3.1's norms: `fuse` norms both the features and `mask_hidden`
(vLLM projects `mask_hidden` through the same `combine_hidden_states`), and its `norm_output` is inert, since no
step reads step k-1's output (nor does vLLM's parallel pass: eagle/config.py).

Memory stays bounded: attention runs over chunks of queries under activation checkpointing (no S x (K*S) score
tensor; peak extra memory O(chunk * S)), and the lm_head + loss run over chunks of rows under checkpointing (no
[S, Vd] fp32 logits kept per step).
Not here: the optimiser, data loading, distribution (see components/ and flows/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eagle.draft import Eagle3Draft
from eagle.run_config import TTTConfig
from eagle.features import Teacher


@dataclass
class TTTBatch:
    """Right-padded batch. loss_mask_BS marks trained (assistant) tokens; padding has loss_mask 0."""

    input_ids_BS: torch.Tensor
    aux_BS3H: torch.Tensor
    loss_mask_BS: torch.Tensor
    teacher: Teacher


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar, differentiable
    step_loss: torch.Tensor  # [K] per-step mean soft CE (detached)
    correct: torch.Tensor  # [K] count of positions whose draft argmax equals the target argmax
    chain_correct: torch.Tensor  # [K] count of positions right at every step <= k
    counted: torch.Tensor  # [K] positions scored at step k
    chain_prev: torch.Tensor  # [K] positions right at every step < k (among those scored at k)
    tau_sum: torch.Tensor  # sum over fully-valid positions of 1 + number of leading correct steps
    tau_count: torch.Tensor

    def metrics(self) -> dict[str, float]:
        """Per-step accuracy `acc_k`, conditional accuracy `cond_acc_k`, loss `loss_k`, simulated `tau`."""
        out: dict[str, float] = {"loss": float(self.loss.detach())}
        for k in range(self.counted.numel()):
            n = max(float(self.counted[k]), 1.0)
            out[f"acc_{k}"] = float(self.correct[k]) / n
            out[f"cond_acc_{k}"] = float(self.chain_correct[k]) / max(float(self.chain_prev[k]), 1.0)
            out[f"loss_{k}"] = float(self.step_loss[k])
        out["tau"] = float(self.tau_sum) / max(float(self.tau_count), 1.0)
        return out


def _shift(t: torch.Tensor, n: int) -> torch.Tensor:
    """t[:, n:] right-padded with zeros back to length S (dim 1)."""
    if n == 0:
        return t
    pad = torch.zeros_like(t[:, :n])
    return torch.cat([t[:, n:], pad], dim=1)


def _repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _attn_chunk(q_BhCD, k0_BkLD, v0_BkLD, dk_BkCnD, dv_BkCnD, start: int):
    """Queries [start, start+C) over step-0 keys [0, start+C) causally plus n diagonal keys each."""
    rep = q_BhCD.shape[1] // k0_BkLD.shape[1]
    scale = q_BhCD.shape[-1] ** -0.5
    k0, v0 = _repeat_kv(k0_BkLD, rep), _repeat_kv(v0_BkLD, rep)
    C, L = q_BhCD.shape[2], k0.shape[2]
    scores = (q_BhCD @ k0.transpose(-1, -2)).float() * scale  # B,h,C,L
    rows = torch.arange(start, start + C, device=q_BhCD.device)[:, None]
    scores = scores.masked_fill(torch.arange(L, device=q_BhCD.device)[None, :] > rows, float("-inf"))
    dk, dv = _repeat_kv(dk_BkCnD, rep), _repeat_kv(dv_BkCnD, rep)
    diag = (q_BhCD[..., None, :] * dk).sum(-1).float() * scale  # B,h,C,n
    p = torch.cat([scores, diag], dim=-1).softmax(-1).to(q_BhCD.dtype)
    return p[..., :L] @ v0 + (p[..., L:, None] * dv).sum(-2)


def ttt_attention(
    q_BhSD: torch.Tensor,
    k0_BkSD: torch.Tensor,
    v0_BkSD: torch.Tensor,
    dk_BkSnD: torch.Tensor,
    dv_BkSnD: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """Step-k attention: causal over the step-0 keys, plus the n = k diagonal keys of steps 1..k."""
    S = q_BhSD.shape[2]
    outs = []
    for s in range(0, S, chunk):
        e = min(s + chunk, S)
        args = (q_BhSD[:, :, s:e], k0_BkSD[:, :, :e], v0_BkSD[:, :, :e], dk_BkSnD[:, :, s:e], dv_BkSnD[:, :, s:e])
        if torch.is_grad_enabled():
            outs.append(checkpoint(_attn_chunk, *args, s, use_reentrant=False))
        else:
            outs.append(_attn_chunk(*args, s))
    return torch.cat(outs, dim=2)


def _loss_chunk(draft: Eagle3Draft, hidden_NH, probs_NV, weight_N):
    logp = F.log_softmax(draft.logits(hidden_NH).float(), dim=-1)
    return (-(probs_NV * logp).sum(-1) * weight_N).sum(), logp.argmax(-1)


def _step_loss(draft: Eagle3Draft, out_BSH, probs_BSV, offset: int, weight_BS, chunk: int):
    """Weighted soft CE of `out` against `probs` shifted left by `offset`, and the draft argmax (draft ids).

    Runs `chunk` flattened rows at a time and gathers the teacher rows it needs (no shifted copy of [B, S, Vd]).
    """
    B, S, H = out_BSH.shape
    flat, probs, w = out_BSH.reshape(B * S, H), probs_BSV.reshape(B * S, -1), weight_BS.reshape(B * S)
    total, argmax = out_BSH.new_zeros((), dtype=torch.float32), []
    for s in range(0, B * S, chunk):
        rows = torch.arange(s, min(s + chunk, B * S), device=flat.device)
        src = rows + offset
        inside = (rows % S) + offset < S  # rows past their sequence's end have weight 0
        p = probs[src.clamp(max=B * S - 1)] * inside[:, None]
        args = (flat[s : s + rows.numel()], p, w[s : s + rows.numel()])
        if torch.is_grad_enabled():
            loss, am = checkpoint(_loss_chunk, draft, *args, use_reentrant=False)
        else:
            loss, am = _loss_chunk(draft, *args)
        total = total + loss
        argmax.append(am)
    return total, torch.cat(argmax).view(B, S)


def ttt_loss(draft: Eagle3Draft, batch: TTTBatch, cfg: TTTConfig) -> TTTOutput:
    """Unroll K drafting steps over the batch and return the gamma-weighted loss and step metrics."""
    ids, mask, t = batch.input_ids_BS, batch.loss_mask_BS.bool(), batch.teacher
    B, S = ids.shape
    K = cfg.ttt_steps
    layer = draft.midlayer
    pos = torch.arange(S, device=ids.device)[None].expand(B, S)
    hidden = draft.fuse(batch.aux_BS3H)
    k0 = v0 = None
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    chain = torch.ones(B, S, dtype=torch.bool, device=ids.device)
    valid_all = torch.ones_like(chain)
    run_len = torch.zeros(B, S, device=ids.device)  # leading correct steps per position, for simulated tau
    loss = hidden.new_zeros((), dtype=torch.float32)
    stats = {n: torch.zeros(K, device=ids.device) for n in ("step_loss", "correct", "chain", "counted", "prev")}
    for k in range(K):
        if k and draft.cfg.parallel:  # a masked slot: fixed inputs, nothing of step k-1
            emb, hidden = draft.masked_slots(B, S)
        else:
            emb = draft.embed_tokens(_shift(ids, 1 + k)).to(hidden.dtype)
        q, kk, vv = layer.project_qkv(emb, hidden, pos + k)
        if k == 0:
            k0, v0 = kk, vv
            dk = kk.new_zeros(*kk.shape[:3], 0, kk.shape[-1])
            dv = dk
        else:
            diag_k.append(kk)
            diag_v.append(vv)
            dk, dv = torch.stack(diag_k, dim=3), torch.stack(diag_v, dim=3)
        out = layer.finish(hidden, ttt_attention(q, k0, v0, dk, dv, cfg.attn_chunk))
        scored = _shift(mask, 2 + k)
        weight = (scored & _shift(t.in_vocab_BT, 1 + k)).to(torch.float32)
        ce_sum, am = _step_loss(draft, out, t.probs_BTVd, 1 + k, weight, cfg.loss_chunk)
        step = ce_sum / weight.sum().clamp(min=1.0)
        loss = loss + (cfg.gamma**k) * step
        right = draft.to_target_ids(am) == _shift(t.argmax_BT, 1 + k)
        stats["prev"][k] = (chain & scored).sum()
        chain = chain & right
        run_len = run_len + chain
        valid_all = valid_all & scored
        stats["step_loss"][k] = step.detach()
        stats["correct"][k] = (right & scored).sum()
        stats["chain"][k] = (chain & scored).sum()
        stats["counted"][k] = scored.sum()
        hidden = draft.carry(out)  # what drafting step k+1 reads (eagle3.1: norm(out))
    tau_sum = ((1.0 + run_len) * valid_all).sum()
    return TTTOutput(
        loss,
        stats["step_loss"],
        stats["correct"],
        stats["chain"],
        stats["counted"],
        stats["prev"],
        tau_sum,
        valid_all.sum().float(),
    )
