"""The one speculative loop: any drafter proposes, the target verifies in one pass, the loop keeps what the rule keeps.

Purpose: `generate_drafted(target, drafter, ids, mask, cfg)` runs lossless speculative generation with any
`Drafter` (eagle/drafters.py: the EAGLE-3 head, prompt lookup, a draft LM). Each step the drafter proposes (a chain
of K <= depth drafts, or for the head an EAGLE-2 tree), `Verifier` runs the target once over root + proposal
(`TargetRunner`: lean decoder, preallocated cache, prebuilt masks), keeps the accepted drafts (greedy: while they
equal the target's argmax; sampling: the standard rule, recursive rejection for trees: `eagle.sampling`) and the
next token, and moves a tree's kept path to the slots after the prefix; the loop emits the kept tokens (`Emitted`:
EOS, `max_new_tokens`), counts them (`SpecStats`: accepted drafts per step and row, drafted length, emitted) and
hands the drafter what was kept. The output is distributed exactly as `eagle.speculative.generate_plain`'s
(identical when greedy), whatever the drafter.
Interface (`Drafter`): `check(cfg)` refuses what it cannot draft before any work; `reach(cfg)` the cache slots one
step may write past the root; `session(setup)` once per generation (`DraftSetup`: capacity, vocabulary, config,
RNG); `begin(history, aux)` after the target's prefill (aux: the fused features of its `layer_ids`, None without);
`propose(prefix, root, history)` returns a `Proposal`; `accepted(prefix, kept, aux, n)` after verification.
`History` holds each row's tokens so far (prompt and every kept token; its last is the root, the token the next
pass verifies first). Rows advance by their own accepted lengths; a finished row is frozen while the others run.
How to run: `generate_drafted(target, PromptLookupDrafter(), ids, mask, SpecConfig(method="chain", depth=5))`;
`eagle.speculative.generate_speculative(target, draft, ...)` is this loop with the head's drafter.
Not here: the drafters (eagle/drafters.py), drafting trees (eagle/tree.py), the acceptance rules themselves
(eagle/sampling.py), plain decoding (eagle/speculative.py).

Shape legend: B batch, T prompt positions, C history capacity, K drafted tokens, N verified nodes (root first),
A kept tokens (accepted drafts + the next token), V target vocabulary, H hidden, S verification steps.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import ContextManager

import torch
from torch import nn

from eagle import sampling
from eagle.run_config import SpecConfig
from eagle.runners import Prefix, TargetRunner
from eagle.stats import SpecStats
from eagle.tree import Tree


@dataclass
class GenOutput:
    """`sequences` [B, max_new_tokens]: new tokens only, `pad_token_id` after each row's `lengths` (EOS included)."""

    sequences: torch.Tensor
    lengths: torch.Tensor
    stats: SpecStats | None = None


class Emitted:
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


def outside_inference_mode(out: GenOutput) -> GenOutput:
    """Copies that autograd code may use (inference-mode tensors cannot be saved for backward)."""
    st = out.stats

    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    stats = (
        None
        if st is None
        else SpecStats(st.accept_lengths.clone(), st.depth, copy(st.drafted), copy(st.emitted_lengths))
    )
    return GenOutput(out.sequences.clone(), out.lengths.clone(), stats)


