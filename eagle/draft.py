"""The EAGLE-3 draft head: fused target features + token embedding -> one decoder layer -> draft-vocab logits.

Purpose: the model code of the head and nothing else. `Eagle3Draft.forward` runs the head over T new positions
(with an optional KV cache, for drafting); `Eagle3Layer.project_qkv`/`finish` expose the two halves of the layer
so that training-time test (`eagle.ttt`) can run its own memory-bounded attention between them.
Variants (`DraftConfig.variant`, eagle/config.py): "eagle3.1" adds `fc_norm` (an RMSNorm per fused state, in
`fuse`) and `norm_output` (`carry`: the next step reads `norm(output)`); `forward` returns what the next step
reads, as vLLM's `LlamaModel.forward` returns its `aux_output`, so drafting and TTT follow the variant alike.
"parallel" adds `mask_hidden` [1, 3H], the learned fused feature of parallel drafting's masked slots
(`masked_slots`: their inputs, the embedding of `mask_token_id` and `fuse(mask_hidden)`, as vLLM feeds them);
"eagle3.1-parallel" has both, its `mask_hidden` normed by `fc_norm` in `fuse` as vLLM's is.
Inference (autograd off) takes a leaner route with the same results: q/k/v and gate/up each as one product over
stacked weights, RoPE from a cos/sin table, one fused RMSNorm kernel, oneDNN for multi-row products on CPU
(`eagle.fastpath.linear`), and `forward(select_B=...)` computes the output of one new position per row only.
How to run: `draft = Eagle3Draft(DraftConfig.from_target(target.config, Vd))`, `set_draft_vocab`,
`init_from_target`; then `out_BTH, logits_BTVd = draft(ids_BT, draft.fuse(aux_BT3H), pos_BT)` (tests/test_ttt.py).
Not here: training loops, drafting policies, distribution, file formats, the CPU kernels themselves
(`eagle.fastpath`).

Shape legend: B batch, T new positions, L keys visible (past + T), H hidden size, D head dim, h query heads,
g key/value heads, s stacked heads (q|k|v or q|k), I MLP width, Vd draft vocabulary, V target vocabulary.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from eagle.config import DraftConfig
from eagle.fastpath import linear, version


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32 and not torch.is_grad_enabled():
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one kernel, the same bits as below
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: DraftConfig) -> torch.Tensor:
    """Inverse frequencies, with llama3 or linear scaling applied when the target uses it."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "linear":
        inv = inv / float(s["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(is_mid, mid, scaled)
    return inv.float()


def rope_cos_sin(pos_BT: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, T, D] of the positions' rotation angles (fp32 angles, cast to `dtype`)."""
    half_BTD = pos_BT.float()[..., None] * inv_freq.to(pos_BT.device)  # D/2 angles
    angles_BTD = torch.cat([half_BTD, half_BTD], dim=-1)
    return angles_BTD.cos().to(dtype), angles_BTD.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last dim (halves convention); cos/sin broadcast against x."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class RopeTable:
    """cos/sin of positions 0..n-1 computed once (CPU only: a lookup there cannot fail silently); the same values
    `rope_cos_sin` computes per call. Grows when a position past the end is asked for."""

    def __init__(self, inv_freq: torch.Tensor, n: int):
        self.inv_freq, self.n, self.cos = inv_freq, n, None
        self.sin: torch.Tensor | None = None

    def __call__(self, pos_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if pos_BT.device.type != "cpu":
            return rope_cos_sin(pos_BT, self.inv_freq, dtype)
        if self.cos is None or self.cos.dtype != dtype or self.cos.device != pos_BT.device:
            self.cos, self.sin = rope_cos_sin(torch.arange(self.n), self.inv_freq.cpu(), dtype)
        try:
            return self.cos[pos_BT], self.sin[pos_BT]
        except IndexError:
            self.n, self.cos = max(2 * self.n, int(pos_BT.max()) + 1), None
            return self(pos_BT, dtype)


class _Stacked:
    """The weights of several bias-free linears stacked by rows, rebuilt whenever one of them changes."""

    __slots__ = ("key", "weight", "bias", "__weakref__")

    def __init__(self, parts: tuple[torch.Tensor, ...]):
        self.key = _version_key(parts)
        self.weight, self.bias = torch.cat([p.detach() for p in parts]), None


def _version_key(parts: tuple[torch.Tensor, ...]) -> tuple:
    return tuple((p.data_ptr(), version(p), p.dtype) for p in parts)


class KVStore(Protocol):
    """What the head needs from a KV cache: take the new keys/values, return every visible key/value."""

    def update(self, k_BhTD: torch.Tensor, v_BhTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class Eagle3Layer(nn.Module):
    """One Llama decoder layer whose attention reads concat(norm(embedding), norm(feature)), width 2H."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        H, h, kvh, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * H, h * D, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * H, kvh * D, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * H, kvh * D, bias=False)
        self.self_attn.o_proj = nn.Linear(h * D, H, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.rope = RopeTable(self.inv_freq, min(cfg.max_position_embeddings, 4096))
        self._stacked: dict[str, _Stacked] = {}

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.rope = RopeTable(self.inv_freq, self.rope.n)  # the table follows `inv_freq` to its device
        return out

    def stacked(self, name: str, *parts: torch.Tensor) -> _Stacked:
        """`parts` stacked by rows (for one product instead of several), cached until a part changes."""
        hit = self._stacked.get(name)
        if hit is None or hit.key != _version_key(parts):
            hit = self._stacked[name] = _Stacked(parts)
        return hit

    def project_qkv(
        self, emb_BTH: torch.Tensor, hidden_BTH: torch.Tensor, pos_BT: torch.Tensor, emb_normed: bool = False
    ):
        """Rotated q [B,h,T,D], k and v [B,g,T,D]. `emb_normed`: `emb_BTH` has been through `input_layernorm`."""
        B, T, _ = hidden_BTH.shape
        emb_BTH = emb_BTH if emb_normed else self.input_layernorm(emb_BTH)
        x_BT2H = torch.cat([emb_BTH, self.hidden_norm(hidden_BTH)], dim=-1)
        a, c = self.self_attn, self.cfg
        h, g, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        cos_BTD, sin_BTD = self.rope(pos_BT, x_BT2H.dtype)
        if torch.is_grad_enabled():
            q_BhTD = a.q_proj(x_BT2H).view(B, T, h, D).transpose(1, 2)
            k_BgTD = a.k_proj(x_BT2H).view(B, T, g, D).transpose(1, 2)
            v_BgTD = a.v_proj(x_BT2H).view(B, T, g, D).transpose(1, 2)
            cos_B1TD, sin_B1TD = cos_BTD[:, None], sin_BTD[:, None]
            return rotate(q_BhTD, cos_B1TD, sin_B1TD), rotate(k_BgTD, cos_B1TD, sin_B1TD), v_BgTD
        qkv_w = self.stacked("qkv", a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
        qkv_BTsD = linear(x_BT2H, qkv_w).view(B, T, -1, D)
        qk_BsTD = rotate(qkv_BTsD[:, :, : h + g], cos_BTD[:, :, None], sin_BTD[:, :, None]).transpose(1, 2)
        return qk_BsTD[:, :h], qk_BsTD[:, h:], qkv_BTsD[:, :, h + g :].transpose(1, 2)

    def finish(self, hidden_BTH: torch.Tensor, attn_BhTD: torch.Tensor) -> torch.Tensor:
        """Output projection, residual on the un-normalised input feature, then the MLP block."""
        B, _, T, _ = attn_BhTD.shape
        m = self.mlp
        out_BTH = hidden_BTH + linear(attn_BhTD.transpose(1, 2).reshape(B, T, -1), self.self_attn.o_proj)
        y_BTH = self.post_attention_layernorm(out_BTH)
        if torch.is_grad_enabled():
            return out_BTH + m.down_proj(F.silu(m.gate_proj(y_BTH)) * m.up_proj(y_BTH))
        gate_up_w = self.stacked("gate_up", m.gate_proj.weight, m.up_proj.weight)
        gate_BTI, up_BTI = linear(y_BTH, gate_up_w).chunk(2, dim=-1)
        return out_BTH + linear(F.silu(gate_BTI) * up_BTI, m.down_proj)


class Eagle3Draft(nn.Module):
    """The head. `embed_tokens` is the target's embedding, frozen and never exported."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * H, H, bias=False)
        if cfg.fc_norm:  # vLLM: `fc_norm.{i}.weight`, one per fused state
            self.fc_norm = nn.ModuleList([RMSNorm(H, cfg.rms_norm_eps) for _ in range(3)])
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        if cfg.parallel:  # vLLM: tensor `mask_hidden`, read as [1, fc_input_size]
            self.mask_hidden = nn.Parameter(torch.empty(1, 3 * H).normal_(std=0.02))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.set_draft_vocab(torch.arange(cfg.draft_vocab_size))

    # ---- draft vocabulary -------------------------------------------------------------------------------------
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Install the draft vocabulary: `target_ids` (sorted, unique, length Vd) are the target ids it covers."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).to(self.d2t.device)
        if ids.numel() != self.cfg.draft_vocab_size or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("draft vocabulary must be sorted unique target ids of length draft_vocab_size")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @torch.no_grad()
    def init_from_target(self, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor) -> None:
        """Copy the target's (frozen) embedding and, for `lm_head`, its output rows of the draft vocabulary.

        Call after `set_draft_vocab`.
        """
        if embed_VH.shape != self.embed_tokens.weight.shape or lm_head_VH.shape != embed_VH.shape:
            raise ValueError(
                f"target embedding {tuple(embed_VH.shape)} / lm_head {tuple(lm_head_VH.shape)} do not "
                f"match the head's {tuple(self.embed_tokens.weight.shape)}"
            )
        self.embed_tokens.weight.copy_(embed_VH)
        self.lm_head.weight.copy_(lm_head_VH[self.draft_ids()])

    def draft_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, in draft order."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def to_target_ids(self, draft_idx: torch.Tensor) -> torch.Tensor:
        return draft_idx + self.d2t[draft_idx]

    def draft_inputs(self) -> torch.Tensor:
        """`input_layernorm(embedding)` of every draft-vocabulary token, [Vd, H] in draft order (inference only).

        Drafting feeds the head its own draft-vocabulary picks: one row lookup here replaces the embedding lookup,
        its norm and the id conversion per step. Rebuilt whenever the embedding, that norm or the vocabulary change.
        """
        parts = (self.embed_tokens.weight, self.midlayer.input_layernorm.weight, self.d2t)
        key = _version_key(parts)
        hit = self.__dict__.get("_draft_inputs")
        if hit is None or hit[0] != key:
            with torch.no_grad():
                emb_VdH = self.embed_tokens.weight[self.draft_ids()]
                hit = (key, self.midlayer.input_layernorm(emb_VdH.to(self.fc.weight.dtype)))
            self.__dict__["_draft_inputs"] = hit
        return hit[1]

    # ---- forward ----------------------------------------------------------------------------------------------
    def fuse(self, aux_BT3H: torch.Tensor) -> torch.Tensor:
        """Linear fusion of the low/mid/high target hidden states (each through its own RMSNorm first with
        `fc_norm`)."""
        w = self.fc.weight
        aux_BT3H = aux_BT3H if aux_BT3H.dtype == w.dtype else aux_BT3H.to(w.dtype)
        if self.cfg.fc_norm:
            aux_BT3H = torch.cat([n(x) for n, x in zip(self.fc_norm, aux_BT3H.chunk(3, dim=-1))], dim=-1)
        return linear(aux_BT3H, self.fc)

    def masked_slots(self, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs of T masked slots per row ("parallel"): the token embedding of `mask_token_id` and the hidden
        state `fuse(mask_hidden)` (vLLM's `parallel_drafting_hidden_state_tensor`), [B, T, H] each (expanded)."""
        w = self.embed_tokens.weight
        emb_H = w[self.cfg.mask_token_id]
        hidden_H = self.fuse(self.mask_hidden[None])[0, 0]
        return emb_H.to(hidden_H.dtype).expand(B, T, -1), hidden_H.expand(B, T, -1)

    def logits(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [B,T,Vd] from the layer's un-normalised output hidden state."""
        return linear(self.norm(hidden_BTH), self.lm_head)

    def carry(self, out_BTH: torch.Tensor) -> torch.Tensor:
        """The hidden state the next drafting (or TTT) step reads from the layer's output: the output itself, or
        `norm(output)` with `norm_output`."""
        return self.norm(out_BTH) if self.cfg.norm_output else out_BTH

    def forward(
        self,
        input_ids_BT: torch.Tensor | None,
        hidden_BTH: torch.Tensor,
        pos_BT: torch.Tensor,
        cache: KVStore | None = None,
        attn_mask_BTL: torch.Tensor | None = None,
        select_B: torch.Tensor | None = None,
        normed_emb_BTH: torch.Tensor | None = None,
    ):
        """Run T positions. `hidden_BTH` is a fused feature (see `fuse`) or the head's own previous output.

        Returns (the hidden state the next step reads [B,T,H] (`carry`), logits [B,T,Vd]). `attn_mask_BTL` is
        boolean, True = may attend; None means causal with every cached key visible. With `select_B` (one new
        position per row, [B], or K of them, [B, K]) only those positions' outputs are computed ([B,1,H] or
        [B,K,H], and logits alike); every position's keys and values still go to the cache. `normed_emb_BTH`
        (rows of `draft_inputs()`) replaces the tokens' embedding and its norm; `input_ids_BT` is then unused.
        """
        layer = self.midlayer
        emb_BTH = self.embed_tokens(input_ids_BT) if normed_emb_BTH is None else normed_emb_BTH
        if emb_BTH.dtype != hidden_BTH.dtype:
            emb_BTH = emb_BTH.to(hidden_BTH.dtype)
        emb_normed = normed_emb_BTH is not None
        q_BhTD, k_BgLD, v_BgLD = layer.project_qkv(emb_BTH, hidden_BTH, pos_BT, emb_normed)  # L = T before the cache
        if cache is not None:
            k_BgLD, v_BgLD = cache.update(k_BgLD, v_BgLD)
        if select_B is not None:  # from here T is 1 (or K)
            q_BhTD, hidden_BTH, attn_mask_BTL = _select(q_BhTD, hidden_BTH, attn_mask_BTL, k_BgLD.shape[2], select_B)
        attn_BhTD = sdpa(q_BhTD, k_BgLD, v_BgLD, attn_mask_BTL)
        out_BTH = layer.finish(hidden_BTH, attn_BhTD)
        normed_BTH = self.norm(out_BTH)
        return (normed_BTH if self.cfg.norm_output else out_BTH), linear(normed_BTH, self.lm_head)

    def trainable_parameters(self):
        return [p for n, p in self.named_parameters() if not n.startswith("embed_tokens")]


def _select(
    q_BhTD: torch.Tensor, hidden_BTH: torch.Tensor, mask_BTL: torch.Tensor | None, L: int, select_B: torch.Tensor
):
    """Row b's queries, input features and mask rows at new positions `select_B[b]` (one, [B], or K, [B, K]):
    [B,h,K,D], [B,K,H], [B,K,L]. A missing mask means causal: new position i (of T) sees keys 0..L-T+i."""
    B, h, T, D = q_BhTD.shape
    i_BK = select_B if select_B.dim() == 2 else select_B[:, None]
    K = i_BK.shape[1]
    q_BhKD = q_BhTD.gather(2, i_BK[:, None, :, None].expand(B, h, K, D))
    hidden_BKH = hidden_BTH.gather(1, i_BK[..., None].expand(B, K, hidden_BTH.shape[-1]))
    if mask_BTL is None:
        mask_BKL = torch.arange(L, device=q_BhKD.device) <= (L - T) + i_BK[..., None]
    else:
        mask_BTL = mask_BTL if mask_BTL.dim() == 3 else mask_BTL[:, 0]
        mask_BKL = mask_BTL.expand(B, -1, -1).gather(1, i_BK[..., None].expand(B, K, L))
    return q_BhKD, hidden_BKH, mask_BKL


def sdpa(
    q_BhTD: torch.Tensor, k_BgLD: torch.Tensor, v_BgLD: torch.Tensor, mask_BTL: torch.Tensor | None
) -> torch.Tensor:
    """Grouped-query attention over L keys; the last T keys are the queries' own positions. `mask_BTL` may also come
    as [B, 1, T, L]; None means causal."""
    T, L = q_BhTD.shape[2], k_BgLD.shape[2]
    if mask_BTL is None:  # causal: [T, L], or nothing to mask for one query
        mask = None if T == 1 else torch.ones(T, L, dtype=torch.bool, device=q_BhTD.device).tril(L - T)
    else:
        mask = mask_BTL[:, None] if mask_BTL.dim() == 3 else mask_BTL  # [B, 1, T, L]
    queries_per_key = q_BhTD.shape[1] // k_BgLD.shape[1]
    return F.scaled_dot_product_attention(q_BhTD, k_BgLD, v_BgLD, attn_mask=mask, enable_gqa=queries_per_key > 1)
