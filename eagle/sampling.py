"""Token selection and the lossless acceptance rules of speculative decoding.

Purpose: the distribution both models sample from (`probs`: temperature, then top-p, applied the same way to
target and draft logits), and the rules that decide how many drafted tokens a verification pass keeps:
- `accept_chain_greedy`: drafts kept while they equal the target's argmax, then the target's argmax (bonus).
- `accept_chain`: the standard rule for drafts x ~ q: keep x with probability min(1, p(x)/q(x)); at the first
  rejection draw from norm(max(0, p - q)) (`residual`); when all are kept, draw the bonus from p.
- `walk_tree`: for tree drafts (chosen deterministically, top-k, so each proposal is a point mass): draw y ~ p at
  every node (or take the argmax), follow the child whose token is y, stop at the first node without one and emit
  its y. This is the multi-candidate rejection rule (SpecInfer / EAGLE) with point-mass proposals: every emitted
  token is a fresh draw from p at its own context, so it is exact.
How to run: pure tensor functions, used by `eagle.speculative`; tested statistically in tests/test_sampling.py.
Not here: models, caches, the drafting policy.

Shape legend: B batch, K drafted positions, V vocabulary, N tree nodes (root at index 0).
"""

from __future__ import annotations

import torch


def probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Softmax(logits / temperature) restricted to the smallest top set of mass >= top_p, renormalised (fp32)."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return p
    sorted_p, order = p.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(p).scatter_(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def sample(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of a [..., V] probability tensor; returns [...] token ids."""
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(p.shape[:-1])


def residual(p_BV: torch.Tensor, q_BV: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)), unnormalised; p itself where p <= q everywhere (no rejection can happen there)."""
    r = (p_BV - q_BV).clamp_min(0.0)
    empty = r.sum(-1, keepdim=True) <= 0
    return torch.where(empty, p_BV, r)


def accept_chain_greedy(target_logits_BKV: torch.Tensor, draft_BK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain rule. `target_logits_BKV` covers K+1 positions. Returns (accepted count [B], next token [B])."""
    best_BK = target_logits_BKV.argmax(-1)
    n_B = (draft_BK == best_BK[:, :-1]).long().cumprod(1).sum(1)
    return n_B, best_BK.gather(1, n_B[:, None])[:, 0]


def accept_chain(p_BKV: torch.Tensor, q_BKV: torch.Tensor, draft_BK: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard speculative rule for drafts sampled from q (K positions); p has K+1 positions (the last for the bonus).

    Returns (accepted count n [B], next token [B]): the residual draw at position n, or the bonus from p when n = K.
    """
    B, K = draft_BK.shape
    V = p_BKV.shape[-1]
    px_BK = p_BKV[:, :K].gather(2, draft_BK[..., None])[..., 0]
    qx_BK = q_BKV.gather(2, draft_BK[..., None])[..., 0]
    u_BK = torch.rand(B, K, generator=generator, device=p_BKV.device)
    kept_BK = u_BK * qx_BK < px_BK
    n_B = kept_BK.long().cumprod(1).sum(1)
    at_n = n_B[:, None, None].expand(B, 1, V)
    p_n = p_BKV.gather(1, at_n)[:, 0]
    q_n = torch.cat([q_BKV, q_BKV.new_zeros(B, 1, V)], dim=1).gather(1, at_n)[:, 0]
    return n_B, sample(residual(p_n, q_n), generator)


def walk_tree(tokens_BN: torch.Tensor, parent_BN: torch.Tensor, choice_BN: torch.Tensor,
              depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follow, from the root, the child whose token equals the target's choice at the current node.

    `choice_BN` is the target's token at every node (argmax, or one draw from p per node). Returns
    (accepted count n [B], path [B, depth+1] of node indices whose first n+1 entries are the kept nodes,
    next token [B] = the choice at the last kept node).
    """
    B, N = tokens_BN.shape
    cur_B = torch.zeros(B, dtype=torch.long, device=tokens_BN.device)
    alive_B = torch.ones(B, dtype=torch.bool, device=tokens_BN.device)
    is_node = torch.arange(N, device=tokens_BN.device)[None] > 0
    path = [cur_B]
    for _ in range(depth):
        want_B1 = choice_BN.gather(1, cur_B[:, None])
        match_BN = (parent_BN == cur_B[:, None]) & (tokens_BN == want_B1) & is_node
        alive_B = alive_B & match_BN.any(1)
        cur_B = torch.where(alive_B, match_BN.long().argmax(1), cur_B)
        path.append(cur_B)
    path_BA = torch.stack(path, dim=1)
    n_B = (path_BA[:, 1:] != path_BA[:, :-1]).sum(1)
    return n_B, path_BA, choice_BN.gather(1, cur_B[:, None])[:, 0]
