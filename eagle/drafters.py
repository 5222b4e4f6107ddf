"""Drafters behind one interface, verified by one lossless chain loop: the EAGLE-3 head, prompt lookup, a draft LM.

Purpose: measure what speculation gains like for like. `generate_drafted(target, drafter, ids, mask, cfg)` drafts a
chain with any `Drafter`, verifies it in one target pass and keeps what the acceptance rule keeps, with the same
target runner (lean decoder, preallocated cache, prebuilt masks), output buffer, rules and statistics as
`eagle.speculative`; only the drafter differs. So "prompt lookup in our loop" vs "the head in our loop" is the
speculation gain alone, and our loop vs transformers' `generate` is the implementation gain alone.
Drafters:
- `HeadDrafter`: the EAGLE-3 head's chain (the same drafts, rules and random draws as `generate_speculative` with
  `method="chain"`, so the same output; tested).
- `PromptLookupDrafter`: the continuation of an earlier occurrence of the history's last n tokens (n from
  `max_ngram` down to `min_ngram`; the latest occurrence with a full-length continuation, else the earliest), as
  transformers' prompt lookup and vLLM's `ngram` method draft.
  Deterministic: when sampling, its draft distribution is one-hot, which the standard rule handles exactly.
- `ModelDrafter`: a small causal LM of the target's tokenizer, with its own cache in a `TargetRunner` (its lean
  decoder too), drafting autoregressively; greedy or sampled from its own distribution.
Interface (`Drafter`): `session(setup)` once per generation (capacity, vocabulary, config, RNG); `begin(history,
aux)` after the target's prefill; `propose(prefix, history, depth)` returns (drafts [B, K] target ids, K <= depth,
and their draft distributions over the target vocabulary [B, K, V] when sampling, else None); `accepted(prefix,
kept, aux, n)` after verification. `History` holds each row's tokens so far (prompt and every kept token; its last
is the root, the token not yet verified).
How to run: `generate_drafted(target, PromptLookupDrafter(), ids, mask, SpecConfig(method="chain", depth=5))`.
Not here: trees for drafters other than the head (`generate_speculative` does the head's trees), batching rows of
different drafters.

Shape legend: B batch, T prompt positions, C history capacity, K drafted tokens, N = K + 1 verified nodes,
A kept tokens (accepted drafts + the next token), V target vocabulary, Vd draft vocabulary, H hidden.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import ContextManager, Iterator

import torch
from torch import nn

from eagle import sampling
from eagle.draft import Eagle3Draft
from eagle.run_config import SpecConfig
from eagle.runners import HeadRunner, Prefix, TargetRunner
from eagle.speculative import GenOutput, _Emitted, _outside_inference_mode, _pick, commit_head, pack_left
from eagle.stats import SpecStats
from eagle.tree import draft_chain


@dataclass(frozen=True)
class DraftSetup:
    """What a drafter learns once per generation: cache capacity, the target's vocabulary size, the config and RNG."""

    capacity: int
    vocab: int
    cfg: SpecConfig
    generator: torch.Generator | None


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
        return self.tokens_BC[b, :int(self.lengths_B[b])]


