"""Prompts the target cannot take, from the stage's refusal to the terminal (HARDENING.md's bad-input table, the
rows whose tests are named `flow::`).

Purpose: the regenerate stage refuses prompts longer than the target's context, naming the file and what to do, with
no shard marked done; bad input is not retried (an outage is); a stage's refusal met inside a running flow reaches
the terminal as the CLI's one line, without Prefect's failure log (a filter on its console handler, and the real CLI
in a subprocess), and the flow takes back what the run made when no stage finished (its run directory, the target
version it registered).
Run: `python -m pytest tests/test_bad_input_flow.py` (about 30 s once the tiny embedded default is built, plus the
slow CLI run, ~40 s).
Not here: the other bad input the stages meet (tests/test_bad_input_stages.py), kills and outages
(tests/test_faults.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

QUIET = dict(progress=lambda s: None)


def _jsonl(path: Path, *rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _later_turns_too_long(path: Path) -> str:
    """Three conversations whose first turn fits the tiny target's context and whose second does not."""
    return _jsonl(
        path,
        *[
            {
                "id": f"long-{i}",
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "x = 1\n" * 400},
                ],
            }
            for i in range(3)
        ],
    )


def test_prompts_longer_than_the_targets_context(tiny_embedded, tmp_path):
    from components.regenerate.stage import RegenerateConfig, RegenerateError, regenerate

    traffic = _jsonl(
        tmp_path / "long.jsonl",
        *[{"id": f"long-{i}", "messages": [{"role": "user", "content": "x = 1\n" * 400}]} for i in range(3)],
    )
    out = tmp_path / "regen"
    with pytest.raises(RegenerateError) as err:
        regenerate(
            RegenerateConfig(max_new_tokens=8, shard_size=2), tiny_embedded.target_dir, traffic, str(out), **QUIET
        )
    msg = str(err.value)
    assert traffic in msg and "long-0" in msg and "exceeds the target's context" in msg and "Shorten the prompts" in msg
    assert sorted(p.name for p in out.iterdir()) == ["accounting.json"]  # no shard marked done: a re-run retries
    assert json.loads((out / "accounting.json").read_text())["failed"] == 3


@pytest.mark.parametrize("error, attempts", [("bad input", 1), ("outage", 3)])
def test_bad_input_is_not_retried_but_an_outage_is(prefect_harness, monkeypatch, error, attempts):
    from prefect import flow

    from components.regenerate.stage import RegenerateConfig, RegenerateError
    from flows import tasks

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RegenerateError("every prompt is too long") if error == "bad input" else ConnectionError("endpoint down")

    monkeypatch.setattr(tasks, "regenerate", failing)

    @flow
    def one_stage():
        return tasks.regenerate_task.with_options(retry_delay_seconds=0)(RegenerateConfig(), "t", "x.jsonl", "out")

    with pytest.raises((RegenerateError, ConnectionError)):
        one_stage()
    assert len(calls) == attempts


# ---- a stage's refusal met inside a running flow: the CLI's one line, not Prefect's failure log ------------------


def test_prefects_log_of_a_bad_input_failure_is_hidden_and_other_failures_stay(prefect_harness):
    """Real flows, real Prefect records, through a handler on the root logger (where Prefect's console handler is)
    with `hide_bad_input_failures` installed: a task that fails on bad input leaves no failure record, a task that
    fails otherwise keeps Prefect's task and flow failure logs with the traceback."""
    import io
    import logging

    from prefect import flow, task

    from components.regenerate.stage import RegenerateError
    from infra.prefect_env import hide_bad_input_failures

    @task
    def refuse():
        raise RegenerateError("/x/traffic.jsonl: none of 3 conversations could be regenerated")

    @task
    def crash():
        raise RuntimeError("a bug")

    @flow
    def one_stage(fail):
        return fail()

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logging.getLogger().addHandler(handler)
    level = logging.getLogger("prefect").level
    logging.getLogger("prefect").setLevel(logging.INFO)  # a CLI run in this process may have quieted it
    try:
        hide_bad_input_failures()
        hide_bad_input_failures()  # twice adds nothing
        assert sum(type(f).__name__ == "_HideBadInputFailures" for f in handler.filters) == 1
        with pytest.raises(RegenerateError):
            one_stage(refuse)
        refused, _ = out.getvalue(), out.truncate(0)
        with pytest.raises(RuntimeError):
            one_stage(crash)
        crashed = out.getvalue()
    finally:
        logging.getLogger().removeHandler(handler)
        logging.getLogger("prefect").setLevel(level)
    assert "Beginning flow run" in refused  # the run's other lines still show
    assert "RegenerateError" not in refused and "Traceback" not in refused and "Failed" not in refused, refused
    assert "Task run encountered an exception RuntimeError: a bug" in crashed and "Traceback" in crashed
    assert "Flow run encountered an exception: RuntimeError: a bug" in crashed


