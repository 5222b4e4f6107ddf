"""Parallel drafting (head variants "parallel", P-EAGLE, and "eagle3.1-parallel", P-EAGLE with EAGLE-3.1's norms):
trained, decoded and served as vLLM 0.32 does it. Every test below runs for both variants (`PARALLEL_VARIANTS`).

Fast tier (tiny random Llama targets, CPU, seconds):
- the TTT loss of a parallel head equals a naive reference that builds vLLM's parallel pass per anchor position
  (committed entries, then K-1 masked slots: token `mask_token_id`, hidden state fc(mask_hidden), one causal pass;
  with eagle3.1's norms fc(fc_norm(.)) for features and mask_hidden alike, as vLLM's `combine_hidden_states`),
  gradients included; and it falls when trained;
- our decoder's one-pass drafts are that pass (checked against the head run from scratch), greedy output equals
  plain decoding token for token, with drafts accepted, in batches, with sampling and early exit too;
- export writes `mask_token_id` into config.json and the `mask_hidden` tensor [1, 3H] (and eagle3.1's `fc_norm`,
  `norm_output` and `fc_norm.{0,1,2}`), and loads back bit-identical; the serving spec turns `parallel_drafting` on
  for such a head only; the variant settings are checked at config load; every variant name is a valid MLflow key.
Engine tier (`engine`, real vLLM CPU build, one server pair per variant): a head of the variant trained by the
pipeline on the tiny engine target is loaded unmodified by vLLM with `parallel_drafting: true`; its greedy output
equals vLLM's plain output and ours, and vLLM's counters (drafts, accepted per position) and per-request steps equal
ours (with eagle3.1's norms, equal counters show that vLLM norms `mask_hidden` as we do).
Run: `python -m pytest tests/test_parallel_drafting.py -m "not engine"` (~80 s on 2 busy cores); each engine test
~5-9 min with its session fixtures (the engine target and head, ~3 min) and two vLLM servers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from eagle.config import PARALLEL_VARIANTS, VARIANTS, DraftConfig
from eagle.draft import Eagle3Draft
from eagle.drafters import commit_head
from eagle.export import export_head, load_head
from eagle.features import target_forward, teacher_targets
from eagle.run_config import TTTConfig
from eagle.speculative import SpecConfig, generate_plain, generate_speculative
from eagle.runners import HeadRunner, Prefix
from eagle.ttt import TTTBatch, ttt_loss
from eagle.vocab import count_tokens, select_draft_vocab
from tests.test_speculative import _prompts, predictable

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


def _head(target, draft_vocab: int, ids=None, mask=None, variant: str = "parallel") -> Eagle3Draft:
    cfg = DraftConfig.from_target(target.config, draft_vocab, variant=variant)
    draft = Eagle3Draft(cfg)
    if ids is not None:
        draft.set_draft_vocab(
            select_draft_vocab(count_tokens(torch.zeros(cfg.vocab_size, dtype=torch.long), ids, mask), draft_vocab)
        )
    draft.init_from_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    if cfg.fc_norm:  # away from their initial ones, so that a missing norm shows
        with torch.no_grad():
            for n in draft.fc_norm:
                n.weight.uniform_(0.5, 1.5)
    return draft


def _combine(draft: Eagle3Draft, aux: torch.Tensor) -> torch.Tensor:
    """vLLM's `combine_hidden_states` written out: with `fc_norm`, an RMSNorm per H-chunk, then `fc`."""
    if draft.cfg.fc_norm:
        eps = draft.cfg.rms_norm_eps
        aux = torch.cat(
            [
                c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * n.weight
                for c, n in zip(aux.chunk(3, -1), draft.fc_norm)
            ],
            -1,
        )
    return aux @ draft.fc.weight.T


