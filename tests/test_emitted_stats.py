"""`SpecStats` counts what reached the output (`tau`, `per_position_acceptance`) apart from what the acceptance rule
accepted (`tau_raw`, `per_position_acceptance_raw`, `accept_lengths`), when a row ends inside a step on EOS or
`max_new_tokens`, for chains and trees, greedy and sampled.

Each generation test first runs without EOS and with a long limit, then places the end (an EOS token, or the
length limit) at the first draft of a step that accepted it, and reruns with the same seed: the rerun makes the
same steps until then, so its last step accepts more than the output holds (at least the correction/bonus token).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eagle.speculative import GenOutput, SpecConfig, generate_plain, generate_speculative
from eagle.stats import SpecStats
from tests.test_speculative import _prompts, _same, llama_pair  # noqa: F401  (llama_pair is a fixture)

MODES = [("chain", 0.0), ("tree", 0.0), ("chain", 1.0), ("tree", 1.0)]


def test_stats_from_counts():
    acc = torch.tensor([[0, 2], [3, 3], [1, -1]])
    # row 0 hits the length limit after the first draft of step 2; row 1 emits EOS as the 2nd draft of step 1
    emitted = torch.tensor([[1, 3], [4, 2], [1, -1]])
    stats = SpecStats(acc, depth=3, emitted_lengths=emitted)
    assert stats.tau_raw == pytest.approx((1 + 4 + 2 + 3 + 4) / 5)
    assert stats.tau == pytest.approx((1 + 4 + 1 + 3 + 2) / 5)
    assert stats.per_position_acceptance_raw == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    # censored: (a=1, e=1) does not reach depth 2, (a=3, e=2) does not reach depth 3
    assert stats.per_position_acceptance == pytest.approx([4 / 5, 3 / 3, 1 / 2])
    stats = SpecStats(acc, depth=3, drafted=torch.tensor([3, 3, 1]), emitted_lengths=emitted)
    assert stats.per_position_acceptance_raw == pytest.approx([4 / 5, 3 / 3, 2 / 3])
    assert stats.per_position_acceptance == pytest.approx([4 / 5, 3 / 3, 1 / 2])
    untruncated = SpecStats(acc, depth=3)  # no emitted counts: every live step emitted accepted + 1
    assert untruncated.tau == untruncated.tau_raw
    assert untruncated.per_position_acceptance == untruncated.per_position_acceptance_raw


def _run(pair, cfg: SpecConfig, batch: int) -> GenOutput:
    target, draft = pair
    ids, mask = _prompts(batch)
    gen = None if cfg.greedy else torch.Generator().manual_seed(11)
    return generate_speculative(target, draft, ids, mask, cfg, generator=gen)


def _step_ends(out: GenOutput) -> list[int]:
    """Row 0's output length after each of its live steps, in the run without truncation."""
    a = out.stats.accept_lengths[:, 0]
    return (1 + torch.cumsum(a[a >= 0] + 1, 0)).tolist()


def _censoring_points(out: GenOutput) -> list[int]:
    """Output indices of row 0 holding the first draft of a step that accepted it and more: ending the output
    there truncates the step."""
    a = out.stats.accept_lengths[:, 0]
    starts = [1] + _step_ends(out)[:-1]
    return [p for p, n in zip(starts, a[a >= 0].tolist()) if n >= 1 and p < int(out.lengths[0]) - 1]


def _check_emitted(out: GenOutput, cfg: SpecConfig) -> None:
    """Emitted counts agree with the output and with the raw counts, row by row."""
    st, B = out.stats, out.lengths.shape[0]
    acc, e = st.accept_lengths, st.emitted_lengths
    assert e.shape == acc.shape and torch.equal(e < 0, acc < 0)
    live = acc >= 0
    assert int(e[live].sum()) == int(out.lengths.sum()) - B  # the token after prefill belongs to no step
    assert st.tau == (int(out.lengths.sum()) - B) / int(live.sum())
    assert ((e >= 1) | ~live).all() and (e <= acc + 1).all()
    for b in range(B):
        steps = live[:, b].nonzero()[:, 0]
        assert torch.equal(e[steps[:-1], b], acc[steps[:-1], b] + 1), "only a row's last step is truncated"
    assert st.tau <= st.tau_raw


@pytest.mark.parametrize("method,temperature", MODES)
def test_eos_inside_a_step(llama_pair, method, temperature):
    base = SpecConfig(method=method, depth=4, topk=3, budget=10, max_new_tokens=48, temperature=temperature)
    free = _run(llama_pair, base, batch=2)
    seq = free.sequences[0].tolist()
    points = [p for p in _censoring_points(free) if seq[p] not in seq[:p]]
    assert points, "the test pair should accept a draft token not emitted before"
    p = points[0]
    cfg = dataclasses.replace(base, eos_token_id=seq[p])
    out = _run(llama_pair, cfg, batch=2)
    assert int(out.lengths[0]) == p + 1 and int(out.sequences[0, p]) == seq[p]
    _cut_inside_its_last_step(llama_pair, out, cfg, batch=2)


