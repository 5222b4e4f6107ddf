"""The runners the decoding loops drive: the target's and the head's passes over their preallocated caches.

Purpose: `TargetRunner` (the target with its `SlotCache`, on the path `eagle.target_path` picks), `HeadRunner` (the
head with its own cache, one method per kind of pass) and `Prefix` (each row's committed cache length, which both
place their new entries after). `time_paths(target, paths)` times a `TargetRunner` of each path: the measurement
`eagle.target_path` is handed (it imports no runner).
How to run: built by `eagle.verify` (the speculative loop), `eagle.speculative.generate_plain`, `eagle.drafters` and the
timing above; `with runner.session(): runner.prefill(ids, n)`, then `runner(prefix, ids, pos, region)`.
Not here: drafting (eagle/tree.py, eagle/drafters.py), verification and acceptance (eagle/verify.py), the caches
(eagle/kvcache.py).

Shape legend: B batch, T new positions, L slots visible (span), H hidden, Vd draft vocabulary, R slots after the
prefix a query may see.
"""

from __future__ import annotations

import inspect
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from eagle import fastpath, target_path
from eagle.draft import Eagle3Draft
from eagle.fastpath import LeanDecoder, packed_linears
from eagle.features import capture_layer_inputs, decoder_layers
from eagle.kvcache import CausalMask, SlotCache, additive_mask, causal_region, check_no_sliding_window, visibility_mask


@dataclass
class Prefix:
    """Per-row committed cache lengths (slots [0, length) hold positions 0..length-1) and their maximum."""

    lengths_B: torch.Tensor
    longest: int

    @classmethod
    def of(cls, lengths_B: torch.Tensor) -> "Prefix":
        return cls(lengths_B, int(lengths_B.max()))


