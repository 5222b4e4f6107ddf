"""Drafting with the EAGLE-3 head: one head pass over committed features, chains, and EAGLE-2 dynamic trees.

Purpose: everything the draft side of a speculative step does, with the head's own preallocated `SlotCache`.
The head's passes (`HeadRunner` in eagle/runners.py: `extend`, `chain_step`, `tree_step`) are what these drive.
- `draft_chain`: depth d tokens, each step feeding the head its own previous output hidden state (RoPE +1 per step).
- `draft_tree`: EAGLE-2: the root's top-k children, then per depth the top-k of each frontier node, scored by
  cumulative draft log-probability; the next frontier is the best k of those k*k; finally the `budget` best of all
  candidates form the tree (a stable sort puts a parent before a child of equal score, so the kept set always
  contains every kept node's ancestors). `Tree.ancestors_BNN` is the verification pass's attention pattern.
- `draft_parallel`: parallel drafting ("parallel" heads, vLLM's `parallel_drafting`): the K drafts are the picks
  at the last committed entry and at the K-1 masked slots that followed it in the same head pass.
- `draft_tree_sampled`: the same frontier loop (`_grow`) with children drawn from the head instead of its top-k.
How to run: called by `eagle.drafters.HeadDrafter` (the head's drafter of the loop in `eagle.verify`).
Not here: verification, acceptance rules, the target's cache.

Shape legend: B batch, T new entries, L slots visible (span), H hidden, Vd draft vocabulary, k top-k, R slots after
the prefix a query may see, C drafted candidates, N tree nodes incl. root, n kept candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from eagle.draft import Eagle3Draft
from eagle.runners import HeadRunner, Prefix


@dataclass
class Tree:
    """Draft tree per row; node 0 is the root (the last emitted token), parents come before their children."""

    tokens_BN: torch.Tensor  # target ids
    parent_BN: torch.Tensor  # node index of the parent; the root is its own parent
    depth_BN: torch.Tensor
    ancestors_BNN: torch.Tensor  # [b, i, j]: node j is node i or one of its ancestors


Pick = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def draft_chain(
    head: HeadRunner,
    prefix: Prefix,
    root_hidden_BH: torch.Tensor,
    root_logits_BVd: torch.Tensor,
    depth: int,
    pick: Pick,
    min_prob: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Up to `depth` drafted target ids [B, d]; `pick(logits)` returns (draft index [B], the draft distribution or
    None). With `min_prob` > 0 drafting stops (after at least one token) as soon as the head's top probability for
    the next draft is below `min_prob` in every row, so d may be less than `depth`.

    Returns the tokens and, when `pick` samples, the draft distributions [B, d, Vd] they were drawn from.
    """
    B = root_hidden_BH.shape[0]
    hidden_B1H, logits_BVd = root_hidden_BH[:, None], root_logits_BVd
    pos_BD = prefix.lengths_B[:, None] + torch.arange(depth, device=root_hidden_BH.device)  # step j's at column j
    inputs_VdH = head.draft.draft_inputs()  # the picks go back in as draft-vocabulary rows, no id conversion
    picks, dists = [], []
    for j in range(depth):
        if j and min_prob > 0 and bool((torch.softmax(logits_BVd.float(), -1).amax(-1) < min_prob).all()):
            break
        idx_B, q_BVd = pick(logits_BVd)
        picks.append(idx_B)
        dists.append(q_BVd)
        if j + 1 == depth:
            break
        hidden_B1H, logits_B1Vd = head.chain_step(
            prefix, inputs_VdH[idx_B][:, None], hidden_B1H, pos_BD[:, j : j + 1], offset=j
        )
        logits_BVd = logits_B1Vd[:, 0]
    q_BdVd = None if dists[0] is None else torch.stack(dists, dim=1)
    return head.draft.to_target_ids(torch.stack(picks, dim=1).view(B, len(picks))), q_BdVd


