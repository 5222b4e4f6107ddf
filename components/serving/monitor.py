"""Acceptance monitor: a served head's acceptance from vLLM's `/metrics`, against the τ its registry entry promised.

Purpose: `Monitor(cfg, state_file, baseline)` keeps timestamped readings of vLLM's cumulative spec-decode counters
(`infra.vllm_server.SpecCounters`) in a JSON state file and, on each `observe(counters, now)`, returns a
`WindowReport`: τ and α_k over the sliding window (`cfg.window_s`: from the newest reading at least that old to
now, or from the oldest reading kept), the champion's registered τ, and a verdict:
  warming   fewer than `cfg.min_drafts` drafts in the window: no judgement yet;
  ok        window τ >= `cfg.ratio` x registered τ (clears a drop);
  low       below, for less than `cfg.sustain_s` so far;
  dropped   below for at least `cfg.sustain_s` and not yet announced: the caller emits `eagle.acceptance.dropped`
            and calls `mark_announced()` only if the event was sent;
  announced below, and this drop was announced already: nothing is sent again until the window recovers to `ok`
            or the champion changes (the debounce: one drop, one event, one retrain).
Counter resets (the server restarted: a counter went back) are handled: the interval across a reset counts the
new reading from zero. `baseline_of(store, target)` reads the champion head of a target version and its registered
τ: `tau_vllm` when the evaluation measured it in vLLM (the same counters the monitor reads), else `tau`.
`newest_snapshot(traffic_dir)` picks the traffic a drop retrains on: the last `<snapshot>/train.jsonl` +
`heldout.jsonl` in name order (name snapshots by ISO date, `YYYY-MM-DD`, so that name order is time order).
`window_start` / `window_counts` are the window arithmetic the rollback's judge shares (components/serving/rollback.py);
`RollbackConfig` (`monitor.rollback`) says when `eagle-heads serve --follow-alias` swaps a collapsed head back.
Run: `eagle-heads monitor --metrics-url URL --target models:/NAME/VERSION` or the `watch-acceptance` flow.
Not here: the HTTP scrape (`infra.vllm_server.read_metrics`), the event (flows/watch_acceptance.py), the rollback.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from components.data.atomic import atomic_write_text
from components.registry.register import TargetRef, head_model_name
from eagle.config_checks import FieldError, at_least, finite
from eagle.errors import BadInput
from infra.mlflow_store import CHAMPION, MlflowStore, parse_model_uri
from infra.model_uri import lookup
from infra.settings import redact_uri
from infra.vllm_server import SpecCounters

EVENT = "eagle.acceptance.dropped"
Verdict = Literal["warming", "ok", "low", "dropped", "announced"]


class MonitorError(BadInput):
    """The monitor cannot judge: no champion, a bad target URI, a served K unlike the evaluated one; one line."""


@dataclass(frozen=True)
class RollbackConfig:
    """When `eagle-heads serve --follow-alias` swaps a served head back (components/serving/rollback.py)."""

    enabled: bool = True  # judge the served head's live acceptance and roll back on a collapse
    window_s: float = 60.0  # the engine's counters are read once a window; each window is judged
    floor_tau: float = 1.1  # window tau below this is a collapse: drafts almost never accepted, slower than plain
    min_drafts: int = 50  # fewer drafts in a window: it reaches back over earlier windows before judging
    sustain_windows: int = 2  # window tau below monitor.ratio x the previous champion's this many windows in a row

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise FieldError(self, "enabled", f"must be true or false, got {self.enabled!r}")
        finite(self, "window_s", lambda x: x > 0, "> 0")  # 0 would read the counters in a busy loop
        finite(self, "floor_tau", lambda x: x >= 1, ">= 1 (tau counts the bonus token: 1 is no draft accepted)")
        at_least(self, {"min_drafts": 1, "sustain_windows": 1})


@dataclass(frozen=True)
class MonitorConfig:
    interval_s: float = 60.0  # between scrapes
    window_s: float = 900.0  # the sliding window τ is computed over
    ratio: float = 0.8  # a drop: window τ below ratio x the champion's registered τ ...
    sustain_s: float = 300.0  # ... for at least this long
    min_drafts: int = 200  # fewer drafts in the window: no judgement
    traffic_dir: str = ""  # snapshots `<dir>/<name>/{train,heldout}.jsonl`; a drop retrains on the newest
    rollback: RollbackConfig = field(default_factory=RollbackConfig)

    def __post_init__(self) -> None:
        finite(self, "interval_s", lambda x: x > 0, "> 0")  # 0 would scrape in a busy loop
        for name in ("window_s", "sustain_s"):
            finite(self, name, lambda x: x >= 0, ">= 0")
        finite(self, "ratio", lambda x: 0 < x <= 1, "in (0, 1]")
        at_least(self, {"min_drafts": 1})

    @classmethod
    def tiny(cls) -> "MonitorConfig":
        return cls(interval_s=1.0, window_s=0.0, sustain_s=0.0, min_drafts=20)


@dataclass(frozen=True)
class Baseline:
    """What the served head promised: the champion of `target`'s head model and its registered τ."""

    target: str  # models:/NAME/VERSION of the target
    head_uri: str  # models:/HEAD/VERSION of its champion head
    tau: float
    tau_source: str  # "tau_vllm", "tau_raw" (ours, counted as vLLM counts) or "tau"
    depth: int  # drafted tokens per step in the evaluation (0: unknown)


