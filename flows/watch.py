"""Flow `watch-registry`: announce target versions that have no head yet, as Prefect events (poll the registry).

Purpose: MLflow webhooks fire only through a tracking server's REST API and fail silently when misconfigured,
so polling is the reliable path. Each run lists the versions of every registered target model; for each one with
no head registered and not yet announced, it emits `mlflow.model_version.created` (resource
`mlflow.model_version.<name>.<version>`, payload name/version), which the `on-new-finetune` deployment's trigger
turns into a flow run. With `dispatch="local"` (no Prefect server: the demo, tests) it also runs `on-new-finetune`
itself. Announced versions are remembered in `<state>/watcher/announced.json` (written atomically), so a version
is announced once; a failed local dispatch is not remembered and is retried on the next poll.
Run: the interval deployment in prefect.yaml, or `eagle-heads watch [--once] [--dispatch local]`.
"""

from __future__ import annotations

import json

from prefect import flow

from components.atomic import atomic_write_text
from components.register import TARGET_KIND, TargetRef, head_model_name
from infra.mlflow_store import MlflowStore
from infra.prefect_env import emit_event
from infra.settings import Settings

EVENT = "mlflow.model_version.created"


def versions_without_head(store: MlflowStore) -> list[tuple[str, int]]:
    out = []
    for model in store.list_models(kind=TARGET_KIND):
        for v in store.list_versions(model.name):
            head = head_model_name(TargetRef(model.name, v.version, "", ""))
            if not store.find_versions(head):
                out.append((model.name, v.version))
    return out


@flow(name="watch-registry", log_prints=True)
def watch_registry(dispatch: str = "event", preset: str = "default", config_path: str | None = None) -> dict:
    """Announce every target version without a head; returns {"name/version": summary or "announced"}."""
    if dispatch not in ("event", "local"):
        raise ValueError(f"dispatch must be 'event' or 'local', got {dispatch!r}")
    settings = Settings.from_env()
    store = MlflowStore.connect(settings)
    state = settings.state_dir / "watcher" / "announced.json"
    announced = set(json.loads(state.read_text())) if state.is_file() else set()
    done: dict = {}
    for name, version in versions_without_head(store):
        key = f"{name}/{version}"
        if key in announced and dispatch == "event":
            continue
        emit_event(EVENT, f"mlflow.model_version.{name}.{version}", payload={"name": name, "version": version})
        print(f"announced {EVENT} for models:/{key}")
        if dispatch == "local":
            from flows.on_new_finetune import on_new_finetune

            done[key] = on_new_finetune(name, version, preset, config_path)
        else:
            done[key] = "announced"
        announced.add(key)
        atomic_write_text(state, json.dumps(sorted(announced)) + "\n")
    return done
