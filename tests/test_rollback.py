"""Roll back on collapse, the decision: synthetic counters through the judge and the follow loop, no engine.

Purpose: `components.serving.rollback.Judge` on counters made up window by window: a collapse rolls back at the first
judged window, a drop below ratio x the previous champion's τ only after `sustain_windows` in a row, too few drafts
reach back over earlier windows before judging, no previous champion leaves only the floor; the loop of
`components.serving.live.follow` with a fake server (its counters made from a τ per head) swaps a collapsed head back
to the previous one within 2 windows, to plain decoding when none served before, and never swaps it in again;
`RollbackConfig`'s bad values and serve's flags are refused with the field's name; the registry's side
(`move_alias_back`) on a SQLite MLflow store.
Run: `python -m pytest tests/test_rollback.py` (a few seconds).
Not here: the same with real vLLM engines and the CLI (tests/test_rollback_engine.py).
"""

from __future__ import annotations

import time

import pytest

from components.serving.live import Follow, RolledBack, Served, follow
from components.serving.monitor import MonitorConfig, RollbackConfig, window_counts, window_start
from components.serving.rollback import REASON_TAG, Judge, move_alias_back
from eagle.errors import BadInput
from infra.vllm_engine_spec import EngineSpec
from infra.vllm_server import SpecCounters

CFG = RollbackConfig(window_s=10.0, floor_tau=1.1, min_drafts=50, sustain_windows=2)


def _counters(drafts: int, tau: float) -> SpecCounters:
    accepted = round(drafts * (tau - 1))
    return SpecCounters(drafts, drafts * 3, accepted, (accepted,))


class _Feed:
    """Cumulative counters of one engine: each `step(drafts, tau)` adds a window's worth."""

    def __init__(self):
        self.total = SpecCounters(0, 0, 0, (0,))

    def step(self, drafts: int, tau: float) -> SpecCounters:
        self.total = self.total + _counters(drafts, tau)
        return self.total


def _run(judge: Judge, windows: list[tuple[int, float]], dt: float = 10.0):
    feed, out = _Feed(), []
    judge.observe(feed.total, 0.0)
    for i, (drafts, tau) in enumerate(windows, 1):
        out.append(judge.observe(feed.step(drafts, tau), i * dt))
    return out


def test_a_collapse_rolls_back_at_the_first_judged_window():
    [j] = _run(Judge(CFG, 0.8, 2.5), [(100, 1.0)])
    assert j.roll_back and j.verdict == "collapse" and j.windows == 1
    assert "collapse: window tau 1.00 < floor 1.1" in j.reason and "100 drafts" in j.reason


def test_below_the_ratio_rolls_back_only_when_sustained():
    got = _run(Judge(CFG, 0.8, 2.5), [(100, 1.8), (100, 2.4), (100, 1.8), (100, 1.7)])
    assert [j.verdict for j in got] == ["low", "ok", "low", "below"]
    assert got[-1].roll_back and "< 0.8 x 2.50" in got[-1].reason and "2 window(s) in a row" in got[-1].reason
    assert not any(j.roll_back for j in _run(Judge(CFG, 0.8, 2.5), [(100, 2.1)] * 5))  # 2.1 >= 0.8 x 2.5


def test_too_few_drafts_reach_back_before_judging():
    got = _run(Judge(CFG, 0.8, 2.5), [(20, 1.0), (20, 1.0), (20, 1.0)])
    assert [j.verdict for j in got] == ["warming", "warming", "collapse"]
    assert got[-1].drafts == 60 and got[-1].span_s == 30.0 and got[-1].windows == 3
    idle = _run(Judge(CFG, 0.8, 2.5), [(0, 1.0)] * 4)  # no traffic, no judgement, however long
    assert all(j.verdict == "warming" and not j.roll_back for j in idle)


def test_without_a_previous_champion_only_the_floor_applies():
    got = _run(Judge(CFG, 0.8, None), [(100, 1.3)] * 3 + [(100, 1.05)])
    assert [j.verdict for j in got] == ["ok", "ok", "ok", "collapse"]