@dataclass(frozen=True)
class DraftSetup:
    """What a drafter learns once per generation: cache capacity, the target's vocabulary size, the config and RNG."""

    capacity: int
    vocab: int
    cfg: SpecConfig
    generator: torch.Generator | None

    def pick(self, logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A pick at the config's temperature and top-p with this generation's RNG (`sampling.pick`)."""
        return sampling.pick(logits_BV, self.cfg.temperature, self.cfg.top_p, self.generator)


class History:
    """Each row's tokens so far in `tokens_BC[b, :lengths_B[b]]`: the prompt, then every kept token; the last one
    is the root (emitted, not yet verified by a target pass)."""

    def __init__(self, ids_BT: torch.Tensor, n_B: torch.Tensor, capacity: int):
        B, T = ids_BT.shape
        self.tokens_BC = torch.zeros(B, capacity, dtype=torch.long, device=ids_BT.device)
        self.tokens_BC[:, :T] = ids_BT
        self.lengths_B = n_B.clone()

    def append(self, tokens_BA: torch.Tensor, n_B: torch.Tensor) -> None:
        """Append each row's first n_B[b] tokens."""
        B, A = tokens_BA.shape
        ar_A = torch.arange(A, device=tokens_BA.device)
        ok_BA = ar_A[None] < n_B[:, None]
        rows_BA = torch.arange(B, device=tokens_BA.device)[:, None].expand(B, A)
        self.tokens_BC[rows_BA[ok_BA], (self.lengths_B[:, None] + ar_A)[ok_BA]] = tokens_BA[ok_BA]
        self.lengths_B = self.lengths_B + n_B

    def row(self, b: int) -> torch.Tensor:
        return self.tokens_BC[b, : int(self.lengths_B[b])]


@dataclass(frozen=True)
class Proposal:
    """One step's drafts (target ids). A chain: `drafts_BK`, verified in order (rows of a batch pad theirs to one K).
    A tree (`tree` set; the head's EAGLE-2 drafts): its nodes, root first, each verified seeing its ancestors.
    When sampling, `q`: the draft distributions the drafts were drawn from (a chain's [B, K, V'], a tree's per node:
    the one its children were drawn from [B, N, V']), over the target vocabulary (V' = V) or over a draft
    vocabulary whose target ids are `q_ids` [V']; None when greedy."""

    drafts_BK: torch.Tensor | None = None
    tree: Tree | None = None
    q: torch.Tensor | None = None
    q_ids: torch.Tensor | None = None


class Drafter:
    """A drafter for `generate_drafted`; see the module docstring for the protocol. `layer_ids`: the target layers
    whose inputs the drafter reads (the head's fused features); empty for drafters that read tokens only."""

    layer_ids: tuple[int, ...] = ()

    def check(self, cfg: SpecConfig) -> None:
        if cfg.method != "chain":
            raise ValueError(
                f"{type(self).__name__} drafts chains; method {cfg.method!r} needs the EAGLE-3 head "
                "(HeadDrafter, generate_speculative)"
            )

    def reach(self, cfg: SpecConfig) -> int:
        """Cache slots past the root that one step may write (the target's verification pass, the drafter's own)."""
        return cfg.depth

    def session(self, setup: DraftSetup) -> ContextManager[None]:
        self.setup = setup
        return nullcontext()

    def begin(self, history: History, aux_BT3H: torch.Tensor | None) -> None:
        pass

    def propose(self, prefix: Prefix, root_B: torch.Tensor, history: History) -> Proposal:
        """Drafts to follow each row's root (`root_B`; for a finished row the loop's last pick) after `prefix`."""
        raise NotImplementedError

    def accepted(self, prefix: Prefix, kept_BA: torch.Tensor, aux_BA3H: torch.Tensor | None, n_B: torch.Tensor) -> None:
        """Row b's verification kept its first n_B[b] drafts, then `kept_BA[b, n_B[b]]` (the next root);
        `aux_BA3H`: the target's fused features at the root and the kept drafts (None without `layer_ids`)."""


class Verifier:
    """The target's side of a step: one pass over root + proposal in its runner's cache, the acceptance rule, and
    the cache's kept path right after the prefix."""

    def __init__(self, runner: TargetRunner, setup: DraftSetup):
        self.runner, self.setup = runner, setup

    def __call__(
        self, prefix: Prefix, root_B: torch.Tensor, proposal: Proposal
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Returns (accepted drafts n [B], kept tokens [B, K+1]: the accepted drafts, the next token at index n,
        the target's fused features at the root and along the kept path [B, K+1, 3H] or None); K = the drafted
        depth (a chain's length, a tree's depth)."""
        if proposal.tree is None:
            drafts_BK = proposal.drafts_BK
            tokens_BN = torch.cat([root_B[:, None], drafts_BK], 1)
            ar_N = torch.arange(tokens_BN.shape[1], device=root_B.device)
            hidden_BNH, aux_BA3H = self.runner(prefix, tokens_BN, prefix.lengths_B[:, None] + ar_N, None)
            n_B, next_B = self.accept_chain(self.runner.logits(hidden_BNH), drafts_BK, proposal)
        else:
            tree = proposal.tree
            pos_BN = prefix.lengths_B[:, None] + tree.depth_BN
            hidden_BNH, aux_BN3H = self.runner(prefix, tree.tokens_BN, pos_BN, tree.ancestors_BNN)
            n_B, path_BA, next_B = self.walk_tree(self.runner.logits(hidden_BNH), proposal)
            slots_B1 = prefix.lengths_B[:, None]
            self.runner.cache.move(slots_B1 + path_BA, slots_B1 + torch.arange(path_BA.shape[1], device=n_B.device))
            drafts_BK = tree.tokens_BN.gather(1, path_BA[:, 1:])
            aux_BA3H = (
                None if aux_BN3H is None else aux_BN3H.gather(1, path_BA[..., None].expand(-1, -1, aux_BN3H.shape[-1]))
            )
        kept_BA = torch.cat([drafts_BK, torch.zeros_like(n_B)[:, None]], 1)
        kept_BA.scatter_(1, n_B[:, None], next_B[:, None])
        return n_B, kept_BA, aux_BA3H

    def accept_chain(
        self, logits_BNV: torch.Tensor, drafts_BK: torch.Tensor, proposal: Proposal
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted count [B], next token [B]): greedy exact match, or the standard rule on q put on the target's
        vocabulary."""
        cfg = self.setup.cfg
        if cfg.greedy:
            return sampling.accept_chain_greedy(logits_BNV, drafts_BK)
        p_BNV = sampling.probs(logits_BNV, cfg.temperature, cfg.top_p)
        q_BKV = proposal.q
        if proposal.q_ids is not None:
            B, K, Vd = q_BKV.shape
            q_BKV = q_BKV.new_zeros(B, K, self.setup.vocab).scatter_(2, proposal.q_ids.expand(B, K, Vd), q_BKV)
        return sampling.accept_chain(p_BNV, q_BKV, drafts_BK, self.setup.generator)

    def walk_tree(
        self, logits_BNV: torch.Tensor, proposal: Proposal
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(accepted count [B], path of node indices [B, depth+1], next token [B]): along the target's argmax, or
        by recursive rejection."""
        cfg, tree = self.setup.cfg, proposal.tree
        if cfg.greedy:
            return sampling.walk_tree(tree.tokens_BN, tree.parent_BN, logits_BNV.argmax(-1), cfg.depth)
        p_BNV = sampling.probs(logits_BNV, cfg.temperature, cfg.top_p)
        return sampling.walk_tree_sampled(
            tree.tokens_BN, tree.parent_BN, p_BNV, proposal.q, proposal.q_ids, cfg.depth, self.setup.generator
        )


def generate_drafted(
    target: nn.Module,
    drafter: Drafter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cfg: SpecConfig,
    generator: torch.Generator | None = None,
) -> GenOutput:
    """Speculative generation with any drafter; its output is distributed exactly as `generate_plain`'s (identical
    when greedy)."""
    drafter.check(cfg)
    with torch.inference_mode():
        ids_BT, n_B = pack_left(input_ids, attention_mask)
        capacity = ids_BT.shape[1] + cfg.max_new_tokens + drafter.reach(cfg) + 2
        runner = TargetRunner(target, capacity, drafter.layer_ids, cfg.path)
        setup = DraftSetup(capacity, runner.lm_head.weight.shape[0], cfg, generator)
        with ExitStack() as stack:
            stack.enter_context(runner.session())
            stack.enter_context(drafter.session(setup))
            out = decode(Verifier(runner, setup), drafter, ids_BT, n_B)
    return outside_inference_mode(out)


def decode(verify: Verifier, drafter: Drafter, ids_BT: torch.Tensor, n_B: torch.Tensor) -> GenOutput:
    """The loop: prefill, then propose, verify, emit, count and tell the drafter, until every row is done."""
    setup, runner, B = verify.setup, verify.runner, ids_BT.shape[0]
    out = Emitted(B, setup.cfg, ids_BT.device)
    logits_BV, aux_BT3H = runner.prefill(ids_BT, n_B)
    root_B, _ = setup.pick(logits_BV)
    one_B = torch.ones_like(n_B)
    out.emit(root_B[:, None], one_B)
    history = History(ids_BT, n_B, setup.capacity)
    history.append(root_B[:, None], one_B)
    drafter.begin(history, aux_BT3H)
    lengths_B, accepted, emitted, drafted = n_B, [], [], []
    while not bool(out.done_B.all()):
        prefix = Prefix.of(lengths_B)
        n_B, kept_BA, aux_BA3H = verify(prefix, root_B, drafter.propose(prefix, root_B, history))
        active_B = ~out.done_B
        accepted.append(torch.where(active_B, n_B, -1))
        drafted.append(kept_BA.shape[1] - 1)
        emitted.append(torch.where(active_B, out.emit(kept_BA, n_B + 1), -1))
        history.append(kept_BA, (n_B + 1) * active_B)
        drafter.accepted(prefix, kept_BA, aux_BA3H, n_B)
        root_B = kept_BA.gather(1, n_B[:, None])[:, 0]
        lengths_B = lengths_B + (n_B + 1) * active_B
    empty = torch.zeros(0, B, dtype=torch.long, device=ids_BT.device)
    accepted_SB, emitted_SB = (torch.stack(x) if x else empty for x in (accepted, emitted))
    stats = SpecStats(accepted_SB, setup.cfg.depth, torch.tensor(drafted, dtype=torch.long), emitted_SB)
    return GenOutput(out.tokens_BN, out.count_B, stats)
