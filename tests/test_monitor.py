"""The acceptance monitor's window, verdicts and debounce, and its clear lines on bad input, without an engine.

Purpose: `components.serving.monitor.Monitor` fed counter readings at chosen times: τ and α_k over the sliding window,
warming below `min_drafts`, `low` then `dropped` after `sustain_s`, one announcement per drop (until the window
recovers or the champion changes), counter resets across a server restart, state that survives the process, a
served K unlike the evaluated one refused. `baseline_of` reads the champion's τ (`tau_vllm` first) from a SQLite
registry, and refuses a target without a champion. `eagle-heads monitor` against a port with no server and against
a real HTTP server whose `/metrics` has no vLLM counters: one line each, no event. `newest_snapshot` picks the last
snapshot in name order.
Run: `python -m pytest tests/test_monitor.py` (seconds).
Not here: the monitor against a real vLLM with the retrain it triggers (tests/test_monitor_vllm.py).
"""

from __future__ import annotations

import http.server
import threading

import pytest

from components.serving.monitor import Baseline, Monitor, MonitorConfig, MonitorError, baseline_of, newest_snapshot
from infra.vllm_server import SpecCounters

BASE = Baseline("models:/tgt/1", "models:/tgt-v1-eagle3/1", tau=3.0, tau_source="tau_vllm", depth=3)
CFG = MonitorConfig(interval_s=10, window_s=60, ratio=0.8, sustain_s=30, min_drafts=10)


class Server:
    """Cumulative vLLM counters of a server whose drafts accept `accepted` tokens on average (K = 3)."""

    def __init__(self):
        self.c = SpecCounters(0, 0, 0, (0, 0, 0))

    def serve(self, drafts: int, accepted_each: int) -> SpecCounters:
        per = tuple(p + drafts * (k < accepted_each) for k, p in enumerate(self.c.accepted_per_pos))
        self.c = SpecCounters(
            self.c.drafts + drafts, self.c.draft_tokens + 3 * drafts, self.c.accepted + drafts * accepted_each, per
        )
        return self.c


def test_window_tau_and_alphas_follow_the_counters(tmp_path):
    srv, m = Server(), Monitor(CFG, tmp_path / "s.json", BASE)
    assert m.observe(srv.serve(0, 0), 0).verdict == "warming"
    r = m.observe(srv.serve(20, 2), 10)
    assert (r.verdict, r.window_tau, r.drafts) == ("ok", 3.0, 20)
    assert r.acceptance == [1.0, 1.0, 0.0]
    r = m.observe(srv.serve(20, 3), 20)
    assert r.window_tau == pytest.approx(3.5) and r.drafts == 40


def test_the_window_reports_the_mean_load_beside_tau(tmp_path):
    """`vllm:num_requests_running` at each scrape, averaged over the window: a drop of acceptance is told apart from
    a change of load."""
    from infra.vllm_server import running_requests

    text = (
        '# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0",model_name="t"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="t"} 2.0\n'
    )
    assert running_requests(text) == 5.0 and running_requests("vllm:other 1\n") is None
    srv, m = Server(), Monitor(CFG, tmp_path / "s.json", BASE)
    m.observe(srv.serve(0, 0), 0, running=2.0)
    r = m.observe(srv.serve(20, 2), 10, running=6.0)
    assert r.mean_running == pytest.approx(4.0) and "mean running requests 4.0" in r.line()
    assert r.payload()["mean_running"] == 4.0
    r = Monitor(CFG, tmp_path / "s.json", BASE).observe(srv.serve(20, 2), 20)  # state kept across processes
    assert r.mean_running == pytest.approx(4.0) and r.window_tau == 3.0


def test_sliding_window_forgets_old_readings(tmp_path):
    srv, m = Server(), Monitor(CFG, tmp_path / "s.json", BASE)
    m.observe(srv.serve(0, 0), 0)
    m.observe(srv.serve(100, 3), 10)  # good traffic, then only poor traffic for longer than the window
    for t in range(20, 100, 10):
        r = m.observe(srv.serve(20, 0), t)
    assert r.window_tau == 1.0 and r.window_s >= CFG.window_s and r.drafts == 20 * 6


