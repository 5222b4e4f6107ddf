"""Token selection and the lossless acceptance rules of speculative decoding.

Purpose: the distribution both models sample from (`probs`: temperature, then top-p, applied the same way to
target and draft logits), the one way either model picks a token (`pick`: argmax at temperature 0, else a draw
from `probs`), and the rules that decide how many drafted tokens a verification pass keeps:
- `accept_chain_greedy`: drafts kept while they equal the target's argmax, then the target's argmax (bonus).
- `accept_chain`: the standard rule for drafts x ~ q: keep x with probability min(1, p(x)/q(x)); at the first
  rejection draw from norm(max(0, p - q)) (`residual`); when all are kept, draw the bonus from p.
- `walk_tree`: for greedy tree drafts (top-k, deterministic): take the target's argmax at every node, follow the
  child whose token it is, stop at the first node without one and emit its argmax.
- `walk_tree_sampled`: for sampling trees whose children were drawn i.i.d. from their parent's draft distribution:
  recursive rejection (SpecInfer's multi-draft rule): try the children in draw order, keep x with probability
  min(1, r(x)/q(x)), after each rejection r <- norm(max(0, r - q)); emit a draw from r where no child is kept.
  Exact, and it accepts at least what a chain's single draft does at every node.
How to run: pure tensor functions, used by `eagle.verify` (the loop), `eagle.drafters` and `eagle.speculative`;
tested statistically in tests/test_sampling.py.
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


def pick(
    logits_BV: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token [B], the distribution it was drawn from [B, V] or None): the argmax at temperature 0, else a draw
    from `probs`. The target's picks and every drafter's own picks go through here."""
    if temperature == 0:
        return logits_BV.argmax(-1), None
    p_BV = probs(logits_BV, temperature, top_p)
    return sample(p_BV, generator), p_BV


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


def accept_chain(
    p_BKV: torch.Tensor, q_BKV: torch.Tensor, draft_BK: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
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


def walk_tree(
    tokens_BN: torch.Tensor, parent_BN: torch.Tensor, choice_BN: torch.Tensor, depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def walk_tree_sampled(
    tokens_BN: torch.Tensor,
    parent_BN: torch.Tensor,
    p_BNV: torch.Tensor,
    q_BNVd: torch.Tensor,
    draft_ids_Vd: torch.Tensor,
    depth: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection over a tree whose children were drawn i.i.d. from their parent's draft distribution
    (`eagle.tree.draft_tree_sampled`; multi-draft speculative sampling as in SpecInfer).

    At node u with target distribution r = p_u: try u's children in the order they were drawn; keep child x with
    probability min(1, r(x) / q_u(x)) and continue from it; after a rejection r <- norm(max(0, r - q_u)). When no
    child is kept (or u has none) the next token is drawn from r. Every emitted token is then distributed exactly as
    p at its context. `p_BNV`: target probabilities at every node; `q_BNVd`: the draft distribution each node's
    children were drawn from (draft vocabulary, target ids `draft_ids_Vd`). Returns what `walk_tree` returns.
    """
    B, N = tokens_BN.shape
    V, dev = p_BNV.shape[-1], tokens_BN.device
    rows = torch.arange(B, device=dev)
    cur_B = torch.zeros(B, dtype=torch.long, device=dev)
    alive_B = torch.ones(B, dtype=torch.bool, device=dev)
    is_node = torch.arange(N, device=dev)[None] > 0
    r_BV = p_BNV[:, 0]
    path = [cur_B]
    for _ in range(depth):
        kids_BN = (parent_BN == cur_B[:, None]) & is_node
        rank_BN = kids_BN.long().cumsum(1) - 1
        n_kids_B = kids_BN.sum(1)
        q_BV = p_BNV.new_zeros(B, V).scatter_(1, draft_ids_Vd.expand(B, -1), q_BNVd[rows, cur_B])
        moved_B = torch.zeros_like(alive_B)
        for i in range(int(n_kids_B.max()) if bool(alive_B.any()) else 0):
            live_B = alive_B & ~moved_B & (n_kids_B > i)
            child_B = (kids_BN & (rank_BN == i)).long().argmax(1)
            tok_B = tokens_BN[rows, child_B]
            u_B = torch.rand(B, generator=generator, device=dev)
            keep_B = live_B & (u_B * q_BV[rows, tok_B] < r_BV[rows, tok_B])
            res_BV = residual(r_BV, q_BV)
            res_BV = res_BV / res_BV.sum(-1, keepdim=True)
            r_BV = torch.where((live_B & ~keep_B)[:, None], res_BV, r_BV)
            cur_B = torch.where(keep_B, child_B, cur_B)
            r_BV = torch.where(keep_B[:, None], p_BNV[rows, cur_B], r_BV)
            moved_B = moved_B | keep_B
        alive_B = alive_B & moved_B
        path.append(cur_B)
    path_BA = torch.stack(path, dim=1)
    n_B = (path_BA[:, 1:] != path_BA[:, :-1]).sum(1)
    return n_B, path_BA, sample(r_BV, generator)
