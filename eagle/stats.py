"""Acceptance statistics of speculative generation: what the rules accepted and what reached the output.

Purpose: `SpecStats`, filled by `eagle.verify`'s loop, holds per verification step and row the drafted tokens
the acceptance rule accepted (raw, as an engine's spec-decode counters count them) and the tokens that reached the
output (after EOS and `max_new_tokens` truncation), and gives the figures of both: `tau` / `tau_raw` and
`per_position_acceptance` / `per_position_acceptance_raw` (alpha_k per draft depth). This project reports the
emitted figures; the raw ones are for comparisons with an engine's counters.
`acceptance_by_position` gives tau and alpha_1 per output-position bucket (where in a long output a step starts),
from per-step counts of ours or of an engine's per-request metrics alike.
Tested in tests/test_emitted_stats.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class SpecStats:
    """Per verification step and row, -1 where the row had already finished before the step:
    `accept_lengths`, drafted tokens the acceptance rule accepted (raw: also those past an EOS or the
    `max_new_tokens` limit; what an engine's spec-decode counters count); `emitted_lengths`, tokens that reached
    the output in that step (accepted drafts + the correction/bonus token, after EOS and length truncation; None
    means nothing was truncated: accepted + 1). The token picked after prefill belongs to no step, so the live
    entries of `emitted_lengths` sum to `lengths.sum()` minus the batch size."""

    accept_lengths: torch.Tensor  # [steps, B]
    depth: int
    drafted: torch.Tensor | None = None  # [steps] tokens drafted per step (< depth when a chain stopped early)
    emitted_lengths: torch.Tensor | None = None  # [steps, B]

    @classmethod
    def cat(cls, parts: Sequence["SpecStats"]) -> "SpecStats":
        """Several runs of the same batch size and depth as one run, their steps one after another."""
        if not parts:
            raise ValueError("SpecStats.cat needs at least one run")
        depth = parts[0].depth
        if any(p.depth != depth or p.accept_lengths.shape[1:] != parts[0].accept_lengths.shape[1:] for p in parts):
            raise ValueError("SpecStats.cat: the runs differ in depth or batch size")
        drafted = [p.drafted.cpu() if p.drafted is not None else torch.full((p.n_verify_steps,), depth) for p in parts]
        return cls(
            torch.cat([p.accept_lengths.cpu() for p in parts]),
            depth,
            torch.cat(drafted).long(),
            torch.cat([p._emitted().cpu() for p in parts]),
        )

    @property
    def n_verify_steps(self) -> int:
        return int(self.accept_lengths.shape[0])

    def _emitted(self) -> torch.Tensor:
        e = self.emitted_lengths
        return torch.where(self.accept_lengths >= 0, self.accept_lengths + 1, -1) if e is None else e

    @property
    def tau(self) -> float:
        """Mean tokens emitted per live (row, step): output tokens of all steps / live (row, step) pairs."""
        e = self._emitted()
        e = e[e >= 0]
        return int(e.sum()) / e.numel() if e.numel() else 0.0

    @property
    def tau_raw(self) -> float:
        """Mean raw accepted drafts + 1 per live (row, step); the engines' mean acceptance length."""
        a = self.accept_lengths[self.accept_lengths >= 0]
        return (int(a.sum()) + a.numel()) / a.numel() if a.numel() else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """alpha_k = (steps whose output holds draft k: min(accepted, emitted) >= k) / (steps that drafted depth k
        and emitted >= k tokens), k = 1..depth. A step whose row ended inside it (EOS or length limit) is censored
        there: depths past its last emitted token count as neither reached nor accepted."""
        live = self.accept_lengths >= 0
        e = self._emitted()[live]
        return self._alphas(torch.minimum(self.accept_lengths[live], e), e, live)

    @property
    def per_position_acceptance_raw(self) -> list[float]:
        """alpha_k = (steps that accepted depth k) / (steps that drafted depth k, having accepted k-1), k = 1..depth,
        on raw accepted counts (no censoring at EOS or the length limit): per-position counts as an engine's."""
        live = self.accept_lengths >= 0
        a = self.accept_lengths[live]
        return self._alphas(a, a + 1, live)

    @property
    def cumulative_acceptance(self) -> list[float]:
        """P[the step's output holds draft k] over the live (row, step) pairs, k = 1..depth (emitted, like `tau`)."""
        live = self.accept_lengths >= 0
        kept = torch.minimum(self.accept_lengths[live], self._emitted()[live])
        n = max(int(kept.numel()), 1)
        return [int((kept >= k).sum()) / n for k in range(1, self.depth + 1)]

    def _alphas(self, accepted: torch.Tensor, reach: torch.Tensor, live: torch.Tensor) -> list[float]:
        """Per depth k: (accepted >= k) / (reach >= k and drafted >= k), over the live pairs."""
        d = (
            self.drafted.to(live.device)[:, None].expand_as(live)[live]
            if self.drafted is not None
            else torch.full_like(accepted, self.depth)
        )
        return [
            float((accepted >= k).sum() / ((reach >= k) & (d >= k)).sum().clamp_min(1))
            for k in range(1, self.depth + 1)
        ]


POSITION_EDGES = (0, 128, 512, 2048)  # default output-position buckets [0, 128), [128, 512), [512, 2048)


def step_starts(emitted: Sequence[int]) -> list[int]:
    """Output position at which each verification step of one sequence starts: the token picked after prefill is
    output position 0 and belongs to no step, so step 0 starts at 1 and step i at 1 + sum(emitted[:i])."""
    starts, pos = [], 1
    for e in emitted:
        starts.append(pos)
        pos += int(e)
    return starts


def acceptance_by_position(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]], edges: Sequence[int] = POSITION_EDGES
) -> list[dict]:
    """tau and alpha_1 per output-position bucket [edges[i], edges[i+1]) over the verification steps of several
    sequences, each given as (accepted, emitted) per step in output order; a step belongs to the bucket of the
    output position where it starts (`step_starts`); steps starting at or past the last edge are in no bucket.
    tau = mean emitted tokens per step; alpha_1 = share of steps whose output holds draft 1
    (min(accepted, emitted) >= 1). Emitted = accepted + 1 gives the raw figures an engine's per-request counts give.
    Returns [{"lo", "hi", "steps", "tau", "alpha_1"}] per bucket; tau and alpha_1 are None for an empty bucket."""
    sums = [[0, 0, 0] for _ in edges[1:]]  # steps, emitted tokens, steps holding draft 1
    for accepted, emitted in sequences:
        for start, a, e in zip(step_starts(emitted), accepted, emitted):
            b = next((i for i in range(len(sums)) if edges[i] <= start < edges[i + 1]), None)
            if b is not None:
                sums[b][0] += 1
                sums[b][1] += int(e)
                sums[b][2] += int(min(a, e) >= 1)
    return [
        {"lo": int(lo), "hi": int(hi), "steps": n, "tau": em / n if n else None, "alpha_1": one / n if n else None}
        for lo, hi, (n, em, one) in zip(edges[:-1], edges[1:], sums)
    ]


def raw_steps(accepted: Sequence[int]) -> tuple[list[int], list[int]]:
    """(accepted, emitted) of one sequence counted as an engine counts: every accepted draft plus the bonus token."""
    return list(accepted), [int(a) + 1 for a in accepted]