def test_a_restarted_engine_counts_from_zero():
    judge = Judge(CFG, 0.8, 2.5)
    judge.observe(_counters(1000, 3.0), 0.0)
    j = judge.observe(_counters(100, 1.0), 10.0)  # counters went back: the interval counts the new reading whole
    assert j.drafts == 100 and j.verdict == "collapse"


def test_the_monitor_and_the_judge_share_the_window_arithmetic():
    assert window_start([0.0, 5.0, 10.0, 15.0], 15.0, 10.0) == 1
    assert window_start([0.0, 5.0], 5.0, 10.0) == 0
    total = window_counts([_counters(10, 2.0), _counters(30, 2.0), _counters(5, 1.0)])
    assert total.drafts == 25  # 20 more, then a restart counted from zero


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("window_s", 0, "window_s must be a finite number > 0"),
        ("window_s", float("inf"), "window_s must be a finite number > 0"),
        ("floor_tau", 0.9, "floor_tau must be a finite number >= 1"),
        ("min_drafts", 0, "min_drafts must be an integer >= 1"),
        ("sustain_windows", 1.5, "sustain_windows must be an integer >= 1"),
        ("enabled", "yes", "enabled must be true or false"),
    ],
)
def test_bad_rollback_settings_name_the_field(field, value, needle):
    with pytest.raises(BadInput, match=needle):
        RollbackConfig(**{field: value})


def test_serve_flags_and_config_reach_monitor_rollback(tmp_path):
    from flows.commands import parser
    from flows.preflight import command_config

    def cfg(*extra):
        return command_config(parser().parse_args(["serve", "--head", "models:/h@champion", *extra])).monitor

    assert cfg().rollback == RollbackConfig() and cfg().ratio == MonitorConfig().ratio
    got = cfg(
        "--no-rollback",
        "--rollback-window",
        "5",
        "--rollback-floor",
        "1.2",
        "--set",
        "monitor.ratio=0.9",
        "--set",
        "monitor.rollback.min_drafts=7",
    )
    assert (
        got.rollback.enabled,
        got.rollback.window_s,
        got.rollback.floor_tau,
        got.rollback.min_drafts,
        got.ratio,
    ) == (False, 5.0, 1.2, 7, 0.9)
    with pytest.raises(BadInput, match="monitor.rollback.floor_tau must be a finite number >= 1"):
        cfg("--rollback-floor", "0.5")
    with pytest.raises(BadInput, match="monitor.rollback.sustain_windows"):
        cfg("--set", "monitor.rollback.sustain_windows=0")


# ---- the follow loop, with a fake server -------------------------------------------------------------------------


def _served(head: str) -> Served:
    spec = EngineSpec("/t", head or None, method="eagle3" if head else None)
    return Served(spec, head, "t")


class _FakeLive:
    """What `follow` uses of a LiveServer; each counters read adds 40 drafts at the served head's τ."""

    def __init__(self, first: Served, taus: dict[str, float], budget_s: float):
        self.served, self.taus, self.swaps = first, taus, [first.head]
        self.feed, self.deadline = _Feed(), time.monotonic() + budget_s
        self.reads_since_swap = 0

    def alive(self) -> bool:
        return time.monotonic() < self.deadline

    def spec_counters(self) -> SpecCounters:
        self.reads_since_swap += 1
        return self.feed.step(40, self.taus[self.served.head])

    def swap_to(self, served: Served) -> bool:
        self.served, self.feed, self.reads_since_swap = served, _Feed(), 0
        self.swaps.append(served.head)
        return True


def _follow(
    live: _FakeLive, alias: list[int], taus_by_version: dict[int, float | None], first: int, window_s: float = 0.05
) -> list[RolledBack]:
    events: list[RolledBack] = []

    def rolled_back(r: RolledBack) -> None:
        events.append(r)
        alias[0] = r.to_version if r.to_version is not None else 0

    f = Follow(
        lambda: alias[0] or None,
        lambda v: _served(f"models:/h/{v}"),
        first,
        0.05,
        rollback=RollbackConfig(window_s=window_s, min_drafts=30),
        ratio=0.8,
        registered_tau=lambda v: taus_by_version.get(v),
        rolled_back=rolled_back,
    )
    follow(live, f, lambda line: None)
    return events


