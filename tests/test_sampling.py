"""Speculative sampling keeps the target's distribution; deliberately broken rules are caught by the same check.

The check: n draws, K outcomes, total variation distance between the empirical and the exact distribution below
    bound(K, n) = 0.5 * sqrt(K / n) + sqrt(ln(1/delta) / (2 n)),   delta = 1e-6.
E[TV] <= 0.5 * sum_i sqrt(p_i (1 - p_i) / n) <= 0.5 * sqrt(K / n) (Cauchy-Schwarz), and TV moves by at most 1/n
when one draw changes, so by McDiarmid P(TV > E[TV] + t) <= exp(-2 n t^2): a correct rule fails with
probability below 1e-6. Draws are vectorised: one batched call of the rule (or of generation) per chunk.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle import sampling
from eagle.config import DraftConfig
from eagle.draft import Eagle3Draft
from eagle.speculative import SpecConfig, generate_speculative


def tv_bound(k: int, n: int, delta: float = 1e-6) -> float:
    return 0.5 * math.sqrt(k / n) + math.sqrt(math.log(1 / delta) / (2 * n))


def tv(samples: torch.Tensor, exact: torch.Tensor) -> float:
    empirical = samples.bincount(minlength=exact.numel()).double() / samples.numel()
    return 0.5 * float((empirical - exact.double().flatten()).abs().sum())


def test_probs_temperature_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).log_softmax(-1)
    p = sampling.probs(logits, 1.0, 1.0)
    torch.testing.assert_close(p, logits.exp())
    kept = sampling.probs(logits, 1.0, 0.8)  # sorted masses .56 .21 .13 .08 .03: two reach .77, three .90
    assert (kept[0, [3, 2]] == 0).all() and kept[0, [0, 1, 4]].gt(0).all()
    torch.testing.assert_close(kept.sum(-1), torch.ones(1))
    hot = sampling.probs(logits, 2.0, 1.0)
    torch.testing.assert_close(hot, (logits / 2).softmax(-1))


# ---- the single-step rule in isolation -------------------------------------------------------------------------

V, N_DRAWS = 8, 200_000
P = torch.tensor(
    [
        [0.30, 0.05, 0.20, 0.00, 0.15, 0.10, 0.05, 0.15],  # target at positions 1, 2, 3 (context-free here)
        [0.05, 0.40, 0.05, 0.10, 0.00, 0.10, 0.20, 0.10],
        [0.10, 0.10, 0.10, 0.30, 0.10, 0.10, 0.10, 0.10],
    ]
)
Q = torch.tensor(
    [
        [0.05, 0.30, 0.05, 0.25, 0.05, 0.20, 0.10, 0.00],  # draft at positions 1, 2: far from P, with zeros
        [0.30, 0.10, 0.00, 0.10, 0.30, 0.10, 0.10, 0.00],
    ]
)


def _always_accept(p, q, draft, generator=None):
    n = torch.full((draft.shape[0],), draft.shape[1], dtype=torch.long)
    return n, sampling.sample(p[:, -1], generator)


def _emitted(rule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run a chain rule on N_DRAWS rows with drafts x_k ~ Q_k; returns (n accepted, tok 1, tok 2, tok 3)."""
    g = torch.Generator().manual_seed(0)
    p = P[None].expand(N_DRAWS, 3, V)
    q = Q[None].expand(N_DRAWS, 2, V)
    draft = sampling.sample(q, g)
    n, nxt = rule(p, q, draft, g)
    kept = torch.cat([draft, torch.zeros_like(nxt)[:, None]], 1).scatter(1, n[:, None], nxt[:, None])
    return n, kept[:, 0], kept[:, 1], kept[:, 2]


def _chain_rule_error(rule) -> float:
    """Worst TV over: token 1 vs P1; token 2 (when draft 1 kept) vs P2; token 3 (when both kept) vs P3."""
    n, t1, t2, t3 = _emitted(rule)
    assert (n >= 1).sum() > 10_000 and (n == 2).sum() > 3_000, "both acceptance depths must be exercised"
    errs = [
        tv(t1, P[0]) / tv_bound(V, N_DRAWS),
        tv(t2[n >= 1], P[1]) / tv_bound(V, int((n >= 1).sum())),
        tv(t3[n == 2], P[2]) / tv_bound(V, int((n == 2).sum())),
    ]
    return max(errs)


