"""Flow `retrain` (scheduled): a fresh head for every target version whose head is missing or stale.

Purpose: for each version of each registered target model (tag kind=causal-lm-target) it looks at the head
model `<target>-v<version><suffix>` (the config's `register.experiment_suffix`, `-eagle3` by default): no
champion -> missing; a champion trained on other weights or on a traffic file whose content has changed since ->
stale (fresh traffic). Each such version runs `on-new-finetune`; the
rest are reported as fresh. Heads are never deleted; the gate decides whether the new one becomes champion.
Run: the cron deployment in prefect.yaml, or `python -c "from flows.retrain import retrain; retrain()"`.
Not here: the training itself (flows/train_head.py).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from components.pipeline_config import PipelineConfig
from components.register import TARGET_KIND, TargetRef, head_model_name
from components.traffic_io import traffic_sha256
from flows.on_new_finetune import on_new_finetune
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
    if traffic and Path(traffic).is_file() and traffic_sha256(traffic) != champion.tags.get("traffic_sha256"):
        return "stale"
    return "fresh"


@flow(name="retrain", log_prints=True)
def retrain(preset: str = "default", config_path: str | None = None) -> dict[str, str]:
    suffix = PipelineConfig.load(config_path, preset).register.experiment_suffix
    store = MlflowStore.connect(Settings.from_env())
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
            report[key] = f"{status} -> {result['head_uri']} ({result.get('alias', 'existing')})"
    print("retrain:", report or "no target registered")
    return report
