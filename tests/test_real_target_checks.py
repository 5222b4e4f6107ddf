"""What a real setup can lack that the bad-input table cannot express: vLLM's own venv, a GGUF of another family.

Purpose: issue 49's checks that need more than a row's argv and environment (tests/test_bad_input_table.py):
- the project's `.venv-vllm` missing, its python not executable or a link to a removed python (EAGLE_VLLM_PYTHON
  unset, so `Settings.check` has nothing to check): `train` with a stage in the engine, `evaluate --engine vllm`
  and `serve` refuse it in one line, exit 2, before any work (flows/preflight.py `check_engine_python`), while a
  `train` whose stages all run here passes. The suite cannot remove the real venv: `infra.vllm_server.__file__`,
  from which `vllm_python` finds the project's root, is pointed into an empty tree, so the real check runs on a
  venv that is not there;
- components/targets/target.py `PROVEN_FAMILIES` names exactly the families tests/test_families.py proves, each of
  whose architectures vLLM's model-info cache is warmed for (infra/vllm_warm.py);
- a GGUF file of a family transformers reads but the pipeline is not proven on (phi3) is refused by its header,
  before the conversion.
Run: `python -m pytest tests/test_real_target_checks.py` (seconds once the tiny embedded default is built).
Not here: the table's rows (tests/test_bad_input_table.py, tests/helpers_bad_input.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import fake_head
from tests.helpers_bad_input import EVAL, SERVE, TRAIN, argv_with

VENVS = {
    "missing": "no such file",
    "not-executable": "not executable, mode 644",
    "dangling-link": "a symbolic link to /no/such/python3, which does not exist",
}
ENGINE_COMMANDS = {
    "train": ([*TRAIN, "--set", "evaluate.engine=vllm"], "evaluate.engine 'vllm' starts vLLM here"),
    "evaluate": (argv_with(EVAL, engine="vllm"), "evaluate.engine 'vllm' starts vLLM here"),
    "serve": (SERVE, "serve starts vLLM here"),
}


@pytest.fixture
def paths(tiny_embedded, tmp_path):
    return {
        "target": str(tiny_embedded.target_dir),
        "traffic": str(tiny_embedded.target_traffic.train),
        "heldout": str(tiny_embedded.target_traffic.heldout),
        "head": fake_head(tmp_path, "head"),
    }


def _checkout_without_venv(tmp_path: Path, kind: str, monkeypatch) -> Path:
    """An empty project tree whose `.venv-vllm/bin/python` is `kind`; returns that python's path."""
    import infra.vllm_server

    root = tmp_path / "checkout"
    (root / "infra").mkdir(parents=True)
    monkeypatch.setattr(infra.vllm_server, "__file__", str(root / "infra" / "vllm_server.py"))
    python = root / ".venv-vllm" / "bin" / "python"
    if kind != "missing":
        python.parent.mkdir(parents=True)
        if kind == "not-executable":
            python.write_text("#!/bin/sh\n")
            python.chmod(0o644)
        else:
            python.symlink_to("/no/such/python3")
    return python


def _preflight(argv: list[str], home: Path, monkeypatch, capsys) -> tuple[int, str]:
    """`flows.cli.main(argv)` with only the preflight: 99 when it passed (the command is not run)."""
    from flows import cli

    for key in [k for k in os.environ if k.startswith(("MLFLOW_", "EAGLE_", "RAY_ADDRESS"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("EAGLE_HOME", str(home))
    monkeypatch.setattr("infra.prefect_env.apply_prefect_defaults", lambda settings: {})
    monkeypatch.setattr(cli, "_run_command", lambda a, settings, cfg: 99)
    rc = cli.main(argv)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("command", list(ENGINE_COMMANDS))
@pytest.mark.parametrize("venv", list(VENVS))
def test_a_command_that_starts_vllm_refuses_a_broken_project_venv(command, venv, paths, tmp_path, monkeypatch, capsys):
    python = _checkout_without_venv(tmp_path, venv, monkeypatch)
    argv, who = ENGINE_COMMANDS[command]
    home = tmp_path / "home"
    rc, err = _preflight([a.format(**paths) for a in argv], home, monkeypatch, capsys)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{who}, but vLLM is not installed at {python} ({VENVS[venv]}" in err and "make vllm" in err, err
    assert not home.exists(), "the refusal wrote under the state dir"


def test_a_command_that_runs_every_stage_here_needs_no_vllm(paths, tmp_path, monkeypatch, capsys):
    _checkout_without_venv(tmp_path, "missing", monkeypatch)
    rc, err = _preflight([a.format(**paths) for a in TRAIN], tmp_path / "home", monkeypatch, capsys)
    assert rc == 99, err


def test_the_proven_families_are_the_tested_ones():
    from components.targets.target import PROVEN_FAMILIES
    from infra.vllm_warm import ARCHITECTURES
    from tests.test_families import FAMILIES

    assert set(PROVEN_FAMILIES) == set(FAMILIES)
    assert set(PROVEN_FAMILIES.values()) <= set(ARCHITECTURES)


def test_a_gguf_of_an_unproven_family_is_refused_before_its_conversion(tmp_path):
    from components.targets.gguf import supported_architectures
    from components.targets.target import TargetError
    from flows.preflight import check_target_dir
    from infra.settings import Settings
    from tests.helpers_gguf import tiny_llama, tiny_tokenizer, write_tiny_gguf

    assert "phi3" in supported_architectures()  # transformers reads it: only the family check refuses it
    tokenizer = tiny_tokenizer()
    path = write_tiny_gguf(tiny_llama(tokenizer), tokenizer, tmp_path / "phi.gguf", architecture="phi3")
    settings = Settings.local(tmp_path / "home")
    with pytest.raises(TargetError, match=r"phi\.gguf \(general\.architecture\): model_type 'phi3' is not a family"):
        check_target_dir(str(path), settings)
    assert not (tmp_path / "home").exists()
    ok = write_tiny_gguf(tiny_llama(tokenizer), tokenizer, tmp_path / "llama.gguf")
    assert check_target_dir(str(ok), settings) is None  # proven, not converted yet: checked once it is
