"""Flow `watch-acceptance`: a served head's acceptance in vLLM, and the event that retrains it when it drops.

Purpose: each scrape reads the server's `/metrics` (vLLM's spec-decode counters), adds the reading to the target's
sliding window (`components.serving.monitor.Monitor`, state under `<state>/monitor/`, so windows span flow runs and
restarts) and prints the window τ against the champion's registered τ. When the window has stayed below
`monitor.ratio` x that τ for `monitor.sustain_s`, it emits `eagle.acceptance.dropped` (resource
`mlflow.model_version.<target>.<version>`, payload: window τ, registered τ, drafts, α_k, the head), which the
`retrain-on-drop` deployment's trigger turns into a `retrain` of that target on the newest traffic snapshot. One
drop sends one event: the drop is remembered as announced only when the event was sent, and nothing more is sent
until the window recovers or a new champion is registered. A stopped server, a page without vLLM's counters and a
target without a champion are one clear line each (`MonitorError` / `EngineError`), and no event.
Run: the `watch-acceptance` deployment (prefect.yaml), or `eagle-heads monitor --metrics-url URL --target
models:/NAME/VERSION [--once]`. Not here: the window arithmetic (components/serving/monitor.py).
"""

from __future__ import annotations

import hashlib
import time
from typing import Callable

from prefect import flow

from components.config.pipeline import PipelineConfig, monitor_config
from components.serving.monitor import EVENT, Monitor, WindowReport, baseline_of
from infra.mlflow_store import MlflowStore, parse_model_uri
from infra.prefect_env import emit_event
from infra.settings import Settings
from infra.vllm_server import EngineError, SpecCounters, read_metrics, running_requests


def open_monitor(metrics_url: str, target: str, cfg: PipelineConfig, settings: Settings) -> Monitor:
    """The monitor of `target` as served at `metrics_url` (one state file per target and server)."""
    baseline = baseline_of(MlflowStore.connect(settings), target, cfg.register.experiment_suffix)
    name, version, _ = parse_model_uri(baseline.target)
    url_key = hashlib.sha256(metrics_url.encode()).hexdigest()[:8]
    state = settings.state_dir / "monitor" / f"{name}-v{version}-{url_key}.json"
    return Monitor(cfg.monitor, state, baseline)


def scrape(metrics_url: str) -> tuple[SpecCounters, float | None]:
    """vLLM's counters at `metrics_url`; `EngineError` (one line) for a page that is not vLLM's, a server that speaks
    another protocol, or a counter that is not a finite number (`NaN`)."""
    import http.client

    try:
        text = read_metrics(metrics_url)
        return SpecCounters.parse(text), running_requests(text)
    except http.client.HTTPException as e:
        raise EngineError(
            f"cannot read {metrics_url}: not an HTTP answer ({type(e).__name__}): is this a vLLM server's /metrics?"
        ) from None
    except (ValueError, OverflowError, IndexError) as e:
        raise EngineError(
            f"{metrics_url}: a spec-decode counter is not a finite number ({e}): is this a vLLM server's /metrics?"
        ) from None


def check_acceptance(monitor: Monitor, metrics_url: str, say: Callable[[str], None] = print) -> WindowReport:
    """One scrape: read the counters, judge the window, announce a drop once. Raises EngineError (no vLLM there)."""
    counters, running = scrape(metrics_url)
    report = monitor.observe(counters, time.time(), running)
    say(report.line())
    if report.verdict == "dropped":
        name, version, _ = parse_model_uri(report.baseline.target)
        sent = emit_event(EVENT, f"mlflow.model_version.{name}.{version}", payload=report.payload())
        if sent:
            monitor.mark_announced()
            say(
                f"announced {EVENT} for {report.baseline.target}: window tau {report.window_tau:.2f} < "
                f"{monitor.cfg.ratio} x {report.registered_tau:.2f}"
            )
        else:
            say(f"{EVENT} for {report.baseline.target} not sent (no Prefect API); the next scrape tries again")
    return report


@flow(name="watch-acceptance", log_prints=True)
def watch_acceptance(
    metrics_url: str, target: str, scrapes: int = 1, preset: str = "default", config_path: str | None = None
) -> list[dict]:
    """`scrapes` scrapes, `monitor.interval_s` apart; returns each window's report as a dict."""
    if scrapes < 1:
        raise ValueError(f"scrapes must be >= 1, got {scrapes}")
    cfg = monitor_config(preset, config_path)
    monitor = open_monitor(metrics_url, target, cfg, Settings.from_env())
    out = []
    for i in range(scrapes):
        if i:
            time.sleep(cfg.monitor.interval_s)
        r = check_acceptance(monitor, metrics_url)
        out.append({"verdict": r.verdict, **r.payload()})
    return out


def monitor_forever(monitor: Monitor, metrics_url: str, once: bool, say: Callable[[str], None] = print) -> int:
    """The CLI's loop: a scrape every `interval_s`; a failed scrape is one line (and exit 1 with `once`)."""
    while True:
        try:
            check_acceptance(monitor, metrics_url, say)
        except EngineError as e:
            say(f"monitor: {e}")
            if once:
                return 1
        if once:
            return 0
        time.sleep(monitor.cfg.interval_s)
