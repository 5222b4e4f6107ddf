"""TTT loss, metrics and gradients against the plain step-by-step reference; draft vocabulary selection."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle.config import DraftConfig
from eagle.draft import Eagle3Draft
from eagle.features import target_forward, teacher_targets
from eagle.ttt import TTTBatch, TTTConfig, ttt_loss
from eagle.vocab import count_tokens, select_draft_vocab
from bench.reference_ttt import naive_ttt


def _setup(vocab=16, draft_vocab=12, B=2, S=24, seed=0, variant="eagle3"):
    torch.manual_seed(seed)
    tc = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    target = LlamaForCausalLM(tc).eval()
    ids = torch.randint(0, vocab, (B, S))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[:, :5] = 0  # a "prompt" that is not trained on
    mask[1, -4:] = 0  # right padding in row 1
    cfg = DraftConfig.from_target(tc, draft_vocab, variant=variant)
    draft = Eagle3Draft(cfg)
    counts = count_tokens(torch.zeros(vocab, dtype=torch.long), ids, mask)
    draft.set_draft_vocab(select_draft_vocab(counts, draft_vocab))
    draft.init_from_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    with torch.no_grad():
        step = target_forward(target, ids, cfg.aux_layer_ids)
    return target, draft, ids, mask, step


@pytest.mark.parametrize(
    "K,attn_chunk,loss_chunk,variant",
    [(1, 5, 7, "eagle3"), (4, 5, 7, "eagle3"), (3, 64, 64, "eagle3"), (3, 5, 7, "eagle3.1")],
)
def test_ttt_matches_naive_reference(K, attn_chunk, loss_chunk, variant):
    target, draft, ids, mask, step = _setup(variant=variant)
    w = target.get_output_embeddings().weight.detach()
    teacher = teacher_targets(step.last_hidden_BTH, w, draft.draft_ids(), chunk=9)
    batch = TTTBatch(ids, step.aux_BT3H, mask, teacher)
    cfg = TTTConfig(ttt_steps=K, gamma=0.8, attn_chunk=attn_chunk, loss_chunk=loss_chunk)
    _train(draft, batch, cfg, steps=15)  # so that some predictions are right and the metrics mean something
    draft.zero_grad(set_to_none=True)
    out = ttt_loss(draft, batch, cfg)
    out.loss.backward()
    ours = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()

    ref_loss, acc, cond, tau = naive_ttt(draft, ids, step.aux_BT3H, mask, step.last_hidden_BTH, w, K, 0.8)
    ref_loss.backward()
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert set(ours) == {n for n, p in draft.named_parameters() if p.grad is not None}
    for n, p in draft.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(ours[n], p.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")
    m = out.metrics()
    for k in range(K):
        assert m[f"acc_{k}"] == pytest.approx(acc[k], abs=1e-6)
        assert m[f"cond_acc_{k}"] == pytest.approx(cond[k], abs=1e-6)
    assert m["tau"] == pytest.approx(tau, abs=1e-6)
    assert any(a > 0 for a in acc), "test is vacuous: no correct prediction at all"
    assert "embed_tokens.weight" not in ours  # the target's embedding stays frozen


def _train(draft, batch, cfg, steps, lr=3e-3):
    opt = torch.optim.AdamW(draft.trainable_parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        ttt_loss(draft, batch, cfg).loss.backward()
        opt.step()


def test_ttt_training_raises_step_accuracy():
    target, draft, ids, mask, step = _setup(vocab=16, draft_vocab=16, B=4, S=32, seed=1)
    w = 30 * target.get_output_embeddings().weight.detach()  # a confident teacher (a random one is ~uniform)
    teacher = teacher_targets(step.last_hidden_BTH, w, draft.draft_ids())
    batch = TTTBatch(ids, step.aux_BT3H, mask, teacher)
    cfg = TTTConfig(ttt_steps=3)
    first = ttt_loss(draft, batch, cfg).metrics()
    _train(draft, batch, cfg, steps=60)
    last = ttt_loss(draft, batch, cfg).metrics()
    assert last["loss"] < 0.7 * first["loss"]
    assert last["acc_2"] > first["acc_2"] + 0.2 and last["tau"] > first["tau"] + 0.3


def test_draft_vocab_selection_and_mapping():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    ids = select_draft_vocab(counts, 4)
    assert ids.tolist() == [0, 2, 3, 5]
    assert select_draft_vocab(counts, 4, always_include=[6]).tolist() == [2, 3, 5, 6]
    cfg = DraftConfig.tiny(vocab_size=8, draft_vocab_size=4)
    d = Eagle3Draft(cfg)
    d.set_draft_vocab(ids)
    assert d.d2t.dtype == torch.int64 and d.d2t.tolist() == [0, 1, 1, 2]
    assert d.t2d.tolist() == [True, False, True, True, False, True, False, False]
    assert d.to_target_ids(torch.arange(4)).tolist() == [0, 2, 3, 5]
    with pytest.raises(ValueError):
        select_draft_vocab(counts, 9)
    with pytest.raises(ValueError):
        d.set_draft_vocab(torch.tensor([3, 2, 1, 0]))


def test_draft_inputs_follow_embedding_norm_and_vocabulary():
    """The drafting table is input_layernorm(embedding) of the draft vocabulary, rebuilt when any of them changes,
    and a head step fed its rows equals the step fed the tokens."""
    torch.manual_seed(0)
    d = Eagle3Draft(DraftConfig.tiny(vocab_size=32, draft_vocab_size=8)).eval()
    d.set_draft_vocab(torch.tensor([1, 3, 4, 8, 9, 20, 30, 31]))

    def expected():
        return d.midlayer.input_layernorm(d.embed_tokens.weight[d.draft_ids()])

    with torch.no_grad():
        table = d.draft_inputs()
        assert torch.equal(table, expected()) and d.draft_inputs() is table, "built once"
        d.midlayer.input_layernorm.weight.mul_(2)
        assert torch.equal(d.draft_inputs(), expected())
        d.set_draft_vocab(torch.arange(8) * 3)
        assert torch.equal(d.draft_inputs(), expected())
    with torch.inference_mode():
        idx = torch.tensor([[2, 5, 7]])
        hidden, pos = torch.randn(1, 3, 64), torch.arange(3)[None]
        a = d(d.to_target_ids(idx), hidden, pos)
        b = d(None, hidden, pos, normed_emb_BTH=d.draft_inputs()[idx])
        assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b))


def test_count_tokens_uses_loss_mask_only():
    c = count_tokens(torch.zeros(5, dtype=torch.long), torch.tensor([[1, 1, 2, 4]]), torch.tensor([[0, 1, 1, 0]]))
    assert c.tolist() == [0, 1, 1, 0, 0]
