"""Roll back on collapse: judge a served head's live acceptance window by window, and say when to swap it back.

Purpose: `Judge(cfg, ratio, previous_tau)` takes readings of the running engine's cumulative spec-decode counters
(`observe(counters, now)`, one per `RollbackConfig.window_s`, the first when the head came into service) and judges
each window with the monitor's window arithmetic (components/serving/monitor.py `window_start`, `window_counts`):
  warming   fewer than `min_drafts` drafts, even reaching back over the earlier windows: no judgement yet;
  ok        window τ at or above both rules;
  low       below `ratio` x the previous champion's registered τ, fewer than `sustain_windows` windows in a row;
  collapse  window τ below `floor_tau` (≈ 1: every step pays for drafts and keeps none): roll back now;
  below     below `ratio` x the previous champion's τ for `sustain_windows` windows in a row: roll back.
With no previous champion (the head was the first served, or the previous was plain decoding) only the floor applies
and the rollback goes to plain decoding. `Judgement.reason` is the one line the log, the registry tag and the event
carry. `move_alias_back(store, name, alias, from_version, to_version, reason)` tags the rolled-back version with
`rollback_reason` and points the alias at `to_version` (None: removes it, so that no version claims to be served).
Run: inside `eagle-heads serve --follow-alias` (components/serving/live.py `follow`); tests/test_rollback.py.
Not here: the swap (components/serving/live.py), the event (flows/command_serve.py `serve`), the drop monitor that
retrains (components/serving/monitor.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from components.serving.monitor import RollbackConfig, window_counts, window_start
from infra.mlflow_store import MlflowStore
from infra.vllm_server import SpecCounters

EVENT = "eagle.head.rolled_back"
REASON_TAG = "rollback_reason"
Verdict = Literal["warming", "ok", "low", "collapse", "below"]


@dataclass(frozen=True)
class Judgement:
    at: float
    verdict: Verdict
    window_tau: float
    drafts: int
    span_s: float  # the span the judged window really covers
    windows: int  # windows ended since the head came into service, this one included
    reason: str  # one line: what was measured against what

    @property
    def roll_back(self) -> bool:
        return self.verdict in ("collapse", "below")


class Judge:
    """The live acceptance of one head since it came into service; one `observe` a window."""

    def __init__(self, cfg: RollbackConfig, ratio: float, previous_tau: float | None):
        self.cfg, self.ratio, self.previous_tau = cfg, ratio, previous_tau
        self.readings: list[tuple[float, SpecCounters]] = []
        self.windows = 0
        self.low_in_row = 0

    def observe(self, counters: SpecCounters, now: float) -> Judgement:
        self.readings.append((now, counters))
        if len(self.readings) == 1:  # the start of the first window
            return Judgement(now, "warming", 0.0, 0, 0.0, 0, "the head came into service")
        self.windows += 1
        start = window_start([t for t, _ in self.readings], now, self.cfg.window_s)
        window = window_counts([c for _, c in self.readings[start:]])
        while window.drafts < self.cfg.min_drafts and start > 0:  # too few drafts to judge: reach back
            start -= 1
            window = window_counts([c for _, c in self.readings[start:]])
        span = now - self.readings[start][0]
        if window.drafts < self.cfg.min_drafts:
            return Judgement(
                now,
                "warming",
                window.tau,
                window.drafts,
                span,
                self.windows,
                f"{window.drafts} drafts in {span:.0f} s, fewer than {self.cfg.min_drafts}: not judged",
            )
        self.readings = self.readings[start:]
        return self._judge(window, now, span)

    def _judge(self, window: SpecCounters, now: float, span: float) -> Judgement:
        over = f"over {window.drafts} drafts in {span:.0f} s"
        verdict: Verdict
        if window.tau < self.cfg.floor_tau:
            verdict = "collapse"
            reason = f"collapse: window tau {window.tau:.2f} < floor {self.cfg.floor_tau:g} {over}"
        elif self.previous_tau is not None and window.tau < self.ratio * self.previous_tau:
            self.low_in_row += 1
            verdict = "below" if self.low_in_row >= self.cfg.sustain_windows else "low"
            reason = (
                f"window tau {window.tau:.2f} < {self.ratio:g} x {self.previous_tau:.2f} (the previous "
                f"champion's registered tau) {over}, {self.low_in_row} window(s) in a row"
            )
        else:
            self.low_in_row = 0
            verdict = "ok"
            floor = f"floor {self.cfg.floor_tau:g}"
            rule = floor if self.previous_tau is None else f"{floor}, {self.ratio:g} x {self.previous_tau:.2f}"
            reason = f"window tau {window.tau:.2f} {over} ({rule})"
        return Judgement(now, verdict, window.tau, window.drafts, span, self.windows, reason)


def move_alias_back(
    store: MlflowStore, name: str, alias: str, from_version: int, to_version: int | None, reason: str
) -> None:
    """The registry's side of a rollback: the reason on the version rolled back, the alias on the one served now."""
    store.set_version_tag(name, from_version, REASON_TAG, reason)
    if to_version is None:
        store.delete_alias(name, alias)
    else:
        store.set_alias(name, alias, to_version)
