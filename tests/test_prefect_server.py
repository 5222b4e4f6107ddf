"""Live Prefect: the deployments of prefect.yaml on a real `prefect server start` and a process worker, no mocks.

Purpose: run the commands of README "Running the deployments" as a user would, against a server on a free loopback
port with its own Prefect home and database under tmp_path: create the `eagle-local` pool, `prefect deploy --all`
(a copy of prefect.yaml with `preset: tiny`), start `prefect worker start --pool eagle-local`, register version 1 of
a target (the tiny embedded default) in a SQLite MLflow under a tmp EAGLE_HOME, run `eagle-heads watch --once`;
the event it emits must fire the `on-new-finetune` trigger, and the worker must run that flow to COMPLETED and
register the head. Then version 2 goes through `prefect deployment run train-head/train-head`, and a run of the
`watch-registry` deployment completes with nothing left to announce.
The server's scheduler service is off (PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED=false) so that the interval
`watch-registry` deployment does not start runs of its own in the middle; the schedules are checked as declared.
Every process started here (server, worker, the worker's flow runs) is stopped at the end, pass or fail.
Run: `python -m pytest tests/test_prefect_server.py` (about 1 minute on 2 cores; needs only loopback).
Not here: the flows' logic (tests/test_flows.py), prefect.yaml's static checks (tests/test_deployments.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.live_prefect import BIN, ROOT, live_prefect  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.live, pytest.mark.timeout(600)]

TARGET = "stdlib-llama"


def _tiny_prefect_yaml(dest: Path) -> Path:
    text = (ROOT / "prefect.yaml").read_text()
    assert text.count("preset: default") == 4, (
        "prefect.yaml: expected `preset: default` in retrain, the two triggers and retrain-on-capture"
    )
    out = dest / "prefect.yaml"
    out.write_text(text.replace("preset: default", "preset: tiny"))
    return out


def _register(store, emb_dir: Path, traffic, role: str, base_model: str = "") -> int:
    from components.registry.register import register_target
    from components.targets.target import weights_sha256

    ref = register_target(
        store,
        TARGET,
        str(emb_dir),
        role=role,
        base_model=base_model,
        weights_sha256=weights_sha256(emb_dir),
        extra_tags={"traffic_train": str(traffic.train), "traffic_heldout": str(traffic.heldout)},
    )
    return ref.version


def _head_version(store, version: int):
    from components.registry.register import TargetRef, head_model_name

    versions = store.list_versions(head_model_name(TargetRef(TARGET, version, "", "")))
    assert len(versions) == 1, f"head of {TARGET} v{version}: expected one registered version, got {versions}"
    assert versions[0].tags["target_version"] == str(version)
    return versions[0]


def test_deployments_on_a_live_server_and_process_worker(live_prefect, tiny_embedded, mlflow_store, tmp_path):
    live = live_prefect
    emb = tiny_embedded
    v1 = _register(mlflow_store, emb.target_dir, emb.target_traffic, "base")  # while the server starts
    live.wait_healthy()
    prefect = str(BIN / "prefect")
    live.cli(prefect, "work-pool", "create", "eagle-local", "--type", "process")
    live.cli(prefect, "deploy", "--all", "--prefect-file", str(_tiny_prefect_yaml(tmp_path)), timeout=180)
    retrain = live.deployment("retrain", "retrain")
    assert retrain["work_pool_name"] == "eagle-local" and retrain["parameters"] == {"preset": "tiny"}
    assert retrain["schedules"][0]["schedule"]["cron"] == "0 3 * * *"
    watch = live.deployment("watch-registry", "watch-registry")
    assert watch["schedules"][0]["schedule"]["interval"] == 300
    on_new = live.deployment("on-new-finetune", "on-new-finetune")
    (pull,) = on_new["pull_steps"]
    assert pull["prefect.deployments.steps.set_working_directory"]["directory"] == str(ROOT)
    train = live.deployment("train-head", "train-head")
    live.start("worker", prefect, "worker", "start", "--pool", "eagle-local")

    out = live.cli(str(BIN / "eagle-heads"), "watch", "--once", timeout=180)
    assert "1 version(s) announced" in out, out
    run = live.wait_run(on_new["id"], f"on-new-finetune for {TARGET} v{v1} (fired by the event trigger)")
    assert run["parameters"]["model_name"] == TARGET and int(run["parameters"]["version"]) == v1
    assert run["parameters"]["preset"] == "tiny"
    head1 = _head_version(mlflow_store, v1)

    v2 = _register(mlflow_store, emb.finetune_dir, emb.finetune_traffic, "finetune", f"{TARGET}/{v1}")
    t = emb.finetune_traffic
    live.cli(
        prefect,
        "deployment",
        "run",
        "train-head/train-head",
        "--param",
        f"target=models:/{TARGET}/{v2}",
        "--param",
        f"traffic={t.train}",
        "--param",
        f"heldout={t.heldout}",
        "--param",
        "preset=tiny",
    )
    live.wait_run(train["id"], f"train-head for {TARGET} v{v2} (prefect deployment run)")
    head2 = _head_version(mlflow_store, v2)
    assert head1.tags["run_key"] != head2.tags["run_key"]

    live.cli(prefect, "deployment", "run", "watch-registry/watch-registry")  # every version has its head now
    live.wait_run(watch["id"], "watch-registry (prefect deployment run)")
    announced = json.loads((Path(live.env["EAGLE_HOME"]) / "watcher" / "announced.json").read_text())
    assert announced == [f"{TARGET}/{v1}"], "watch-registry announced a version that already had its head"
    assert len(live.runs_of(on_new["id"])) == 1, "the trigger fired again, but no version was left without a head"