@dataclass(frozen=True)
class WindowReport:
    at: float
    verdict: Verdict
    window_tau: float
    registered_tau: float
    acceptance: list[float]
    drafts: int
    window_s: float  # the span the window really covers
    baseline: Baseline
    # mean of `vllm:num_requests_running` over the window's scrapes (None: not reported): a change of load, not of
    # acceptance, is told apart by it
    mean_running: float | None = None

    def line(self) -> str:
        alphas = " ".join(f"{a:.2f}" for a in self.acceptance)
        return (
            f"{self.baseline.target}: window tau {self.window_tau:.2f} (registered {self.registered_tau:.2f}, "
            f"{self.baseline.tau_source}) over {self.drafts} drafts in {self.window_s:.0f} s, alpha {alphas or '-'}"
            f"{'' if self.mean_running is None else f', mean running requests {self.mean_running:.1f}'}"
            f": {self.verdict}"
        )

    def payload(self) -> dict:
        name, version, _ = parse_model_uri(self.baseline.target)
        return {
            "name": name,
            "version": version,
            "window_tau": round(self.window_tau, 4),
            "registered_tau": round(self.registered_tau, 4),
            "tau_source": self.baseline.tau_source,
            "head": self.baseline.head_uri,
            "drafts": self.drafts,
            "window_s": round(self.window_s, 1),
            "acceptance": [round(a, 4) for a in self.acceptance],
            "mean_running": None if self.mean_running is None else round(self.mean_running, 2),
        }


@dataclass
class _State:
    head_uri: str = ""
    readings: list[tuple[float, dict]] = field(default_factory=list)  # (time, SpecCounters as a dict)
    below_since: float | None = None
    announced: bool = False


def baseline_of(store: MlflowStore, target: str, suffix: str = "-eagle3") -> Baseline:
    """The champion head of target version `target` (models:/NAME/VERSION) and the τ it was registered with."""
    try:
        name, _, _ = parse_model_uri(target)
    except ValueError as e:
        raise MonitorError(f"{e}; pass the target version as models:/NAME/VERSION") from None
    version = lookup(store.client, target, redact_uri(store.tracking_uri))  # UnknownModel: model, version or alias
    head = head_model_name(TargetRef(name, version, "", ""), suffix)
    champion = store.get_alias(head, CHAMPION) if store.find_versions(head) else None
    if champion is None:
        raise MonitorError(
            f"models:/{name}/{version} has no champion head (no model {head} with alias champion): "
            "train and register one first (eagle-heads train)"
        )
    tau, source, depth = registered_tau(champion.tags)
    if tau is None:
        raise MonitorError(
            f"models:/{head}/{champion.version} has no registered tau tag: register it with its "
            "evaluation (eagle-heads train)"
        )
    return Baseline(f"models:/{name}/{version}", f"models:/{head}/{champion.version}", tau, source, depth)


def registered_tau(tags: dict[str, str]) -> tuple[float | None, str, int]:
    """(τ, the tag it came from, drafted tokens per step in that evaluation (0: unknown)) of a head version's tags;
    τ None when none is registered. vLLM's counters count what the rule accepted: vLLM's own figure first, else ours
    counted alike (`tau_raw`), else `tau`."""
    source = next((k for k in ("tau_vllm", "tau_raw", "tau") if k in tags), "tau")
    depth = len(tags.get("acceptance_vllm" if source == "tau_vllm" else "acceptance", "").split())
    try:
        return float(tags[source]), source, depth
    except (KeyError, ValueError):
        return None, source, depth


