"""Small helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


def target_copy(tiny_embedded, tmp_path: Path, edit=None) -> Path:
    """A copy of the tiny embedded target under tmp_path, its config.json edited in place by `edit(cfg)`."""
    d = tmp_path / "target"
    shutil.copytree(tiny_embedded.target_dir, d)
    if edit:
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


class Crash(RuntimeError):
    """What `CrashAt` raises: the process died at a step, after that step's metrics were logged."""


@dataclass(frozen=True)
class CrashAt:
    """A metrics sink that raises `Crash` when step `step` is logged: a training run dying mid-way, as a kill
    between two checkpoints leaves it (the history has the rows up to `step`, checkpoints only up to the last)."""

    step: int

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step == self.step:
            raise Crash(f"crashed at step {step}")


def send_json(handler, code: int, payload: dict) -> None:
    """A JSON answer from a test HTTP server's handler (`http.server.BaseHTTPRequestHandler`)."""
    data = json.dumps(payload).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


@contextlib.contextmanager
def state_dir_env(state_dir: Path):
    """EAGLE_HOME pointed at `state_dir` and MLFLOW_TRACKING_URI unset while the block runs (the registry of that
    state dir), both as they were afterwards: what a flow run from a test reads its settings from."""
    old = {k: os.environ.get(k) for k in ("EAGLE_HOME", "MLFLOW_TRACKING_URI")}
    os.environ["EAGLE_HOME"] = str(state_dir)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def our_counts(report_file: str, depth: int) -> tuple[int, list[int]]:
    """(verification steps, steps that accepted draft position k, k < depth) from this project's evaluation.json:
    what vLLM's counters count (drafts, accepted per position) for the same prompts."""
    steps = [a for s in json.loads(Path(report_file).read_text())["samples"] for a in s["accept_lengths"]]
    return len(steps), [sum(a > k for a in steps) for k in range(depth)]


def fake_head(root: Path, name: str, damage=None) -> str:
    """A head directory with what the preflight reads (eagle_head.json, config.json, weights), damaged by `damage`
    (not a head that runs)."""
    from safetensors.torch import save_file
    import torch

    d = root / name
    (d / "probe").mkdir(parents=True)
    (d / "eagle_head.json").write_text(json.dumps({"format_version": 1, "lineage": {}}))
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    save_file({"fc.weight": torch.zeros(8, 24)}, str(d / "model.safetensors"))
    save_file({"probe": torch.zeros(4)}, str(d / "probe" / "probe.safetensors"))
    if damage:
        damage(d)
    return str(d)


def refusal(script: str, argv: list[str], capsys, monkeypatch) -> tuple[int, list[str]]:
    """(exit code, lines on stderr) of `bench/<script>.py argv`, run as `__main__` in this process: the refusal
    comes before any work, so it needs none of a fresh interpreter's ~3 s of imports (torch, transformers)."""
    root = Path(__file__).resolve().parent.parent
    monkeypatch.syspath_prepend(str(root / "bench"))
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    monkeypatch.chdir(root)
    with pytest.raises(SystemExit) as out:
        runpy.run_path(str(root / "bench" / f"{script}.py"), run_name="__main__")
    return out.value.code, capsys.readouterr().err.strip().splitlines() or [""]
