"""Flow `on-new-finetune`: train a head for the target version named by an `mlflow.model_version.created` event.

Purpose: the deployment's trigger (prefect.yaml) fills `model_name` and `version` from the event's payload; the
flow reads the version's traffic from its tags (`traffic_train`, `traffic_heldout`) and runs `train-head` for
`models:/<model_name>/<version>`. Fails clearly when the version does not exist or names no traffic.
Run: as a triggered deployment, from the registry watcher (flows/watch.py), or `eagle-heads watch --dispatch local`.
Not here: detecting new versions (flows/watch.py).
"""

from __future__ import annotations

from prefect import flow

from flows.train_head import HeadRun, train_head
from infra.mlflow_store import MlflowStore
from infra.settings import Settings


def version_traffic(store: MlflowStore, model_name: str, version: int) -> tuple[str, str]:
    v = store.get_version(model_name, int(version))
    try:
        return v.tags["traffic_train"], v.tags["traffic_heldout"]
    except KeyError:
        raise ValueError(
            f"models:/{model_name}/{version} has no traffic_train/traffic_heldout tags: tag the version "
            "with the traffic to train and evaluate its head on"
        ) from None


@flow(name="on-new-finetune", log_prints=True)
def on_new_finetune(model_name: str, version: int, preset: str = "default", config_path: str | None = None) -> HeadRun:
    store = MlflowStore.connect(Settings.from_env())
    traffic, heldout = version_traffic(store, model_name, int(version))
    print(f"new target version models:/{model_name}/{version}: training its head on {traffic}")
    return train_head(f"models:/{model_name}/{version}", traffic, heldout, preset, config_path)
