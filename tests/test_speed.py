"""The speedup estimator (components/evaluate/speed.py) on a simulated clock: what it measures, in which order, when it
stops, and when it calls a figure unreliable. No real timing: each decode advances a fake clock by a set cost.
Beside it, the other-load probe (infra/cpu_load.py) with real processes: a busy neighbour is other load, our own
work and the process groups we name are not, and a figure measured beside a neighbour is flagged.

Run: `python -m pytest tests/test_speed.py` (about 10 s: the probe's tests burn real CPU for a second or two each).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from components.config.pipeline import ConfigError, PipelineConfig
from components.evaluate.speed import SpeedupConfig, Timing, measure_speedup, median_interval
from components.evaluate.stage import EvaluateConfig
from infra.cpu_load import MIN_WALL_S, OtherLoad, machine_busy_s

BUSY = "import time\nt = time.time()\nwhile time.time() - t < 30: pass"


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

    return measure_speedup(n, make("plain", plain_cost), make("spec", spec_cost), cfg, timing=Timing(clock=clock))


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


def test_in_blocks_each_side_takes_a_block_and_the_side_that_ends_one_begins_the_next():
    calls: list = []
    est = _run(
        6, SpeedupConfig(min_rounds=2, max_rounds=2, block=4), lambda i, r: 2.0 + i, lambda i, r: 1.0 + i / 2, calls
    )
    kinds = [(k, i) for k, i, r in calls if r == 0]
    assert kinds == [
        ("plain", 0),
        ("plain", 1),
        ("plain", 2),
        ("plain", 3),
        ("spec", 0),
        ("spec", 1),
        ("spec", 2),
        ("spec", 3),
        ("spec", 4),
        ("spec", 5),
        ("plain", 4),
        ("plain", 5),
    ]
    assert [(k, i) for k, i, r in calls if r == 1][0] == ("spec", 0)  # the next round begins with the other side
    assert est.plain_s[0] == [2.0 + i for i in range(6)] and est.spec_s[0] == [1.0 + i / 2 for i in range(6)]
    assert est.speedup == pytest.approx(2.0)
    from components.evaluate.engine import SwitchPause

    slept: list[float] = []
    pause = SwitchPause(1.2, last="spec", sleep=slept.append)
    for k, _, _ in calls:
        pause(k)
    assert len(slept) == 6  # one wait per side change: 3 a round of two blocks, against 6 prompt by prompt


def test_block_zero_is_prompt_by_prompt_in_our_decoder_and_blocks_of_four_where_switching_waits():
    from components.evaluate.speed import SWITCH_BLOCK

    assert SpeedupConfig().block_for(switch_costs=False) == 1
    assert SpeedupConfig().block_for(switch_costs=True) == SWITCH_BLOCK == 4
    assert SpeedupConfig(block=2).block_for(switch_costs=True) == 2


def test_settle_runs_before_each_decode_untimed_and_outside_the_budget():
    clock, seen = FakeClock(), []

    def decode(cost):
        def fn(i, r):
            seen.append("decode")
            clock.t += cost
            return 10

        return fn

    def settle(kind):
        seen.append(kind)
        clock.t += 100.0  # far past the budget, were it counted

    cfg = SpeedupConfig(min_rounds=3, max_rounds=3, budget_s=50.0)
    est = measure_speedup(2, decode(2.0), decode(1.0), cfg, timing=Timing(clock=clock, settle=settle))
    assert est.speedup == pytest.approx(2.0) and est.rounds == 3 and est.reliable
    assert seen[:4] == ["plain", "decode", "spec", "decode"] and len(seen) == 2 * 2 * 2 * 3


def test_the_engine_pause_waits_only_when_the_other_server_served_last():
    from components.evaluate.engine import SwitchPause

    slept: list[float] = []
    pause = SwitchPause(1.2, last="spec", sleep=slept.append)
    for kind in ("plain", "spec", "spec", "plain", "plain", "spec"):  # the interleaved order of two rounds' prompts
        pause(kind)
    assert slept == [1.2, 1.2, 1.2, 1.2]
    off = SwitchPause(0.0, last="spec", sleep=slept.append)
    off("plain")
    assert len(slept) == 4  # a GPU build: the spin takes a host core, no wait


def test_the_pause_between_servers_is_the_devices_unless_the_config_sets_one():
    """`evaluate.speed.switch_pause_s`: None waits out a CPU engine's idle spin (and nothing on a GPU); a number is
    taken as given (0 where the cores are many, and in the tests' tiny config); a negative one is refused."""
    from components.evaluate.engine import SETTLE_MARGIN_S, SwitchPause
    from infra.vllm_engine_spec import EngineSpec
    from infra.vllm_server import IDLE_SPIN_S

    cpu, gpu = EngineSpec("/t", method=None, device="cpu"), EngineSpec("/t", method=None, device="cuda")
    assert SwitchPause.between(cpu).seconds == IDLE_SPIN_S + SETTLE_MARGIN_S == pytest.approx(1.2)
    assert SwitchPause.between(gpu).seconds == 0.0
    assert SwitchPause.between(cpu, seconds=0.0).seconds == 0.0 and SwitchPause.between(gpu, seconds=0.5).seconds == 0.5
    assert SpeedupConfig().switch_pause_s is None and SpeedupConfig.tiny().switch_pause_s == 0.0
    with pytest.raises(ValueError, match="switch_pause_s"):
        SpeedupConfig(switch_pause_s=-1.0)


def test_a_burst_of_load_in_one_round_does_not_move_the_median():
    def spec(i, r):
        return 3.0 if r == 1 else 1.0  # another job slowed the speculative side in round 1 only

    est = _run(2, SpeedupConfig(min_rounds=5, max_rounds=5, max_spread=0.5), lambda i, r: 1.5, spec)
    assert est.speedup == pytest.approx(1.5) and est.round_ratios[1] == pytest.approx(0.5)


def test_disagreeing_rounds_make_the_figure_unreliable_and_say_why():
    est = _run(
        2,
        SpeedupConfig(min_rounds=5, max_rounds=6, max_spread=0.05),
        lambda i, r: 1.0 + 0.3 * (r % 2),
        lambda i, r: 1.0,
    )
    assert not est.reliable and est.rounds == 6 and "disagree" in est.reason
    assert "unreliable" in est.describe()
    assert est.wide_only  # enough rounds, no other load: an honest interval, only wide


def test_the_budget_stops_the_rounds_and_too_few_rounds_are_unreliable():
    est = _run(2, SpeedupConfig(min_rounds=5, max_rounds=9, budget_s=10.0), lambda i, r: 3.0, lambda i, r: 1.5)
    assert est.rounds == 2 and not est.reliable and "budget" in est.reason and est.speedup == pytest.approx(2.0)
    assert not est.wide_only


def test_median_interval_coverage_follows_the_binomial_rule():
    assert median_interval([1.0, 2.0, 3.0])[:2] == (1.0, 3.0)
    lo, hi, cov = median_interval([float(x) for x in range(8)])
    assert (lo, hi) == (1.0, 6.0) and cov == pytest.approx(1 - 2 * 9 / 256)
    assert median_interval([float(x) for x in range(5)])[2] == pytest.approx(1 - 2 / 32)


@pytest.mark.parametrize(
    "key,value",
    [
        ("min_rounds", 0),
        ("max_spread", 0),
        ("max_spread", 1.5),
        ("budget_s", float("inf")),
        ("max_rounds", 1),
        ("max_other_load", -1.0),
        ("max_other_load", True),
        ("block", -1),
    ],
)
def test_bad_speed_settings_fail_at_config_load_with_the_key_path(key, value):
    with pytest.raises(ConfigError, match=f"evaluate.speed.{key}"):
        PipelineConfig.preset("tiny").override(
            {"evaluate": {"speed": {key: value, "min_rounds": 2} if key != "min_rounds" else {key: value}}}
        )


def test_the_tiny_preset_measures_two_rounds():
    assert EvaluateConfig.tiny().speed.min_rounds == 2


def test_the_tiny_preset_puts_no_bound_on_other_load_and_the_default_does():
    assert EvaluateConfig.tiny().speed.max_other_load == float("inf")
    assert PipelineConfig.preset("default").evaluate.speed.max_other_load == 0.5


@pytest.fixture
def neighbour():
    """A busy process in its own session (process group = its pid), killed after the test."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True)
    time.sleep(0.3)  # past its start-up
    yield proc
    proc.kill()
    proc.wait()


def test_a_busy_neighbour_is_other_load_unless_its_process_group_is_ours(neighbour):
    from infra.cpu_load import own_busy_s

    busy0, t0 = own_busy_s([neighbour.pid]), time.monotonic()
    theirs, ours = OtherLoad.start(), OtherLoad.start([neighbour.pid])
    time.sleep(1.5)
    gap = theirs.cores() - ours.cores()
    share = (own_busy_s([neighbour.pid]) - busy0) / (time.monotonic() - t0)
    # the same window: the only difference is whose the neighbour's CPU time is, so the two readings differ by the
    # share of a core it got (whatever else runs is in both; on a saturated machine that share is small, not zero)
    assert share > 0.05 and gap == pytest.approx(share, abs=0.15), (gap, share)


def test_our_own_cpu_time_is_not_other_load():
    probe, machine0, cpu0, wall0 = OtherLoad.start(), machine_busy_s(), time.process_time(), time.monotonic()
    while time.monotonic() - wall0 < 1.2:
        pass
    other = probe.cores()
    wall = time.monotonic() - wall0
    machine, own = (machine_busy_s() - machine0) / wall, (time.process_time() - cpu0) / wall
    assert own > 0.2 and machine - other == pytest.approx(own, abs=0.15)


def test_a_short_window_says_nothing():
    assert OtherLoad.start().cores() is None and MIN_WALL_S >= 1.0


def test_a_figure_measured_beside_a_busy_neighbour_is_unreliable_and_says_so(neighbour):
    def decode(i, r):
        time.sleep(0.2)
        return 10

    est = measure_speedup(2, decode, decode, SpeedupConfig(min_rounds=2, max_rounds=2, max_other_load=0.3))
    assert est.other_load is not None and est.other_load > 0.3
    assert not est.reliable and "the machine was busy" in est.reason and "speed.max_other_load" in est.reason
    assert not est.wide_only  # other load moves the ratio itself: not comparable, however wide
    assert est.metrics()["speedup_other_load"] == est.other_load
    calm = measure_speedup(2, decode, decode, SpeedupConfig(min_rounds=2, max_rounds=2, max_other_load=float("inf")))
    assert calm.reliable and calm.other_load is not None
