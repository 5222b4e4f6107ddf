"""Preallocated, slot-addressed KV caches for a HF target and for the EAGLE-3 head, and the masks over them.

Purpose: speculative decoding writes speculative entries and then keeps only some of them, a different number per
row. Here every row owns a fixed buffer [B, h, S, D]; a forward writes its T new entries at per-row slots chosen by
the caller (`SlotCache.plan`) and attention reads the first `span` slots. Rolling back is lowering a row's length
(kept by the caller), keeping a tree path is copying a few entries per row (`SlotCache.move`). `visibility_mask`
builds the boolean [B, T, L] mask: each row sees its own committed prefix plus, inside the region just after it,
what the caller allows (causal for chains, ancestors for trees). In committed slots, slot index == RoPE position.
How to run: used by `eagle.speculative`; pass a `SlotCache` to a HF decoder as its cache together with the 4-D mask
from `additive_mask`, or `SlotCache.layers[0]` to `Eagle3Draft.forward` as its `KVStore`.
Not here: sliding-window attention (`check_no_sliding_window` refuses lengths past a window), paged or quantised
storage, flash-attention backends (they ignore 4-D masks: use "sdpa" or "eager").

Shape legend: B batch, T new positions, L visible slots (span), R region slots, S capacity, h kv heads, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotPlan:
    """Where the next forward writes (`slots_BT`, per row) and how many leading slots attention reads (`span`).
    `start` is set instead of `slots_BT` when every row writes the same consecutive slots start..start+T-1."""

    __slots__ = ("slots_BT", "rows_B1", "span", "start")

    def __init__(self) -> None:
        self.slots_BT: torch.Tensor | None = None
        self.rows_B1: torch.Tensor | None = None
        self.span = 0
        self.start: int | None = None


class SlotLayer(CacheLayerMixin):
    """One attention layer's K/V buffers [B, h, S, D], allocated on the first write."""

    is_sliding = False
    is_compileable = False

    def __init__(self, plan: SlotPlan, capacity: int):
        super().__init__()
        self.plan = plan
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, h, _, D = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_zeros(B, h, self.capacity, D)
        self.values = value_states.new_zeros(B, value_states.shape[1], self.capacity, value_states.shape[3])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Write the new [B, h, T, D] entries at the planned slots; return the first `span` slots."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        p = self.plan
        if p.start is not None:
            T = key_states.shape[2]
            self.keys[:, :, p.start : p.start + T] = key_states
            self.values[:, :, p.start : p.start + T] = value_states
        else:
            self.keys[p.rows_B1, :, p.slots_BT] = key_states.transpose(1, 2)
            self.values[p.rows_B1, :, p.slots_BT] = value_states.transpose(1, 2)
        return self.keys[:, :, : p.span], self.values[:, :, : p.span]

    def move(self, src_BT: torch.Tensor, dst_BT: torch.Tensor) -> None:
        rows = torch.arange(src_BT.shape[0], device=src_BT.device)[:, None]
        self.keys[rows, :, dst_BT] = self.keys[rows, :, src_BT]
        self.values[rows, :, dst_BT] = self.values[rows, :, src_BT]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.plan.span, 0

    def get_seq_length(self) -> int:
        return self.plan.span

    def get_max_length(self) -> int:
        return self.capacity


