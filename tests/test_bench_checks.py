"""The benchmarks' own checks that need no quick run: bad arguments refused, the call counter, the ratio pairing.

Purpose: keep bench/'s scripts honest where a quick run would not show it: real_head.py, capture_mix.py,
proxy_overhead.py and rollback_live.py refuse bad arguments in one line (exit 2) before any work; speedup's
`CallCounter` (bench/speedup_methods.py) hooks the target only while counting (a hook anywhere makes our loops leave
their lean decoder); proxy_overhead.py's ratios pair the direct and proxy cells of each round; serving_loop.py's live
clients hold their requests while the retrain measures in vLLM; rollback_live.py's collapsed head accepts nothing.
Marked slow, as the quick runs in tests/test_bench_quick.py, whose module they were part of.
Run: `python -m pytest -m slow tests/test_bench_checks.py` (1-2 minutes on 2 busy cores: each refusal is a fresh
process).
Not here: the quick runs and their result files (tests/test_bench_quick.py), the figures (bench/README.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import refusal

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_call_counter_hooks_the_target_only_while_counting() -> None:
    """speedup.py counts transformers' passes with a forward hook; outside `counting()` the target must have none,
    or our loops would leave their lean decoder (slower plain and speculative decoding alike)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "bench"))
    from speedup_methods import CallCounter

    from eagle.fastpath import LeanDecoder

    target = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=64,
        )
    ).eval()
    counter = CallCounter(target)
    assert LeanDecoder.of(target) is not None
    with counter.counting(), torch.no_grad():
        target(torch.tensor([[1, 2, 3]]))
        assert counter.n == 1
    assert LeanDecoder.of(target) is not None


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--runs", "-1"], "--runs must not be negative"),
        (["--summary", "/no/such/summary.json"], "does not exist"),
        (["--head", ".", "--summary", "."], "give one"),
    ],
)
def test_real_head_refuses_bad_arguments_in_one_line_before_any_work(argv, says, capsys, monkeypatch):
    code, (*_, last) = refusal("real_head", argv, capsys, monkeypatch)
    assert code == 2 and says in last, last


@pytest.mark.parametrize("argv", [["--window", "0"], ["--clients", "0"], ["--after", "-1"], ["--check", "-2"]])
def test_rollback_bench_refuses_bad_arguments_in_one_line_before_any_work(argv, capsys, monkeypatch):
    code, (*_, last) = refusal("rollback_live", argv, capsys, monkeypatch)
    assert code == 2 and "--window > 0, --after >= 0, --clients >= 1, --check >= 0" in last, last


def test_proxy_overhead_ratios_pair_the_cells_of_each_round() -> None:
    """proxy_overhead.py's ratio is per round (a direct and a proxy cell back to back), its median the goal's figure,
    min and max its interval; the per-mode medians are over rounds."""
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "bench"))
    from proxy_overhead import summarize

    def cell(tok_s, ttft):
        return SimpleNamespace(output_tokens_per_s=tok_s, median_ttft_ms=ttft)

    keys = [
        (1, "direct"),
        (1, "proxy"),
        (16, "direct"),
        (16, "proxy"),
        (1, "proxy"),
        (1, "direct"),
        (16, "proxy"),
        (16, "direct"),
        (1, "direct"),
        (1, "proxy"),
        (16, "direct"),
        (16, "proxy"),
    ]
    cells = [
        cell(100, 10),
        cell(98, 12),
        cell(400, 50),
        cell(400, 60),
        cell(90, 10),
        cell(80, 10),
        cell(380, 50),
        cell(400, 50),
        cell(110, 10),
        cell(110, 14),
        cell(500, 50),
        cell(450, 50),
    ]
    out = summarize(keys, cells)
    assert out[1]["tok_s_ratio_by_round"] == [0.98, 90 / 80, 1.0]  # rounds pair by order of each mode's cells
    assert (out[1]["tok_s_ratio"], out[1]["tok_s_ratio_min"], out[1]["tok_s_ratio_max"]) == (1.0, 0.98, 90 / 80)
    assert out[16]["tok_s_ratio"] == 0.95 and out[16]["direct"]["tok_s"] == 400 and out[1]["ttft_ratio"] == 1.2
    with pytest.raises(ValueError, match="concurrency 1: 1 direct and 0 proxy"):
        summarize([(1, "direct")], [cell(1, 1)])


@pytest.mark.parametrize(
    "script, argv, says",
    [
        ("capture_mix", ["--mixes", "1.0"], "must lie in (0, 1)"),
        ("capture_mix", ["--build", "/no/such/build"], "not a real build of the embedded default"),
        ("capture_mix", ["--quick", "--build", "."], "exclude each other"),
        ("proxy_overhead", ["--target", "."], "go together"),
        ("proxy_overhead", ["--target", ".", "--heldout", "/no/such.jsonl"], "not a model directory"),
        ("proxy_overhead", ["--prompts", "8"], "--prompts >= 16"),
    ],
)
def test_bench_serving_scripts_refuse_bad_arguments_in_one_line_before_any_work(
    script, argv, says, capsys, monkeypatch
):
    code, (*_, last) = refusal(script, argv, capsys, monkeypatch)
    assert code == 2 and says in last, last


