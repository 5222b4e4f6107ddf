"""The load sweep's rules without an engine (components/evaluate/load_cells.py, load_config.py; infra/vllm_bench.py).

Purpose: the schedule rule on given throughputs: the best K per level, K 0 unless a K beats plain by the margin and
its spread over rounds lies above plain's, ranges from batch size 1 that vLLM accepts, the crossover; cells as medians
over rounds with their spread, and concurrency 1 from an engine evaluation's report (`evaluation_cells`); the
alternating order of a round; batch variance told from a head mismatch on made-up texts (`judge`); the load client
runs past EOS only when told to (`ignore_eos`); bad sweep settings fail at config load with the key's path.
Run: `python -m pytest tests/test_load_cells.py` (a few seconds; no engine).
Not here: the sweep on the real engine (tests/test_load_sweep.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from components.config.pipeline import ConfigError, PipelineConfig
from components.evaluate.load_cells import cells_of, crossover_of, derive_schedule
from components.evaluate.load_sweep import round_order
from infra.settings import Settings


def test_the_schedule_takes_the_best_k_per_level_and_stops_where_plain_wins():
    tput = {0: {1: 100.0, 4: 300.0, 16: 900.0}, 3: {1: 150.0, 4: 320.0, 16: 600.0}, 5: {1: 160.0, 4: 290.0, 16: 500.0}}
    schedule, best = derive_schedule(tput, margin=0.03)
    assert best == {1: 5, 4: 3, 16: 0} and crossover_of(best) == 16
    assert schedule == [[1, 3, 5], [4, 15, 3], [16, 1024, 0]]
    # within the margin plain keeps the level; equal throughputs prefer the smaller K
    schedule, best = derive_schedule(
        {0: {1: 100.0, 8: 400.0}, 2: {1: 130.0, 8: 410.0}, 4: {1: 130.0, 8: 300.0}}, margin=0.05
    )
    assert best == {1: 2, 8: 0} and schedule == [[1, 7, 2], [8, 1024, 0]]
    schedule, best = derive_schedule({0: {2: 100.0, 4: 150.0}, 3: {2: 200.0, 4: 300.0}}, margin=0.0)
    assert schedule == [[1, 1024, 3]] and crossover_of(best) is None  # the first range starts at 1, merged


def test_a_k_whose_spread_overlaps_plains_does_not_beat_plain():
    """Medians alone would schedule K 3 at both levels; at 4 its slowest round is slower than plain's fastest."""
    tput = {0: {1: 100.0, 4: 300.0}, 3: {1: 130.0, 4: 330.0}}
    spread = {0: {1: (95.0, 105.0), 4: (250.0, 340.0)}, 3: {1: (120.0, 140.0), 4: (320.0, 340.0)}}
    assert derive_schedule(tput, 0.03)[1] == {1: 3, 4: 3}
    schedule, best = derive_schedule(tput, 0.03, spread)
    assert best == {1: 3, 4: 0} and schedule == [[1, 3, 3], [4, 1024, 0]] and crossover_of(best) == 4
    # the fastest median overlaps plain, a slower K does not: the slower K is scheduled
    tput[5], spread[5] = {1: 150.0, 4: 200.0}, {1: (90.0, 200.0), 4: (150.0, 250.0)}
    assert derive_schedule(tput, 0.03, spread)[1] == {1: 3, 4: 0}


