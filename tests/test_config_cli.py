"""Presets, `--set key.path=value`, `eagle-heads config show`, the command table and the retry rule, without flows.

Purpose: the CLI's config layers (preset, `--config` file, `--set`, a command's own flags) resolve in that order and
refuse an unknown key or a wrong type with exit 2, naming the key path; `config show` prints what a command would
run with, and that JSON loads back as a `--config` file to the same config (the file the flows are handed); every
command that takes a config takes `--set`; every row of the command table names a preflight that exists; Prefect
tasks retry anything but `BadInput`.
Run: `python -m pytest tests/test_config_cli.py` (a few seconds: no Prefect flow, no model, no server).
Not here: the commands' work (tests/test_flows.py, tests/test_evaluate_register.py), the bad-input rows
(tests/test_bad_input_table.py).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from components.config import presets
from components.config.pipeline import ConfigError, PipelineConfig
from flows import cli
from flows.commands import COMMANDS, parser


def _show(capsys, *args: str) -> tuple[int, dict | None, str]:
    try:
        rc = cli.main(["config", "show", *args])
    except SystemExit as e:  # argparse
        rc = e.code
    out = capsys.readouterr()
    return rc, json.loads(out.out) if rc == 0 else None, out.err


def test_every_preset_is_one_function_in_one_place():
    for name in presets.NAMES:
        assert PipelineConfig.preset(name) == PipelineConfig(**presets.PRESETS[name]())
    assert PipelineConfig.tiny() == PipelineConfig.preset("tiny")
    assert PipelineConfig.default() == PipelineConfig(**presets.default())
    assert presets.gpu()["train"].ray.num_workers == 0  # the device run trains in-process: no Ray there
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        PipelineConfig.preset("huge")


def test_config_show_layers_preset_file_and_set(tmp_path, capsys):
    rc, shown, _ = _show(capsys, "--preset", "tiny")
    assert rc == 0 and shown == json.loads(json.dumps(PipelineConfig.tiny().to_dict()))
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"train": {"steps": 7, "batch_size": 2}}))
    rc, shown, _ = _show(
        capsys,
        "--preset",
        "tiny",
        "--config",
        str(f),
        "--set",
        "train.steps=9",
        "--set",
        "train.optim.lr=0.01",
        "--set",
        "evaluate.spec.method=tree",
    )
    assert rc == 0 and shown["train"]["steps"] == 9 and shown["train"]["batch_size"] == 2  # --set wins over the file
    assert shown["train"]["optim"]["lr"] == 0.01 and shown["evaluate"]["spec"]["method"] == "tree"


@pytest.mark.parametrize(
    "assignment, needle",
    [
        ("train.stepz=5", "--set: unknown key train.stepz"),
        ("train.optim.lrr=1", "--set: unknown key train.optim.lrr"),
        ("train.steps=many", "--set: train.steps: 'many' is not of type int"),
        ("train.steps=0", "--set: train.steps"),
        ("nosection.x=1", "--set: unknown section 'nosection'"),
    ],
)
def test_a_bad_set_is_refused_in_one_line_naming_the_key(assignment, needle, capsys):
    rc, _, err = _show(capsys, "--preset", "tiny", "--set", assignment)
    lines = [x for x in err.splitlines() if "error:" in x]
    assert rc == 2 and len(lines) == 1 and needle in lines[0], err


@pytest.mark.parametrize("text", ["train.steps", "=5", "train..steps=5"])
def test_set_syntax_is_checked_by_argparse(text, capsys):
    rc, _, err = _show(capsys, "--set", text)
    assert rc == 2 and "KEY.PATH=VALUE" in err


def test_the_resolved_config_loads_back_as_the_file_a_flow_takes(tmp_path):
    """`config_file` writes the whole config the command resolved; the flows load it over the preset: the same."""
    from flows.command_runs import config_file
    from flows.preflight import command_config

    a = parser().parse_args(
        [
            "train",
            "--target",
            "t",
            "--traffic",
            "x",
            "--heldout",
            "y",
            "--preset",
            "default",
            "--set",
            "train.steps=33",
            "--set",
            "evaluate.load.concurrency=[1, 2]",
        ]
    )
    settings = SimpleNamespace(state_dir=tmp_path)
    path = config_file(a, settings, command_config(a))
    assert path == config_file(a, settings, command_config(a)) and path.startswith(str(tmp_path / "configs"))
    assert PipelineConfig.load(path, "default") == command_config(a)
    assert command_config(a).train.steps == 33 and command_config(a).evaluate.load.concurrency == (1, 2)
    assert config_file(parser().parse_args(["watch", "--config", "c.json"]), settings, None) == "c.json"  # no --set


def test_set_then_the_commands_own_flags():
    from flows.preflight import command_config

    a = parser().parse_args(
        [
            "evaluate",
            "--head",
            "h",
            "--traffic",
            "t",
            "--preset",
            "tiny",
            "--set",
            "evaluate.limit=2",
            "--set",
            "evaluate.spec.depth=2",
            "--depth",
            "4",
        ]
    )
    cfg = command_config(a).evaluate
    assert cfg.limit == 2 and cfg.spec.depth == 4
    a = parser().parse_args(
        [
            "monitor",
            "--metrics-url",
            "http://h/metrics",
            "--target",
            "models:/t/1",
            "--preset",
            "tiny",
            "--set",
            "monitor.ratio=0.5",
            "--interval",
            "3",
        ]
    )
    assert command_config(a).monitor.ratio == 0.5 and command_config(a).monitor.interval_s == 3.0


def test_the_command_table_is_the_only_list_of_commands():
    import flows.preflight

    sub = next(a for a in parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS)
    options = {n: {o for act in sub.choices[n]._actions for o in act.option_strings} for n in COMMANDS}
    for name, command in COMMANDS.items():  # each row holds its preflight function itself
        assert command.preflight is getattr(flows.preflight, f"check_{name}"), name
    takes_config = {n for n in COMMANDS if "--config" in options[n]}
    assert takes_config == {"train", "evaluate", "watch", "monitor", "serve"}  # serve: its monitor section
    assert all("--set" in options[n] for n in takes_config)


@pytest.mark.parametrize(
    "error, retried", [("bad input", False), ("value error", True), ("outage", True), ("none", True)]
)
def test_tasks_retry_anything_but_bad_input(error, retried):
    from eagle.errors import BadInput
    from flows.tasks import transient

    raised = {"bad input": BadInput("x"), "value error": ValueError("x"), "outage": ConnectionError("x")}

    class State:
        def result(self):
            if error in raised:
                raise raised[error]

    assert transient(None, None, State()) is retried