def draft_pick(logits_BV: torch.Tensor, setup: DraftSetup) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's own pick: its argmax when greedy, else a draw from its distribution at the config's temperature
    and top-p (returned too, for the acceptance rule)."""
    cfg = setup.cfg
    if cfg.greedy:
        return logits_BV.argmax(-1), None
    q_BV = sampling.probs(logits_BV, cfg.temperature, cfg.top_p)
    return sampling.sample(q_BV, setup.generator), q_BV


class Drafter:
    """A chain drafter for `generate_drafted`; see the module docstring for the protocol. `layer_ids`: the target
    layers whose inputs the drafter reads (the head's fused features); empty for drafters that read tokens only."""

    layer_ids: tuple[int, ...] = ()

    def session(self, setup: DraftSetup) -> ContextManager[None]:
        self.setup = setup
        return nullcontext()

    def begin(self, history: History, aux_BT3H: torch.Tensor | None) -> None:
        pass

    def propose(self, prefix: Prefix, history: History, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def accepted(self, prefix: Prefix, kept_BA: torch.Tensor, aux_BN3H: torch.Tensor | None,
                 n_B: torch.Tensor) -> None:
        """Row b's verification kept its first n_B[b] drafts, then `kept_BA[b, n_B[b]]` (the next root)."""


class HeadDrafter(Drafter):
    """The EAGLE-3 head drafting a chain: the same drafts, draws and output as
    `generate_speculative(method="chain")`."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.layer_ids = tuple(draft.cfg.aux_layer_ids)

    def session(self, setup: DraftSetup) -> ContextManager[None]:
        self.setup = setup
        self.head = HeadRunner(self.draft, setup.capacity)
        return nullcontext()

    def _pick(self, logits_BVd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return draft_pick(logits_BVd, self.setup)

    def begin(self, history: History, aux_BT3H: torch.Tensor | None) -> None:
        T = aux_BT3H.shape[1]
        n_B = history.lengths_B - 1  # prompt lengths (the root follows them)
        shifted_BT = history.tokens_BC[:, 1:T + 1]  # (x_{i+1}, f_i); x at each row's prompt length is the root
        self.hidden_BH, self.logits_BVd = commit_head(self.head, self.draft, Prefix(torch.zeros_like(n_B), 0),
                                                      shifted_BT, aux_BT3H, n_B)

    def propose(self, prefix: Prefix, history: History, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        drafts_BK, q_BKVd = draft_chain(self.head, prefix, self.hidden_BH, self.logits_BVd, depth, self._pick,
                                        self.setup.cfg.min_draft_prob)
        if q_BKVd is None:
            return drafts_BK, None
        B, K, Vd = q_BKVd.shape
        q_BKV = q_BKVd.new_zeros(B, K, self.setup.vocab)
        q_BKV.scatter_(2, self.draft.draft_ids().expand(B, K, Vd), q_BKVd)
        return drafts_BK, q_BKV

    def accepted(self, prefix: Prefix, kept_BA: torch.Tensor, aux_BN3H: torch.Tensor | None,
                 n_B: torch.Tensor) -> None:
        A = int(n_B.max()) + 1
        self.hidden_BH, self.logits_BVd = commit_head(self.head, self.draft, prefix, kept_BA[:, :A],
                                                      aux_BN3H[:, :A], n_B + 1)


def _one_hot(drafts_BK: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(drafts_BK, vocab).float()


class PromptLookupDrafter(Drafter):
    """Drafts the tokens that followed an earlier occurrence of the history's last n tokens (`lookup`), trying
    n = `max_ngram` down to `min_ngram`; no match: no draft (the step verifies the root alone). Rows of a batch
    with shorter matches are padded with their last draft (any token is lossless to verify)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def lookup(self, h_L: torch.Tensor, depth: int) -> torch.Tensor:
        """The continuation (at most `depth` tokens) of an earlier match of h's last n tokens, the longest n first:
        the latest match with `depth` tokens after it, else the earliest (the longest continuation there is)."""
        L = h_L.shape[0]
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            windows_WN = h_L[:L - 1].unfold(0, n, 1)  # starts 0..L-1-n: each has a following token
            starts = (windows_WN == h_L[L - n:]).all(1).nonzero()[:, 0] + n  # where each continuation starts
            if starts.numel():
                full = starts[starts + depth <= L]
                start = int(full[-1]) if full.numel() else int(starts[0])
                return h_L[start:start + depth]
        return h_L[:0]

    def propose(self, prefix: Prefix, history: History, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        B = history.tokens_BC.shape[0]
        found = [self.lookup(history.row(b), depth) for b in range(B)]
        K = max(len(f) for f in found)
        drafts_BK = torch.empty(B, K, dtype=torch.long, device=history.tokens_BC.device)
        for b, f in enumerate(found):
            fill = f[-1] if len(f) else history.row(b)[-1]
            drafts_BK[b] = fill
            drafts_BK[b, :len(f)] = f
        return drafts_BK, None if self.setup.cfg.greedy else _one_hot(drafts_BK, self.setup.vocab)


class ModelDrafter(Drafter):
    """A small causal LM of the target's tokenizer drafting autoregressively, with its own preallocated cache.

    Its cache holds the history's first `cached_B` tokens; a proposal first runs the history tokens it has not seen
    (the root, and the last accepted draft when the whole chain was accepted: 1 or 2 per row, the whole prompt the
    first time), then drafts `depth` tokens, feeding each but the last. Greedy: its argmax; sampling: draws from its
    own distribution at the config's temperature and top-p, which the standard rule corrects exactly."""

    def __init__(self, model: nn.Module):
        self.model = model

    @contextmanager
    def _session(self, setup: DraftSetup) -> Iterator[None]:
        rows = self.model.get_output_embeddings().weight.shape[0]
        if rows != setup.vocab:
            raise ValueError(f"the draft model's vocabulary has {rows} tokens, the target's {setup.vocab}: a draft "
                             "model must share the target's tokenizer")
        self.runner = TargetRunner(self.model, setup.capacity, path=setup.cfg.path, role="decode")
        with self.runner.session():
            yield

    def session(self, setup: DraftSetup) -> ContextManager[None]:
        self.setup = setup
        return self._session(setup)

    def begin(self, history: History, aux_BT3H: torch.Tensor | None) -> None:
        self.cached_B = torch.zeros_like(history.lengths_B)

    def propose(self, prefix: Prefix, history: History, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        L_B = history.lengths_B
        c_B = torch.minimum(self.cached_B, L_B)  # a finished row's history stops growing
        pend_B = (L_B - c_B).clamp(min=1)
        ar_P = torch.arange(int(pend_B.max()), device=L_B.device)
        idx_BP = (c_B[:, None] + ar_P).clamp(max=history.tokens_BC.shape[1] - 1)
        hidden_BPH, _ = self.runner(Prefix.of(c_B), history.tokens_BC.gather(1, idx_BP), c_B[:, None] + ar_P, None)
        logits_BV = self.runner.logits(hidden_BPH[torch.arange(len(L_B), device=L_B.device), pend_B - 1])
        picks, dists, min_prob = [], [], self.setup.cfg.min_draft_prob
        for j in range(depth):
            if j and min_prob > 0 and bool((torch.softmax(logits_BV.float(), -1).amax(-1) < min_prob).all()):
                break
            tok_B, q_BV = draft_pick(logits_BV, self.setup)
            picks.append(tok_B)
            dists.append(q_BV)
            if j + 1 == depth:
                break
            hidden_B1H, _ = self.runner(Prefix.of(L_B + j), tok_B[:, None], (L_B + j)[:, None], None)
            logits_BV = self.runner.logits(hidden_B1H[:, 0])
        self.proposed_at_B, self.fed = L_B, len(picks) - 1 if len(picks) == depth else len(picks)
        drafts_BK = torch.stack(picks, 1)
        return drafts_BK, None if dists[0] is None else torch.stack(dists, 1)

    def accepted(self, prefix: Prefix, kept_BA: torch.Tensor, aux_BN3H: torch.Tensor | None,
                 n_B: torch.Tensor) -> None:
        self.cached_B = self.proposed_at_B + n_B.clamp(max=self.fed)


def generate_drafted(target: nn.Module, drafter: Drafter, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None, cfg: SpecConfig,
                     generator: torch.Generator | None = None) -> GenOutput:
    """Chain speculative generation with any drafter; its output is distributed exactly as `generate_plain`'s
    (identical when greedy). `cfg.method` must be "chain"."""
    if cfg.method != "chain":
        raise ValueError(f"generate_drafted drafts chains; method {cfg.method!r} needs generate_speculative (the head)")
    with torch.inference_mode():
        ids_BT, n_B = pack_left(input_ids, attention_mask)
        capacity = ids_BT.shape[1] + cfg.max_new_tokens + cfg.depth + 2
        runner = TargetRunner(target, capacity, drafter.layer_ids, cfg.path)
        setup = DraftSetup(capacity, runner.lm_head.weight.shape[0], cfg, generator)
        with ExitStack() as stack:
            stack.enter_context(runner.session())
            stack.enter_context(drafter.session(setup))
            out = _drafted_loop(runner, drafter, ids_BT, n_B, setup)
    return _outside_inference_mode(out)


def _drafted_loop(runner: TargetRunner, drafter: Drafter, ids_BT: torch.Tensor, n_B: torch.Tensor,
                  setup: DraftSetup) -> GenOutput:
    cfg, generator, B = setup.cfg, setup.generator, ids_BT.shape[0]
    out = _Emitted(B, cfg, ids_BT.device)
    logits_BV, aux_BT3H = runner.prefill(ids_BT, n_B)
    root_B = _pick(logits_BV, cfg, generator)
    one_B = torch.ones_like(n_B)
    out.emit(root_B[:, None], one_B)
    history = History(ids_BT, n_B, setup.capacity)
    history.append(root_B[:, None], one_B)
    drafter.begin(history, aux_BT3H)
    lengths_B, accepted, emitted, drafted = n_B, [], [], []
    while not bool(out.done_B.all()):
        prefix = Prefix.of(lengths_B)
        drafts_BK, q_BKV = drafter.propose(prefix, history, cfg.depth)
        tokens_BN = torch.cat([root_B[:, None], drafts_BK], 1)
        ar_N = torch.arange(tokens_BN.shape[1], device=root_B.device)
        hidden_BNH, aux_BN3H = runner(prefix, tokens_BN, lengths_B[:, None] + ar_N, None)
        logits_BNV = runner.logits(hidden_BNH)
        if q_BKV is None:
            n_B, next_B = sampling.accept_chain_greedy(logits_BNV, drafts_BK)
        else:
            p_BNV = sampling.probs(logits_BNV, cfg.temperature, cfg.top_p)
            n_B, next_B = sampling.accept_chain(p_BNV, q_BKV, drafts_BK, generator)
        kept_BA = torch.cat([drafts_BK, torch.zeros_like(n_B)[:, None]], 1).scatter(1, n_B[:, None], next_B[:, None])
        active_B = ~out.done_B
        accepted.append(torch.where(active_B, n_B, -1))
        drafted.append(drafts_BK.shape[1])
        emitted.append(torch.where(active_B, out.emit(kept_BA, n_B + 1), -1))
        history.append(kept_BA, (n_B + 1) * active_B)
        drafter.accepted(prefix, kept_BA, aux_BN3H, n_B)
        root_B = next_B
        lengths_B = lengths_B + (n_B + 1) * active_B
    empty = torch.zeros(0, B, dtype=torch.long, device=ids_BT.device)
    accepted_SB, emitted_SB = (torch.stack(x) if x else empty for x in (accepted, emitted))
    stats = SpecStats(accepted_SB, cfg.depth, torch.tensor(drafted, dtype=torch.long), emitted_SB)
    return GenOutput(out.tokens_BN, out.count_B, stats)