class SlotCache(Cache):
    """A HF `Cache` of `SlotLayer`s sharing one write plan. The head uses one layer, a target one per decoder layer."""

    def __init__(self, num_layers: int, capacity: int):
        self.slot_plan = SlotPlan()
        self.capacity = capacity
        self._arange = torch.arange(capacity)
        super().__init__(layers=[SlotLayer(self.slot_plan, capacity) for _ in range(num_layers)])

    def slot_index(self, span: int) -> torch.Tensor:
        """arange(span) on the device of the current plan, built once."""
        return self._arange[:span]

    def plan(self, slots_BT: torch.Tensor, span: int) -> None:
        """Next forward writes row b's T entries at `slots_BT[b]`; attention reads slots [0, span)."""
        if span > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity} exceeded (span {span})")
        p = self.slot_plan
        p.slots_BT, p.span, p.start = slots_BT, span, None
        if p.rows_B1 is None or p.rows_B1.shape[0] != slots_BT.shape[0] or p.rows_B1.device != slots_BT.device:
            p.rows_B1 = torch.arange(slots_BT.shape[0], device=slots_BT.device)[:, None]
            self._arange = torch.arange(self.capacity, device=slots_BT.device)

    def plan_after(self, lengths_B: torch.Tensor, max_length: int, T: int, offset: int = 0) -> None:
        """Write T entries right after each row's first `lengths_B + offset` slots (`max_length` = max of lengths)."""
        if lengths_B.shape[0] == 1:  # one row: its length is `max_length`, no slot tensor needed
            span = max_length + offset + T
            if span > self.capacity:
                raise ValueError(f"KV cache capacity {self.capacity} exceeded (span {span})")
            p = self.slot_plan
            p.slots_BT, p.span, p.start = None, span, max_length + offset
            return
        ar = torch.arange(offset, offset + T, device=lengths_B.device)
        self.plan(lengths_B[:, None] + ar, max_length + offset + T)

    def move(self, src_BT: torch.Tensor, dst_BT: torch.Tensor) -> None:
        """Copy each row's entries at slots `src_BT` to slots `dst_BT`, in every layer (reads before writing)."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.move(src_BT, dst_BT)


def visibility_mask(lengths_B: torch.Tensor, region_BTR: torch.Tensor, span: int) -> torch.Tensor:
    """Boolean [B, T, span]: row b's query t sees slot j iff j < lengths[b], or j = lengths[b] + r and region[b,t,r]."""
    B, T, R = lengths_B.shape[0], region_BTR.shape[1], region_BTR.shape[2]
    rel_BL = torch.arange(span, device=lengths_B.device)[None] - lengths_B[:, None]
    inside_BL = (rel_BL >= 0) & (rel_BL < R)
    idx_BTL = rel_BL.clamp(0, R - 1)[:, None, :].expand(B, T, span)
    seen_BTL = region_BTR.expand(B, T, R).gather(2, idx_BTL) & inside_BL[:, None]
    return seen_BTL | (rel_BL < 0)[:, None]


def causal_region(T: int, device: torch.device | str) -> torch.Tensor:
    """[1, T, T] lower-triangular region: new entry t sees new entries 0..t."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()[None]


def additive_mask(mask_BTL: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [B, 1, T, L] float mask HF attention adds to its scores (0 where visible, the dtype's minimum elsewhere)."""
    out = torch.zeros(mask_BTL.shape, dtype=dtype, device=mask_BTL.device)
    return out.masked_fill_(~mask_BTL, torch.finfo(dtype).min)[:, None]


class CausalMask:
    """Additive masks of one row's pass of T <= `rows` new tokens after L committed slots (causal among the new ones),
    sliced from one prebuilt [1, 1, rows, capacity + rows] mask: no per-pass construction."""

    def __init__(self, capacity: int, rows: int, dtype: torch.dtype, device: torch.device | str):
        col = torch.arange(capacity + rows, device=device)[None]
        self.capacity, self.rows = capacity, rows
        self.mask = additive_mask((col <= capacity + torch.arange(rows, device=device)[:, None])[None], dtype)

    def __call__(self, L: int, T: int) -> torch.Tensor:
        """[1, 1, T, L + T]: column C - L + j of row t is visible iff j <= L + t."""
        C = self.capacity
        m = self.mask[:, :, :T, C - L : C + T]
        # CUDA's memory-efficient attention reads the mask with aligned vector loads: a slice starting C - L columns
        # in (not a multiple of 16) faults with "misaligned address" (seen on an H200, torch 2.11). A fresh copy is
        # aligned; on the CPU the slice is kept (no per-pass allocation).
        return m if m.device.type == "cpu" or (C - L) % 16 == 0 else m.clone()


def check_no_sliding_window(config: Any, total_length: int) -> None:
    """Refuse a target whose sliding window would matter: these masks are always full-causal."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    if window is not None and total_length > window:
        raise ValueError(
            f"sequences of up to {total_length} tokens exceed the target's sliding window {window}; "
            "sliding-window attention is not supported here"
        )