def _cut_inside_its_last_step(llama_pair, out, cfg, batch: int) -> None:
    """Row 0's last step emitted one token of the several it accepted: tau_raw counts them, tau does not; greedy
    output is still plain decoding's."""
    _check_emitted(out, cfg)
    last = int((out.stats.accept_lengths[:, 0] >= 0).sum()) - 1
    assert out.stats.emitted_lengths[last, 0] == 1 < out.stats.accept_lengths[last, 0] + 1
    assert out.stats.tau_raw > out.stats.tau
    if cfg.greedy:
        target, _ = llama_pair
        _same(out, generate_plain(target, *_prompts(batch), cfg))


@pytest.mark.parametrize("method,temperature", MODES)
def test_length_limit_inside_a_step(llama_pair, method, temperature):
    base = SpecConfig(method=method, depth=4, topk=3, budget=10, max_new_tokens=48, temperature=temperature)
    free = _run(llama_pair, base, batch=1)
    points = _censoring_points(free)
    assert points, "the test pair should accept drafts in some step"
    cfg = dataclasses.replace(base, max_new_tokens=points[0] + 1)
    out = _run(llama_pair, cfg, batch=1)
    assert torch.equal(out.sequences[0], free.sequences[0, : points[0] + 1])
    _cut_inside_its_last_step(llama_pair, out, cfg, batch=1)


@pytest.mark.parametrize("method,temperature", MODES)
def test_untruncated_run_counts_alike(llama_pair, method, temperature):
    """The length limit falls on a step's end and there is no EOS: both definitions agree exactly."""
    base = SpecConfig(method=method, depth=4, topk=3, budget=10, max_new_tokens=48, temperature=temperature)
    free = _run(llama_pair, base, batch=1)
    ends = [n for n in _step_ends(free) if n <= 48]
    cfg = dataclasses.replace(base, max_new_tokens=ends[len(ends) // 2])
    out = _run(llama_pair, cfg, batch=1)
    _check_emitted(out, cfg)
    st = out.stats
    assert torch.equal(st.emitted_lengths, st.accept_lengths + 1)
    assert st.tau == st.tau_raw
    assert st.per_position_acceptance == st.per_position_acceptance_raw


def test_acceptance_by_output_position_buckets_steps_where_they_start():
    from components.registry.register import _acceptance_tags
    from eagle.stats import acceptance_by_position, raw_steps, step_starts

    # one sequence: steps start at output positions 1, 4, 5, 9 (the token after prefill is position 0)
    accepted, emitted = [2, 0, 3, 3], [3, 1, 4, 2]  # the last step ended at the length limit inside the step
    assert step_starts(emitted) == [1, 4, 5, 9]
    b = acceptance_by_position([(accepted, emitted), ([1], [2])], edges=(0, 4, 9, 20))
    assert [(x["lo"], x["hi"], x["steps"]) for x in b] == [(0, 4, 2), (4, 9, 2), (9, 20, 1)]
    assert (b[0]["tau"], b[0]["alpha_1"]) == (2.5, 1.0) and (b[1]["tau"], b[1]["alpha_1"]) == (2.5, 0.5)
    assert (b[2]["tau"], b[2]["alpha_1"]) == (2.0, 1.0)
    raw = acceptance_by_position([raw_steps(accepted)], edges=(0, 4, 9, 20, 40))
    assert raw[2]["tau"] == 4.0 and raw[3] == {"lo": 20, "hi": 40, "steps": 0, "tau": None, "alpha_1": None}
    assert acceptance_by_position([(accepted, emitted)], edges=(0, 2))[0]["steps"] == 1  # later steps: no bucket
    tags = _acceptance_tags(
        {"tau_pos_128_512": 2.5, "tau_pos_0_128": 3.0, "tau_vllm_pos_0_128": 3.0, "alpha_1_pos_0_128": 0.9}
    )
    assert tags["tau_by_position"] == "0-128:3.0000 128-512:2.5000" and tags["tau_by_position_vllm"] == "0-128:3.0000"


def test_position_edges_are_checked():
    from components.evaluate.stage import EvaluateConfig
    from eagle.config_checks import FieldError

    assert EvaluateConfig().position_edges == (0, 128, 512, 2048)
    for bad in ((0,), (0, 128, 128), (-1, 4), (0, 2.5)):
        with pytest.raises(FieldError, match="position_edges"):
            EvaluateConfig(position_edges=bad)
