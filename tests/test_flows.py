"""End to end: the Prefect flows on the tiny embedded default, with real MLflow (SQLite), Prefect and Ray paths.

One session of work: the demo flow builds the tiny default, trains the base target's head through `train-head`
(features extracted locally), registers the fine-tune and lets the registry watcher + `on-new-finetune` (the trigger
path) train its head on features extracted by vLLM (`extract.engine: vllm`: one engine start, so the module is also
an `engine` test and needs vLLM's venv, `make vllm`).
Then: a second identical run adds no registry version; the scheduled `retrain` finds every head fresh; the
watcher announces nothing new; a changed traffic file makes the head stale.
"""

import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.engine]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, prefect_harness):
    home = tmp_path_factory.mktemp("eagle-home")
    old = {k: os.environ.get(k) for k in ("EAGLE_HOME", "MLFLOW_TRACKING_URI", "RAY_AUTH_MODE")}
    os.environ["EAGLE_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    from flows.demo import demo

    res = demo(preset="tiny", embedded_preset="tiny")
    yield home, res
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _store():
    from infra.mlflow_store import MlflowStore
    from infra.settings import Settings

    return MlflowStore.connect(Settings.from_env())


def test_demo_registers_a_head_per_target_version_through_the_trigger(demo_run):
    home, res = demo_run
    assert res["lines"][-1].startswith("demo: tau=") and "identical=yes" in res["lines"][-1]
    # both extraction paths side by side: the table's `features` column, from the heads' `extract_engine` tags
    rows = {label: line.split() for line in res["lines"] for label in ("(base)", "(fine-tune)") if label in line}
    assert rows["(base)"][3] == "local" and rows["(fine-tune)"][3] == "vllm", res["lines"]
    # tau in the first..last output-position bucket, from the heads' `tau_by_position` tags
    assert all(r[7] == "-" or all(float(t) >= 1.0 for t in r[7].split("..")) for r in rows.values()), res["lines"]
    store = _store()
    heads = {m.name for m in store.list_models(kind="eagle3-head")}
    assert heads == {"stdlib-llama-v1-eagle3", "stdlib-llama-v2-eagle3"}
    targets = store.list_versions("stdlib-llama")
    assert [v.tags["role"] for v in targets] == ["base", "finetune"]
    for name in heads:
        (v,) = store.list_versions(name)
        assert v.tags["run_key"] and v.tags["traffic_sha256"] and float(v.tags["tau"]) >= 1.0
        assert "champion" in v.aliases  # tiny preset floor is 1.0
        head_dir = store.resolve(v.uri)
        cfg = json.loads((head_dir / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert (head_dir / "probe" / "probe.safetensors").is_file()
        assert [p.name for p in head_dir.glob("*.safetensors")] == ["model.safetensors"]  # what engines load
    v2 = store.list_versions("stdlib-llama-v2-eagle3")[0]
    assert v2.tags["target_version"] == "2"
    assert v2.tags["extract_engine"] == "vllm"  # the fine-tune's head: features from the serving engine
    assert store.list_versions("stdlib-llama-v1-eagle3")[0].tags["extract_engine"] == "local"
    assert json.loads((home / "demo" / "finetune-extract-vllm.json").read_text()) == {"extract": {"engine": "vllm"}}
    manifest = json.loads((Path(res["finetune"].extract.manifest)).read_text())
    assert manifest["engine"] == "vllm"
    # the fine-tune's head warm-started from the base target's champion head, and says so in its lineage
    assert v2.tags["init_from"] == "models:/stdlib-llama-v1-eagle3/1"
    assert "init_from" not in store.list_versions("stdlib-llama-v1-eagle3")[0].tags
    meta = json.loads((store.resolve(v2.uri) / "eagle_head.json").read_text())
    assert meta["lineage"]["init_from"] == "models:/stdlib-llama-v1-eagle3/1"
    assert meta["lineage"]["train_config"]["steps"] == 6  # the tiny preset's warm_start_steps
    # the exported checkpoint is the one with the best held-out tau, and the registry says which and why
    assert v2.tags["checkpoint_step"] == str(meta["lineage"]["selected_step"])
    assert v2.tags["checkpoint_rule"] == meta["lineage"]["selection_rule"].strip()
    assert v2.tags["checkpoint_rule"].startswith("best held-out tau at step ")
    assert float(v2.tags["heldout_tau"]) >= float(v2.tags["heldout_tau_last"])
    assert (home / "watcher" / "announced.json").is_file()


def test_second_identical_run_adds_no_version_and_retrain_finds_heads_fresh(demo_run):
    home, res = demo_run
    from flows.retrain import retrain
    from flows.train_head import train_head
    from flows.watch import watch_registry

    store = _store()
    base = store.list_versions("stdlib-llama")[0]
    again = train_head("models:/stdlib-llama/1", base.tags["traffic_train"], base.tags["traffic_heldout"], "tiny")
    assert again.created is False and again.head_uri == res["base"].head_uri
    assert again.acceptance == pytest.approx(res["base"].acceptance, abs=1e-4)  # from the version's tags
    assert again.identical is res["base"].identical is True  # the evaluation's verdict, from its tag
    assert len(store.list_versions("stdlib-llama-v1-eagle3")) == 1
    assert retrain(preset="tiny") == {"stdlib-llama/1": "fresh", "stdlib-llama/2": "fresh"}
    assert watch_registry(dispatch="event", preset="tiny") == {}


def test_second_demo_retrains_nothing_and_keeps_both_extraction_paths(demo_run):
    home, res = demo_run
    from flows.demo import demo

    again = demo(preset="tiny", embedded_preset="tiny")  # the fine-tune's run key includes extract.engine 'vllm'
    assert again["finetune"].created is False and again["finetune"].head_uri == res["finetune"].head_uri
    assert again["base"].created is False
    last, first = again["lines"][-1].split(), res["lines"][-1].split()
    assert (last[0], last[3:]) == (first[0], first[3:])  # "demo:", identical=, head= (tau from 4-digit tags)
    rows = [line.split() for line in again["lines"] if "(fine-tune)" in line or "(base)" in line]
    assert [r[3] for r in rows] == ["local", "vllm"]


def test_changed_traffic_makes_the_head_stale(demo_run, tmp_path):
    from flows.retrain import head_status

    store = _store()
    v1 = store.list_versions("stdlib-llama")[0]
    path = v1.tags["traffic_train"]
    original = open(path, "rb").read()
    try:
        with open(path, "ab") as f:
            f.write(original.splitlines(keepends=True)[0])
        assert head_status(store, "stdlib-llama", 1) == "stale"
    finally:
        open(path, "wb").write(original)
    assert head_status(store, "stdlib-llama", 1) == "fresh"


def test_the_engines_pair_starts_beside_our_evaluation_only_when_ours_is_untimed(tmp_path, monkeypatch):
    """flows/evaluate_head.py `start_pair_early`: vLLM's pair starts before our evaluation where nothing of ours is
    timed beside it, on a CPU engine, and only when the engine's evaluation is still to run."""
    import dataclasses

    from components.config.pipeline import PipelineConfig
    from flows.evaluate_head import start_pair_early as _start_pair_early
    from infra.vllm_engine_spec import EngineSpec

    monkeypatch.setattr(EngineSpec, "resolved_device", lambda self: "cpu")
    demo = PipelineConfig.preset("default")
    assert demo.evaluate.engine == "vllm" and not demo.evaluate.time_local
    assert _start_pair_early(demo, str(tmp_path))
    timed = dataclasses.replace(demo, evaluate=dataclasses.replace(demo.evaluate, time_local=True))
    local = dataclasses.replace(demo, evaluate=dataclasses.replace(demo.evaluate, engine="local"))
    assert not _start_pair_early(timed, str(tmp_path)) and not _start_pair_early(local, str(tmp_path))
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "engine_evaluation.json").write_text("{}")  # measured already: its task is cached
    assert not _start_pair_early(demo, str(tmp_path))
    monkeypatch.setattr(EngineSpec, "resolved_device", lambda self: "cuda")
    assert not _start_pair_early(demo, str(tmp_path / "fresh"))


def test_a_run_that_differs_past_regenerate_links_the_first_runs_answers(demo_run, tmp_path):
    """components/regenerate/reuse.py through the flow: a second run of the base version whose config differs only
    in `train.steps` answers nothing again; its regenerate folder's shards are the first run's files (links)."""
    from components.config.pipeline import PipelineConfig
    from flows.train_head import train_head

    base = _store().list_versions("stdlib-llama")[0]
    cfg = tmp_path / "more-steps.json"
    cfg.write_text(json.dumps({"train": {"steps": PipelineConfig.tiny().train.steps + 2}}))
    run = train_head(
        "models:/stdlib-llama/1", base.tags["traffic_train"], base.tags["traffic_heldout"], "tiny", str(cfg)
    )
    assert run.created
    runs = sorted(p for p in Path(run.work_dir).parent.iterdir() if (p / "regenerate" / "source.json").is_file())
    assert len(runs) == 2, runs
    first, second = (sorted((p / "regenerate").glob("shard-0*.jsonl")) for p in runs)
    assert first and [p.name for p in first] == [p.name for p in second]
    assert [p.stat().st_ino for p in first] == [p.stat().st_ino for p in second]