def _naive_parallel(draft: Eagle3Draft, ids, aux, mask, teacher, K: int, gamma: float):
    """vLLM's parallel pass built literally for every anchor i: committed entries (x_{j+1}, f_j) at j <= i, then
    K-1 masked slots at i+1..i+K-1, one causal forward without a cache; slot k drafts x_{i+2+k}."""
    B, S = ids.shape
    nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
    fused = _combine(draft, aux)
    m = draft.cfg.mask_token_id
    mask_h = _combine(draft, draft.mask_hidden.view(-1))[None]  # vLLM projects the flat [3H] buffer
    loss = 0.0
    argmax = torch.full((K, B, S), -1, dtype=torch.long)
    for k in range(K):
        num, den = 0.0, 0.0
        for b in range(B):
            for i in range(S):
                if i + 1 + k >= S:
                    continue
                toks = torch.cat([nxt[b, : i + 1], torch.full((K - 1,), m)])[None]
                hid = torch.cat([fused[b, : i + 1], mask_h.expand(K - 1, -1)])[None]
                pos = torch.arange(i + K)[None]
                _, logits = draft(toks, hid, pos)
                logp = torch.log_softmax(logits[0, i + k].float(), -1)
                argmax[k, b, i] = int(logp.argmax())
                w = float(i + 2 + k < S and mask[b, i + 2 + k] and teacher.in_vocab_BT[b, i + 1 + k])
                num = num - w * (teacher.probs_BTVd[b, i + 1 + k] * logp).sum()
                den += w
        loss = loss + gamma**k * num / max(den, 1.0)
    return loss, argmax


def _setup(seed=0, B=2, S=12, vocab=32, draft_vocab=24, variant="parallel"):
    torch.manual_seed(seed)
    tc = LlamaConfig(**{**SHAPE, "vocab_size": vocab})
    target = LlamaForCausalLM(tc).eval()
    ids = torch.randint(0, vocab, (B, S))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[:, :3] = 0
    mask[1, -3:] = 0
    draft = _head(target, draft_vocab, ids, mask, variant)
    with torch.no_grad():
        step = target_forward(target, ids, draft.cfg.aux_layer_ids)
    teacher = teacher_targets(step.last_hidden_BTH, target.get_output_embeddings().weight.detach(), draft.draft_ids())
    return target, draft, TTTBatch(ids, step.aux_BT3H, mask, teacher)


@pytest.mark.parametrize("variant", PARALLEL_VARIANTS)
def test_ttt_loss_is_vllms_parallel_pass(variant):
    _, draft, batch = _setup(variant=variant)
    K = 3
    cfg = TTTConfig(ttt_steps=K, gamma=0.8, attn_chunk=5, loss_chunk=7)
    out = ttt_loss(draft, batch, cfg)
    out.loss.backward()
    ours = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    ref, _ = _naive_parallel(draft, batch.input_ids_BS, batch.aux_BS3H, batch.loss_mask_BS, batch.teacher, K, 0.8)
    ref.backward()
    torch.testing.assert_close(out.loss, ref, atol=1e-5, rtol=1e-5)
    assert "mask_hidden" in ours and float(ours["mask_hidden"].abs().sum()) > 0  # the masked slots train it
    if draft.cfg.fc_norm:  # eagle3.1-parallel: the norms train too, from the features and from mask_hidden
        assert all(float(ours[f"fc_norm.{i}.weight"].abs().sum()) > 0 for i in range(3))
    for n, p in draft.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(ours[n], p.grad, atol=1e-5, rtol=1e-4, msg=lambda msg: f"{n}: {msg}")


@pytest.mark.parametrize("variant", PARALLEL_VARIANTS)
def test_training_lowers_the_loss_of_every_slot(variant):
    _, draft, batch = _setup(seed=1, B=4, S=32, vocab=16, draft_vocab=16, variant=variant)
    batch = dataclasses.replace(
        batch,
        teacher=dataclasses.replace(batch.teacher, probs_BTVd=torch.softmax(30 * batch.teacher.probs_BTVd.log(), -1)),
    )  # a confident teacher
    cfg = TTTConfig(ttt_steps=3)
    first = ttt_loss(draft, batch, cfg).metrics()
    opt = torch.optim.AdamW(draft.trainable_parameters(), lr=3e-3)
    for _ in range(60):
        opt.zero_grad()
        ttt_loss(draft, batch, cfg).loss.backward()
        opt.step()
    last = ttt_loss(draft, batch, cfg).metrics()
    assert last["loss"] < 0.7 * first["loss"]
    assert all(last[f"loss_{k}"] < first[f"loss_{k}"] for k in range(3))


