"""Flow `retrain` (scheduled): a fresh head for every target version whose head is missing or stale.

Purpose: for each version of each registered target model (tag kind=causal-lm-target) it looks at the head
model `<target>-v<version><suffix>` (the config's `register.experiment_suffix`, `-eagle3` by default): no
champion -> missing; a champion trained on other weights or on a traffic file whose content has changed since ->
stale (fresh traffic). Each such version runs `on-new-finetune`; the
rest are reported as fresh. Heads are never deleted; the gate decides whether the new one becomes champion.
With `model_name` and `version` (the `retrain-on-drop` deployment, fired by `eagle.acceptance.dropped`) only that
version is retrained, on the newest snapshot of the traffic directory (`monitor.traffic_dir`, or the `traffic_dir`
parameter; see components/serving/monitor.py `newest_snapshot`), or on its registered traffic when none is set.
Run: the cron deployment in prefect.yaml, or `python -c "from flows.retrain import retrain; retrain()"`.
Not here: the training itself (flows/train_head.py).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from components.config.pipeline import PipelineConfig
from components.data.traffic_io import traffic_sha256
from components.registry.register import TARGET_KIND, TargetRef, head_model_name
from components.serving.monitor import newest_snapshot
from flows.on_new_finetune import on_new_finetune, version_traffic
from infra.mlflow_store import CHAMPION, MlflowStore
from infra.settings import Settings


def head_status(store: MlflowStore, name: str, version: int, suffix: str = "-eagle3") -> str:
    """'missing', 'stale' or 'fresh' for the head (model `<name>-v<version><suffix>`) of target version
    `name`/`version`."""
    v = store.get_version(name, version)
    champion = store.get_alias(head_model_name(TargetRef(name, version, "", ""), suffix), CHAMPION)
    if champion is None:
        return "missing"
    if champion.tags.get("target_weights_sha256") != v.tags.get("weights_sha256"):
        return "stale"
    traffic = v.tags.get("traffic_train")
    if traffic and Path(traffic).exists() and traffic_sha256(traffic) != champion.tags.get("traffic_sha256"):
        return "stale"
    return "fresh"


@flow(name="retrain", log_prints=True)
def retrain(
    preset: str = "default",
    config_path: str | None = None,
    model_name: str | None = None,
    version: int | None = None,
    traffic_dir: str | None = None,
) -> dict[str, str]:
    """Every registered target version, or only `model_name`/`version` (the acceptance-drop trigger: retrained
    whatever its status, on the newest snapshot of `traffic_dir`, default `monitor.traffic_dir`)."""
    cfg = PipelineConfig.load(config_path, preset)
    store = MlflowStore.connect(Settings.from_env())
    if model_name is not None:
        if version is None:
            raise ValueError("retrain: model_name needs a version")
        return {
            f"{model_name}/{version}": _retrain_on_drop(
                store,
                cfg,
                model_name,
                int(version),
                preset,
                config_path,
                traffic_dir if traffic_dir is not None else cfg.monitor.traffic_dir,
            )
        }
    suffix = cfg.register.experiment_suffix
    report: dict[str, str] = {}
    for model in store.list_models(kind=TARGET_KIND):
        for v in store.list_versions(model.name):
            status = head_status(store, model.name, v.version, suffix)
            key = f"{model.name}/{v.version}"
            if status == "fresh":
                report[key] = "fresh"
                continue
            print(f"{key}: head {status}; retraining")
            result = on_new_finetune(model.name, v.version, preset, config_path)
            report[key] = f"{status} -> {result.head_uri} ({result.alias})"
    print("retrain:", report or "no target registered")
    return report


def _retrain_on_drop(
    store: MlflowStore,
    cfg: PipelineConfig,
    name: str,
    version: int,
    preset: str,
    config_path: str | None,
    traffic_dir: str,
) -> str:
    """A new head for `name`/`version` on the newest traffic snapshot (its registered traffic without a traffic
    directory). The same snapshot twice is one run: train-head's run key makes the second a no-op."""
    from flows.train_head import train_head

    if traffic_dir:
        traffic, heldout = newest_snapshot(traffic_dir)
    else:
        traffic, heldout = version_traffic(store, name, version)
    print(f"{name}/{version}: acceptance dropped; retraining its head on {traffic}")
    result = train_head(f"models:/{name}/{version}", traffic, heldout, preset, config_path)
    created = "new" if result.created else "existing"
    return f"drop -> {result.head_uri} ({result.alias}, {created}; traffic {traffic})"