class HeadRunner:
    """The head with its own preallocated `SlotCache`; each pass writes T new entries at slots lengths+offset+t
    (`offset` entries of the current draft already follow the prefix) and returns the head's (output hidden
    [B, T, H], logits [B, T, Vd])."""

    def __init__(self, draft: Eagle3Draft, capacity: int):
        self.draft = draft
        self.cache = SlotCache(1, capacity)

    def _plan(self, prefix: Prefix, T: int, offset: int) -> int:
        """Plan the write of T entries after `offset` drafted ones; returns the span the queries read."""
        self.cache.plan_after(prefix.lengths_B, prefix.longest, T, offset)
        return prefix.longest + offset + T

    def extend(
        self,
        prefix: Prefix,
        tokens_BT: torch.Tensor,
        hidden_BTH: torch.Tensor,
        pos_BT: torch.Tensor,
        select_B: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit T entries (token, fused feature) right after each row's prefix, causal among themselves. With
        `select_B` only new entry `select_B[b]`'s outputs per row ([B, 1, H], [B, 1, Vd])."""
        B, T = hidden_BTH.shape[0], hidden_BTH.shape[1]
        span = self._plan(prefix, T, 0)
        if B == 1:
            mask_BTL = None  # one row: its prefix is the longest, so the head's default (causal) is the same
        else:
            mask_BTL = visibility_mask(prefix.lengths_B, causal_region(T, hidden_BTH.device), span)
        return self.draft(tokens_BT, hidden_BTH, pos_BT, self.cache.layers[0], mask_BTL, select_B)

    def chain_step(
        self, prefix: Prefix, normed_emb_B1H: torch.Tensor, hidden_B1H: torch.Tensor, pos_B1: torch.Tensor, offset: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafted entry per row after the `offset` drafted before it; it sees the prefix and all of them.
        `normed_emb_B1H` (rows of `Eagle3Draft.draft_inputs`) stands for the drafted tokens."""
        span = self._plan(prefix, 1, offset)
        if hidden_B1H.shape[0] == 1:
            mask_B1L = None
        else:
            mask_B1L = (self.cache.slot_index(span)[None] < (prefix.lengths_B + offset + 1)[:, None])[:, None]
        return self.draft(None, hidden_B1H, pos_B1, self.cache.layers[0], mask_B1L, None, normed_emb_B1H)

    def tree_step(
        self,
        prefix: Prefix,
        tokens_BT: torch.Tensor,
        hidden_BTH: torch.Tensor,
        pos_BT: torch.Tensor,
        seen_BTR: torch.Tensor,
        offset: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """T frontier entries per row after the `offset` drafted before them; `seen_BTR` (boolean, R = offset + T)
        says which of the slots after the prefix each one sees (its ancestors and itself)."""
        span = self._plan(prefix, hidden_BTH.shape[1], offset)
        mask_BTL = visibility_mask(prefix.lengths_B, seen_BTR, span)
        return self.draft(tokens_BT, hidden_BTH, pos_BT, self.cache.layers[0], mask_BTL)


class TargetRunner:
    """The target with its `SlotCache`: one pass over T new tokens placed after each row's committed prefix.
    `path` (`eagle.target_path`; "auto": the fastest measured on this machine for the runner's `role`, "decode" for
    one token a pass, "verify" for the speculative step's wider passes) picks the decoder and the kernels:
    a "lean" path runs Llama-family targets through `LeanDecoder` once it has reproduced HF's forward on a first
    pass (every other target through HF); inside `with runner.session():` a "packed" path computes linears with
    the CPU kernels of `eagle.fastpath.linear`, and HF's feature capture hooks stay attached (outside a session
    they are attached per call). `runner.path` is the path resolved, `runner.decoder` the decoder in use."""

    CAUSAL_ROWS = 64  # passes of up to this many tokens of one row slice a prebuilt causal mask

    def __init__(
        self,
        target: nn.Module,
        capacity: int,
        layer_ids: tuple[int, ...] = (),
        path: str = "auto",
        role: str = "verify",
    ):
        check_no_sliding_window(target.config, capacity)
        self.path = target_path.resolve(target, path, role, time_paths)
        self.target, self.layer_ids = target, tuple(layer_ids)
        self.cache = SlotCache(len(decoder_layers(target)), capacity)
        self.lm_head = target.get_output_embeddings()
        self.dtype = next(target.parameters()).dtype
        self._base = target.get_decoder()
        params = inspect.signature(self._base.forward).parameters  # transformers >= 5.2x names the cache `cache`
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._store: dict[int, torch.Tensor] | None = None
        self._causal: CausalMask | None = None
        self.packed = target_path.kernels_of(self.path) == "packed"
        self._linear = fastpath.linear if self.packed else fastpath.torch_linear
        self._lean = LeanDecoder.of(target) if target_path.decoder_of(self.path) == "lean" else None
        if self._lean is not None:
            self._lean.linear = self._linear

    @property
    def decoder(self) -> str:
        return "hf" if self._lean is None else "lean"

    @contextmanager
    def session(self) -> Iterator[None]:
        with packed_linears(self.target) if self.packed else nullcontext(), ExitStack() as stack:
            if self.layer_ids and self._store is None:
                self._store = stack.enter_context(capture_layer_inputs(self.target, self.layer_ids))
                stack.callback(setattr, self, "_store", None)
            yield

    def logits(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        return self._linear(hidden_BTH, self.lm_head) if type(self.lm_head) is nn.Linear else self.lm_head(hidden_BTH)

    def __call__(self, prefix: Prefix, ids_BT: torch.Tensor, pos_BT: torch.Tensor, region_BTR: torch.Tensor | None):
        """Returns (final hidden [B, T, H], fused-layer inputs [B, T, 3H] or None without `layer_ids`).
        `region_BTR` None means causal over the T new tokens."""
        T = ids_BT.shape[1]
        self.cache.plan_after(prefix.lengths_B, prefix.longest, T)
        mask_B1TL = self._mask(prefix, T, region_BTR)
        lean = self._lean
        if lean is not None and lean.trusted:
            return lean(ids_BT, pos_BT, mask_B1TL, self.cache.layers, self.layer_ids)
        out = self._hf(ids_BT, pos_BT, mask_B1TL)
        if lean is not None and not lean.confirm(
            out, lean(ids_BT, pos_BT, mask_B1TL, self.cache.layers, self.layer_ids)
        ):
            self._hf(ids_BT, pos_BT, mask_B1TL)  # put HF's own entries back into the cache
            self._lean = None
        return out

    def _hf(self, ids_BT: torch.Tensor, pos_BT: torch.Tensor, mask_B1TL: torch.Tensor):
        kwargs = dict(input_ids=ids_BT, attention_mask=mask_B1TL, position_ids=pos_BT, use_cache=True)
        kwargs[self._cache_kw] = self.cache
        if not self.layer_ids:
            return self._base(**kwargs).last_hidden_state, None
        with ExitStack() as stack:
            store = (
                self._store
                if self._store is not None
                else stack.enter_context(capture_layer_inputs(self.target, self.layer_ids))
            )
            out = self._base(**kwargs)
        return out.last_hidden_state, torch.cat([store[i] for i in self.layer_ids], dim=-1)

    def _mask(self, prefix: Prefix, T: int, region_BTR: torch.Tensor | None) -> torch.Tensor:
        """Additive [B, 1, T, span] mask; one row and a causal region slice a prebuilt one."""
        dev = prefix.lengths_B.device
        if region_BTR is None and prefix.lengths_B.shape[0] == 1 and T <= self.CAUSAL_ROWS:
            if self._causal is None or self._causal.mask.device != dev:
                self._causal = CausalMask(self.cache.capacity, self.CAUSAL_ROWS, self.dtype, dev)
            return self._causal(prefix.longest, T)
        region = causal_region(T, dev) if region_BTR is None else region_BTR
        return additive_mask(visibility_mask(prefix.lengths_B, region, prefix.longest + T), self.dtype)

    def prefill(self, ids_BT: torch.Tensor, n_B: torch.Tensor):
        """Prompt pass; returns (logits at each row's last prompt token [B, V], fused features or None)."""
        B, T = ids_BT.shape
        pos_BT = torch.arange(T, device=ids_BT.device).expand(B, T)
        hidden_BTH, aux = self(Prefix(torch.zeros_like(n_B), 0), ids_BT, pos_BT, None)
        last_BH = hidden_BTH[torch.arange(B, device=ids_BT.device), n_B - 1]
        return self.logits(last_BH), aux


def time_paths(target: nn.Module, paths: list[str]) -> dict[str, dict[str, float]]:
    """Per role (`target_path.ROLES`: a 1-token and a `WIDTH`-token pass after a `PREFIX`-token prefill, each with
    the last position's logits), each path's fastest pass in seconds, over at least `MIN_ROUNDS` rounds after
    `WARMUP`, then more until `BUDGET_S` or `MAX_ROUNDS` (eagle/target_path.py's constants); rounds rotate the order
    of the paths so that each sees the same machine state."""
    PREFIX, WIDTH, WARMUP = target_path.PREFIX, target_path.WIDTH, target_path.WARMUP
    MIN_ROUNDS, MAX_ROUNDS, BUDGET_S = target_path.MIN_ROUNDS, target_path.MAX_ROUNDS, target_path.BUDGET_S
    p = next(target.parameters())
    vocab = target.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, PREFIX + WIDTH), generator=g).to(p.device)
    n = torch.tensor([PREFIX], device=p.device)
    prefix = Prefix.of(n)
    pos = torch.arange(PREFIX, PREFIX + WIDTH, device=p.device)[None]
    runners = {q: TargetRunner(target, PREFIX + WIDTH + 1, path=q) for q in paths}
    sync = torch.cuda.synchronize if p.device.type == "cuda" else (lambda: None)
    times: dict[str, dict[str, list[float]]] = {role: {q: [] for q in paths} for role in target_path.ROLES}
    with torch.inference_mode():
        for q, r in runners.items():
            with r.session():
                r.prefill(ids[:, :PREFIX], n)
        for q, r in list(runners.items()):  # a lean decoder that failed to reproduce HF is gone: not a lean path
            if target_path.decoder_of(q) == "lean" and r.decoder != "lean":
                del runners[q]
                for t in times.values():
                    del t[q]
        t_start, i = time.perf_counter(), 0
        while i < WARMUP + MIN_ROUNDS or (i < WARMUP + MAX_ROUNDS and time.perf_counter() - t_start < BUDGET_S):
            names = list(runners)
            for q in names[i % len(names) :] + names[: i % len(names)]:
                r = runners[q]
                with r.session():
                    for role, width in target_path.ROLES.items():
                        sync()
                        t0 = time.perf_counter()
                        h, _ = r(prefix, ids[:, PREFIX : PREFIX + width], pos[:, :width], None)
                        r.logits(h[:, -1])
                        sync()
                        if i >= WARMUP:
                            times[role][q].append(time.perf_counter() - t0)
            i += 1
    return {role: {q: min(ts) for q, ts in t.items()} for role, t in times.items()}