def test_cells_are_medians_over_rounds_with_their_spread_and_rounds_alternate(tmp_path):
    from components.evaluate.plots import plot_load_sweep

    assert [round_order([0, 2, 3], r, i) for r in (0, 1) for i in (0, 1)] == [
        [0, 2, 3],
        [3, 2, 0],
        [3, 2, 0],
        [0, 2, 3],
    ]
    base = dict(
        concurrency=4,
        requests=4,
        median_ttft_ms=5.0,
        p99_ttft_ms=9.0,
        median_itl_ms=2.0,
        p99_itl_ms=3.0,
        duration_s=1.0,
        texts=["a", "b"],
    )
    samples = [
        {
            **base,
            "phase": "sweep",
            "round": r,
            "k": k,
            "output_tokens_per_s": t,
            "drafts": d,
            "accepted": a,
            "acceptance_length": None,
            "per_position": p,
        }
        for r, k, t, d, a, p in (
            (0, 0, 100.0, None, None, None),
            (1, 0, 120.0, None, None, None),
            (2, 0, 90.0, None, None, None),
            (0, 3, 150.0, 10, 10, [0.6, 0.4]),
            (1, 3, 130.0, 30, 15, [0.4, 0.1]),
            (2, 3, 140.0, 0, 0, [0.0, 0.0]),
        )
    ]
    plain, k3 = cells_of(samples)
    assert (
        plain["k"],
        plain["output_tokens_per_s"],
        plain["output_tokens_per_s_min"],
        plain["output_tokens_per_s_max"],
        plain["repeats"],
    ) == (0, 100.0, 90.0, 120.0, 3)
    assert plain["output_tokens_per_s_rounds"] == [100.0, 120.0, 90.0] and plain["drafts"] is None
    assert k3["output_tokens_per_s"] == 140.0 and (k3["drafts"], k3["accepted"]) == (40, 25)
    assert k3["acceptance_length"] == pytest.approx(1 + 25 / 40)
    assert k3["per_position"] == pytest.approx([(0.6 * 10 + 0.4 * 30) / 40, (0.4 * 10 + 0.1 * 30) / 40])
    png = plot_load_sweep([plain, k3], [[1, 1024, 3]], tmp_path / "sweep.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_evaluation_cells_are_each_rounds_tokens_over_its_seconds(tmp_path):
    """Concurrency 1 from an engine evaluation's report: per side, the tokens of its outputs over each round's
    seconds; medians and spreads as the sweep's cells; the head's counters; None for another K."""
    from components.evaluate.load_cells import evaluation_cells

    report = {
        "config": {"spec": {"depth": 3}},
        "result": {"drafts": 10, "accepted_per_pos": [8, 6, 4], "tau": 2.8},
        "speed": {"plain_s": [[1.0, 1.0], [2.0, 2.0], [1.0, 3.0]], "spec_s": [[0.5, 0.5], [1.0, 1.0], [1.0, 1.0]]},
        "samples": [
            {"plain": [1] * 30, "spec": [1] * 30, "identical_to_plain": True},
            {"plain": [2] * 10, "spec": [2] * 10, "identical_to_plain": True},
        ],
    }
    path = tmp_path / "engine_evaluation.json"
    path.write_text(json.dumps(report))
    assert evaluation_cells(path, 5) is None
    plain, head = evaluation_cells(path, 3)
    assert (plain["k"], head["k"], plain["concurrency"], plain["requests"]) == (0, 3, 1, 2)
    assert plain["output_tokens_per_s_rounds"] == [20.0, 10.0, 10.0] and plain["output_tokens_per_s"] == 10.0
    assert (head["output_tokens_per_s_min"], head["output_tokens_per_s"], head["output_tokens_per_s_max"]) == (
        20.0,
        20.0,
        40.0,
    )
    assert (head["drafts"], head["accepted"], head["acceptance_length"]) == (10, 18, 2.8)
    assert head["per_position"] == [0.8, 0.6, 0.4] and plain["drafts"] is None
    assert plain["source"] == head["source"] == "evaluation" and head["identical_to_plain"] == 2
    assert plain["median_ttft_ms"] is None  # the evaluation does not stream


def test_batching_alone_is_told_from_the_head_by_plains_texts_at_the_lowest_level():
    """Plain's output of prompt 0 changes from batch 1 to batch 4 (batching alone) and the head's at 4 is plain's at
    1: batch variance, not a mismatch, once plain at 1 is among the samples (the "baseline" phase when concurrency 1
    came from the evaluation); without it the lowest level measured (4) is the baseline and the same outputs read
    as the head's mismatch. A head output that is no plain output, where plain did not vary, is a mismatch."""
    from components.evaluate.load_cells import judge

    def sample(phase, k, c, texts):
        return {"phase": phase, "k": k, "concurrency": c, "texts": texts}

    at4 = [
        sample("sweep", 0, 4, ["a4", "b"]),
        sample("sweep", 5, 4, ["a", "b"]),
        sample("sweep", 0, 16, ["a4", "b"]),
        sample("sweep", 5, 16, ["a4", "x"]),
    ]
    assert judge(at4) == (set(), {(5, 4, 0), (5, 16, 1)})
    variant, mismatched = judge(at4 + [sample("baseline", 0, 1, ["a", "b"])])
    assert variant == {(4, 0), (16, 0)} and mismatched == {(5, 16, 1)}


def test_the_load_client_stops_at_eos_unless_told_to_run_past_it():
    from infra.vllm_bench import LoadRequest, _argv
    from infra.vllm_engine_spec import EngineSpec
    from infra.vllm_server import VllmServer

    srv = VllmServer(EngineSpec("/nonexistent/target", method=None), Settings.local(Path("/nonexistent/.eagle")))
    req = LoadRequest("d.json", "/nonexistent/target", 4, 8, 24, ignore_eos=False)
    assert "--ignore-eos" not in _argv(srv, req, "/tmp", "c.json")
    assert "--ignore-eos" in _argv(srv, dataclasses.replace(req, ignore_eos=True), "/tmp", "c.json")


@pytest.mark.parametrize(
    "load,key",
    [
        ({"concurrency": [4, 1]}, "concurrency"),
        ({"concurrency": [0]}, "concurrency"),
        ({"concurrency": [1], "k_values": []}, "k_values"),
        ({"k_values": [40]}, "k_values"),
        ({"margin": 1.5}, "margin"),
        ({"concurrency": [1, 32], "requests": 8}, "requests"),
        ({"repeats": 0}, "repeats"),
        ({"repeats": 1.5}, "repeats"),
    ],
)
def test_bad_sweep_settings_fail_at_config_load_with_the_key_path(load, key):
    with pytest.raises(ConfigError, match=f"evaluate.load.{key}"):
        PipelineConfig.preset("tiny").override({"evaluate": {"load": load}})


def test_the_default_preset_sweeps_what_two_cores_afford():
    load = PipelineConfig.preset("default").evaluate.load
    assert load.enabled and load.concurrency == (1, 4) and load.k_values == (5,) and load.repeats == 1  # ~1.6 min
    assert not PipelineConfig.preset("tiny").evaluate.load.enabled
