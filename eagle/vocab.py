"""Draft vocabulary selection: the Vd most frequent target tokens among the trained (assistant) tokens.

Purpose: `count_tokens` accumulates counts over loss-masked tokens; `select_draft_vocab` picks the Vd most
frequent ids (ties to the lower id, then sorted by id), optionally forcing some ids in (e.g. end-of-turn).
The head stores the choice as `d2t[j] = target_id_j - j` (int64) and `t2d` (bool over the target vocabulary).
Not here: tokenisation or data loading.
"""

from __future__ import annotations

from typing import Iterable

import torch


def count_tokens(counts_V: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Add the counts of loss-masked tokens of one batch to `counts_V` (in place) and return it."""
    ids = input_ids[loss_mask.bool()].reshape(-1).to(counts_V.device)
    counts_V += torch.bincount(ids, minlength=counts_V.numel())[: counts_V.numel()].to(counts_V.dtype)
    return counts_V


def select_draft_vocab(
    counts_V: torch.Tensor, draft_vocab_size: int, always_include: Iterable[int] = ()
) -> torch.Tensor:
    """Sorted target ids of the draft vocabulary (length `draft_vocab_size`)."""
    V = counts_V.numel()
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in 1..{V}, got {draft_vocab_size}")
    score = counts_V.to(torch.float64).clone()
    forced = [int(i) for i in always_include]
    if len(set(forced)) > draft_vocab_size:
        raise ValueError("more forced ids than draft_vocab_size")
    score[forced] = float("inf")
    # stable: among equal counts the lower id wins
    order = torch.sort(-score, stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values