def test_chain_rule_keeps_target_distribution():
    assert _chain_rule_error(sampling.accept_chain) < 1.0


def test_broken_chain_rules_fail(monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(sampling, "residual", lambda p, q: p)  # resample from p instead of norm(max(0, p - q))
        assert _chain_rule_error(sampling.accept_chain) > 2.0
    n, t1, _, _ = _emitted(_always_accept)
    assert tv(t1, P[0]) > 2.0 * tv_bound(V, N_DRAWS)


def test_greedy_chain_rule():
    logits = torch.tensor([[[0.0, 5, 0], [5.0, 0, 0], [0.0, 0, 5]], [[0.0, 5, 0], [0.0, 5, 0], [0.0, 0, 5]]])
    n, nxt = sampling.accept_chain_greedy(logits, torch.tensor([[1, 0], [1, 0]]))
    assert n.tolist() == [2, 1] and nxt.tolist() == [2, 1]


def test_walk_tree():
    # root 0 -> 1 (tok 5), 2 (tok 6); 1 -> 3 (tok 7); 2 -> 4 (tok 7)
    tokens = torch.tensor([[9, 5, 6, 7, 7]]).repeat(3, 1)
    parent = torch.tensor([[0, 0, 0, 1, 2]]).repeat(3, 1)
    choice = torch.tensor([[6, 0, 7, 0, 3], [5, 8, 0, 0, 0], [1, 7, 7, 0, 0]])
    n, path, nxt = sampling.walk_tree(tokens, parent, choice, depth=2)
    assert n.tolist() == [2, 1, 0] and nxt.tolist() == [3, 8, 1]
    assert path[0].tolist() == [0, 2, 4] and path[1, :2].tolist() == [0, 1] and path[2, 0] == 0


# ---- end to end: joint distribution of generated tokens 2 and 3 ------------------------------------------------
# Rows alternate between two prompts of different lengths (the short one left-padded), so rows of one batch
# accept different lengths; each prompt's rows are checked against that prompt's exact distribution.

E2E_VOCAB, E2E_DRAWS, CHUNK = 8, 100_000, 25_000
PROMPTS = [torch.tensor([3, 1, 4]), torch.tensor([5])]


@pytest.fixture(scope="module")
def tiny_pair():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=E2E_VOCAB,
        max_position_embeddings=64,
    )
    target = LlamaForCausalLM(cfg).eval()
    draft = Eagle3Draft(DraftConfig.from_target(cfg, draft_vocab_size=6)).eval()
    draft.set_draft_vocab(torch.tensor([0, 1, 2, 4, 5, 7]))
    with torch.no_grad():
        target.lm_head.weight.mul_(12.0)  # logits of order 1: far from uniform, context-dependent, not one-hot
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight[draft.draft_ids()])
    return target, draft


def _exact_tokens_2_3(target, prompt: torch.Tensor, cfg: SpecConfig) -> torch.Tensor:
    """P(x2, x3 | prompt) = sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2), from uncached forwards; [V*V]."""
    V = E2E_VOCAB
    grid = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # (x1, x2) pairs
    seqs = torch.cat([prompt.expand(V * V, -1), grid], 1)
    with torch.no_grad():
        probs = sampling.probs(target(seqs).logits[:, -3:], cfg.temperature, cfg.top_p).double()
    p1 = probs[0, 0]  # [V]
    p2 = probs[::V, 1]  # [x1, V]
    p3 = probs[:, 2].view(V, V, V)  # [x1, x2, V]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint.sum(0).flatten()


