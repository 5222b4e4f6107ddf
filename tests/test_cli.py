"""The `eagle-heads` CLI: help that imports nothing heavy, clear errors for bad arguments and unreachable services, and
a `train` that resolves its config and checks its inputs once (its preflight's, handed to the flow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, env=None, timeout=120):
    e = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout
    )


def test_help_imports_nothing_heavy():
    r = _cli("--help")
    assert r.returncode == 0 and "demo" in r.stdout and "train" in r.stdout and "watch" in r.stdout
    code = (
        "import sys, flows.cli; flows.cli._parser(); "
        "print(sorted(m for m in ('torch', 'prefect', 'mlflow', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_bad_arguments_exit_2_with_a_message(tmp_path):
    r = _cli(
        "train",
        "--target",
        str(tmp_path / "nope"),
        "--traffic",
        str(tmp_path / "t.jsonl"),
        "--heldout",
        str(tmp_path / "h.jsonl"),
    )
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
        "1.50x [1.40, 1.60] (unreliable: busy)"
    )
    untimed = {
        "speedup": float("nan"),
        "speedup_lo": None,
        "speedup_hi": None,
        "speedup_reliable": False,
        "speedup_note": "not timed (evaluate.time_local false)",
    }
    assert _speed_text(untimed) == "- (not timed (evaluate.time_local false))"


def test_train_resolves_its_config_and_checks_its_inputs_once(
    prefect_harness, tiny_embedded, tmp_path, monkeypatch, capsys
):
    """`eagle-heads train` in this process (tiny preset, a `--set`): the preflight resolves the config and checks the
    inputs, the flow is handed both (flows/train_head.py `CheckedInputs`): one `PipelineConfig.load` (every
    resolution goes through it) and one `check_inputs` for the whole command. Second turns too long for the target's
    context pass the preflight and are refused by the regenerate stage, which ends the run early (exit 2)."""
    from unittest import mock

    import flows.preflight
    import flows.train_head
    from components.config.pipeline import PipelineConfig
    from flows import cli

    calls = {"load": 0, "check_inputs": 0}
    load, check = PipelineConfig.load.__func__, flows.preflight.check_inputs

    def counted_load(cls, *args, **kwargs):
        calls["load"] += 1
        return load(cls, *args, **kwargs)

    def counted_check(*args, **kwargs):
        calls["check_inputs"] += 1
        return check(*args, **kwargs)

    monkeypatch.setattr(PipelineConfig, "load", classmethod(counted_load))
    monkeypatch.setattr(flows.preflight, "check_inputs", counted_check)
    monkeypatch.setattr(flows.train_head, "check_inputs", counted_check)
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "x = 1\n" * 400},
    ]
    traffic = tmp_path / "long.jsonl"
    traffic.write_text("".join(json.dumps({"id": f"long-{i}", "messages": turns}) + "\n" for i in range(3)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "EAGLE_", "RAY_ADDRESS"))}
    with mock.patch.dict(os.environ, {**env, "EAGLE_HOME": str(tmp_path / "home")}, clear=True):
        rc = cli.main(
            [
                "train",
                "--preset",
                "tiny",
                "--target",
                str(tiny_embedded.target_dir),
                "--traffic",
                str(traffic),
                "--heldout",
                str(tiny_embedded.target_traffic.heldout),
                "--set",
                "train.steps=3",
            ]
        )
    err = capsys.readouterr().err
    assert rc == 2 and "turn 2: prompt of" in err, err[-2000:]  # the regenerate stage's refusal: the flow ran
    assert calls == {"load": 1, "check_inputs": 1}
