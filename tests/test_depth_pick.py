"""The K a head drafts at batch size 1, chosen by measurement: the choice and what the evaluation runs with after it.

Purpose: components/evaluate/depth_pick.py's pure parts: `choose` (the most output tokens/s, the smaller K on a tie,
plain never chosen), `applied` (the evaluation config after the pick: `spec.depth`, and the load sweep's K where it
named the old depth alone), the config's refusals, and `evaluate_head`'s order (the pick first, then ours, vLLM's and
the sweep at the chosen K) with stand-in stages. The pick in vLLM itself, end to end: tests/test_vllm.py.
Run: `python -m pytest tests/test_depth_pick.py` (a second).
"""

from __future__ import annotations

import dataclasses

import pytest

from components.evaluate.depth_pick import DepthPick, applied, choose
from components.evaluate.load_config import DepthPickConfig, LoadConfig
from components.evaluate.stage import EvaluateConfig
from eagle.config_checks import FieldError
from eagle.run_config import SpecConfig
from infra.settings import Settings


def test_the_fastest_k_is_chosen_the_smaller_on_a_tie_and_never_plain():
    assert choose({0: 36.0, 1: 42.7, 2: 43.2, 3: 40.8, 5: 34.5}) == 2  # measured on Zen 5 (bench/README.md)
    assert choose({0: 50.0, 2: 40.0, 5: 41.0}) == 5  # plain faster: the best K all the same (the gate judges it)
    assert choose({0: 30.0, 2: 40.0, 3: 40.0}) == 2
    with pytest.raises(ValueError, match="no K measured"):
        choose({0: 30.0})


def test_what_runs_after_the_pick_drafts_the_chosen_k():
    cfg = EvaluateConfig(spec=SpecConfig(depth=5), load=LoadConfig(concurrency=(1, 4), k_values=(5,), requests=8))
    after = applied(cfg, 2)
    assert after.spec.depth == 2 and after.load.k_values == (2,)  # the sweep's K followed the evaluation's depth
    assert dataclasses.replace(after, spec=cfg.spec, load=cfg.load) == cfg  # nothing else changed
    own = dataclasses.replace(cfg, load=LoadConfig(concurrency=(1, 4), k_values=(3, 5), requests=8))
    assert applied(own, 2).load.k_values == (3, 5)  # K values chosen apart from the depth are kept


def test_pick_metrics_name_the_k_and_its_ratio_to_plain():
    p = DepthPick(3, {0: 30.0, 2: 33.0, 3: 36.0}, "r.json")
    assert p.metrics() == {"picked_depth": 3.0, "picked_depth_speedup": pytest.approx(1.2)}


@pytest.mark.parametrize(
    "choices, says",
    [
        ((5,), "at least two K"),
        ((5, 2), "ascending without repeats"),
        ((2, 2), "ascending without repeats"),
        ((0, 2), "whole numbers >= 1"),
        ((2, 17), "<= 16"),
    ],
)
def test_bad_choices_are_refused(choices, says):
    with pytest.raises(FieldError, match=says):
        DepthPickConfig(choices=choices)


def test_no_choices_is_no_pick():
    assert not DepthPickConfig().enabled and DepthPickConfig(choices=(2, 5)).enabled


def test_the_pick_runs_first_and_every_stage_after_it_at_its_k(tmp_path, monkeypatch):
    import flows.evaluate_head as eh
    from components.config.pipeline import PipelineConfig
    from components.evaluate.stage import HeadEval

    seen: list[tuple[str, int]] = []

    class Result:
        def __init__(self, m):
            self.m, self.report_file = m, str(tmp_path / "r.json")

        def metrics(self):
            return self.m

    compiled: list[bool] = []

    def pick(cfg, head, settings):
        seen.append(("pick", cfg.spec.depth))
        compiled.append(settings.engine_compiled)
        return DepthPick(3, {0: 30.0, 2: 31.0, 3: 36.0, 5: 29.0}, "p.json")

    def local(cfg, head, trust):
        seen.append(("local", cfg.spec.depth))
        return Result({"tau": 1.5})

    def engine(cfg, head, report, settings, engines):
        seen.append(("engine", cfg.spec.depth))
        compiled.append(settings.engine_compiled)
        return Result({"tau_vllm": 1.6})

    def sweep(cfg, head, settings, engines, report):
        seen.append(("sweep", cfg.load.k_values[0]))
        compiled.append(settings.engine_compiled)
        return Result({"crossover": 4.0})

    monkeypatch.setattr(eh, "_servable", lambda head, settings: head.head_dir)
    monkeypatch.setattr(eh, "_pool", lambda plan: __import__("contextlib").nullcontext())
    cfg = PipelineConfig.load(None, "default")
    cfg = dataclasses.replace(cfg, evaluate=dataclasses.replace(cfg.evaluate, compiled=True))
    head = HeadEval("target", "head", "heldout.jsonl", str(tmp_path))
    plan = eh.EvalPlan(local=True, engine=True, sweep=cfg.evaluate.load, early=False)
    settings = Settings.local(tmp_path / ".eagle")  # not compiled: the evaluation says so from its config
    figures = eh.evaluate_head(cfg, head, settings, plan, eh.EvalStages(local, engine, sweep, pick=pick))
    assert seen == [("pick", 5), ("local", 3), ("engine", 3), ("sweep", 3)]
    assert figures.metrics["picked_depth"] == 3.0 and figures.metrics["tau"] == 1.5 and "crossover" in figures.metrics
    # every engine it timed ran as `serve` will run the head (`evaluate.compiled`, set here)
    assert compiled == [True, True, True] and figures.metrics["engine_compiled"] == 1.0