def test_the_loop_rolls_a_collapsed_head_back_to_the_previous_champion_within_two_windows():
    live = _FakeLive(_served("models:/h/1"), {"models:/h/1": 2.6, "models:/h/2": 1.0}, budget_s=1.5)
    alias = [1]
    live.deadline = time.monotonic() + 1.5

    import threading

    threading.Timer(0.2, lambda: alias.__setitem__(0, 2)).start()  # the alias moves to the collapsed head
    events = _follow(live, alias, {1: 2.6, 2: 2.9}, first=1)
    assert live.swaps == ["models:/h/1", "models:/h/2", "models:/h/1"], live.swaps
    [r] = events
    assert (r.from_version, r.to_version, r.from_head, r.to_head) == (2, 1, "models:/h/2", "models:/h/1")
    assert r.judgement.verdict == "collapse" and r.judgement.windows <= 2
    assert alias == [1]


def test_a_rolled_back_version_is_not_swapped_in_again():
    live = _FakeLive(_served("models:/h/1"), {"models:/h/1": 2.6, "models:/h/2": 1.0}, budget_s=1.5)
    alias = [1]

    def keep_alias_on_2(r: RolledBack) -> None:  # a registry that did not take the move back
        events.append(r)

    events: list[RolledBack] = []
    f = Follow(
        lambda: alias[0],
        lambda v: _served(f"models:/h/{v}"),
        1,
        0.05,
        rollback=RollbackConfig(window_s=0.05, min_drafts=30),
        registered_tau=lambda v: 2.6,
        rolled_back=keep_alias_on_2,
    )
    alias[0] = 2
    follow(live, f, lambda line: None)
    assert live.swaps == ["models:/h/1", "models:/h/2", "models:/h/1"] and len(events) == 1


def test_with_no_previous_champion_the_loop_rolls_back_to_plain_decoding():
    live = _FakeLive(_served("models:/h/3"), {"models:/h/3": 1.02, "": 1.0}, budget_s=0.8)
    alias = [3]
    events = _follow(live, alias, {3: 2.5}, first=3)
    assert live.swaps == ["models:/h/3", ""]
    [r] = events
    assert (r.from_version, r.to_version, r.to_head) == (3, None, "") and r.judgement.windows <= 2
    assert live.served.spec.method is None and live.served.spec.head_dir is None
    assert alias == [0]  # removed: nothing registered serves


def test_rollback_off_never_swaps_back():
    live = _FakeLive(_served("models:/h/1"), {"models:/h/1": 1.0}, budget_s=0.5)
    f = Follow(
        lambda: 1,
        lambda v: _served(f"models:/h/{v}"),
        1,
        0.05,
        rollback=RollbackConfig(enabled=False, window_s=0.05, min_drafts=1),
    )
    follow(live, f, lambda line: None)
    assert live.swaps == ["models:/h/1"] and live.reads_since_swap == 0


def test_move_alias_back_tags_the_reason_and_moves_the_alias(mlflow_store, tmp_path):
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "config.json").write_text("{}")
    for v in (1, 2):
        with mlflow_store.run(f"head-{v}") as run_id:
            mlflow_store.log_dir(run_id, tmp_path / "head", "head")
            mlflow_store.register("h", run_id, "head", run_key=f"rollback-{v}")
    mlflow_store.set_alias("h", "champion", 2)
    move_alias_back(mlflow_store, "h", "champion", 2, 1, "collapse: window tau 1.00 < floor 1.1")
    assert mlflow_store.get_alias("h", "champion").version == 1
    assert mlflow_store.get_version("h", 2).tags[REASON_TAG] == "collapse: window tau 1.00 < floor 1.1"
    move_alias_back(mlflow_store, "h", "champion", 1, None, "collapse")
    assert mlflow_store.get_alias("h", "champion") is None
    assert mlflow_store.get_version("h", 1).tags[REASON_TAG] == "collapse"
