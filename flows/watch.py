"""Flow `watch-registry`: announce target versions that have no head yet, as Prefect events (poll the registry).

Purpose: MLflow webhooks fire only through a tracking server's REST API and fail silently when misconfigured,
so polling is the reliable path. Each run lists the versions of every registered target model; for each one with
no head registered and not yet announced, it emits `mlflow.model_version.created` (resource
`mlflow.model_version.<name>.<version>`, payload name/version), which the `on-new-finetune` deployment's trigger
turns into a flow run. With `dispatch="local"` (no Prefect server: the demo, tests) it also runs `on-new-finetune`
itself. A version is remembered as announced in `<state>/watcher/announced.json` (written atomically) only when its
event was sent, so it is announced once; an event that was not sent (no Prefect API) and a failed local dispatch
are not remembered, and the next poll tries again. Head names follow the config's `register.experiment_suffix`.
Run: the interval deployment in prefect.yaml, or `eagle-heads watch [--once] [--dispatch local]`.
"""

from __future__ import annotations

import json

from prefect import flow

from components.config.pipeline import PipelineConfig
from components.data.atomic import atomic_write_text
from components.registry.register import TARGET_KIND, TargetRef, head_model_name
from infra.mlflow_store import MlflowStore
from infra.prefect_env import emit_event
from infra.settings import Settings

EVENT = "mlflow.model_version.created"


def versions_without_head(store: MlflowStore, suffix: str = "-eagle3") -> list[tuple[str, int]]:
    """(target name, version) of every registered target version whose head model `<name>-v<version><suffix>`
    has no version."""
    out = []
    for model in store.list_models(kind=TARGET_KIND):
        for v in store.list_versions(model.name):
            head = head_model_name(TargetRef(model.name, v.version, "", ""), suffix)
            if not store.find_versions(head):
                out.append((model.name, v.version))
    return out


@flow(name="watch-registry", log_prints=True)
def watch_registry(dispatch: str = "event", preset: str = "default", config_path: str | None = None) -> dict:
    """Announce every target version without a head; returns {"name/version": the `HeadRun` of `on-new-finetune`
    (local) or "announced"} for the versions it dispatched (an event that was not sent dispatches nothing in event
    mode)."""
    if dispatch not in ("event", "local"):
        raise ValueError(f"dispatch must be 'event' or 'local', got {dispatch!r}")
    suffix = PipelineConfig.load(config_path, preset).register.experiment_suffix
    settings = Settings.from_env()
    store = MlflowStore.connect(settings)
    state = settings.state_dir / "watcher" / "announced.json"
    announced = set(json.loads(state.read_text())) if state.is_file() else set()
    done: dict = {}
    for name, version in versions_without_head(store, suffix):
        key = f"{name}/{version}"
        if key in announced and dispatch == "event":
            continue
        sent = emit_event(EVENT, f"mlflow.model_version.{name}.{version}", payload={"name": name, "version": version})
        if sent:
            print(f"announced {EVENT} for models:/{key}")
        elif dispatch == "event":
            print(f"models:/{key} not announced (the event was not sent); the next poll tries again")
        if dispatch == "local":
            from flows.on_new_finetune import on_new_finetune

            print(f"models:/{key} has no head: running on-new-finetune here")
            done[key] = on_new_finetune(name, version, preset, config_path)
        elif sent:
            done[key] = "announced"
        if sent:
            announced.add(key)
            atomic_write_text(state, json.dumps(sorted(announced)) + "\n")
    return done