def _trained_pair(variant: str, seed: int = 1) -> tuple[torch.nn.Module, Eagle3Draft]:
    """A random Llama with its residual branches scaled down (predictable argmax) and a head of the (parallel)
    `variant` fitted by TTT to its own greedy continuations."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        predictable(target)
        prompts = torch.randint(0, 256, (64, 4), generator=g)
        data = torch.cat([prompts, generate_plain(target, prompts, None, SpecConfig(max_new_tokens=28)).sequences], 1)
    mask = torch.ones_like(data)
    draft = _head(target, 200, data, mask, variant)
    with torch.no_grad():
        step = target_forward(target, data, draft.cfg.aux_layer_ids)
        teacher = teacher_targets(step.last_hidden_BTH, target.lm_head.weight, draft.draft_ids())
    cfg = TTTConfig(ttt_steps=3, attn_chunk=32, loss_chunk=512)
    opt = torch.optim.AdamW(draft.trainable_parameters(), lr=1e-2)
    for _ in range(120):
        rows = torch.randint(0, 64, (16,), generator=g)
        t = teacher
        batch = TTTBatch(
            data[rows],
            step.aux_BT3H[rows],
            mask[rows],
            type(t)(t.probs_BTVd[rows], t.in_vocab_BT[rows], t.argmax_BT[rows]),
        )
        opt.zero_grad()
        ttt_loss(draft, batch, cfg).loss.backward()
        opt.step()
    return target, draft.eval()


@pytest.fixture(scope="module", params=PARALLEL_VARIANTS)
def pair(request):
    return _trained_pair(request.param)


def test_one_pass_drafts_are_the_head_run_from_scratch(pair):
    """The commit with masked slots (our cache, rows of different lengths) gives the logits of the whole sequence
    [committed entries, masked slots] run through the head without a cache: vLLM's single forward."""
    target, draft = pair
    ids, mask = _prompts(3)
    n_B = mask.sum(1)
    packed = torch.stack([torch.cat([r[m.bool()], r[~m.bool()]]) for r, m in zip(ids, mask)])
    with torch.no_grad():
        aux = target_forward(target, packed, draft.cfg.aux_layer_ids).aux_BT3H
        head = HeadRunner(draft, 32)
        _, logits_BKVd = commit_head(head, draft, Prefix(torch.zeros_like(n_B), 0), packed, aux, n_B, masked=3)
        for b in range(3):
            n = int(n_B[b])
            toks = torch.cat([packed[b, :n], torch.full((3,), draft.cfg.mask_token_id)])[None]
            hidden_mask = _combine(draft, draft.mask_hidden.view(-1)).expand(1, 3, -1)
            hid = torch.cat([_combine(draft, aux[b : b + 1, :n]), hidden_mask], 1)
            _, ref = draft(toks, hid, torch.arange(n + 3)[None])
            torch.testing.assert_close(logits_BKVd[b], ref[0, n - 1 :], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_equals_plain(pair, batch):
    target, draft = pair
    ids, mask = _prompts(batch)
    cfg = SpecConfig(depth=3, max_new_tokens=40)
    spec = generate_speculative(target, draft, ids, mask, cfg)
    plain = generate_plain(target, ids, mask, cfg)
    assert torch.equal(spec.sequences, plain.sequences) and torch.equal(spec.lengths, plain.lengths)
    acc = spec.stats.accept_lengths
    assert acc.max() >= 2, "the masked slots' drafts should be accepted sometimes"
    assert (spec.stats.drafted == 3).all()
    early = generate_speculative(target, draft, ids, mask, dataclasses.replace(cfg, min_draft_prob=0.9))
    assert torch.equal(early.sequences, plain.sequences) and (early.stats.drafted < 3).any()


def test_sampled_generation_runs_and_trees_are_refused(pair):
    target, draft = pair
    ids, mask = _prompts(2)
    out = generate_speculative(
        target,
        draft,
        ids,
        mask,
        SpecConfig(depth=3, max_new_tokens=16, temperature=1.0),
        generator=torch.Generator().manual_seed(0),
    )
    assert (out.lengths == 16).all() and out.stats.n_verify_steps < 16 * 2
    with pytest.raises(ValueError, match="parallel head drafts chains"):
        generate_speculative(target, draft, ids, mask, SpecConfig(method="tree", depth=3, max_new_tokens=4))


def test_export_round_trip_and_engine_keys(tmp_path, pair):
    from infra.vllm_engine_spec import EngineSpec, head_drafts_in_parallel

    target, draft = pair
    out = export_head(draft, tmp_path / "head")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mask_token_id"] == draft.cfg.mask_token_id == target.config.eos_token_id  # no pad token: EOS
    normed = draft.cfg.variant == "eagle3.1-parallel"
    assert cfg["fc_norm"] is cfg["norm_output"] is normed and cfg["norm_before_fc"] is False
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["mask_hidden"].shape == (1, 3 * draft.cfg.hidden_size)
    assert {k for k in tensors if k.startswith("fc_norm")} == (
        {f"fc_norm.{i}.weight" for i in range(3)} if normed else set()
    )
    back = load_head(out, target)
    assert back.cfg == draft.cfg
    for name, t in draft.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    ids, mask = _prompts(2)
    cfg_gen = SpecConfig(depth=3, max_new_tokens=12)
    a, b = (generate_speculative(target, h, ids, mask, cfg_gen) for h in (draft, back))
    assert torch.equal(a.stats.accept_lengths, b.stats.accept_lengths)
    spec = EngineSpec(str(tmp_path), str(out), num_speculative_tokens=3)
    assert head_drafts_in_parallel(out) and spec.speculative_config()["parallel_drafting"] is True
    eagle3 = export_head(
        Eagle3Draft(dataclasses.replace(draft.cfg, variant="eagle3", mask_token_id=None)), tmp_path / "eagle3"
    )
    assert "mask_token_id" not in json.loads((eagle3 / "config.json").read_text())
    assert "parallel_drafting" not in EngineSpec(str(tmp_path), str(eagle3)).speculative_config()
    from components.serving.launch import launch_commands

    cmds = launch_commands(spec)
    assert '"parallel_drafting": true' in cmds["vllm"] and cmds["sglang"].startswith("#")


def test_variant_settings(tmp_path):
    from components.config.pipeline import ConfigError, PipelineConfig
    from components.registry.variant_choice import choose_variant, variant_tags
    from components.train.stage import TrainConfig
    from eagle.train import as_variant
    from mlflow.utils.validation import validate_param_and_metric_name

    assert TrainConfig(variant="parallel").variant == "parallel"
    assert TrainConfig(variants=("eagle3", "parallel")).variants == ("eagle3", "parallel")
    for v in PARALLEL_VARIANTS:
        with pytest.raises(ValueError, match=f"TrainConfig.variant '{v}' needs ttt.ttt_steps >= 2"):
            TrainConfig(variant=v, ttt=TTTConfig(ttt_steps=1))
        path = tmp_path / f"{v}.json"
        tree = {"method": "tree", "topk": 2, "budget": 8}
        path.write_text(json.dumps({"train": {"variants": ["eagle3", v]}, "evaluate": {"spec": tree}}))
        with pytest.raises(ConfigError, match=f"train.variant '{v}' drafts chains .* set evaluate.spec.method"):
            PipelineConfig.load(path, "tiny")
    base = DraftConfig.tiny()
    both = dataclasses.replace(base, variant="eagle3.1-parallel")
    assert both.fc_norm and both.norm_output and both.parallel and both.mask_token_id == 0
    with pytest.raises(ValueError, match="mask_token_id is for the parallel variants only"):
        dataclasses.replace(base, mask_token_id=3)
    with pytest.raises(ValueError, match="mask_token_id must be a token id"):
        dataclasses.replace(base, variant="parallel", mask_token_id=base.vocab_size)
    head = Eagle3Draft(base)
    par = as_variant(head, "parallel", mask_token_id=5)
    assert par.cfg.mask_token_id == 5 and torch.equal(par.fc.weight, head.fc.weight)
    assert as_variant(par, "parallel", mask_token_id=7) is par and as_variant(head, "parallel").cfg.mask_token_id == 0
    back = as_variant(par, "eagle3")
    assert back.cfg.mask_token_id is None and "mask_hidden" not in back.state_dict()
    normed = as_variant(head, "eagle3.1")
    with torch.no_grad():
        normed.fc_norm[0].weight.fill_(2.0)
    combined = as_variant(normed, "eagle3.1-parallel", mask_token_id=5)  # keeps fc_norm, adds mask_hidden
    assert combined.cfg.mask_token_id == 5 and torch.equal(combined.fc_norm[0].weight, normed.fc_norm[0].weight)
    assert torch.equal(as_variant(combined, "parallel").mask_hidden, combined.mask_hidden)
    # the last in VARIANTS (simplest first): it wins a tie with nothing; names fit MLflow's keys
    metrics = {v: {"speedup": 1.5, "speedup_lo": 1.4, "speedup_hi": 1.6} for v in VARIANTS}
    assert VARIANTS[-1] == "eagle3.1-parallel" and choose_variant(metrics).variant == "eagle3"
    keys = [*variant_tags(metrics, choose_variant(metrics)), *(f"{v}/loss" for v in VARIANTS)]
    assert all(validate_param_and_metric_name(k) for k in keys), keys


def _engine_eval():
    from components.evaluate.speed import SpeedupConfig
    from components.evaluate.stage import EvaluateConfig

    return EvaluateConfig(
        spec=SpecConfig(depth=3, max_new_tokens=24), limit=6, speed=SpeedupConfig.tiny(), position_edges=(0, 8, 16, 64)
    )


@pytest.fixture(scope="module")
def plain_vllm(engine_target, engine_settings):
    """vLLM without speculation for `_engine_eval()`, started once for both variants' head servers."""
    from components.evaluate.engine import plain_server

    with plain_server(_engine_eval(), engine_target.target_dir, engine_settings) as srv:
        yield srv


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("variant", PARALLEL_VARIANTS)
def test_vllm_serves_the_parallel_head_losslessly_with_our_acceptance(
    variant, engine_target, engine_head, engine_settings, plain_vllm, tmp_path
):
    from components.evaluate.engine import evaluate_in_vllm, our_outputs
    from components.evaluate.stage import HeadEval, evaluate
    from components.targets.servable import is_servable
    from components.train.stage import TrainConfig, train
    from tests.helpers import our_counts

    quiet = dict(progress=lambda s: None)
    cfg = dataclasses.replace(TrainConfig.tiny(), steps=60, checkpoint_every=60, variant=variant)
    head = train(cfg, engine_head.extract_dir, str(tmp_path / "train"), engine_target.target_dir).head_dir
    head_cfg = json.loads((Path(head) / "config.json").read_text())
    assert is_servable(head) and "mask_token_id" in head_cfg
    assert head_cfg["fc_norm"] is head_cfg["norm_output"] is (variant == "eagle3.1-parallel")
    ev = _engine_eval()
    heldout = str(engine_target.target_traffic.heldout)
    ours = evaluate(ev, HeadEval(engine_target.target_dir, head, heldout, str(tmp_path / "local")), **quiet)
    assert ours.identical
    res = evaluate_in_vllm(
        ev,
        HeadEval(engine_target.target_dir, head, heldout, str(tmp_path / "vllm")),
        engine_settings,
        ours=our_outputs(ours.report_file),
        plain=plain_vllm,
        **quiet,
    )
    log = "\n".join(p.read_text(errors="replace") for p in (engine_settings.state_dir / "vllm").glob("*.log"))
    assert "parallel_drafting': True" in log or '"parallel_drafting": true' in log
    assert res.identical_to_plain and res.identical_to_ours
    steps, per_pos = our_counts(ours.report_file, ev.spec.depth)
    assert (res.drafts, res.accepted_per_pos) == (steps, per_pos)
    local = json.loads(Path(ours.report_file).read_text())
    engine = json.loads(Path(res.report_file).read_text())
    assert [s["accept_lengths"] for s in engine["samples"]] == [s["accept_lengths"] for s in local["samples"]]
    assert per_pos[1] > 0, "the masked slots' drafts should be accepted sometimes"
