"""Greedy speculative generation is token-for-token plain greedy; caches, trees and stats behave.

Targets are tiny random Llama / Qwen3 models (hidden 64, 6 layers, vocab 256) whose residual branches are scaled
down so that a head trained for ~2 s on CPU (step-0 and step-1 teacher forcing, below) gets non-trivial, mixed
acceptance: some steps accept nothing, some the whole chain, rows differ.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from eagle import speculative, verify
from eagle.config import DraftConfig
from eagle.draft import Eagle3Draft
from eagle.features import target_forward
from eagle.kvcache import CausalMask, SlotCache, visibility_mask
from eagle.runners import Prefix, TargetRunner
from eagle.drafters import HeadDrafter
from eagle.speculative import SpecConfig, generate_plain, generate_speculative, pack_left
from eagle.stats import SpecStats
from eagle.tree import draft_chain, draft_tree
from eagle.verify import DraftSetup, History

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
)


def predictable(target: torch.nn.Module) -> None:
    """Scale the target's residual branches down (in place): its argmax then follows its input closely, so a small
    head can learn it."""
    for layer in target.model.layers:
        layer.self_attn.o_proj.weight.mul_(0.3)
        layer.mlp.down_proj.weight.mul_(0.3)


def _train_pair(target: torch.nn.Module, draft_vocab: int, seed: int, variant: str = "eagle3") -> Eagle3Draft:
    """Scale the target's residual branches down, then fit a head to its argmax on its own greedy and sampled
    continuations of random prompts: step 0 on true features, step 1 on the head's own output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        predictable(target)
        prompts = torch.randint(0, 256, (128, 4), generator=g)
        greedy = generate_plain(target, prompts[:64], None, SpecConfig(max_new_tokens=28)).sequences
        sampled = generate_plain(
            target, prompts[64:], None, SpecConfig(max_new_tokens=28, temperature=1.0), generator=g
        ).sequences
        data = torch.cat([prompts, torch.cat([greedy, sampled])], 1)
        step = target_forward(target, data, DraftConfig.from_target(target.config, 256).aux_layer_ids)
        best = target.lm_head(step.last_hidden_BTH).argmax(-1)
    draft = Eagle3Draft(DraftConfig.from_target(target.config, draft_vocab_size=draft_vocab, variant=variant))
    draft.set_draft_vocab(best.flatten().bincount(minlength=256).topk(draft_vocab).indices.sort().values)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight[draft.draft_ids()])
    to_draft = torch.full((256,), -100, dtype=torch.long)
    to_draft[draft.draft_ids()] = torch.arange(draft_vocab)
    opt = torch.optim.Adam(draft.trainable_parameters(), lr=1e-2)
    pos = torch.arange(31)[None].expand(16, -1)
    for _ in range(150):
        rows = torch.randint(0, 128, (16,), generator=g)
        x, y, f = data[rows], to_draft[best[rows]], step.aux_BT3H[rows]
        out, logits = draft(x[:, 1:], draft.fuse(f[:, :-1]), pos)
        _, logits2 = draft(x[:, 2:], out[:, :-1], pos[:, 1:])
        loss = F.cross_entropy(logits.flatten(0, 1), y[:, 1:].flatten()) + 0.8 * F.cross_entropy(
            logits2.flatten(0, 1), y[:, 2:].flatten()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


@pytest.fixture(scope="module")
def llama_pair():
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    return target, _train_pair(target, draft_vocab=200, seed=1)


@pytest.fixture(scope="module")
def llama_pair_eagle3_1():
    """The same kind of pair with an eagle3.1 head (fc_norm, norm_output), trained the same way."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    return target, _train_pair(target, draft_vocab=200, seed=1, variant="eagle3.1")


@pytest.fixture(scope="module")
def qwen3_pair():
    torch.manual_seed(1)
    target = Qwen3ForCausalLM(Qwen3Config(**SHAPE)).eval()
    return target, _train_pair(target, draft_vocab=200, seed=2)


def _prompts(batch: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths (3..9 tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch, 9), generator=g)
    mask = torch.ones_like(ids)
    for b in range(1, batch):
        mask[b, : 2 * b] = 0
    return ids * mask, mask


def _same(a: speculative.GenOutput, b: speculative.GenOutput) -> None:
    assert torch.equal(a.lengths, b.lengths), (a.lengths, b.lengths)
    assert torch.equal(a.sequences, b.sequences), (a.sequences, b.sequences)


def test_plain_matches_uncached_reference(llama_pair):
    target, _ = llama_pair
    ids, mask = _prompts(3)
    out = generate_plain(target, ids, mask, SpecConfig(max_new_tokens=12))
    for b in range(3):
        x = ids[b][mask[b].bool()][None]
        for _ in range(12):
            x = torch.cat([x, target(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert out.sequences[b].tolist() == x[0, -12:].tolist()


def test_padding_side_does_not_matter(llama_pair):
    target, draft = llama_pair
    ids, mask = _prompts(3)
    packed, n = pack_left(ids, mask)
    right_mask = (torch.arange(9)[None] < n[:, None]).long()
    right_ids = packed * right_mask
    cfg = SpecConfig(method="tree", max_new_tokens=10, depth=3, topk=2, budget=5)
    _same(
        generate_speculative(target, draft, ids, mask, cfg),
        generate_speculative(target, draft, right_ids, right_mask, cfg),
    )


@pytest.mark.parametrize("method", ["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_plain(llama_pair, method, batch):
    target, draft = llama_pair
    ids, mask = _prompts(batch)
    cfg = SpecConfig(method=method, depth=4, topk=3, budget=10, max_new_tokens=40)
    plain = generate_plain(target, ids, mask, cfg)
    spec = generate_speculative(target, draft, ids, mask, cfg)
    _same(spec, plain)
    acc = spec.stats.accept_lengths
    assert acc.max() >= 2 and (acc == 0).any(), "the test pair should accept some drafts and reject others"
    assert spec.stats.tau > 1.3
    assert spec.stats.n_verify_steps < 40


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_eagle3_1_head_greedy_speculative_equals_plain(llama_pair_eagle3_1, method):
    target, draft = llama_pair_eagle3_1
    assert draft.cfg.fc_norm and draft.cfg.norm_output
    ids, mask = _prompts(4)
    cfg = SpecConfig(method=method, depth=4, topk=3, budget=10, max_new_tokens=40)
    spec = generate_speculative(target, draft, ids, mask, cfg)
    _same(spec, generate_plain(target, ids, mask, cfg))
    assert spec.stats.accept_lengths.max() >= 2 and spec.stats.tau > 1.3


@pytest.mark.parametrize("batch", [1, 4])
def test_early_exit_chain_drafts_less_and_stays_identical(llama_pair, batch):
    target, draft = llama_pair
    ids, mask = _prompts(batch)
    cfg = SpecConfig(method="chain", depth=4, max_new_tokens=40, min_draft_prob=0.8)
    plain = generate_plain(target, ids, mask, cfg)
    spec = generate_speculative(target, draft, ids, mask, cfg)
    _same(spec, plain)
    full = generate_speculative(target, draft, ids, mask, dataclasses.replace(cfg, min_draft_prob=0.0))
    d = spec.stats.drafted
    assert d.min() >= 1 and d.max() <= 4 and (d < 4).any(), "the threshold should stop some chains early"
    assert (full.stats.drafted == 4).all()
    acc = spec.stats.accept_lengths
    assert (acc <= d[:, None]).all()  # never more accepted than drafted
    assert d.sum() < full.stats.drafted.sum()


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_eos_and_max_length_edges(llama_pair, method):
    target, draft = llama_pair
    ids, mask = _prompts(4)
    free = generate_plain(target, ids, mask, SpecConfig(max_new_tokens=30))
    eos = int(free.sequences[1, 7])  # a token row 1 emits mid-way; other rows may emit it earlier or never
    for max_new in (1, 2, 5, 30):
        cfg = SpecConfig(
            method=method, depth=3, topk=3, budget=8, max_new_tokens=max_new, eos_token_id=(eos, 999), pad_token_id=-1
        )
        plain = generate_plain(target, ids, mask, cfg)
        _same(generate_speculative(target, draft, ids, mask, cfg), plain)
    assert plain.lengths[1] <= 8 and plain.sequences[1, plain.lengths[1] - 1] == eos
    assert (plain.sequences[1, plain.lengths[1] :] == -1).all()


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_qwen3_target(qwen3_pair, method):
    target, draft = qwen3_pair
    ids, mask = _prompts(3, seed=5)
    cfg = SpecConfig(method=method, depth=3, topk=3, budget=8, max_new_tokens=24)
    spec = generate_speculative(target, draft, ids, mask, cfg)
    _same(spec, generate_plain(target, ids, mask, cfg))
    assert spec.stats.tau > 1.2


def _recording(cls: type) -> type:
    """`cls` with its last instance kept in `.last`."""

    class Recording(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            type(self).last = self

    return Recording


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_caches_hold_exactly_the_accepted_sequence(llama_pair, method, monkeypatch):
    """After generation, both caches' committed entries equal a fresh pass over prompt + output."""
    target, draft = llama_pair
    monkeypatch.setattr(verify, "TargetRunner", _recording(TargetRunner))
    monkeypatch.setattr(speculative, "HeadDrafter", _recording(HeadDrafter))
    ids, mask = _prompts(2)
    out = generate_speculative(
        target, draft, ids, mask, SpecConfig(method=method, depth=4, topk=3, budget=10, max_new_tokens=17)
    )
    target_cache, drafter = verify.TargetRunner.last.cache, speculative.HeadDrafter.last
    for b in range(2):
        full = torch.cat([ids[b][mask[b].bool()], out.sequences[b]])[None]
        n = full.shape[1] - 1  # the last token is emitted, never verified
        fresh = TargetRunner(target, n + 4, draft.cfg.aux_layer_ids)
        _, aux = fresh.prefill(full[:, :n], torch.tensor([n]))
        for got, want in zip(target_cache.layers, fresh.cache.layers):
            torch.testing.assert_close(got.keys[b, :, :n], want.keys[0, :, :n], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(got.values[b, :, :n], want.values[0, :, :n], atol=1e-5, rtol=1e-4)
        head = SlotCache(1, n + 4)
        head.plan(torch.arange(n)[None], n)
        draft(full[:, 1 : n + 1], draft.fuse(aux), torch.arange(n)[None], head.layers[0])
        torch.testing.assert_close(
            drafter.head.cache.layers[0].keys[b, :, :n], head.layers[0].keys[0, :, :n], atol=1e-5, rtol=1e-4
        )


def _uncached_head_logits(draft, tokens_T, feats_TH, path):
    """Reference: the head's logits after drafting `path` (target ids) on top of committed entries, no cache."""
    n = tokens_T.shape[0]
    toks, hid = tokens_T, feats_TH
    out, logits = draft(toks[None], hid[None], torch.arange(n)[None])
    for s, tok in enumerate(path):
        toks, hid = torch.cat([toks, tok.view(1)]), torch.cat([hid, out[0, -1:]])
        out, logits = draft(toks[None], hid[None], torch.arange(n + s + 1)[None])
    return logits[0, -1]


def _committed_head(target, draft, cfg: SpecConfig):
    """A head drafter after the target's prefill of three padded prompts and the head's prompt commit: (drafter,
    lengths, root, shifted prompt, aux, hidden, draft logits)."""
    ids, n = pack_left(*_prompts(3))
    drafter = HeadDrafter(draft)
    capacity = ids.shape[1] + cfg.max_new_tokens + drafter.reach(cfg) + 2
    runner = TargetRunner(target, capacity, draft.cfg.aux_layer_ids)
    drafter.session(DraftSetup(capacity, runner.lm_head.weight.shape[0], cfg, None))
    logits, aux = runner.prefill(ids, n)
    root = logits.argmax(-1)
    history = History(ids, n, capacity)
    history.append(root[:, None], torch.ones_like(n))
    drafter.begin(history, aux)
    shifted = history.tokens_BC[:, 1 : ids.shape[1] + 1]
    return drafter, n, root, shifted, aux, drafter.hidden_BH, drafter.logits_BVd


def test_chain_drafting_against_uncached_reference(llama_pair):
    target, draft = llama_pair
    drafter, n, _, shifted, aux, hidden, dlogits = _committed_head(target, draft, SpecConfig(depth=4))
    drafts, q = draft_chain(drafter.head, Prefix.of(n), hidden, dlogits, 4, drafter.pick)
    assert q is None and drafts.shape == (3, 4)
    with torch.no_grad():
        for b in range(3):
            feats = draft.fuse(aux[b, : n[b]])
            for j in range(4):
                ref = _uncached_head_logits(draft, shifted[b, : n[b]], feats, drafts[b, :j])
                assert drafts[b, j] == draft.to_target_ids(ref.argmax())


def test_tree_drafting_against_uncached_reference(llama_pair):
    """Structure of the tree, and every node is a top-k child of its parent under an uncached head rerun."""
    target, draft = llama_pair
    depth, k, budget = 4, 3, 11
    cfg = SpecConfig(method="tree", depth=depth, topk=k, budget=budget)
    drafter, n, root, shifted, aux, hidden, dlogits = _committed_head(target, draft, cfg)
    tree = draft_tree(drafter.head, Prefix.of(n), root, hidden, dlogits, (depth, k, budget))
    assert tree.tokens_BN.shape == (3, budget + 1)
    assert (tree.parent_BN[:, 1:] < torch.arange(1, budget + 1)).all(), "parents come before children"
    assert torch.equal(tree.depth_BN[:, 1:], tree.depth_BN.gather(1, tree.parent_BN)[:, 1:] + 1)
    assert tree.depth_BN.max() <= depth
    assert torch.equal(tree.ancestors_BNN.sum(-1), tree.depth_BN + 1), "a node sees its root path and itself"
    with torch.no_grad():
        for b in range(3):
            feats = draft.fuse(aux[b, : n[b]])
            assert len(set(zip(tree.parent_BN[b].tolist(), tree.tokens_BN[b].tolist()))) == budget + 1
            for i in range(1, budget + 1):
                path = tree.ancestors_BNN[b, tree.parent_BN[b, i]].nonzero()[1:, 0]  # parent's path, root excluded
                ref = _uncached_head_logits(draft, shifted[b, : n[b]], feats, tree.tokens_BN[b, path])
                assert tree.tokens_BN[b, i] in draft.to_target_ids(ref.topk(k).indices)


def test_slot_cache_move_and_visibility():
    cache = SlotCache(1, 8)
    cache.plan(torch.tensor([[2, 3, 4], [1, 2, 3]]), 5)
    k = torch.arange(2 * 3, dtype=torch.float).view(2, 1, 3, 1)
    keys, _ = cache.layers[0].update(k, k)
    assert keys.shape == (2, 1, 5, 1) and keys[0, 0, 2:5, 0].tolist() == [0, 1, 2]
    cache.move(torch.tensor([[4, 4], [3, 3]]), torch.tensor([[2, 3], [1, 2]]))
    assert cache.layers[0].keys[0, 0, 2:4, 0].tolist() == [2, 2] and cache.layers[0].keys[1, 0, 1, 0] == 5
    region = torch.tensor([[[True, False], [True, True]]])
    mask = visibility_mask(torch.tensor([2, 1]), region, 4)
    assert mask[0].tolist() == [[True, True, True, False], [True, True, True, True]]
    assert mask[1].tolist() == [[True, True, False, False], [True, True, True, False]]


def test_causal_mask_slices_stay_aligned_on_an_accelerator():
    """CUDA's memory-efficient attention faults ("misaligned address", seen on an H200) on a mask whose first column
    is not 16-aligned: off the CPU an unaligned slice comes back as a fresh copy, an aligned one and any CPU one as a
    view of the prebuilt mask (no per-pass allocation)."""
    for device in ("cpu", "meta"):
        cm = CausalMask(64, 8, torch.float32, device)
        for L, T in ((5, 1), (48, 3), (64, 8), (17, 8)):
            m = cm(L, T)
            assert m.shape == (1, 1, T, L + T)
            view = (
                m.untyped_storage().data_ptr() == cm.mask.untyped_storage().data_ptr()
                if device == "cpu"
                else m._base is not None
            )
            assert view == (device == "cpu" or (64 - L) % 16 == 0), (device, L, T)
            if device == "cpu":  # column C - L + j of row t visible iff j <= L + t
                assert (m[0, 0] == 0).tolist() == [[j <= L + t for j in range(L + T)] for t in range(T)]


def test_stats():
    acc = torch.tensor([[0, 2], [3, -1], [1, -1]])
    stats = SpecStats(acc, depth=3)
    assert stats.n_verify_steps == 3
    assert stats.tau == pytest.approx((1 + 3 + 4 + 2) / 4)
    assert stats.per_position_acceptance == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    # with early exit a step that drafted only k tokens did not reach depth k + 1
    stats = SpecStats(acc, depth=3, drafted=torch.tensor([3, 3, 1]))
    assert stats.per_position_acceptance == pytest.approx([3 / 4, 2 / 2, 1 / 2])


def test_config_validation():
    with pytest.raises(ValueError):
        SpecConfig(method="beam")
    with pytest.raises(ValueError):
        SpecConfig(method="tree", depth=2, topk=2, budget=7)
    with pytest.raises(ValueError):
        SpecConfig(top_p=0.0)
    with pytest.raises(ValueError, match="min_draft_prob"):
        SpecConfig(min_draft_prob=1.0)


def test_forward_hooks_send_decoding_through_hf_with_one_warning(llama_pair):
    """A hook on the target (someone counting or altering passes) disables the lean decoder: the loops then run
    HF's forward (same tokens) and say so once, instead of silently running slower."""
    from eagle.fastpath import LeanDecoder

    target, draft = llama_pair
    ids, mask = _prompts(2)
    cfg = SpecConfig(depth=3, max_new_tokens=8)
    lean = generate_speculative(target, draft, ids, mask, cfg)
    assert LeanDecoder.of(target) is not None
    calls = []
    handle = target.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    try:
        with pytest.warns(UserWarning, match="forward hooks"):
            hooked = generate_speculative(target, draft, ids, mask, cfg)
        assert LeanDecoder.of(target) is None and calls, "the hook saw HF's forward passes"
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            generate_plain(target, ids, mask, cfg)  # warned once per target only
    finally:
        handle.remove()
    _same(lean, hooked)
    assert LeanDecoder.of(target) is not None
