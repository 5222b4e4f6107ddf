"""The drafters of the one speculative loop (`eagle.verify`): the EAGLE-3 head, prompt lookup, a draft LM.

Purpose: measure what speculation gains like for like. Every drafter proposes through `eagle.verify.Drafter` and
`eagle.verify.generate_drafted` verifies them all with the same target runner (lean decoder, preallocated cache,
prebuilt masks), output buffer, rules and statistics; only the drafter differs. So "prompt lookup in our loop" vs
"the head in our loop" is the speculation gain alone, and our loop vs transformers' `generate` is the implementation
gain alone.
Drafters:
- `HeadDrafter`: the EAGLE-3 head: a chain (`eagle.tree.draft_chain`), an EAGLE-2 tree (`draft_tree`, greedy, or
  `draft_tree_sampled`) or, for a parallel head, the picks of one head pass (`draft_parallel`); after each step it
  commits the target's features along the kept path to its own cache (`commit_head`).
  `eagle.speculative.generate_speculative` is the loop with this drafter.
- `PromptLookupDrafter`: the continuation of an earlier occurrence of the history's last n tokens (n from
  `max_ngram` down to `min_ngram`; the latest occurrence with a full-length continuation, else the earliest), as
  transformers' prompt lookup and vLLM's `ngram` method draft.
  Deterministic: when sampling, its draft distribution is one-hot, which the standard rule handles exactly.
- `ModelDrafter`: a small causal LM of the target's tokenizer, with its own cache in a `TargetRunner` (its lean
  decoder too), drafting autoregressively; greedy or sampled from its own distribution.
How to run: `generate_drafted(target, PromptLookupDrafter(), ids, mask, SpecConfig(method="chain", depth=5))`
(`from eagle.verify import generate_drafted`).
Not here: the loop, verification and counters (eagle/verify.py); the head's passes (eagle/runners.py) and drafting
algorithms (eagle/tree.py); trees for drafters other than the head; batching rows of different drafters.

Shape legend: B batch, T prompt positions, K drafted tokens, A kept tokens (accepted drafts + the next token),
V target vocabulary, Vd draft vocabulary, H hidden, M masked slots.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import ContextManager, Iterator

import torch
from torch import nn

from eagle import sampling
from eagle.draft import Eagle3Draft
from eagle.run_config import SpecConfig
from eagle.runners import HeadRunner, Prefix, TargetRunner
from eagle.tree import draft_chain, draft_parallel, draft_tree, draft_tree_sampled
from eagle.verify import DraftSetup, Drafter, History, Proposal


def commit_head(
    head: HeadRunner,
    draft: Eagle3Draft,
    prefix: Prefix,
    tokens_BA: torch.Tensor,
    aux_BA3H: torch.Tensor,
    n_B: torch.Tensor,
    masked: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
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
        hidden_BAH = torch.where(
            slot_BT[..., None], mask_hidden_BTH, torch.cat([hidden_BAH, mask_hidden_BTH[:, :masked]], 1)
        )
        tokens_BA, A = ids_BT, T
    pos_BA = prefix.lengths_B[:, None] + torch.arange(A, device=tokens_BA.device)
    select = (n_B - 1).clamp(0, A - 1)
    if masked is not None:
        select = select[:, None] + torch.arange(1 + masked, device=n_B.device)
    hidden_BKH, logits_BKVd = head.extend(prefix, tokens_BA, hidden_BAH, pos_BA, select_B=select)
    return (hidden_BKH, logits_BKVd) if masked is not None else (hidden_BKH[:, 0], logits_BKVd[:, 0])


class HeadDrafter(Drafter):
    """The EAGLE-3 head: chains, EAGLE-2 trees (greedy top-k, or sampled sibling groups) and a parallel head's
    one-pass chains, with its own preallocated cache. Its prompt commit is (x_{i+1}, f_i) for every prompt position
    i (the last x is the root); each later commit is the kept tokens with the target's features at the root and
    the kept drafts, so the head's cache always holds exactly the accepted sequence."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.layer_ids = tuple(draft.cfg.aux_layer_ids)

    def check(self, cfg: SpecConfig) -> None:
        if cfg.method == "tree" and cfg.topk > self.draft.cfg.draft_vocab_size:
            raise ValueError("topk exceeds the draft vocabulary")
        if self.draft.cfg.parallel and cfg.method != "chain":
            raise ValueError(
                f"a parallel head drafts chains (vLLM's parallel drafting), not a {cfg.method}: set method chain"
            )

    def reach(self, cfg: SpecConfig) -> int:
        return max(cfg.verify_width, cfg.depth * cfg.topk)  # a tree's head passes write depth x topk entries

    def session(self, setup: DraftSetup) -> ContextManager[None]:
        self.setup, cfg = setup, setup.cfg
        self.masked = cfg.depth - 1 if self.draft.cfg.parallel else None  # masked slots per commit
        self.head = HeadRunner(self.draft, setup.capacity + (cfg.depth if self.draft.cfg.parallel else 0))
        return super().session(setup)

    def pick(self, logits_BVd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's own pick (draft index, and its distribution when sampling)."""
        return self.setup.pick(logits_BVd)

    def commit(self, prefix: Prefix, tokens_BA: torch.Tensor, aux_BA3H: torch.Tensor, n_B: torch.Tensor) -> None:
        """Commit (token x_{i+1}, feature f_i) at positions lengths+i; keeps the head's output at the n-th entry
        (and, for a parallel head, at the masked slots after it), where the next draft starts."""
        self.hidden_BH, self.logits_BVd = commit_head(
            self.head, self.draft, prefix, tokens_BA, aux_BA3H, n_B, self.masked
        )

    def begin(self, history: History, aux_BT3H: torch.Tensor | None) -> None:
        T = aux_BT3H.shape[1]
        n_B = history.lengths_B - 1  # prompt lengths (the root follows them)
        shifted_BT = history.tokens_BC[:, 1 : T + 1]  # (x_{i+1}, f_i); x at each row's prompt length is the root
        self.commit(Prefix(torch.zeros_like(n_B), 0), shifted_BT, aux_BT3H, n_B)

    def propose(self, prefix: Prefix, root_B: torch.Tensor, history: History) -> Proposal:
        cfg = self.setup.cfg
        if self.masked is not None:
            drafts_BK, q_BKVd = draft_parallel(self.logits_BVd, self.draft, self.pick, cfg.min_draft_prob)
        elif cfg.method == "chain":
            drafts_BK, q_BKVd = draft_chain(
                self.head, prefix, self.hidden_BH, self.logits_BVd, cfg.depth, self.pick, cfg.min_draft_prob
            )
        elif cfg.greedy:
            shape = (cfg.depth, cfg.topk, cfg.budget)
            return Proposal(tree=draft_tree(self.head, prefix, root_B, self.hidden_BH, self.logits_BVd, shape))
        else:
            tree, q_BNVd = draft_tree_sampled(
                self.head,
                prefix,
                self.hidden_BH,
                self._probs(self.logits_BVd),
                root_B,
                (cfg.depth, cfg.topk, cfg.budget),
                self._probs,
                self.setup.generator,
            )
            return Proposal(tree=tree, q=q_BNVd, q_ids=self.draft.draft_ids())
        return Proposal(drafts_BK, q=q_BKVd, q_ids=None if q_BKVd is None else self.draft.draft_ids())

    def _probs(self, logits_BTVd: torch.Tensor) -> torch.Tensor:
        return sampling.probs(logits_BTVd, self.setup.cfg.temperature, self.setup.cfg.top_p)

    def accepted(self, prefix: Prefix, kept_BA: torch.Tensor, aux_BA3H: torch.Tensor | None, n_B: torch.Tensor) -> None:
        A = int(n_B.max()) + 1
        self.commit(prefix, kept_BA[:, :A], aux_BA3H[:, :A], n_B + 1)


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
            windows_WN = h_L[: L - 1].unfold(0, n, 1)  # starts 0..L-1-n: each has a following token
            starts = (windows_WN == h_L[L - n :]).all(1).nonzero()[:, 0] + n  # where each continuation starts
            if starts.numel():
                full = starts[starts + depth <= L]
                start = int(full[-1]) if full.numel() else int(starts[0])
                return h_L[start : start + depth]
        return h_L[:0]

    def propose(self, prefix: Prefix, root_B: torch.Tensor, history: History) -> Proposal:
        B, depth = history.tokens_BC.shape[0], self.setup.cfg.depth
        found = [self.lookup(history.row(b), depth) for b in range(B)]
        K = max(len(f) for f in found)
        drafts_BK = torch.empty(B, K, dtype=torch.long, device=history.tokens_BC.device)
        for b, f in enumerate(found):
            fill = f[-1] if len(f) else history.row(b)[-1]
            drafts_BK[b] = fill
            drafts_BK[b, : len(f)] = f
        q_BKV = None if self.setup.cfg.greedy else torch.nn.functional.one_hot(drafts_BK, self.setup.vocab).float()
        return Proposal(drafts_BK, q=q_BKV)


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
            raise ValueError(
                f"the draft model's vocabulary has {rows} tokens, the target's {setup.vocab}: a draft "
                "model must share the target's tokenizer"
            )
        self.runner = TargetRunner(self.model, setup.capacity, path=setup.cfg.path, role="decode")
        with self.runner.session():
            yield

    def session(self, setup: DraftSetup) -> ContextManager[None]:
        self.setup = setup
        return self._session(setup)

    def begin(self, history: History, aux_BT3H: torch.Tensor | None) -> None:
        self.cached_B = torch.zeros_like(history.lengths_B)

    def propose(self, prefix: Prefix, root_B: torch.Tensor, history: History) -> Proposal:
        L_B, depth = history.lengths_B, self.setup.cfg.depth
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
            tok_B, q_BV = self.setup.pick(logits_BV)
            picks.append(tok_B)
            dists.append(q_BV)
            if j + 1 == depth:
                break
            hidden_B1H, _ = self.runner(Prefix.of(L_B + j), tok_B[:, None], (L_B + j)[:, None], None)
            logits_BV = self.runner.logits(hidden_B1H[:, 0])
        self.proposed_at_B, self.fed = L_B, len(picks) - 1 if len(picks) == depth else len(picks)
        return Proposal(torch.stack(picks, 1), q=None if dists[0] is None else torch.stack(dists, 1))

    def accepted(self, prefix: Prefix, kept_BA: torch.Tensor, aux_BA3H: torch.Tensor | None, n_B: torch.Tensor) -> None:
        self.cached_B = self.proposed_at_B + n_B.clamp(max=self.fed)
