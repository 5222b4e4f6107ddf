"""The `eagle-heads` CLI: help that imports nothing heavy, clear errors for bad arguments and unreachable services."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, env=None, timeout=120):
    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=timeout)


def test_help_imports_nothing_heavy():
    r = _cli("--help")
    assert r.returncode == 0 and "demo" in r.stdout and "train" in r.stdout and "watch" in r.stdout
    code = ("import sys, flows.cli; flows.cli._parser(); "
            "print(sorted(m for m in ('torch', 'prefect', 'mlflow', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_bad_arguments_exit_2_with_a_message(tmp_path):
    r = _cli("train", "--target", str(tmp_path / "nope"), "--traffic", str(tmp_path / "t.jsonl"),
             "--heldout", str(tmp_path / "h.jsonl"))
    assert r.returncode == 2 and "no such file or directory" in r.stderr
    r = _cli("train", "--traffic", "x")
    assert r.returncode == 2 and "--target" in r.stderr
    r = _cli("frobnicate")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_unreachable_tracking_server_is_a_clear_error(tmp_path):
    traffic = tmp_path / "t.jsonl"
    traffic.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    env = {"EAGLE_HOME": str(tmp_path / ".eagle"), "MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}
    r = _cli("watch", "--once", env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "127.0.0.1:9" in r.stderr and "error" in r.stderr.lower()


def test_an_untimed_speedup_prints_as_a_dash_with_its_reason():
    """flows/command_runs.py `_speed_text`: `eagle-heads evaluate` prints an untimed speedup (`evaluate.time_local`
    false) as "-" and why, a timed one with its interval, an unreliable one with its reason."""
    from flows.command_runs import _speed_text

    timed = {"speedup": 1.5, "speedup_lo": 1.4, "speedup_hi": 1.6, "speedup_reliable": True, "speedup_note": ""}
    assert _speed_text(timed) == "1.50x [1.40, 1.60]"
    assert _speed_text({**timed, "speedup_reliable": False, "speedup_note": "busy"}) == (
        "1.50x [1.40, 1.60] (unreliable: busy)")
    untimed = {"speedup": float("nan"), "speedup_lo": None, "speedup_hi": None, "speedup_reliable": False,
               "speedup_note": "not timed (evaluate.time_local false)"}
    assert _speed_text(untimed) == "- (not timed (evaluate.time_local false))"