def draft_parallel(
    logits_BKVd: torch.Tensor, draft: Eagle3Draft, pick: Pick, min_prob: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The K drafted target ids [B, d] of parallel drafting from one head pass's outputs `logits_BKVd` (slot 0: the
    last committed entry, slot k: masked slot k; `commit_head` with `masked`): slot k's pick is draft k+1. With
    `min_prob` > 0 the drafts end (after at least one) at the first slot whose top probability is below `min_prob`
    in every row, so d may be less than K. Returns the draft distributions [B, d, Vd] too when `pick` samples."""
    picks, dists = [], []
    for j in range(logits_BKVd.shape[1]):
        if j and min_prob > 0 and bool((torch.softmax(logits_BKVd[:, j].float(), -1).amax(-1) < min_prob).all()):
            break
        idx_B, q_BVd = pick(logits_BKVd[:, j])
        picks.append(idx_B)
        dists.append(q_BVd)
    q_BdVd = None if dists[0] is None else torch.stack(dists, dim=1)
    return draft.to_target_ids(torch.stack(picks, dim=1)), q_BdVd


@dataclass(frozen=True)
class _Candidates:
    """Every node a tree draft created, in creation order: candidate c is node c + 1 (node 0 is the root)."""

    idx_BC: torch.Tensor  # draft-vocabulary index of the token
    score_BC: torch.Tensor  # cumulative draft log-probability of the path root -> node
    parent_BC: torch.Tensor  # node index of the parent
    depth_BC: torch.Tensor


# (frontier node ids [B, k], head logits at the frontier [B, k, Vd]) -> (children's draft indices [B, k, k],
# their draft log-probabilities [B, k, k])
Expand = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _grow(
    head: HeadRunner,
    prefix: Prefix,
    root_hidden_BH: torch.Tensor,
    idx_Bk: torch.Tensor,
    score_Bk: torch.Tensor,
    depth: int,
    expand: Expand,
) -> _Candidates:
    """The frontier loop shared by both trees: from the root's k children (`idx_Bk`, log-probabilities
    `score_Bk`), per depth run the frontier through the head, give each frontier node k children (`expand`), and
    make the best k of those k*k by cumulative score the next frontier."""
    B, k = idx_Bk.shape
    H, dev, draft = root_hidden_BH.shape[1], idx_Bk.device, head.draft
    cand_idx, cand_score = [idx_Bk], [score_Bk]
    cand_parent, cand_depth = [torch.zeros_like(idx_Bk)], [torch.ones_like(idx_Bk)]
    node_Bk = torch.arange(1, k + 1, device=dev).expand(B, k)
    hid_BkH = root_hidden_BH[:, None].expand(B, k, H)
    seen_BkR = torch.eye(k, dtype=torch.bool, device=dev)[None].expand(B, k, k)
    tok_Bk, n_nodes = draft.to_target_ids(idx_Bk), 1 + k
    for j in range(1, depth):
        pos_Bk = (prefix.lengths_B - 1 + j)[:, None].expand(B, k)
        out_BkH, logits_BkVd = head.tree_step(prefix, tok_Bk, hid_BkH, pos_Bk, seen_BkR, offset=(j - 1) * k)
        kids_Bkk, logq_Bkk = expand(node_Bk, logits_BkVd)
        cum_BC = (score_Bk[..., None] + logq_Bkk).reshape(B, k * k)
        cand_idx.append(kids_Bkk.reshape(B, k * k))
        cand_score.append(cum_BC)
        cand_parent.append(node_Bk[..., None].expand(B, k, k).reshape(B, k * k))
        cand_depth.append(torch.full_like(cum_BC, j + 1, dtype=torch.long))
        if j + 1 < depth:
            score_Bk, sel_Bk = cum_BC.topk(k, dim=-1)
            tok_Bk = draft.to_target_ids(cand_idx[-1].gather(1, sel_Bk))
            node_Bk = n_nodes + sel_Bk
            hid_BkH, seen_BkR = _next_frontier(out_BkH, seen_BkR, sel_Bk, j)
        n_nodes += k * k
    return _Candidates(
        torch.cat(cand_idx, 1), torch.cat(cand_score, 1), torch.cat(cand_parent, 1), torch.cat(cand_depth, 1)
    )


def draft_tree(
    head: HeadRunner,
    prefix: Prefix,
    root_B: torch.Tensor,
    root_hidden_BH: torch.Tensor,
    root_logits_BVd: torch.Tensor,
    shape: tuple[int, int, int],
) -> Tree:
    """EAGLE-2 dynamic tree of `budget` drafted nodes; `shape` = (depth, topk, budget)."""
    depth, k, budget = shape

    def top_k(_node_Bk: torch.Tensor, logits_BkVd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp_Bkk, idx_Bkk = torch.log_softmax(logits_BkVd.float(), -1).topk(k, dim=-1)
        return idx_Bkk, logp_Bkk

    score_Bk, idx_Bk = torch.log_softmax(root_logits_BVd.float(), -1).topk(k, dim=-1)
    c = _grow(head, prefix, root_hidden_BH, idx_Bk, score_Bk, depth, top_k)
    return _rerank(root_B, head.draft.to_target_ids(c.idx_BC), c.score_BC, c.parent_BC, c.depth_BC, budget, depth)[0]


def draft_tree_sampled(
    head: HeadRunner,
    prefix: Prefix,
    root_hidden_BH: torch.Tensor,
    root_q_BVd: torch.Tensor,
    root_B: torch.Tensor,
    shape: tuple[int, int, int],
    probs: Callable[[torch.Tensor], torch.Tensor],
    generator: torch.Generator | None,
) -> tuple[Tree, torch.Tensor]:
    """A tree for sampling (T > 0): every expanded node gets `topk` children drawn i.i.d. from its own draft
    distribution, so `sampling.walk_tree_sampled` can verify them with recursive rejection (exact).

    Which nodes get children may depend on anything drawn before them (here: the best `topk` cumulative draft
    log-probabilities per depth, as in `draft_tree`), but never which of a node's children are kept: a node's
    children are kept or dropped together (`budget` keeps whole groups, best parent score first), in the order
    they were drawn. `probs(logits)` turns head logits into draft distributions (temperature, top-p). Returns the
    tree and, per node, the draft distribution its children were drawn from ([B, N, Vd], zero for leaves).
    """
    depth, k, budget = shape
    B, Vd = root_q_BVd.shape
    frontier_q: list[tuple[torch.Tensor, torch.Tensor]] = [
        (torch.zeros(B, 1, dtype=torch.long, device=root_B.device), root_q_BVd[:, None])
    ]

    def draw_k(node_Bk: torch.Tensor, logits_BkVd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_BkVd = probs(logits_BkVd)
        kids_Bkk = torch.multinomial(q_BkVd.reshape(B * k, -1), k, replacement=True, generator=generator).view(B, k, k)
        frontier_q.append((node_Bk, q_BkVd))
        return kids_Bkk, q_BkVd.gather(2, kids_Bkk).clamp_min(1e-30).log()

    idx_Bk = torch.multinomial(root_q_BVd, k, replacement=True, generator=generator)
    score_Bk = root_q_BVd.gather(1, idx_Bk).clamp_min(1e-30).log()
    c = _grow(head, prefix, root_hidden_BH, idx_Bk, score_Bk, depth, draw_k)
    # a sibling group ranks by its parent's score (the root's children: 0), so groups are kept or dropped whole
    group_BC = torch.cat([torch.zeros_like(c.score_BC[:, :1]), c.score_BC], 1).gather(1, c.parent_BC)
    groups = max(1, budget // k)  # whole sibling groups that fit the budget
    tree, keep_Bn = _rerank(
        root_B, head.draft.to_target_ids(c.idx_BC), group_BC, c.parent_BC, c.depth_BC, groups * k, depth
    )
    # the draft distribution each kept node's children were drawn from, in the tree's numbering
    q_BCVd = root_q_BVd.new_zeros(B, 1 + c.idx_BC.shape[1], Vd)  # node index (0 = root) -> distribution
    for node_BF, q_BFVd in frontier_q:
        q_BCVd.scatter_(1, node_BF[..., None].expand(-1, -1, Vd), q_BFVd)
    kept_BN = torch.cat([torch.zeros_like(keep_Bn[:, :1]), keep_Bn + 1], 1)
    return tree, q_BCVd.gather(1, kept_BN[..., None].expand(-1, -1, Vd))


def _next_frontier(out_BkH: torch.Tensor, seen_BkR: torch.Tensor, sel_Bk: torch.Tensor, j: int):
    """The next depth's frontier, candidates `sel_Bk` of the k*k children of the current one: their input hidden
    states (their parents' head outputs) and what their head entries may see (their parents' view plus themselves,
    over the j*k entries written so far and the k new ones)."""
    B, k, H = out_BkH.shape
    parent_Bk = sel_Bk // k
    hid_BkH = out_BkH.gather(1, parent_Bk[..., None].expand(B, k, H))
    grown = torch.zeros(B, k, k, dtype=torch.bool, device=out_BkH.device)
    grown[:, torch.arange(k), torch.arange(k)] = True
    return hid_BkH, torch.cat([seen_BkR.gather(1, parent_Bk[..., None].expand(B, k, j * k)), grown], -1)


def _rerank(
    root_B: torch.Tensor,
    tok_BC: torch.Tensor,
    score_BC: torch.Tensor,
    parent_BC: torch.Tensor,
    depth_BC: torch.Tensor,
    budget: int,
    depth: int,
) -> tuple[Tree, torch.Tensor]:
    """Keep the `budget` best candidates in creation order; parent indices renumbered to the kept nodes.
    Also returns the kept candidates' indices [B, budget] (candidate c is node c + 1 before renumbering)."""
    B, C = tok_BC.shape
    order_BC = score_BC.sort(dim=1, descending=True, stable=True).indices
    keep_Bn = order_BC[:, :budget].sort(dim=1).values
    new_index = torch.full((B, C + 1), -1, dtype=torch.long, device=tok_BC.device)
    new_index[:, 0] = 0
    new_index.scatter_(1, keep_Bn + 1, torch.arange(1, budget + 1, device=tok_BC.device).expand(B, budget))
    parent_Bn = new_index.gather(1, parent_BC.gather(1, keep_Bn))
    zero = torch.zeros_like(root_B)[:, None]
    tokens_BN = torch.cat([root_B[:, None], tok_BC.gather(1, keep_Bn)], 1)
    parent_BN = torch.cat([zero, parent_Bn], 1)
    depth_BN = torch.cat([zero, depth_BC.gather(1, keep_Bn)], 1)
    return Tree(tokens_BN, parent_BN, depth_BN, ancestors(parent_BN, depth)), keep_Bn


def ancestors(parent_BN: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, N, N] boolean: j is i or an ancestor of i (the root is its own parent)."""
    B, N = parent_BN.shape
    anc_BNN = torch.eye(N, dtype=torch.bool, device=parent_BN.device)[None].repeat(B, 1, 1)
    cur_BN = parent_BN
    for _ in range(depth):
        anc_BNN.scatter_(2, cur_BN[..., None], True)
        cur_BN = parent_BN.gather(1, cur_BN)
    return anc_BNN