def test_serving_loop_offline_plan_keeps_the_captured_traffic_and_one_registered(tmp_path: Path) -> None:
    """bench/serving_loop_offline.py: the offline head's plan is the retrain's with 1 registered conversation and a
    run key of its own; its config turns warm start off and keeps the rest; the summary's ratios are shadow taus'."""
    import json

    sys.path.insert(0, str(ROOT / "bench"))
    import serving_loop_offline as off

    plan = {"captured": 88, "registered": 88, "mix": 0.5, "sha256": "ab" * 32, "captured_file": "c.jsonl"}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    copy = json.loads(off.offline_plan(tmp_path / "plan.json", tmp_path / "off").read_text())
    assert (copy["registered"], copy["captured"], copy["captured_file"]) == (1, 88, "c.jsonl")
    assert copy["mix"] == round(88 / 89, 4) and copy["sha256"] != plan["sha256"] and len(copy["sha256"]) == 64
    cfg = json.loads(
        off.offline_config({"capture": {"heldout": 8}, "train": {"steps": 9}}, tmp_path / "new" / "c.json").read_text()
    )
    assert cfg == {"capture": {"heldout": 8}, "train": {"steps": 9, "warm_start": False}}
    s = off.summary({"head_uri": "models:/h/3", "tags": {"shadow_tau": "2.0", "shadow_champion_tau": "1.9"}}, 1.8)
    assert (s["retrained_over_offline"], s["live_over_offline"]) == (0.95, 0.9)
    assert "0.95x offline" in off.line(s) and off.summary({}, None)["retrained_over_offline"] is None


def test_serving_loop_clients_hold_their_requests_while_the_retrain_measures_in_vllm() -> None:
    """The retrain child's first line of its engine evaluation (or of its shadow test) holds the live clients (on 2
    cores a served speedup measured beside live traffic reads unreliable): no request starts until the hold is
    lifted, and the hold is one event."""
    import http.server
    import json
    import threading
    import time

    sys.path.insert(0, str(ROOT / "bench"))
    from serving_loop_live import Traffic, measure_hold
    from serving_loop_setup import QUICK

    starts: list[float] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            starts.append(time.monotonic())
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"choices": [{"token_ids": [1], "finish_reason": "length"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    events: list[str] = []
    msgs = [{"role": "user", "content": "hi"}]
    traffic = Traffic(f"http://127.0.0.1:{srv.server_port}", "m", {"base": [msgs], "shift": [msgs]}, QUICK, 0.0)
    traffic.pause_s = 0.05
    try:
        traffic.start()
        time.sleep(0.5)
        on_line = measure_hold(traffic, lambda kind, **kw: events.append(kind))
        on_line("retrain: extract 3/4\n")  # any other line changes nothing
        assert traffic.open.is_set() and not events
        on_line("evaluate (vLLM): starting the engine without speculation and with the head, side by side\n")
        on_line("shadow: 8 held-out captured requests; the new head and plain decoding side by side\n")
        held_at = time.monotonic()
        time.sleep(1.5)
        during = [t for t in starts if t > held_at + 0.5]  # a request in flight at the hold may finish
        assert not during, f"{len(during)} requests started while held"
        assert events == ["measuring: traffic held"]
        traffic.hold(False)
        time.sleep(1.5)
        assert any(t > held_at + 1.5 for t in starts), "the clients did not go on after the hold"
    finally:
        traffic.join()
        srv.shutdown()
    assert all(r["error"] is None for r in traffic.results)


def test_rollback_bench_makes_a_head_that_accepts_nothing(tmp_path) -> None:
    """rollback_live.py's collapsed copy keeps the head's format and maps every draft token to one target token no
    answer emitted (so every draft is rejected); its other tensors are the champion's."""
    import torch
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(ROOT / "bench"))
    from rollback_live import accepting_nothing, unused_token

    good = tmp_path / "good"
    good.mkdir()
    weights = {"d2t": torch.tensor([0, 5, 5, 7]), "fc.weight": torch.ones(2, 3)}
    save_file(weights, good / "model.safetensors")
    (good / "config.json").write_text('{"vocab_size": 16}')
    answers = [{"token_ids": [15, 3, 14]}, {"token_ids": [13, 1]}, {"token_ids": []}]
    never = unused_token(answers, 16)
    assert never == 12
    accepting_nothing(good, tmp_path / "bad", never)
    bad = load_file(tmp_path / "bad" / "model.safetensors")
    assert (bad["d2t"] + torch.arange(4)).tolist() == [12] * 4  # draft id j -> target id j + d2t[j]
    assert torch.equal(bad["fc.weight"], weights["fc.weight"]) and (tmp_path / "bad" / "config.json").is_file()
    assert load_file(good / "model.safetensors")["d2t"].tolist() == [0, 5, 5, 7]  # the champion's own is untouched


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--extract", "/no/such/extract"], "not an extract stage's output"),
        (["--extract", "EXTRACT", "--inits", "target"], "invalid choice: 'target'"),
        (["--extract", "EXTRACT", "--schedules", "1/5"], "needs ':FRACTION'"),
        (["--extract", "EXTRACT", "--minutes", "0"], "--minutes and --eval-every must be > 0"),
    ],
)
def test_ttt_schedule_refuses_bad_arguments_in_one_line_before_any_work(argv, says, capsys, monkeypatch, tmp_path):
    (tmp_path / "manifest.json").write_text("{}")  # passes the directory check; the refusal comes before reading it
    argv = [str(tmp_path) if a == "EXTRACT" else a for a in argv]
    code, (*_, last) = refusal("ttt_schedule", argv, capsys, monkeypatch)
    assert code == 2 and says in last, last