@pytest.mark.slow  # a Prefect start and a target load in a child process: ~40 s quiet, ~100 s on loaded cores
def test_a_stages_refusal_through_the_cli_is_one_line(tiny_embedded, tmp_path):
    """The real CLI in a subprocess: second turns longer than the target's context pass the preflight (it renders
    first turns only), reach the regenerate task and are refused there: exit 2 and the CLI's one line, with no
    Prefect failure log or traceback above it and nothing after it; the run directory and the target version the
    run registered are gone."""
    import subprocess
    import sys

    traffic = _later_turns_too_long(tmp_path / "long.jsonl")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "EAGLE_", "RAY_"))}
    env.update(EAGLE_HOME=str(tmp_path / "home"), OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "train",
            "--preset",
            "tiny",
            "--target",
            str(tiny_embedded.target_dir),
            "--traffic",
            traffic,
            "--heldout",
            str(tiny_embedded.target_traffic.heldout),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    errors = [x for x in out.splitlines() if "error" in x.lower() or "exception" in x.lower()]
    assert proc.returncode == 2, out
    assert len(errors) == 1 and errors[0].startswith(f"eagle-heads: error: {traffic}: none of 3 conversations"), out
    assert "turn 2: prompt of" in errors[0] and "exceeds the target's context" in errors[0], out
    assert proc.stderr.rstrip().endswith(errors[0]), out
    for noise in ("Traceback", "Finished in state", "Encountered exception", "| ERROR", "Stopping temporary server"):
        assert noise not in out, out
    home = tmp_path / "home"
    assert not list((home / "runs").glob("*")) and not list((home / "mlartifacts").rglob("*.safetensors"))


# ---- a refusal after the run started: nothing of it is left --------------------------------------------------------


def test_a_refusal_after_the_run_started_takes_back_what_the_run_made(
    prefect_harness, tiny_embedded, tmp_path, monkeypatch
):
    """The train flow in this process: every second turn is too long (the preflight passes), the regenerate stage
    refuses after the run registered the target and made its run directory; both are removed. A second refused run
    on a target an earlier run registered removes its own run directory and keeps that version."""
    from components.regenerate.stage import RegenerateError
    from components.registry.register import register_target
    from components.targets.target import weights_sha256
    from flows.train_head import train_head
    from infra.mlflow_store import MlflowStore
    from infra.settings import Settings

    home = tmp_path / "home"
    for key in [k for k in os.environ if k.startswith(("MLFLOW_", "EAGLE_", "RAY_ADDRESS"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("EAGLE_HOME", str(home))
    traffic = _later_turns_too_long(tmp_path / "long.jsonl")
    target, heldout, name = str(tiny_embedded.target_dir), str(tiny_embedded.target_traffic.heldout), "t"
    with pytest.raises(RegenerateError, match="turn 2: prompt of .* exceeds the target's context"):
        train_head(target, traffic, heldout, "tiny", target_name=name)
    store = MlflowStore.connect(Settings.from_env())
    assert not list((home / "runs").glob("*")), list((home / "runs").rglob("*"))
    assert store.list_models() == [] and not list((home / "mlartifacts").rglob("*.safetensors"))

    earlier = register_target(store, name, target, role="user", base_model="", weights_sha256=weights_sha256(target))
    with pytest.raises(RegenerateError):
        train_head(target, traffic, heldout, "tiny", target_name=name)
    assert [v.version for v in store.list_versions(name)] == [earlier.version]  # an earlier run's: kept
    assert list((home / "mlartifacts").rglob("*.safetensors"))  # with its copy of the target
    assert not list((home / "runs").glob("*"))
