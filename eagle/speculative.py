"""Lossless speculative generation with a HF target and an EAGLE-3 head, and the plain-decoding baseline.

Purpose: `generate_speculative` drafts with the head (a chain, or an EAGLE-2 dynamic tree), verifies the draft in
one target pass, keeps what the target agrees with and rolls both KV caches back; `generate_plain` decodes one
token per target pass with the same cache, mask and sampling helpers, so that timings compare like with like.
Loop: the target's prefill captures the fused features f_i (inputs of `aux_layer_ids`); the head consumes
(token x_{i+1}, f_i) at RoPE position i as its committed cache entries; drafting feeds the head its own output
hidden state with each drafted token, position +1 per depth. A parallel head (variants "parallel" and
"eagle3.1-parallel", eagle/config.py) drafts its chain in one head pass instead, as vLLM's `parallel_drafting`
does: the pass that commits the verified entries carries depth-1 masked slots after each row's last committed
entry (`commit_head` with `masked`), and the K drafts are the picks at that entry and at the masked slots
(`eagle.tree.draft_parallel`). After verification the accepted path's target features replace the head's
speculative entries, and the target keeps only the accepted path's entries.
Rows of a batch advance by their own accepted lengths (per-row cache lengths, positions and masks); a row stops at
EOS or `max_new_tokens` and is then frozen while the others finish.
How to run: `out = generate_speculative(target, draft, ids, mask, SpecConfig(method="tree"))`; `out.sequences`,
`out.stats.tau` (`eagle.stats.SpecStats`). Greedy when `temperature == 0`.
Speed (both functions alike): inference mode; the target runner's session (eagle/runners.py: CPU kernels, feature
hooks attached once), `eagle.fastpath.LeanDecoder` for Llama-family targets, preallocated caches written by slice for one row,
prebuilt causal masks; the head's lean inference path (`eagle.draft`). At batch 1 on a shared 2-core CPU use 1 torch
thread.
Not here: sliding-window targets past their window, flash-attention backends (4-D masks need "sdpa"/"eager"),
dropping finished rows from the batch, CUDA graphs / torch.compile.

Shape legend: B batch, T new positions, V target vocabulary, Vd draft vocabulary, N verified nodes (root first),
A kept path length (accepted drafts + 1), H hidden, S verification steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eagle import sampling
from eagle.draft import Eagle3Draft
from eagle.run_config import SpecConfig
from eagle.stats import SpecStats
from eagle.runners import HeadRunner, Prefix, TargetRunner
from eagle.tree import Tree, draft_chain, draft_parallel, draft_tree, draft_tree_sampled


@dataclass
class GenOutput:
    """`sequences` [B, max_new_tokens]: new tokens only, `pad_token_id` after each row's `lengths` (EOS included)."""

    sequences: torch.Tensor
    lengths: torch.Tensor
    stats: SpecStats | None = None


class _Emitted:
    """Output buffer; truncates each row at its first EOS and at max_new_tokens, then marks it done."""

    def __init__(self, B: int, cfg: SpecConfig, device: torch.device):
        self.tokens_BN = torch.full((B, cfg.max_new_tokens), cfg.pad_token_id, dtype=torch.long, device=device)
        self.count_B = torch.zeros(B, dtype=torch.long, device=device)
        self.done_B = torch.zeros(B, dtype=torch.bool, device=device)
        eos = cfg.eos_token_id
        self.eos = None if eos is None else torch.tensor([eos] if isinstance(eos, int) else list(eos), device=device)
        self.max_new = cfg.max_new_tokens

    def emit(self, tokens_BA: torch.Tensor, n_B: torch.Tensor) -> torch.Tensor:
        """Append each row's first n tokens (as far as the row is not done); returns the tokens kept per row [B]."""
        B, A = tokens_BA.shape
        ar = torch.arange(A, device=tokens_BA.device)[None]
        ok_BA = (ar < n_B[:, None]) & ~self.done_B[:, None] & (self.count_B[:, None] + ar < self.max_new)
        if self.eos is not None:
            eos_BA = torch.isin(tokens_BA, self.eos) & ok_BA
            first_B = torch.where(eos_BA.any(1), eos_BA.long().argmax(1), A)
            ok_BA &= ar <= first_B[:, None]
            self.done_B |= (eos_BA & ok_BA).any(1)
        rows_BA = torch.arange(B, device=tokens_BA.device)[:, None].expand(B, A)
        self.tokens_BN[rows_BA[ok_BA], (self.count_B[:, None] + ar)[ok_BA]] = tokens_BA[ok_BA]
        kept_B = ok_BA.sum(1)
        self.count_B += kept_B
        self.done_B |= self.count_B >= self.max_new
        return kept_B