def _sampled_tokens_2_3(target, draft, cfg: SpecConfig, draws: int = E2E_DRAWS):
    """Cells x2 * V + x3 of `draws` generations, per prompt ([draws / 2] each), and the mean tau."""
    T = max(len(p) for p in PROMPTS)
    ids = torch.stack([torch.cat([torch.zeros(T - len(p), dtype=torch.long), p]) for p in PROMPTS])
    mask = (torch.arange(T)[None] >= torch.tensor([T - len(p) for p in PROMPTS])[:, None]).long()
    g = torch.Generator().manual_seed(1)
    cells, taus = [], []
    for _ in range(draws // CHUNK):
        rep = CHUNK // len(PROMPTS)
        out = generate_speculative(target, draft, ids.repeat(rep, 1), mask.repeat(rep, 1), cfg, generator=g)
        cells.append((out.sequences[:, 1] * E2E_VOCAB + out.sequences[:, 2]).view(rep, len(PROMPTS)))
        taus.append(out.stats.tau)
    return torch.cat(cells).T, sum(taus) / len(taus)


def _errors(target, draft, cfg: SpecConfig, draws: int) -> tuple[list[float], float]:
    """TV / bound for each prompt, and tau."""
    cells, tau = _sampled_tokens_2_3(target, draft, cfg, draws)
    errs = [
        tv(c, _exact_tokens_2_3(target, p[None], cfg)) / tv_bound(E2E_VOCAB**2, c.numel())
        for c, p in zip(cells, PROMPTS)
    ]
    return errs, tau


CHAIN = SpecConfig(method="chain", depth=2, temperature=0.9, top_p=0.95, max_new_tokens=3)
TREE = SpecConfig(method="tree", depth=2, topk=2, budget=4, temperature=1.2, top_p=0.9, max_new_tokens=3)


CHAIN_EXIT = dataclasses.replace(CHAIN, min_draft_prob=0.5)  # early exit: fewer drafts, the same distribution


@pytest.mark.parametrize("cfg", [CHAIN, TREE, CHAIN_EXIT], ids=["chain", "tree", "chain-early-exit"])
def test_speculative_sampling_keeps_joint_distribution(tiny_pair, cfg):
    errs, tau = _errors(*tiny_pair, cfg, E2E_DRAWS)
    print(f"{cfg.method}: TV / bound per prompt = {errs}, tau = {tau:.3f}")
    assert tau > 1.15, "drafts must be accepted often enough for the check to mean something"
    assert max(errs) < 1.0


def _first_child_walk(tokens, parent, choice, depth):
    """Broken: follows the first child whatever the target chose."""
    B, N = tokens.shape
    cur = torch.zeros(B, dtype=torch.long)
    path = [cur]
    for _ in range(depth):
        child = (parent == cur[:, None]) & (torch.arange(N)[None] > 0)
        cur = torch.where(child.any(1), child.long().argmax(1), cur)
        path.append(cur)
    path = torch.stack(path, 1)
    return (path[:, 1:] != path[:, :-1]).sum(1), path, choice.gather(1, cur[:, None])[:, 0]


def _first_child_walk_sampled(tokens, parent, p, q, draft_ids, depth, generator=None):
    """Broken: keeps the first child whatever the target's probabilities, then draws from p at the last node."""
    n, path, _ = _first_child_walk(tokens, parent, torch.zeros_like(tokens), depth)
    last = path[:, -1]
    return n, path, sampling.sample(p[torch.arange(len(last)), last], generator)


def _residual_ignored(r, q):
    """Broken: after a rejection the target distribution is left as it was (no max(0, r - q))."""
    return r


@pytest.mark.parametrize(
    "cfg,broken",
    [(CHAIN, "residual"), (TREE, "walk"), (TREE, "residual")],
    ids=["chain", "tree-first-child", "tree-no-residual"],
)
def test_broken_rules_fail_end_to_end(tiny_pair, cfg, broken, monkeypatch):
    if broken == "residual":
        monkeypatch.setattr(sampling, "residual", _residual_ignored)
    else:
        monkeypatch.setattr(sampling, "walk_tree_sampled", _first_child_walk_sampled)
    errs, _ = _errors(*tiny_pair, cfg, CHUNK)  # the effect is large: fewer draws suffice
    print(f"broken {cfg.method}: TV / bound per prompt = {errs}")
    assert min(errs) > 2.0
