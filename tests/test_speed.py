"""The speedup estimator (components/speed.py) on a simulated clock: what it measures, in which order, when it
stops, and when it calls a figure unreliable. No real timing: each decode advances a fake clock by a set cost.

Run: `python -m pytest tests/test_speed.py` (well under a second).
"""

from __future__ import annotations

import pytest

from components.evaluate import EvaluateConfig
from components.pipeline_config import ConfigError, PipelineConfig
from components.speed import SpeedupConfig, measure_speedup, median_interval


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _run(n, cfg, plain_cost, spec_cost, calls=None):
    """`plain_cost(i, r)` / `spec_cost(i, r)`: the seconds each decode takes on the fake clock."""
    clock = FakeClock()

    def make(kind, cost):
        def fn(i, r):
            if calls is not None:
                calls.append((kind, i, r))
            clock.t += cost(i, r)
            return 10
        return fn

    return measure_speedup(n, make("plain", plain_cost), make("spec", spec_cost), cfg, clock=clock)


def test_a_steady_machine_gives_the_true_ratio_reliably_in_the_fewest_rounds():
    est = _run(4, SpeedupConfig(min_rounds=3, max_rounds=9), lambda i, r: 2.0 + i, lambda i, r: 1.0 + i / 2)
    assert est.speedup == pytest.approx(2.0) and est.reliable and est.rounds == 3
    assert est.lo == est.hi == pytest.approx(2.0) and est.reason == ""
    assert est.plain_tokens_per_s == pytest.approx(40 / 14) and est.spec_tokens_per_s == pytest.approx(40 / 7)


def test_plain_and_speculative_alternate_which_goes_first_by_prompt_and_round():
    calls: list = []
    _run(3, SpeedupConfig(min_rounds=2, max_rounds=2), lambda i, r: 1.0, lambda i, r: 1.0, calls)
    firsts = [calls[k] for k in range(0, len(calls), 2)]
    assert [c[0] for c in firsts] == ["plain", "spec", "plain", "spec", "plain", "spec"]
    assert all(calls[k][1:] == calls[k + 1][1:] for k in range(0, len(calls), 2))  # pairs: same prompt, same round


def test_a_burst_of_load_in_one_round_does_not_move_the_median():
    def spec(i, r):
        return 3.0 if r == 1 else 1.0  # another job slowed the speculative side in round 1 only
    est = _run(2, SpeedupConfig(min_rounds=5, max_rounds=5, max_spread=0.5), lambda i, r: 1.5, spec)
    assert est.speedup == pytest.approx(1.5) and est.round_ratios[1] == pytest.approx(0.5)


def test_disagreeing_rounds_make_the_figure_unreliable_and_say_why():
    est = _run(2, SpeedupConfig(min_rounds=5, max_rounds=6, max_spread=0.05), lambda i, r: 1.0 + 0.3 * (r % 2),
               lambda i, r: 1.0)
    assert not est.reliable and est.rounds == 6 and "disagree" in est.reason
    assert "unreliable" in est.describe()


def test_the_budget_stops_the_rounds_and_too_few_rounds_are_unreliable():
    est = _run(2, SpeedupConfig(min_rounds=5, max_rounds=9, budget_s=10.0), lambda i, r: 3.0, lambda i, r: 1.5)
    assert est.rounds == 2 and not est.reliable and "budget" in est.reason and est.speedup == pytest.approx(2.0)


def test_median_interval_coverage_follows_the_binomial_rule():
    assert median_interval([1.0, 2.0, 3.0])[:2] == (1.0, 3.0)
    lo, hi, cov = median_interval([float(x) for x in range(8)])
    assert (lo, hi) == (1.0, 6.0) and cov == pytest.approx(1 - 2 * 9 / 256)
    assert median_interval([float(x) for x in range(5)])[2] == pytest.approx(1 - 2 / 32)


@pytest.mark.parametrize("key,value", [("min_rounds", 0), ("max_spread", 0), ("max_spread", 1.5),
                                       ("budget_s", float("inf")), ("max_rounds", 1)])
def test_bad_speed_settings_fail_at_config_load_with_the_key_path(key, value):
    with pytest.raises(ConfigError, match=f"evaluate.speed.{key}"):
        PipelineConfig.preset("tiny").override({"evaluate": {"speed": {key: value, "min_rounds": 2}
                                                             if key != "min_rounds" else {key: value}}})


def test_the_tiny_preset_measures_two_rounds():
    assert EvaluateConfig.tiny().speed.min_rounds == 2