def test_drop_needs_sustain_then_fires_once_until_recovered(tmp_path):
    srv, m = Server(), Monitor(CFG, tmp_path / "s.json", BASE)
    m.observe(srv.serve(0, 0), 0)
    verdicts = []
    for t in range(10, 60, 10):
        r = m.observe(srv.serve(20, 1), t)  # tau 2.0 < 0.8 x 3.0
        verdicts.append(r.verdict)
        if r.verdict == "dropped":
            m.mark_announced()
    assert verdicts == ["low", "low", "low", "dropped", "announced"]  # below since t=10, sustained 30 s at t=40
    for t in range(60, 140, 10):
        r = m.observe(srv.serve(20, 3), t)
    assert r.verdict == "ok"
    verdicts = [m.observe(srv.serve(20, 0), t).verdict for t in range(140, 260, 10)]
    assert "dropped" in verdicts, "a new drop after a recovery is announced again"


def test_an_unsent_event_is_tried_again(tmp_path):
    srv, m = Server(), Monitor(dataclass_replace(CFG, sustain_s=0), tmp_path / "s.json", BASE)
    m.observe(srv.serve(0, 0), 0)
    assert m.observe(srv.serve(20, 0), 10).verdict == "dropped"
    assert m.observe(srv.serve(20, 0), 20).verdict == "dropped"  # not marked announced: still to send


def test_state_survives_the_process_and_resets_on_a_new_champion(tmp_path):
    srv, path = Server(), tmp_path / "s.json"
    m = Monitor(dataclass_replace(CFG, sustain_s=0), path, BASE)
    m.observe(srv.serve(0, 0), 0)
    assert m.observe(srv.serve(20, 0), 10).verdict == "dropped"
    m.mark_announced()
    again = Monitor(dataclass_replace(CFG, sustain_s=0), path, BASE)
    assert again.observe(srv.serve(20, 0), 20).verdict == "announced"
    new_head = dataclass_replace(BASE, head_uri="models:/tgt-v1-eagle3/2")
    fresh = Monitor(dataclass_replace(CFG, sustain_s=0), path, new_head)
    assert fresh.observe(srv.serve(20, 0), 30).verdict == "warming"  # one reading: no window yet
    path.write_text("{torn")
    assert Monitor(CFG, path, BASE).observe(srv.serve(0, 0), 40).verdict == "warming"


def test_a_server_restart_counts_from_zero(tmp_path):
    srv, m = Server(), Monitor(CFG, tmp_path / "s.json", BASE)
    m.observe(srv.serve(0, 0), 0)
    m.observe(srv.serve(50, 3), 10)
    restarted = Server()
    r = m.observe(restarted.serve(10, 1), 20)  # counters went back: the 10 new drafts count, nothing negative
    assert r.drafts == 60 and r.window_tau == pytest.approx(1 + (150 + 10) / 60)


def test_a_served_k_unlike_the_evaluated_one_is_refused(tmp_path):
    m = Monitor(CFG, tmp_path / "s.json", BASE)
    with pytest.raises(MonitorError, match="drafts 5 tokens per step but models:/tgt-v1-eagle3/1 was evaluated at 3"):
        m.observe(SpecCounters(1, 5, 0, (0, 0, 0, 0, 0)), 0)


def test_config_values_are_checked_at_load(tmp_path):
    import json

    from components.config.pipeline import ConfigError, PipelineConfig

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"monitor": {"ratio": 1.5}}))
    with pytest.raises(ConfigError, match=r"monitor.ratio must be a finite number in \(0, 1\]"):
        PipelineConfig.load(path, "tiny")


