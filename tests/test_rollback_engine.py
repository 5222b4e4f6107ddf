"""Roll back on collapse in the engine: `eagle-heads serve --follow-alias` with real vLLM servers and a real registry.

Purpose: the toy tiny target's head registered as version 1 (champion) and a copy of it made to accept nothing as
version 2 (its `d2t` points every draft token at one token the target never emits on these prompts: the same
format, every draft rejected, τ exactly 1). Serve follows the alias with 3-second windows; under a bounded greedy
streaming load the alias moves to version 2: serve swaps it in, judges its live acceptance from vLLM's counters,
finds the collapse within 2 windows, swaps back to version 1, moves the alias back to 1 with `rollback_reason` on
version 2, and says the event was not sent (no Prefect API here). No request failed or was cut, and every output
equals plain decoding's.
Run: `python -m pytest tests/test_rollback_engine.py` (about 3 minutes on 2 cores: three engine starts). Needs
vLLM's venv (`make vllm`).
Not here: the decision on synthetic counters (tests/test_rollback.py), the swap's own faults
(tests/test_serve_proxy.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.test_serve_proxy import _client, _plain, _ready, _until
from tests.test_serve_proxy import prompts  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.engine]
ROOT = Path(__file__).resolve().parent.parent
WINDOW_S = 3.0


def _accepting_nothing(head_dir: Path, out: Path, never: int) -> None:
    """A copy of the head whose every draft token maps to target token `never` (d2t[j] = never - j)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(head_dir, out)
    weights = load_file(out / "model.safetensors")
    weights["d2t"] = never - torch.arange(weights["d2t"].numel(), dtype=torch.int64)
    save_file(weights, out / "model.safetensors")


def _register(settings, good: Path, bad: Path) -> str:
    from infra.mlflow_store import MlflowStore

    store = MlflowStore.connect(settings)
    name = "rollback-head"
    for v, head in ((1, good), (2, bad)):
        with store.run(f"head-{v}") as run_id:
            store.log_dir(run_id, head, "head")
            ref = store.register(name, run_id, "head", run_key=f"rollback-{v}", tags={"tau": "1.5"})
        assert ref.version == v
    store.set_alias(name, "champion", 1)
    return name


def test_a_head_that_accepts_nothing_is_rolled_back_within_two_windows(engine_target, engine_head, tmp_path, prompts):  # noqa: F811
    from infra.mlflow_store import MlflowStore
    from infra.settings import Settings

    plain = _plain(engine_target, prompts)
    vocab = json.loads((Path(engine_head.head_dir) / "config.json").read_text())["vocab_size"]
    never = next(t for t in range(vocab) if all(t not in p for p in plain))
    settings = Settings.local(tmp_path / ".eagle")
    shutil.copytree(Path(engine_head.head_dir), tmp_path / "good")
    _accepting_nothing(tmp_path / "good", tmp_path / "bad", never)
    name = _register(settings, tmp_path / "good", tmp_path / "bad")
    env = {**os.environ, "EAGLE_HOME": str(settings.state_dir), "PYTHONPATH": str(ROOT)}
    for key in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        env.pop(key, None)
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "serve",
        "--head",
        f"models:/{name}@champion",
        "--target",
        engine_target.target_dir,
        "--k",
        "3",
        "--follow-alias",
        "--follow-interval",
        "1",
        "--rollback-window",
        str(WINDOW_S),
        "--set",
        "monitor.rollback.min_drafts=20",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    results, stop = [], threading.Event()
    try:
        url, model = _ready(lines, proc)
        clients = [threading.Thread(target=_client, args=(url, model, prompts, i, stop, results)) for i in range(3)]
        for c in clients:
            c.start()
        # the good head was judged ok (under load its first windows can hold too few drafts to judge: wait past them)
        _until(lambda: any(f"models:/{name}/1 window" in ln and ln.rstrip().endswith(": ok") for ln in lines), 240)
        MlflowStore.connect(settings).set_alias(name, "champion", 2)
        _until(lambda: any("serve: swapped" in ln and f"{name}/1 -> " in ln and "/2" in ln for ln in lines), 300)
        _until(lambda: any(f"{name}/2 -> models:/{name}/1" in ln and "serve: swapped" in ln for ln in lines), 300)
        _until(lambda: any("not sent" in ln for ln in lines), 60)
        after = len(results)
        _until(lambda: len(results) >= after + 3, 120)  # served by the champion again
        stop.set()
        for c in clients:
            c.join(120)
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
    log = "".join(lines)
    assert rc in (0, 130), log[-3000:]
    good_windows = [ln for ln in lines if f"models:/{name}/1 window" in ln]
    assert any(ln.rstrip().endswith(": ok") for ln in good_windows), good_windows
    assert not any(ln.rstrip().endswith((": low", ": below", ": collapse")) for ln in good_windows), good_windows
    verdict = next(ln for ln in lines if f"models:/{name}/2 window" in ln and ln.rstrip().endswith(": collapse"))
    assert int(re.search(r"window (\d+):", verdict).group(1)) <= 2, log[-3000:]
    assert "window tau 1.00 < floor 1.1" in verdict
    assert f"rolling back models:/{name}/2 -> models:/{name}/1" in log
    assert f"alias champion of {name} back on version 1" in log and "eagle.head.rolled_back not sent" in log
    failed = [r for r in results if r["error"] or not r["done"] or r["finish_reason"] is None]
    assert not failed and len(results) >= 6, (failed, log[-3000:])
    assert all(r["token_ids"] == plain[r["prompt"]] for r in results)
    store = MlflowStore.connect(settings)
    assert store.get_alias(name, "champion").version == 1
    assert store.get_version(name, 2).tags["rollback_reason"].startswith("collapse: window tau 1.00")