def pack_left(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's real tokens (mask 1, any padding side) to the front; returns (ids [B, T], lengths [B])."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    real_BT = attention_mask.bool()
    n_B = real_BT.sum(1)
    if bool((n_B == 0).any()):
        raise ValueError("every row needs at least one prompt token")
    order_BT = torch.argsort((~real_BT).to(torch.int8), dim=1, stable=True)
    return input_ids.gather(1, order_BT), n_B


def _pick(logits_BV: torch.Tensor, cfg: SpecConfig, generator: torch.Generator | None) -> torch.Tensor:
    if cfg.greedy:
        return logits_BV.argmax(-1)
    return sampling.sample(sampling.probs(logits_BV, cfg.temperature, cfg.top_p), generator)


def generate_plain(target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   cfg: SpecConfig, generator: torch.Generator | None = None) -> GenOutput:
    """One token per target pass (greedy or temperature/top-p sampling), with the speculative path's helpers."""
    with torch.inference_mode():
        ids_BT, n_B = pack_left(input_ids, attention_mask)
        runner = TargetRunner(target, ids_BT.shape[1] + cfg.max_new_tokens + 1, path=cfg.path, role="decode")
        with runner.session():
            out = _plain_loop(runner, ids_BT, n_B, cfg, generator)
    return _outside_inference_mode(out)


def _outside_inference_mode(out: GenOutput) -> GenOutput:
    """Copies that autograd code may use (inference-mode tensors cannot be saved for backward)."""
    st = out.stats

    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    stats = None if st is None else SpecStats(st.accept_lengths.clone(), st.depth, copy(st.drafted),
                                              copy(st.emitted_lengths))
    return GenOutput(out.sequences.clone(), out.lengths.clone(), stats)


def _plain_loop(runner: TargetRunner, ids_BT: torch.Tensor, n_B: torch.Tensor, cfg: SpecConfig,
                generator: torch.Generator | None) -> GenOutput:
    out = _Emitted(ids_BT.shape[0], cfg, ids_BT.device)
    logits_BV, _ = runner.prefill(ids_BT, n_B)
    one_B = torch.ones_like(n_B)
    lengths_B = n_B
    while True:
        tok_B = _pick(logits_BV, cfg, generator)
        active_B = ~out.done_B
        out.emit(tok_B[:, None], one_B)
        if bool(out.done_B.all()):
            return GenOutput(out.tokens_BN, out.count_B)
        prefix = Prefix.of(lengths_B)
        hidden_B1H, _ = runner(prefix, tok_B[:, None], lengths_B[:, None], None)
        logits_BV = runner.logits(hidden_B1H[:, 0])
        lengths_B = lengths_B + active_B.long()


def commit_head(head: HeadRunner, draft: Eagle3Draft, prefix: Prefix, tokens_BA: torch.Tensor,
                aux_BA3H: torch.Tensor, n_B: torch.Tensor,
                masked: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Commit (token x_{i+1}, target feature f_i) to the head's cache at positions lengths+i; returns the head's
    (output hidden [B, H], logits [B, Vd]) at each row's n-th new entry (where its next draft starts).

    With `masked` = M (parallel drafting; M >= 0) the same pass also runs M masked slots (`Eagle3Draft.masked_slots`)
    right after each row's n-th entry, at the next positions, causal like the rest: vLLM's parallel pass. Returns
    the outputs at the n-th entry and at the masked slots ([B, 1+M, H], [B, 1+M, Vd]). Entries after a row's
    n-th are rewritten by the next commit, as drafted ones are."""
    B, A = tokens_BA.shape
    hidden_BAH = draft.fuse(aux_BA3H)
    if masked is not None:
        T = A + masked
        _, mask_hidden_BTH = draft.masked_slots(B, T)  # their token goes in as `mask_token_id`
        slot_BT = torch.arange(T, device=tokens_BA.device)[None] >= n_B[:, None]  # masked from the (n+1)-th on
        ids_BT = torch.cat([tokens_BA, tokens_BA.new_zeros(B, masked)], 1)
        ids_BT = ids_BT.masked_fill(slot_BT, draft.cfg.mask_token_id)
        hidden_BAH = torch.where(slot_BT[..., None], mask_hidden_BTH,
                                 torch.cat([hidden_BAH, mask_hidden_BTH[:, :masked]], 1))
        tokens_BA, A = ids_BT, T
    pos_BA = prefix.lengths_B[:, None] + torch.arange(A, device=tokens_BA.device)
    select = (n_B - 1).clamp(0, A - 1)
    if masked is not None:
        select = select[:, None] + torch.arange(1 + masked, device=n_B.device)
    hidden_BKH, logits_BKVd = head.extend(prefix, tokens_BA, hidden_BAH, pos_BA, select_B=select)
    return (hidden_BKH, logits_BKVd) if masked is not None else (hidden_BKH[:, 0], logits_BKVd[:, 0])


@dataclass(frozen=True)
class Verified:
    """One verification pass per row: accepted drafts `n_B`; `path_BA`, node indices of the verified tokens from
    the root, whose first n+1 are kept; the next token `next_B` (correction or bonus); the verified tokens
    `tokens_BN` and the target's fused features at them `aux_BN3H`."""

    n_B: torch.Tensor
    path_BA: torch.Tensor
    next_B: torch.Tensor
    tokens_BN: torch.Tensor
    aux_BN3H: torch.Tensor


class Speculator:
    """One speculative generation's state (target and head runners, config, RNG) and its two moves:
    `head_extend` (commit verified features to the head) and `step` (draft, verify, accept), which runs the
    `step_<method>_<greedy|sampled>` of the config. Public for profiling."""

    def __init__(self, target: nn.Module, draft: Eagle3Draft, cfg: SpecConfig, prompt_len: int,
                 generator: torch.Generator | None):
        if cfg.method == "tree" and cfg.topk > draft.cfg.draft_vocab_size:
            raise ValueError("topk exceeds the draft vocabulary")
        if draft.cfg.parallel and cfg.method != "chain":
            raise ValueError(f"a parallel head drafts chains (vLLM's parallel drafting), not a {cfg.method}: set "
                             "method chain")
        capacity = prompt_len + cfg.max_new_tokens + max(cfg.verify_width, cfg.depth * cfg.topk) + 2
        self.target = TargetRunner(target, capacity, draft.cfg.aux_layer_ids, cfg.path)
        self.draft, self.cfg, self.generator = draft, cfg, generator
        self.masked = cfg.depth - 1 if draft.cfg.parallel else None  # masked slots per commit (parallel drafting)
        self.head = HeadRunner(draft, capacity + (cfg.depth if draft.cfg.parallel else 0))
        self.vocab = self.target.lm_head.weight.shape[0]

    def head_extend(self, prefix: Prefix, tokens_BA: torch.Tensor, aux_BA3H: torch.Tensor, n_B: torch.Tensor):
        """Commit (token x_{i+1}, feature f_i) at positions lengths+i; returns the head's output at the n-th entry
        (and, for a parallel head, at the masked slots after it: `commit_head`)."""
        return commit_head(self.head, self.draft, prefix, tokens_BA, aux_BA3H, n_B, self.masked)

    def _draft_probs(self, logits_BTVd: torch.Tensor) -> torch.Tensor:
        return sampling.probs(logits_BTVd, self.cfg.temperature, self.cfg.top_p)

    def draft_pick(self, logits_BVd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.cfg.greedy:
            return logits_BVd.argmax(-1), None
        q_BVd = self._draft_probs(logits_BVd)
        return sampling.sample(q_BVd, self.generator), q_BVd

    def step(self, prefix: Prefix, root_B: torch.Tensor, hidden_BH: torch.Tensor, logits_BVd: torch.Tensor):
        """Draft, verify, and keep the target cache's accepted path at slots lengths..lengths+n.

        Returns (accepted count n [B], kept tokens after the root [B, K+1] with the next token at index n,
        the target's fused features along the kept path [B, K+1, 3H]); K = the drafted depth (`depth`, or less
        when a chain stopped early).
        """
        paths = {("chain", True): self.step_chain_greedy, ("chain", False): self.step_chain_sampled,
                 ("tree", True): self.step_tree_greedy, ("tree", False): self.step_tree_sampled}
        step = paths[self.cfg.method, self.cfg.greedy] if self.masked is None else self.step_parallel
        v = step(prefix, root_B, hidden_BH, logits_BVd)
        kept_BA = torch.cat([v.tokens_BN.gather(1, v.path_BA[:, 1:]), torch.zeros_like(v.n_B)[:, None]], 1)
        kept_BA.scatter_(1, v.n_B[:, None], v.next_B[:, None])
        aux_BA3H = v.aux_BN3H.gather(1, v.path_BA[..., None].expand(-1, -1, v.aux_BN3H.shape[-1]))
        return v.n_B, kept_BA, aux_BA3H

    def step_chain_greedy(self, prefix: Prefix, root_B: torch.Tensor, hidden_BH: torch.Tensor,
                          logits_BVd: torch.Tensor) -> Verified:
        """Chain of argmax drafts, kept while they equal the target's argmax."""
        drafts_BK, _ = draft_chain(self.head, prefix, hidden_BH, logits_BVd, self.cfg.depth, self.draft_pick,
                                   self.cfg.min_draft_prob)
        tokens_BN, path_BA, logits_BNV, aux_BN3H = self._verify_chain(prefix, root_B, drafts_BK)
        n_B, next_B = sampling.accept_chain_greedy(logits_BNV, drafts_BK)
        return Verified(n_B, path_BA, next_B, tokens_BN, aux_BN3H)

    def step_chain_sampled(self, prefix: Prefix, root_B: torch.Tensor, hidden_BH: torch.Tensor,
                           logits_BVd: torch.Tensor) -> Verified:
        """Chain of drafts sampled from the head, verified by the standard rejection rule."""
        drafts_BK, q_BKVd = draft_chain(self.head, prefix, hidden_BH, logits_BVd, self.cfg.depth, self.draft_pick,
                                        self.cfg.min_draft_prob)
        tokens_BN, path_BA, logits_BNV, aux_BN3H = self._verify_chain(prefix, root_B, drafts_BK)
        n_B, next_B = self.accept_chain(logits_BNV, drafts_BK, q_BKVd)
        return Verified(n_B, path_BA, next_B, tokens_BN, aux_BN3H)

    def step_parallel(self, prefix: Prefix, root_B: torch.Tensor, hidden_BKH: torch.Tensor,
                      logits_BKVd: torch.Tensor) -> Verified:
        """Parallel drafting: the drafts are the picks at the head pass's K slots (`draft_parallel`), verified as a
        chain (greedy: kept while they equal the target's argmax; sampled: the standard rule)."""
        drafts_BK, q_BKVd = draft_parallel(logits_BKVd, self.draft, self.draft_pick, self.cfg.min_draft_prob)
        tokens_BN, path_BA, logits_BNV, aux_BN3H = self._verify_chain(prefix, root_B, drafts_BK)
        n_B, next_B = self.accept_chain(logits_BNV, drafts_BK, q_BKVd)
        return Verified(n_B, path_BA, next_B, tokens_BN, aux_BN3H)

    def step_tree_greedy(self, prefix: Prefix, root_B: torch.Tensor, hidden_BH: torch.Tensor,
                         logits_BVd: torch.Tensor) -> Verified:
        """EAGLE-2 top-k tree, walked along the target's argmax."""
        cfg = self.cfg
        tree = draft_tree(self.head, prefix, root_B, hidden_BH, logits_BVd, (cfg.depth, cfg.topk, cfg.budget))
        logits_BNV, aux_BN3H = self._verify_tree(prefix, tree)
        n_B, path_BA, next_B = sampling.walk_tree(tree.tokens_BN, tree.parent_BN, logits_BNV.argmax(-1), cfg.depth)
        return self._keep_path(prefix, Verified(n_B, path_BA, next_B, tree.tokens_BN, aux_BN3H))

    def step_tree_sampled(self, prefix: Prefix, root_B: torch.Tensor, hidden_BH: torch.Tensor,
                          logits_BVd: torch.Tensor) -> Verified:
        """Tree of sampled sibling groups, verified by recursive rejection."""
        cfg = self.cfg
        tree, q_BNVd = draft_tree_sampled(self.head, prefix, hidden_BH, self._draft_probs(logits_BVd), root_B,
                                          (cfg.depth, cfg.topk, cfg.budget), self._draft_probs, self.generator)
        logits_BNV, aux_BN3H = self._verify_tree(prefix, tree)
        p_BNV = sampling.probs(logits_BNV, cfg.temperature, cfg.top_p)
        n_B, path_BA, next_B = sampling.walk_tree_sampled(tree.tokens_BN, tree.parent_BN, p_BNV, q_BNVd,
                                                          self.draft.draft_ids(), cfg.depth, self.generator)
        return self._keep_path(prefix, Verified(n_B, path_BA, next_B, tree.tokens_BN, aux_BN3H))

    def _verify_chain(self, prefix: Prefix, root_B: torch.Tensor, drafts_BK: torch.Tensor):
        """One target pass over root + drafts, already in place in its cache: (tokens [B, N], their path (0..N-1),
        target logits [B, N, V], fused features [B, N, 3H])."""
        tokens_BN = torch.cat([root_B[:, None], drafts_BK], 1)
        ar_N = torch.arange(tokens_BN.shape[1], device=root_B.device)
        hidden_BNH, aux_BN3H = self.target(prefix, tokens_BN, prefix.lengths_B[:, None] + ar_N, None)
        return tokens_BN, ar_N.expand(len(root_B), -1), self.target.logits(hidden_BNH), aux_BN3H

    def _verify_tree(self, prefix: Prefix, tree: Tree):
        """One target pass over the tree, each node seeing its ancestors: (target logits [B, N, V], features)."""
        pos_BN = prefix.lengths_B[:, None] + tree.depth_BN
        hidden_BNH, aux_BN3H = self.target(prefix, tree.tokens_BN, pos_BN, tree.ancestors_BNN)
        return self.target.logits(hidden_BNH), aux_BN3H

    def _keep_path(self, prefix: Prefix, v: Verified) -> Verified:
        """Move the target's entries of the kept path to the slots right after the prefix."""
        slots_B1 = prefix.lengths_B[:, None]
        self.target.cache.move(slots_B1 + v.path_BA, slots_B1 + torch.arange(v.path_BA.shape[1], device=v.n_B.device))
        return v

    def accept_chain(self, logits_BNV: torch.Tensor, drafts_BK: torch.Tensor, q_BKVd: torch.Tensor | None):
        """(accepted count [B], next token [B]): greedy without draft distributions, else the standard rule."""
        if q_BKVd is None:
            return sampling.accept_chain_greedy(logits_BNV, drafts_BK)
        p_BNV = sampling.probs(logits_BNV, self.cfg.temperature, self.cfg.top_p)
        B, K, Vd = q_BKVd.shape
        q_BKV = q_BKVd.new_zeros(B, K, self.vocab)
        q_BKV.scatter_(2, self.draft.draft_ids().expand(B, K, Vd), q_BKVd)
        return sampling.accept_chain(p_BNV, q_BKV, drafts_BK, self.generator)


def generate_speculative(target: nn.Module, draft: Eagle3Draft, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor | None, cfg: SpecConfig,
                         generator: torch.Generator | None = None) -> GenOutput:
    """Speculative generation whose output is distributed exactly as `generate_plain`'s (identical when greedy)."""
    with torch.inference_mode():
        ids_BT, n_B = pack_left(input_ids, attention_mask)
        spec = Speculator(target, draft, cfg, ids_BT.shape[1], generator)
        with spec.target.session():
            out = _speculative_loop(spec, ids_BT, n_B)
    return _outside_inference_mode(out)


def _speculative_loop(spec: Speculator, ids_BT: torch.Tensor, n_B: torch.Tensor) -> GenOutput:
    cfg, generator, B = spec.cfg, spec.generator, ids_BT.shape[0]
    out = _Emitted(B, cfg, ids_BT.device)
    logits_BV, aux_BT3H = spec.target.prefill(ids_BT, n_B)
    root_B = _pick(logits_BV, cfg, generator)
    out.emit(root_B[:, None], torch.ones_like(n_B))
    shifted_BT = torch.cat([ids_BT[:, 1:], ids_BT[:, :1]], 1).scatter(1, (n_B - 1)[:, None], root_B[:, None])
    hidden_BH, dlogits_BVd = spec.head_extend(Prefix(torch.zeros_like(n_B), 0), shifted_BT, aux_BT3H, n_B)
    lengths_B, accepted, emitted, drafted = n_B, [], [], []
    while not bool(out.done_B.all()):
        prefix = Prefix.of(lengths_B)
        n_B, kept_BA, aux_BA3H = spec.step(prefix, root_B, hidden_BH, dlogits_BVd)
        active_B = ~out.done_B
        accepted.append(torch.where(active_B, n_B, -1))
        drafted.append(kept_BA.shape[1] - 1)
        emitted.append(torch.where(active_B, out.emit(kept_BA, n_B + 1), -1))
        A = int(n_B.max()) + 1
        hidden_BH, dlogits_BVd = spec.head_extend(prefix, kept_BA[:, :A], aux_BA3H[:, :A], n_B + 1)
        root_B = kept_BA.gather(1, n_B[:, None])[:, 0]
        lengths_B = lengths_B + (n_B + 1) * active_B
    empty = torch.zeros(0, B, dtype=torch.long, device=ids_BT.device)
    accepted_SB, emitted_SB = (torch.stack(x) if x else empty for x in (accepted, emitted))
    stats = SpecStats(accepted_SB, cfg.depth, torch.tensor(drafted, dtype=torch.long), emitted_SB)
    return GenOutput(out.tokens_BN, out.count_B, stats)
