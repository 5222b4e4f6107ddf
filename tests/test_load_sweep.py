"""Throughput by load and the K schedule (components/evaluate/load_sweep.py, infra/vllm_bench.py), with the real engine.

Purpose:
- the sweep on the tiny engine target (two concurrency levels, two K, two rounds: plain, K 2 and K 3 up at once,
  one client process; plain and K 3 the vLLM evaluation's, handed on running in an engine pool as the flow does)
  with vLLM's own load client: every cell measured in every round, in the alternating order,
  each cell's median and spread, 0 head mismatches, the schedule and the plot written;
- with the evaluation's depth as the only K, concurrency 1 is the evaluation's own rounds of the handed-on pair
  (`evaluation_cells`), the client measuring the other levels only, and plain at 1 once more only when outputs
  under load seem to differ (the batching baseline, `judge`: batch variance told from a head mismatch);
- a schedule served by vLLM takes effect: K 3 at batch size 1 and K 0 from 2 on drafts at concurrency 1 and almost
  never at concurrency 4 (only while the batch ramps up or drains), and the engine's log shows the schedule;
- `eagle-heads serve --print-only` puts a registered schedule in the vLLM command and says what SGLang can express.
Run: `python -m pytest tests/test_load_sweep.py` (about 2 minutes on 2 cores: six engine starts; the head is
the session's `engine_head`).
Not here: the rules without an engine (tests/test_load_cells.py), batch-1 speedups (tests/test_vllm.py,
tests/test_speed.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from components.evaluate.load_cells import crossover_of
from components.evaluate.load_sweep import LoadConfig, round_order
from components.evaluate.speed import SpeedupConfig
from components.evaluate.stage import EvaluateConfig, HeadEval
from eagle.run_config import SpecConfig
from infra.engine_pool import EnginePool


# ---- with the engine ----------------------------------------------------------------------------------------------

SWEEP = EvaluateConfig(
    spec=SpecConfig(depth=3, max_new_tokens=16),
    limit=4,
    speed=SpeedupConfig(min_rounds=1, max_rounds=1),  # the evaluation before it: one round
    load=LoadConfig(concurrency=(1, 4), k_values=(2, 3), requests=4, repeats=2, verify_schedule=False),
)


@pytest.fixture(scope="module")
def settings(engine_settings):
    return engine_settings


@pytest.fixture(scope="module")
def head_dir(engine_head) -> str:
    return engine_head.head_dir


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(1500)
def test_the_sweep_measures_every_cell_with_vllms_client_and_writes_the_schedule(
    engine_target, head_dir, settings, tmp_path
):
    """After the vLLM evaluation in one engine pool, as the flow runs them: the evaluation's plain and K 3 servers
    are handed on to the sweep (one engine start instead of three), K 2 started beside them."""
    from components.evaluate.engine import evaluate_in_vllm
    from components.evaluate.load_sweep import load_sweep
    from infra.engine_pool import EnginePool

    heldout, lines = str(engine_target.target_traffic.heldout), []
    with EnginePool() as engines:
        ev = evaluate_in_vllm(
            SWEEP,
            HeadEval(engine_target.target_dir, head_dir, heldout, str(tmp_path / "vllm")),
            settings,
            progress=lambda s: None,
            engines=engines,
        )
        assert ev.identical_to_plain and engines.started == 2
        res = load_sweep(
            SWEEP,
            HeadEval(engine_target.target_dir, head_dir, heldout, str(tmp_path / "load")),
            settings,
            progress=lines.append,
            engines=engines,
        )
        assert engines.reused == 2 and engines.started == 2, lines
    assert "load sweep: plain, K 3 handed on by the evaluation, running already" in lines
    cells = {(c["k"], c["concurrency"]): c for c in res.cells}
    assert set(cells) == {(k, c) for k in (0, 2, 3) for c in (1, 4)}
    assert all(
        c["requests"] == 4 and c["output_tokens_per_s"] > 0 and c["p99_itl_ms"] >= c["median_itl_ms"] for c in res.cells
    )
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
    assert report["rounds"] == [
        {"phase": "sweep", "round": r, "concurrency": c, "order": round_order(g, r, i)}
        for g in groups
        for r in (0, 1)
        for i, c in enumerate((1, 4))
    ]
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
def test_with_one_k_concurrency_1_is_the_evaluations_own_rounds(
    engine_target, head_dir, settings, tmp_path, monkeypatch
):
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

    cfg = dataclasses.replace(
        SWEEP,
        speed=SpeedupConfig(min_rounds=2, max_rounds=2),
        load=LoadConfig(concurrency=(1, 4), k_values=(3,), requests=4, repeats=1, verify_schedule=False),
    )
    heldout, lines = str(engine_target.target_traffic.heldout), []
    with EnginePool() as engines:
        ev = evaluate_in_vllm(
            cfg,
            HeadEval(engine_target.target_dir, head_dir, heldout, str(tmp_path / "vllm")),
            settings,
            progress=lambda s: None,
            engines=engines,
        )
        res = load_sweep(
            cfg,
            HeadEval(engine_target.target_dir, head_dir, heldout, str(tmp_path / "load")),
            settings,
            progress=lines.append,
            engines=engines,
            evaluation=ev.report_file,
        )
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
    assert cells[(res.best_k[1], 1)]["output_tokens_per_s"] / cells[(0, 1)]["output_tokens_per_s"] == pytest.approx(
        res.speedup_at[1]
    ) and set(res.speedup_at) == {1, 4}
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
    texts = [
        tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        for _, m in held_out_messages(str(engine_target.target_traffic.heldout))
        if len(prompt_ids(tok, m)) <= 300
    ][:8]
    data = str(write_dataset(texts, tmp_path / "prompts.json"))
    spec = EngineSpec(
        engine_target.target_dir,
        head_dir,
        num_speculative_tokens=3,
        max_model_len=512,
        k_schedule=((1, 1, 3), (2, 1024, 0)),
    )
    with VllmServer(spec, settings) as srv:
        one, four = bench_serve_many(
            [(srv, LoadRequest(data, engine_target.target_dir, c, 8, 24)) for c in (1, 4)], settings
        )  # one client process: it imports vLLM once
        log = srv.log_path.read_text()
    assert one.drafts and one.drafts >= 8 * 24 // 4  # batch size 1: K 3 on every step
    assert (four.drafts or 0) < one.drafts / 3  # batch size >= 2: no drafts but while ramping up and draining
    assert "num_speculative_tokens_per_batch_size" in log


def test_serve_print_only_puts_the_registered_schedule_in_the_vllm_command(
    mlflow_store, mlflow_settings, tiny_embedded, tmp_path, monkeypatch, capsys
):
    """A head version whose `k_schedule` tag says [[1, 3, 4], [4, 1024, 0]]: `serve --print-only` (no --k) starts
    vLLM with it; `--k 2` pins one K instead; `--concurrency C` serves the schedule's K at C (2: K 4) or plain
    decoding where it says K 0 (8), and refuses to be given with --k."""
    from components.registry.register import RegisterConfig, TargetRef, register_head, register_target
    from components.targets.target import weights_sha256
    from flows import cli
    from tests.test_register import _head

    sha = weights_sha256(tiny_embedded.target_dir)
    ref: TargetRef = register_target(
        mlflow_store, "tiny", tiny_embedded.target_dir, role="base", base_model="", weights_sha256=sha
    )
    head = _tiny_head(tiny_embedded, tmp_path)
    h = _head(mlflow_store, ref, head, "k1", 3.0, None)
    import dataclasses

    register_head(
        mlflow_store,
        RegisterConfig(tau_floor=1.0),
        dataclasses.replace(h, notes={"k_schedule": "[[1, 3, 4], [4, 1024, 0]]", "crossover": "4"}),
    )
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
    assert (
        cli.main(
            ["serve", "--head", "models:/tiny-v1-eagle3@champion", "--print-only", "--concurrency", "8", "--k", "2"]
        )
        == 2
    )
    capsys.readouterr()
    # a head its gate refused (it does not pay when served): serve says so, and serves it as asked
    slow = dataclasses.replace(
        _head(mlflow_store, ref, head, "k2", 3.0, 3.0, speedup_vllm=0.9, speedup_vllm_lo=0.8, speedup_vllm_hi=1.0)
    )
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
    regenerate(
        RegenerateConfig(max_new_tokens=8, batch_size=8, shard_size=8, limit=8),
        tiny_embedded.target_dir,
        str(tiny_embedded.target_traffic.train),
        str(root / "regen"),
        **quiet,
    )
    extract(
        ExtractConfig(max_len=128, seqs_per_shard=8),
        tiny_embedded.target_dir,
        str(root / "regen"),
        str(root / "ext"),
        **quiet,
    )
    return train(TrainConfig.tiny(), str(root / "ext"), str(root / "train")).head_dir