class Monitor:
    """Sliding-window acceptance of one served head, persisted in `state_file` so that windows span processes."""

    def __init__(self, cfg: MonitorConfig, state_file: str | Path, baseline: Baseline):
        self.cfg, self.path, self.baseline = cfg, Path(state_file), baseline
        self.state = self._load()
        if self.state.head_uri != baseline.head_uri:  # a new champion: its own baseline, a fresh window
            self.state = _State(head_uri=baseline.head_uri)

    def _load(self) -> _State:
        try:
            raw = json.loads(self.path.read_text())
            return _State(
                raw["head_uri"], [(float(t), c) for t, c in raw["readings"]], raw["below_since"], bool(raw["announced"])
            )
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or torn: start a fresh window
            return _State()

    def _save(self) -> None:
        atomic_write_text(self.path, json.dumps(asdict(self.state)) + "\n")

    def observe(self, counters: SpecCounters, now: float, running: float | None = None) -> WindowReport:
        """Add a reading taken at `now` (seconds), with the requests running then, and judge the window that ends
        there."""
        depth = len(counters.accepted_per_pos)
        if self.baseline.depth and depth and depth != self.baseline.depth:
            raise MonitorError(
                f"the server drafts {depth} tokens per step but {self.baseline.head_uri} was evaluated "
                f"at {self.baseline.depth}: τ is not comparable; serve it with "
                f"num_speculative_tokens {self.baseline.depth}"
            )
        self.state.readings.append((now, {**asdict(counters), "running": running}))
        start = window_start([t for t, _ in self.state.readings], now, self.cfg.window_s)
        self.state.readings = self.state.readings[start:]
        window = window_counts(
            [
                SpecCounters(
                    **{k: v for k, v in c.items() if k != "running"}
                    | {"accepted_per_pos": tuple(c["accepted_per_pos"])}
                )
                for _, c in self.state.readings
            ]
        )
        report = self._judge(window, now, now - self.state.readings[0][0])
        loads = [c["running"] for _, c in self.state.readings if c.get("running") is not None]
        report = replace(report, mean_running=sum(loads) / len(loads) if loads else None)
        self._save()
        return report

    def _judge(self, window: SpecCounters, now: float, span_s: float) -> WindowReport:
        cfg, st = self.cfg, self.state
        verdict: Verdict
        if window.drafts < cfg.min_drafts:
            verdict = "warming"
        elif window.tau >= cfg.ratio * self.baseline.tau:
            verdict, st.below_since, st.announced = "ok", None, False
        else:
            st.below_since = now if st.below_since is None else st.below_since
            if st.announced:
                verdict = "announced"
            else:
                verdict = "dropped" if now - st.below_since >= cfg.sustain_s else "low"
        return WindowReport(
            now, verdict, window.tau, self.baseline.tau, window.acceptance, window.drafts, span_s, self.baseline
        )

    def mark_announced(self) -> None:
        """The drop's event was sent: no other until the window recovers or the champion changes."""
        self.state.announced = True
        self._save()


def window_start(times: list[float], now: float, window_s: float) -> int:
    """Index of the reading a window ending `now` starts at: the newest one (but the last) at least `window_s` old,
    else the oldest. Shared by the monitor and the rollback's judge (components/serving/rollback.py)."""
    start = 0
    for i, t in enumerate(times[:-1]):
        if t <= now - window_s:
            start = i
    return start


def window_counts(readings: list[SpecCounters]) -> SpecCounters:
    """The counts between the first and last reading; an interval across a restart counts from zero."""
    total = SpecCounters(0, 0, 0, ())
    for before, after in zip(readings, readings[1:]):
        total = total + (after if after.went_back(before) else after - before)
    return total


def newest_snapshot(traffic_dir: str | Path) -> tuple[str, str]:
    """(train, held-out) traffic of the newest snapshot in `traffic_dir`: the last subdirectory in name order that
    holds both `train.jsonl` and `heldout.jsonl`."""
    root = Path(traffic_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"traffic directory {root} does not exist: set monitor.traffic_dir to a directory "
            "of snapshots <name>/train.jsonl + heldout.jsonl"
        )
    snaps = sorted(p for p in root.iterdir() if (p / "train.jsonl").is_file() and (p / "heldout.jsonl").is_file())
    if not snaps:
        raise FileNotFoundError(f"{root} holds no snapshot (a subdirectory with train.jsonl and heldout.jsonl)")
    return str(snaps[-1] / "train.jsonl"), str(snaps[-1] / "heldout.jsonl")