def test_baseline_prefers_the_engine_tau_and_refuses_no_champion(mlflow_store, tmp_path):
    from components.registry.register import TargetRef, head_model_name, register_target
    from infra.mlflow_store import CHAMPION

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    register_target(mlflow_store, "tgt", str(target), role="base", base_model="", weights_sha256="a" * 64)
    with pytest.raises(MonitorError, match="models:/tgt/1 has no champion head"):
        baseline_of(mlflow_store, "models:/tgt/1")
    with pytest.raises(MonitorError, match="pass the target version as models:/NAME/VERSION"):
        baseline_of(mlflow_store, "tgt/1")
    name = head_model_name(TargetRef("tgt", 1, "", ""))
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    with mlflow_store.run("h") as run_id:
        mlflow_store.log_dir(run_id, head, "head")
        mv = mlflow_store.register(
            name,
            run_id,
            "head",
            run_key="k",
            tags={"tau": "2.5000", "tau_vllm": "2.4000", "acceptance": "0.9 0.8 0.7", "acceptance_vllm": "0.9 0.8 0.6"},
        )
    mlflow_store.set_alias(name, CHAMPION, mv.version)
    b = baseline_of(mlflow_store, "models:/tgt/1")
    assert (b.tau, b.tau_source, b.depth, b.head_uri) == (2.4, "tau_vllm", 3, f"models:/{name}/{mv.version}")
    with mlflow_store.run("h2") as run_id:  # measured here only: our tau counted as vLLM counts, not the emitted one
        mlflow_store.log_dir(run_id, head, "head")
        mv = mlflow_store.register(
            name, run_id, "head", run_key="k2", tags={"tau": "2.5000", "tau_raw": "2.6000", "acceptance": "0.9 0.8 0.7"}
        )
    mlflow_store.set_alias(name, CHAMPION, mv.version)
    assert (baseline_of(mlflow_store, "models:/tgt/1").tau_source, baseline_of(mlflow_store, "models:/tgt/1").tau) == (
        "tau_raw",
        2.6,
    )


def test_newest_snapshot_is_the_last_in_name_order(tmp_path):
    for name in ("2026-11-30", "2026-12-02", "2026-12-01"):
        (tmp_path / name).mkdir()
        for f in ("train.jsonl", "heldout.jsonl"):
            (tmp_path / name / f).write_text("{}\n")
    (tmp_path / "2026-12-03").mkdir()  # incomplete: no heldout.jsonl
    (tmp_path / "2026-12-03" / "train.jsonl").write_text("{}\n")
    assert newest_snapshot(tmp_path) == (
        str(tmp_path / "2026-12-02" / "train.jsonl"),
        str(tmp_path / "2026-12-02" / "heldout.jsonl"),
    )
    with pytest.raises(FileNotFoundError, match="does not exist"):
        newest_snapshot(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="holds no snapshot"):
        newest_snapshot(tmp_path / "2026-12-03")


@pytest.fixture
def registered_champion(mlflow_settings, monkeypatch, tmp_path):
    """A SQLite registry (EAGLE_HOME) whose target `tgt/1` has a champion head registered at tau 3."""
    from components.registry.register import TargetRef, head_model_name, register_target
    from infra.mlflow_store import CHAMPION, MlflowStore

    monkeypatch.setenv("EAGLE_HOME", str(mlflow_settings.state_dir))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    store = MlflowStore.connect(mlflow_settings)
    d = tmp_path / "files"
    d.mkdir()
    (d / "config.json").write_text("{}")
    register_target(store, "tgt", str(d), role="base", base_model="", weights_sha256="a" * 64)
    name = head_model_name(TargetRef("tgt", 1, "", ""))
    with store.run("h") as run_id:
        store.log_dir(run_id, d, "head")
        mv = store.register(name, run_id, "head", run_key="k", tags={"tau": "3.0", "acceptance": "0.9 0.8 0.7"})
    store.set_alias(name, CHAMPION, mv.version)
    return store


@pytest.fixture
def not_vllm():
    """A real HTTP server whose /metrics is Prometheus text of something else (no spec-decode counters)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.5\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    srv.shutdown()


def test_cli_says_one_line_for_a_stopped_server_and_a_non_vllm_page(registered_champion, not_vllm, capsys):
    from flows.cli import main
    from infra.vllm_server import free_port

    stopped = f"http://127.0.0.1:{free_port()}/metrics"
    assert main(["monitor", "--metrics-url", stopped, "--target", "models:/tgt/1", "--once"]) == 1
    out = capsys.readouterr().out
    assert f"monitor: cannot read {stopped}" in out and "is the vLLM server running there?" in out
    assert "announced" not in out
    assert main(["monitor", "--metrics-url", not_vllm, "--target", "models:/tgt/1", "--once"]) == 1
    out = capsys.readouterr().out
    assert "has no vLLM speculative-decoding counters" in out and "announced" not in out
    assert main(["monitor", "--metrics-url", not_vllm, "--target", "models:/tgt/2", "--once"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "models:/tgt/2: registered model 'tgt' has no version 2" in err  # not "no champion"


def dataclass_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)
