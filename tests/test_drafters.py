"""Drafters in our own loop (`eagle.verify.generate_drafted`): the head, prompt lookup and a small draft model.

Greedy: every drafter's output is plain greedy decoding token for token, in batches of left-padded prompts of
different lengths, at EOS and length limits. The head through the drafter interface gives exactly what
`generate_speculative` gives (greedy and sampled, the same random draws). A draft model equal to the target has
every draft accepted (its cache bookkeeping is right). Sampled: the joint distribution of tokens 2 and 3 is the
target's (the total-variation check of tests/test_sampling.py).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle.drafters import HeadDrafter, ModelDrafter, PromptLookupDrafter
from eagle.speculative import SpecConfig, generate_plain, generate_speculative
from eagle.verify import generate_drafted
from tests.test_sampling import E2E_VOCAB, PROMPTS, _exact_tokens_2_3, tiny_pair, tv, tv_bound  # noqa: F401
from tests.test_speculative import SHAPE, _prompts, _same, llama_pair  # noqa: F401  (the shared pair)


@pytest.fixture(scope="module")
def small_lm(llama_pair):  # noqa: F811
    """A 2-layer Llama of the target's vocabulary, trained briefly on the target's greedy continuations."""
    target, _ = llama_pair
    torch.manual_seed(4)
    small = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "num_hidden_layers": 2, "tie_word_embeddings": True}))
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (96, 4), generator=g)
    data = torch.cat([data, generate_plain(target, data, None, SpecConfig(max_new_tokens=24)).sequences], 1)
    opt = torch.optim.Adam(small.parameters(), lr=3e-3)
    for _ in range(60):
        x = data[torch.randint(0, 96, (16,), generator=g)]
        loss = small(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return small.eval()


def _drafters(llama_pair, small_lm):
    target, draft = llama_pair
    return {"head": HeadDrafter(draft), "lookup": PromptLookupDrafter(max_ngram=3), "model": ModelDrafter(small_lm)}


@pytest.mark.parametrize("kind", ["head", "lookup", "model"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_drafted_equals_plain(llama_pair, small_lm, kind, batch):
    target, _ = llama_pair
    ids, mask = _prompts(batch)
    cfg = SpecConfig(method="chain", depth=4, max_new_tokens=40)
    out = generate_drafted(target, _drafters(llama_pair, small_lm)[kind], ids, mask, cfg)
    _same(out, generate_plain(target, ids, mask, cfg))
    st = out.stats
    assert st.accept_lengths.max() >= 1, f"{kind}: some draft should be accepted"
    assert (st.accept_lengths <= st.drafted[:, None]).all()
    assert st.n_verify_steps < 40 * batch


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("batch", [1, 4])
def test_head_drafter_is_generate_speculative_chain(llama_pair, temperature, batch):
    target, draft = llama_pair
    ids, mask = _prompts(batch)
    cfg = SpecConfig(method="chain", depth=4, max_new_tokens=30, temperature=temperature, top_p=0.9)
    ours = generate_drafted(target, HeadDrafter(draft), ids, mask, cfg, generator=torch.Generator().manual_seed(7))
    spec = generate_speculative(target, draft, ids, mask, cfg, generator=torch.Generator().manual_seed(7))
    _same(ours, spec)
    assert torch.equal(ours.stats.accept_lengths, spec.stats.accept_lengths)
    assert torch.equal(ours.stats.emitted_lengths, spec.stats.emitted_lengths)


@pytest.mark.parametrize("batch", [1, 3])
def test_target_as_its_own_draft_model_accepts_everything(llama_pair, batch):
    target, _ = llama_pair
    ids, mask = _prompts(batch)
    cfg = SpecConfig(method="chain", depth=3, max_new_tokens=31)
    out = generate_drafted(target, ModelDrafter(copy.deepcopy(target)), ids, mask, cfg)
    _same(out, generate_plain(target, ids, mask, cfg))
    acc = out.stats.accept_lengths
    assert (acc[acc >= 0] == 3).all(), acc  # every chain accepted whole: 1 + 10 * 4 tokens = 41 >= 31
    assert out.stats.n_verify_steps == 8  # steps, each over the whole batch


@pytest.mark.parametrize("kind", ["lookup", "model"])
def test_eos_and_max_length_edges(llama_pair, small_lm, kind):
    target, _ = llama_pair
    ids, mask = _prompts(4)
    free = generate_plain(target, ids, mask, SpecConfig(max_new_tokens=30))
    eos = int(free.sequences[1, 7])
    for max_new in (1, 2, 5, 30):
        cfg = SpecConfig(method="chain", depth=3, max_new_tokens=max_new, eos_token_id=(eos, 999), pad_token_id=-1)
        out = generate_drafted(target, _drafters(llama_pair, small_lm)[kind], ids, mask, cfg)
        _same(out, generate_plain(target, ids, mask, cfg))
        live = out.stats.emitted_lengths >= 0
        assert int(out.stats.emitted_lengths[live].sum()) == int(out.lengths.sum()) - 4


def test_prompt_lookup_finds_the_latest_longest_match():
    d = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    h = torch.tensor([5, 1, 2, 9, 7, 1, 2, 3, 4, 8, 1, 2])
    assert d.lookup(h, 3).tolist() == [3, 4, 8]  # "1 2" last seen at 5: 3 4 8 follow
    assert d.lookup(h, 6).tolist() == [9, 7, 1, 2, 3, 4]  # no later match has 6 tokens after it: the earliest
    assert d.lookup(torch.tensor([4, 6, 4, 6, 4]), 5).tolist() == [6, 4]  # "4 6 4" at 0: runs into the suffix
    assert d.lookup(torch.tensor([1, 2, 3]), 4).tolist() == []  # no earlier 3
    assert PromptLookupDrafter(max_ngram=2, min_ngram=2).lookup(torch.tensor([7, 1, 9, 1]), 4).tolist() == []


def test_bad_drafter_input(llama_pair):
    target, _ = llama_pair
    ids, mask = _prompts(1)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="drafts chains"):
        generate_drafted(target, PromptLookupDrafter(), ids, mask, SpecConfig(method="tree"))
    other = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "vocab_size": 300, "num_hidden_layers": 1})).eval()
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        generate_drafted(target, ModelDrafter(other), ids, mask, SpecConfig(max_new_tokens=4))


# ---- sampled: the joint distribution of tokens 2 and 3 is the target's -------------------------------------------

DRAWS, CHUNK = 40_000, 20_000
SAMPLED = SpecConfig(method="chain", depth=2, temperature=0.9, top_p=0.95, max_new_tokens=3)


def _sampled_errors(target, drafter) -> tuple[list[float], float]:
    T = max(len(p) for p in PROMPTS)
    ids = torch.stack([torch.cat([torch.zeros(T - len(p), dtype=torch.long), p]) for p in PROMPTS])
    mask = (torch.arange(T)[None] >= torch.tensor([T - len(p) for p in PROMPTS])[:, None]).long()
    g = torch.Generator().manual_seed(1)
    cells, taus = [], []
    rep = CHUNK // len(PROMPTS)
    for _ in range(DRAWS // CHUNK):
        out = generate_drafted(target, drafter, ids.repeat(rep, 1), mask.repeat(rep, 1), SAMPLED, generator=g)
        cells.append((out.sequences[:, 1] * E2E_VOCAB + out.sequences[:, 2]).view(rep, len(PROMPTS)))
        taus.append(out.stats.tau)
    errs = [
        tv(c, _exact_tokens_2_3(target, p[None], SAMPLED)) / tv_bound(E2E_VOCAB**2, c.numel())
        for c, p in zip(torch.cat(cells).T, PROMPTS)
    ]
    return errs, sum(taus) / len(taus)


@pytest.mark.parametrize("kind", ["lookup", "model"])
def test_sampled_drafting_keeps_joint_distribution(tiny_pair, kind):  # noqa: F811
    target, _ = tiny_pair
    if kind == "lookup":
        drafter = PromptLookupDrafter(max_ngram=2)
    else:
        small = copy.deepcopy(target)
        with torch.no_grad():  # a draft that is close to the target but not equal: p != q
            for p in small.parameters():
                p.add_(0.3 * torch.randn_like(p))
        drafter = ModelDrafter(small)
    errs, tau = _sampled_errors(target, drafter)
    print(f"{kind}: TV / bound per prompt = {errs}, tau = {tau:.3f}")
    # lookup drafts only where the history repeats (about 6% of steps accept here): still thousands of accepted
    # draws, and the broken-rule test below shows the check fails a biased rule on this very drafter
    assert tau > (1.03 if kind == "lookup" else 1.1), "drafts must be accepted often enough to mean something"
    assert max(errs) < 1.0


def test_sampled_check_catches_a_biased_draft_rule(tiny_pair, monkeypatch):  # noqa: F811
    """Accepting every one-hot draft (ignoring p) must fail the same check."""
    from eagle import sampling

    def always(p, q, draft, generator=None):
        B, K = draft.shape
        return torch.full((B,), K, dtype=torch.long), sampling.sample(p[:, K], generator)

    monkeypatch.setattr(sampling, "accept_chain", always)
    errs, _ = _sampled_errors(tiny_pair[0], PromptLookupDrafter(max_ngram=2))
    assert max(errs) > 2.0


def test_config_depth_is_respected(llama_pair, small_lm):
    target, _ = llama_pair
    ids, mask = _prompts(2)
    for depth in (1, 2, 5):
        cfg = dataclasses.replace(SpecConfig(method="chain", max_new_tokens=20), depth=depth)
        for kind, drafter in _drafters(llama_pair, small_lm).items():
            out = generate_drafted(target, drafter, ids, mask, cfg)
            _same(out, generate_plain(target, ids, mask, cfg))
            assert int(out.stats.drafted.max()) <= depth, kind
