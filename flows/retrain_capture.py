"""Flow `retrain-on-capture`: the next head of a served target version, trained on what it served.

Purpose: counts the conversations `eagle-heads serve --capture` recorded for `model_name`/`version` since the newest
capture any of its heads was trained on (the `capture_until_ms` tag of the head model's versions); below `min_new`
(default `capture.trigger_new`) it stops there, saying so. Else it plans the run (components/data/captured_traffic.py:
only that target version's captures, the newest `capture.heldout` prompts held out, the rest mixed with the version's
registered traffic at `capture.mix`) and runs `train-head` on the plan: captured answers used as served, warm start
from the target's champion, the lineage of the capture files, and the shadow test against the champion on the
held-out requests before the alias may move (components/evaluate/shadow.py).
Prefect triggers a deployment on a schedule or on an event, not on files that appear: the count is this flow's first
task, run by the deployment's interval schedule (cheap, no stage runs below the count), and a nightly schedule runs
it with `min_new: 1` (prefect.yaml).
Run: the `retrain-on-capture` deployment, or `python -c "from flows.retrain_capture import retrain_on_capture;
retrain_on_capture('NAME', VERSION)"`.
Not here: capture (components/serving/capture.py), the plan and the shadow test (components/), training
(flows/train_head.py).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, task

from components.config.pipeline import PipelineConfig
from components.data.captured_traffic import new_conversations, prepare_capture_plan
from components.registry.register import TargetRef, head_model_name
from flows.on_new_finetune import version_traffic
from flows.train_head import train_head
from infra.mlflow_store import MlflowStore
from infra.settings import Settings


def last_captured_ms(store: MlflowStore, head_name: str) -> int:
    """The newest capture time (UTC ms) any version of head model `head_name` was trained or shadow-tested on; 0
    when none was trained on captured traffic."""
    if not store.find_versions(head_name):
        return 0
    return max((int(v.tags.get("capture_until_ms", "0") or 0) for v in store.list_versions(head_name)), default=0)


@task(name="count-captured")
def count_captured(capture_root: str, model_name: str, version: int, after_ms: int) -> int:
    return new_conversations(capture_root, model_name, version, after_ms)


@flow(name="retrain-on-capture", log_prints=True)
def retrain_on_capture(
    model_name: str,
    version: int,
    preset: str = "default",
    config_path: str | None = None,
    capture_dir: str | None = None,
    min_new: int | None = None,
) -> dict:
    """Returns {"new": conversations captured since the last capture-trained head, "needed": the count that starts
    a run, and, when it ran, "head_uri", "alias", "gate", "plan"}."""
    cfg = PipelineConfig.load(config_path, preset)
    settings = Settings.from_env()
    store = MlflowStore.connect(settings)
    root = str(capture_dir or settings.state_dir / "capture")
    head_name = head_model_name(TargetRef(model_name, int(version), "", ""), cfg.register.experiment_suffix)
    new = count_captured(root, model_name, int(version), last_captured_ms(store, head_name))
    needed = cfg.capture.trigger_new if min_new is None else max(1, int(min_new))
    if new < needed:
        print(f"{model_name}/{version}: {new} new captured conversations in {root}, {needed} start a retrain")
        return {"new": new, "needed": needed}
    traffic, heldout = version_traffic(store, model_name, int(version))
    out = settings.state_dir / "capture-plans" / f"{model_name}-v{version}" / time.strftime("%Y%m%dT%H%M%S")
    plan = prepare_capture_plan(cfg.capture, root, model_name, int(version), traffic, out, cfg.regenerate.limit)
    print(
        f"{model_name}/{version}: {new} new captured conversations; training on {plan.captured} captured "
        f"({plan.greedy} greedy, {plan.sampled} sampled) and {plan.registered} registered, {plan.heldout} held out "
        f"for the shadow test; skipped: {plan.skipped or 'none'}"
    )
    run = train_head(
        f"models:/{model_name}/{version}",
        traffic,
        heldout,
        preset,
        config_path,
        capture_plan=str(Path(out) / "plan.json"),
    )
    return {
        "new": new,
        "needed": needed,
        "head_uri": run.head_uri,
        "alias": run.alias,
        "gate": run.gate,
        "plan": str(Path(out) / "plan.json"),
    }
