"""The registry watcher and the scheduled retrain, on a SQLite MLflow store with nothing trained.

Purpose: the watcher remembers a version as announced only when its event was really sent (an unsent one is tried
again on the next poll, a sent one is never sent twice); the watcher and `retrain` look for heads under the
config's `register.experiment_suffix`. The flows' functions run without Prefect (`.fn`); `emit_event` is replaced
by a recorder that says whether the event was sent, as the real one does (an event id, or None).
Run: `python -m pytest tests/test_watch.py` (a few seconds).
Not here: the trigger path end to end (tests/test_flows.py), events reaching a Prefect API (tests/test_infra.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.registry.register import register_target

SHA = "a" * 64


@pytest.fixture
def home(mlflow_settings, monkeypatch, tmp_path) -> Path:
    """A state dir whose registry holds one target version, `tgt/1`, and no head."""
    from infra.mlflow_store import MlflowStore

    monkeypatch.setenv("EAGLE_HOME", str(mlflow_settings.state_dir))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    register_target(
        MlflowStore.connect(mlflow_settings), "tgt", str(target), role="base", base_model="", weights_sha256=SHA
    )
    return mlflow_settings.state_dir


class Events:
    """Stands in for `infra.prefect_env.emit_event`: records each call; `sent` says whether it goes out."""

    def __init__(self, sent: bool):
        self.sent, self.resources = sent, []

    def __call__(self, event: str, resource_id: str, **kwargs) -> str | None:
        self.resources.append(resource_id)
        return f"event-{len(self.resources)}" if self.sent else None


def _config(tmp_path: Path, suffix: str) -> str:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"register": {"experiment_suffix": suffix}}))
    return str(path)


def _champion_head(home: Path, name: str) -> None:
    from infra.mlflow_store import CHAMPION, MlflowStore
    from infra.settings import Settings

    store = MlflowStore.connect(Settings.local(home))
    head = home / "head-files"
    head.mkdir(exist_ok=True)
    (head / "config.json").write_text("{}")
    with store.run(f"head-{name}") as run_id:
        store.log_dir(run_id, head, "head")
    v = store.register(name, run_id, "head", run_key=f"k-{name}", tags={"target_weights_sha256": SHA})
    store.set_alias(name, CHAMPION, v.version)


def test_a_version_is_remembered_as_announced_only_once_its_event_was_sent(home, monkeypatch):
    import flows.watch as watch

    state = home / "watcher" / "announced.json"
    unsent = Events(sent=False)
    monkeypatch.setattr(watch, "emit_event", unsent)
    assert watch.watch_registry.fn(dispatch="event", preset="tiny") == {}  # nothing went out, nothing announced
    assert unsent.resources == ["mlflow.model_version.tgt.1"] and not state.exists()

    sent = Events(sent=True)
    monkeypatch.setattr(watch, "emit_event", sent)
    assert watch.watch_registry.fn(dispatch="event", preset="tiny") == {"tgt/1": "announced"}  # tried again
    assert json.loads(state.read_text()) == ["tgt/1"]
    assert watch.watch_registry.fn(dispatch="event", preset="tiny") == {}  # announced once
    assert sent.resources == ["mlflow.model_version.tgt.1"]


def test_the_watcher_looks_for_heads_under_the_configured_suffix(home, monkeypatch, tmp_path):
    import flows.watch as watch

    _champion_head(home, "tgt-v1-exp")
    events = Events(sent=True)
    monkeypatch.setattr(watch, "emit_event", events)
    assert watch.watch_registry.fn(dispatch="event", preset="tiny", config_path=_config(tmp_path, "-exp")) == {}
    assert events.resources == []  # its head exists under that suffix
    assert watch.watch_registry.fn(dispatch="event", preset="tiny") == {"tgt/1": "announced"}  # none under -eagle3


def test_retrain_looks_for_heads_under_the_configured_suffix(home, tmp_path):
    from flows.retrain import head_status, retrain
    from infra.mlflow_store import MlflowStore
    from infra.settings import Settings

    _champion_head(home, "tgt-v1-exp")
    store = MlflowStore.connect(Settings.local(home))
    assert head_status(store, "tgt", 1, "-exp") == "fresh"
    assert head_status(store, "tgt", 1) == "missing"  # nothing under the default suffix
    assert retrain.fn(preset="tiny", config_path=_config(tmp_path, "-exp")) == {"tgt/1": "fresh"}  # trains nothing


def test_local_dispatch_runs_the_flow_and_remembers_only_a_sent_event(home, monkeypatch):
    import flows.on_new_finetune
    import flows.watch as watch

    runs = []
    monkeypatch.setattr(flows.on_new_finetune, "on_new_finetune", lambda *args: runs.append(args) or {"head": "h"})
    monkeypatch.setattr(watch, "emit_event", Events(sent=False))
    assert watch.watch_registry.fn(dispatch="local", preset="tiny") == {"tgt/1": {"head": "h"}}
    assert runs == [("tgt", 1, "tiny", None)] and not (home / "watcher" / "announced.json").exists()
