"""Throughput by load and the K schedule (components/evaluate/load_sweep.py, load_cells.py; infra/vllm_bench.py), with
the real engine.

Purpose:
- the schedule rule on given throughputs (no engine): the best K per level, K 0 unless a K beats plain by the
  margin and its spread over rounds lies above plain's, ranges from batch size 1 that vLLM accepts, the crossover;
  cells as medians over rounds with their spread; the alternating order of a round; bad sweep settings fail at
  config load with the key's path;
- the sweep on the tiny engine target (two concurrency levels, two K, two rounds: plain, K 2 and K 3 up at once,
  one client process; plain and K 3 the vLLM evaluation's, handed on running in an engine pool as the flow does)
  with vLLM's own load client: every cell measured in every round, in the alternating order,
  each cell's median and spread, 0 head mismatches, the schedule and the plot written;
- with the evaluation's depth as the only K, concurrency 1 is the evaluation's own rounds of the handed-on pair
  (`evaluation_cells`, also on a made-up report), the client measuring the other levels only, and plain at 1 once
  more only when outputs under load seem to differ (the batching baseline, `judge`: batch variance told from a
  head mismatch, also on made-up texts); the client runs past EOS only when told to (`ignore_eos`);
- a schedule served by vLLM takes effect: K 3 at batch size 1 and K 0 from 2 on drafts at concurrency 1 and almost
  never at concurrency 4 (only while the batch ramps up or drains), and the engine's log shows the schedule;
- `eagle-heads serve --print-only` puts a registered schedule in the vLLM command and says what SGLang can express.
Run: `python -m pytest tests/test_load_sweep.py` (about 2 minutes on 2 cores: six engine starts; the head is
the session's `engine_head`).
Not here: batch-1 speedups (tests/test_vllm.py, tests/test_speed.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from components.config.pipeline import ConfigError, PipelineConfig
from components.evaluate.load_cells import cells_of, crossover_of, derive_schedule
from components.evaluate.load_sweep import LoadConfig, round_order
from components.evaluate.speed import SpeedupConfig
from components.evaluate.stage import EvaluateConfig, HeadEval
from eagle.run_config import SpecConfig
from infra.engine_pool import EnginePool
from infra.settings import Settings


def test_the_schedule_takes_the_best_k_per_level_and_stops_where_plain_wins():
    tput = {0: {1: 100.0, 4: 300.0, 16: 900.0}, 3: {1: 150.0, 4: 320.0, 16: 600.0}, 5: {1: 160.0, 4: 290.0, 16: 500.0}}
    schedule, best = derive_schedule(tput, margin=0.03)
    assert best == {1: 5, 4: 3, 16: 0} and crossover_of(best) == 16
    assert schedule == [[1, 3, 5], [4, 15, 3], [16, 1024, 0]]
    # within the margin plain keeps the level; equal throughputs prefer the smaller K
    schedule, best = derive_schedule({0: {1: 100.0, 8: 400.0}, 2: {1: 130.0, 8: 410.0}, 4: {1: 130.0, 8: 300.0}},
                                     margin=0.05)
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

    assert [round_order([0, 2, 3], r, i) for r in (0, 1) for i in (0, 1)] == [[0, 2, 3], [3, 2, 0], [3, 2, 0],
                                                                                [0, 2, 3]]
    base = dict(concurrency=4, requests=4, median_ttft_ms=5.0, p99_ttft_ms=9.0, median_itl_ms=2.0, p99_itl_ms=3.0,
                duration_s=1.0, texts=["a", "b"])
    samples = [{**base, "phase": "sweep", "round": r, "k": k, "output_tokens_per_s": t, "drafts": d,
                "accepted": a, "acceptance_length": None, "per_position": p}
               for r, k, t, d, a, p in ((0, 0, 100.0, None, None, None), (1, 0, 120.0, None, None, None),
                                        (2, 0, 90.0, None, None, None), (0, 3, 150.0, 10, 10, [0.6, 0.4]),
                                        (1, 3, 130.0, 30, 15, [0.4, 0.1]), (2, 3, 140.0, 0, 0, [0.0, 0.0]))]
    plain, k3 = cells_of(samples)
    assert (plain["k"], plain["output_tokens_per_s"], plain["output_tokens_per_s_min"],
            plain["output_tokens_per_s_max"], plain["repeats"]) == (0, 100.0, 90.0, 120.0, 3)
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

    report = {"config": {"spec": {"depth": 3}},
              "result": {"drafts": 10, "accepted_per_pos": [8, 6, 4], "tau": 2.8},
              "speed": {"plain_s": [[1.0, 1.0], [2.0, 2.0], [1.0, 3.0]],
                        "spec_s": [[0.5, 0.5], [1.0, 1.0], [1.0, 1.0]]},
              "samples": [{"plain": [1] * 30, "spec": [1] * 30, "identical_to_plain": True},
                          {"plain": [2] * 10, "spec": [2] * 10, "identical_to_plain": True}]}
    path = tmp_path / "engine_evaluation.json"
    path.write_text(json.dumps(report))
    assert evaluation_cells(path, 5) is None
    plain, head = evaluation_cells(path, 3)
    assert (plain["k"], head["k"], plain["concurrency"], plain["requests"]) == (0, 3, 1, 2)
    assert plain["output_tokens_per_s_rounds"] == [20.0, 10.0, 10.0] and plain["output_tokens_per_s"] == 10.0
    assert (head["output_tokens_per_s_min"], head["output_tokens_per_s"], head["output_tokens_per_s_max"]) == \
           (20.0, 20.0, 40.0)
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

    at4 = [sample("sweep", 0, 4, ["a4", "b"]), sample("sweep", 5, 4, ["a", "b"]),
           sample("sweep", 0, 16, ["a4", "b"]), sample("sweep", 5, 16, ["a4", "x"])]
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


@pytest.mark.parametrize("load,key", [({"concurrency": [4, 1]}, "concurrency"), ({"concurrency": [0]}, "concurrency"),
                                      ({"concurrency": [1], "k_values": []}, "k_values"),
                                      ({"k_values": [40]}, "k_values"), ({"margin": 1.5}, "margin"),
                                      ({"concurrency": [1, 32], "requests": 8}, "requests"),
                                      ({"repeats": 0}, "repeats"), ({"repeats": 1.5}, "repeats")])
def test_bad_sweep_settings_fail_at_config_load_with_the_key_path(load, key):
    with pytest.raises(ConfigError, match=f"evaluate.load.{key}"):
        PipelineConfig.preset("tiny").override({"evaluate": {"load": load}})


def test_the_default_preset_sweeps_what_two_cores_afford():
    load = PipelineConfig.preset("default").evaluate.load
    assert load.enabled and load.concurrency == (1, 4) and load.k_values == (5,) and load.repeats == 1  # ~1.6 min
    assert not PipelineConfig.preset("tiny").evaluate.load.enabled


# ---- with the engine ----------------------------------------------------------------------------------------------

SWEEP = EvaluateConfig(spec=SpecConfig(depth=3, max_new_tokens=16), limit=4,
                       speed=SpeedupConfig(min_rounds=1, max_rounds=1),  # the evaluation before it: one round
                       load=LoadConfig(concurrency=(1, 4), k_values=(2, 3), requests=4, repeats=2,
                                       verify_schedule=False))


@pytest.fixture(scope="module")
def settings(engine_settings):
    return engine_settings


@pytest.fixture(scope="module")
def head_dir(engine_head) -> str:
    return engine_head.head_dir


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(1500)
def test_the_sweep_measures_every_cell_with_vllms_client_and_writes_the_schedule(engine_target, head_dir, settings,
                                                                               tmp_path):
    """After the vLLM evaluation in one engine pool, as the flow runs them: the evaluation's plain and K 3 servers
    are handed on to the sweep (one engine start instead of three), K 2 started beside them."""
    from components.evaluate.engine import evaluate_in_vllm
    from components.evaluate.load_sweep import load_sweep
    from infra.engine_pool import EnginePool

    heldout, lines = str(engine_target.target_traffic.heldout), []
    with EnginePool() as engines:
        ev = evaluate_in_vllm(SWEEP, HeadEval(engine_target.target_dir, head_dir, heldout, str(tmp_path / "vllm")),
                              settings, progress=lambda s: None, engines=engines)
        assert ev.identical_to_plain and engines.started == 2
        res = load_sweep(SWEEP, HeadEval(engine_target.target_dir, head_dir, heldout, str(tmp_path / "load")),
                         settings, progress=lines.append, engines=engines)
        assert engines.reused == 2 and engines.started == 2, lines
    assert "load sweep: plain, K 3 handed on by the evaluation, running already" in lines
    cells = {(c["k"], c["concurrency"]): c for c in res.cells}
    assert set(cells) == {(k, c) for k in (0, 2, 3) for c in (1, 4)}
    assert all(c["requests"] == 4 and c["output_tokens_per_s"] > 0 and c["p99_itl_ms"] >= c["median_itl_ms"]
               for c in res.cells)
    assert cells[(0, 1)]["drafts"] is None and cells[(3, 1)]["drafts"] > 0 and cells[(3, 1)]["acceptance_length"] >= 1
    assert res.mismatches == 0
    # every server up at once when memory allows (else plain beside each K, with the reason, plain's rounds pooled),
    # the order alternating by level and round
    report = json.loads(Path(res.report_file).read_text())
    assert res.mode == report["mode"] and (report["mode"] == "all") == (report["mode_reason"] == "")
    groups = [[0, 2, 3]] if res.mode == "all" else [[0, 2], [0, 3]]
    for c in res.cells:
        n = 2 * (len(groups) if c["k"] == 0 else 1)
        assert c["repeats"] == n and len(c["output_tokens_per_s_rounds"]) == n
        assert c["output_tokens_per_s_min"] <= c["output_tokens_per_s"] <= c["output_tokens_per_s_max"]
    assert report["rounds"] == [{"phase": "sweep", "round": r, "concurrency": c, "order": round_order(g, r, i)}
                                for g in groups for r in (0, 1) for i, c in enumerate((1, 4))]
    assert report["repeats"] == 2 and all("output_tokens_per_s_max" in c for c in report["cells"])
    assert res.schedule[0][0] == 1 and res.schedule[-1][1] == 1024 and set(res.best_k) == {1, 4}
    assert res.crossover == crossover_of(res.best_k) and set(res.speedup_at) == {1, 4}
    assert all(c["k"] != -1 for c in res.cells)  # verify_schedule off: the next test serves a schedule
    assert report["schedule"] == res.schedule and Path(res.plot_file).read_bytes()[:4] == b"\x89PNG"
    tags = res.tags()
    assert json.loads(tags["k_schedule"]) == res.schedule and "speedup_at_4" in tags


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(900)
def test_with_one_k_concurrency_1_is_the_evaluations_own_rounds(engine_target, head_dir, settings, tmp_path,
                                                                 monkeypatch):
    """The sweep's only K is the evaluation's depth and both servers are handed on: concurrency 1 is not measured
    again, its cells are the evaluation's rounds (the same servers); the client measures the other levels only.
    When the outputs under load seem to differ (made to here: the first judgement reports a mismatch), plain runs
    once at concurrency 1 as the batching baseline, and the final judgement, on the real texts, finds none."""
    from components.evaluate import load_sweep as sweep_mod
    from components.evaluate.engine import evaluate_in_vllm
    from components.evaluate.load_sweep import load_sweep

    real_judge, calls = sweep_mod.judge, []

    def judge_once_mismatched(samples):
        calls.append(sorted({(s["phase"], s["concurrency"]) for s in samples}))
        variant, mismatched = real_judge(samples)
        return (variant, {(3, 4, 0)}) if len(calls) == 1 else (variant, mismatched)

    monkeypatch.setattr(sweep_mod, "judge", judge_once_mismatched)

    cfg = dataclasses.replace(SWEEP, speed=SpeedupConfig(min_rounds=2, max_rounds=2),
                              load=LoadConfig(concurrency=(1, 4), k_values=(3,), requests=4, repeats=1,
                                              verify_schedule=False))
    heldout, lines = str(engine_target.target_traffic.heldout), []
    with EnginePool() as engines:
        ev = evaluate_in_vllm(cfg, HeadEval(engine_target.target_dir, head_dir, heldout, str(tmp_path / "vllm")),
                              settings, progress=lambda s: None, engines=engines)
        res = load_sweep(cfg, HeadEval(engine_target.target_dir, head_dir, heldout, str(tmp_path / "load")),
                         settings, progress=lines.append, engines=engines, evaluation=ev.report_file)
        assert engines.reused == 2 and engines.started == 2, lines
    assert any(line.startswith("load sweep: concurrency 1 from the evaluation of these servers") for line in lines)
    assert sum(" at 1: " in line for line in lines) == 1, lines  # the client ran concurrency 1 once: the baseline
    assert calls == [[("sweep", 4)], [("baseline", 1), ("sweep", 4)]]
    assert any("plain at concurrency 1 once, as the batching baseline" in line for line in lines)
    cells = {(c["k"], c["concurrency"]): c for c in res.cells}
    assert set(cells) == {(0, 1), (3, 1), (0, 4), (3, 4)}
    assert cells[(0, 1)]["source"] == cells[(3, 1)]["source"] == "evaluation"
    assert cells[(0, 4)]["source"] == cells[(3, 4)]["source"] == "sweep" and res.mismatches == 0
    assert cells[(3, 1)]["repeats"] == ev.speedup_rounds == 2 and cells[(3, 1)]["drafts"] == ev.drafts
    assert cells[(res.best_k[1], 1)]["output_tokens_per_s"] / cells[(0, 1)]["output_tokens_per_s"] == \
           pytest.approx(res.speedup_at[1]) and set(res.speedup_at) == {1, 4}
    report = json.loads(Path(res.report_file).read_text())
    assert [(r["phase"], r["concurrency"]) for r in report["rounds"]] == [("sweep", 4), ("baseline", 1)]


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(900)
def test_a_schedule_served_by_vllm_stops_drafting_above_its_range(engine_target, head_dir, settings, tmp_path):
    from components.data.chat import prompt_ids
    from components.evaluate.stage import held_out_messages
    from infra.vllm_bench import LoadRequest, bench_serve_many, write_dataset
    from infra.vllm_engine_spec import EngineSpec
    from infra.vllm_server import VllmServer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine_target.target_dir)
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
             for _, m in held_out_messages(str(engine_target.target_traffic.heldout))
             if len(prompt_ids(tok, m)) <= 300][:8]
    data = str(write_dataset(texts, tmp_path / "prompts.json"))
    spec = EngineSpec(engine_target.target_dir, head_dir, num_speculative_tokens=3, max_model_len=512,
                      k_schedule=((1, 1, 3), (2, 1024, 0)))
    with VllmServer(spec, settings) as srv:
        one, four = bench_serve_many([(srv, LoadRequest(data, engine_target.target_dir, c, 8, 24)) for c in (1, 4)],
                                     settings)  # one client process: it imports vLLM once
        log = srv.log_path.read_text()
    assert one.drafts and one.drafts >= 8 * 24 // 4  # batch size 1: K 3 on every step
    assert (four.drafts or 0) < one.drafts / 3  # batch size >= 2: no drafts but while ramping up and draining
    assert "num_speculative_tokens_per_batch_size" in log


def test_serve_print_only_puts_the_registered_schedule_in_the_vllm_command(mlflow_store, mlflow_settings,
                                                                           tiny_embedded, tmp_path, monkeypatch,
                                                                           capsys):
    """A head version whose `k_schedule` tag says [[1, 3, 4], [4, 1024, 0]]: `serve --print-only` (no --k) starts
    vLLM with it; `--k 2` pins one K instead; `--concurrency C` serves the schedule's K at C (2: K 4) or plain
    decoding where it says K 0 (8), and refuses to be given with --k."""
    from components.registry.register import RegisterConfig, TargetRef, register_head, register_target
    from components.targets.target import weights_sha256
    from flows import cli
    from tests.test_evaluate_register import _head

    sha = weights_sha256(tiny_embedded.target_dir)
    ref: TargetRef = register_target(mlflow_store, "tiny", tiny_embedded.target_dir, role="base", base_model="",
                                     weights_sha256=sha)
    head = _tiny_head(tiny_embedded, tmp_path)
    h = _head(mlflow_store, ref, head, "k1", 3.0, None)
    import dataclasses

    register_head(mlflow_store, RegisterConfig(tau_floor=1.0),
                  dataclasses.replace(h, notes={"k_schedule": "[[1, 3, 4], [4, 1024, 0]]", "crossover": "4"}))
    monkeypatch.setenv("EAGLE_HOME", str(mlflow_settings.state_dir))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert cli.main(["serve", "--head", "models:/tiny-v1-eagle3@champion", "--print-only"]) == 0
    out = capsys.readouterr().out
    assert '"num_speculative_tokens_per_batch_size": [[1, 3, 4], [4, 1024, 0]]' in out
    assert '"num_speculative_tokens": 4' in out and "SGLang has no per-batch-size K" in out
    assert cli.main(["serve", "--head", "models:/tiny-v1-eagle3@champion", "--print-only", "--k", "2"]) == 0
    out = capsys.readouterr().out
    assert "num_speculative_tokens_per_batch_size" not in out and '"num_speculative_tokens": 2' in out
    # one typical load: the schedule's K there as a fixed K, or plain decoding (no head) where it says K 0
    assert cli.main(["serve", "--head", "models:/tiny-v1-eagle3@champion", "--print-only", "--concurrency", "2"]) == 0
    out = capsys.readouterr().out
    assert "num_speculative_tokens_per_batch_size" not in out and '"num_speculative_tokens": 4' in out
    assert cli.main(["serve", "--head", "models:/tiny-v1-eagle3@champion", "--print-only", "--concurrency", "8"]) == 0
    out = capsys.readouterr().out
    assert "plain decoding, no head" in out and "speculative" not in out.split("\n", 1)[1]
    assert cli.main(["serve", "--head", "models:/tiny-v1-eagle3@champion", "--print-only", "--concurrency", "8",
                     "--k", "2"]) == 2
    capsys.readouterr()
    # a head its gate refused (it does not pay when served): serve says so, and serves it as asked
    slow = dataclasses.replace(_head(mlflow_store, ref, head, "k2", 3.0, 3.0, speedup_vllm=0.9, speedup_vllm_lo=0.8,
                                     speedup_vllm_hi=1.0))
    assert register_head(mlflow_store, RegisterConfig(tau_floor=1.0), slow).alias == "challenger"
    assert cli.main(["serve", "--head", "models:/tiny-v1-eagle3@challenger", "--print-only"]) == 0
    out = capsys.readouterr().out
    assert "serve: note: models:/tiny-v1-eagle3@challenger is not champion: its gate refused it" in out
    assert "0.90x plain at batch 1 [0.80, 1.00] is not surely above 1" in out
    assert cli.main(["serve", "--head", "models:/tiny-v1-eagle3@champion", "--print-only"]) == 0
    assert "is not champion" not in capsys.readouterr().out


def _tiny_head(tiny_embedded, root: Path) -> str:
    from components.extract.stage import ExtractConfig, extract
    from components.regenerate.stage import RegenerateConfig, regenerate
    from components.train.stage import TrainConfig, train

    quiet = dict(progress=lambda s: None)
    regenerate(RegenerateConfig(max_new_tokens=8, batch_size=8, shard_size=8, limit=8), tiny_embedded.target_dir,
               str(tiny_embedded.target_traffic.train), str(root / "regen"), **quiet)
    extract(ExtractConfig(max_len=128, seqs_per_shard=8), tiny_embedded.target_dir, str(root / "regen"),
            str(root / "ext"), **quiet)
    return train(TrainConfig.tiny(), str(root / "ext"), str(root / "train")).head_dir
