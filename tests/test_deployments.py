"""prefect.yaml declares real flows with parameters they accept, the cron and interval schedules and the event
triggers (new fine-tune, acceptance drop)."""

import importlib
import inspect
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _deployments():
    return {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}


def test_entrypoints_are_flows_accepting_the_declared_parameters():
    from prefect import Flow

    for name, d in _deployments().items():
        path, attr = d["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        flow = getattr(module, attr)
        assert isinstance(flow, Flow), name
        accepted = set(inspect.signature(flow.fn).parameters)
        declared = set(d.get("parameters", {}))
        for trig in d.get("triggers", []):
            declared |= set(trig.get("parameters", {}))
        assert declared <= accepted, (name, declared - accepted)


def test_schedule_and_trigger():
    deps = _deployments()
    assert deps["retrain"]["schedules"][0]["cron"]
    trig = deps["on-new-finetune"]["triggers"][0]
    assert trig["expect"] == ["mlflow.model_version.created"]
    from flows.watch import EVENT

    assert EVENT == "mlflow.model_version.created"
    assert trig["parameters"]["model_name"] == "{{ event.payload.name }}"


def test_acceptance_monitor_schedule_and_drop_trigger():
    deps = _deployments()
    watch = deps["watch-acceptance"]
    assert watch["schedules"][0]["interval"] and watch["schedules"][0]["active"] is False  # paused until configured
    assert {"metrics_url", "target"} <= set(watch["parameters"])
    trig = deps["retrain-on-drop"]["triggers"][0]
    from components.serving.monitor import EVENT

    assert trig["expect"] == [EVENT] == ["eagle.acceptance.dropped"]
    assert trig["match"]["prefect.resource.id"] == "mlflow.model_version.*"
    assert trig["parameters"]["model_name"] == "{{ event.payload.name }}"
    assert trig["parameters"]["version"] == "{{ event.payload.version }}"
    assert deps["retrain-on-drop"]["concurrency_limit"] == 1
