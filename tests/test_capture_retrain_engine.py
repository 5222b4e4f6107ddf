"""Retrain on what was served, end to end: captured traffic -> `retrain-on-capture` -> a warm-started head,
shadow-tested against the champion in vLLM before the alias may move, its lineage and the shadow's verdict in the
registry.

Purpose: a local registry holds the tiny engine target (version 1, with its registered traffic) and, as its champion,
the engine tests' head; the real capture writer (components/serving/capture.py) records what that champion "served"
(chats of the target's traffic, greedy and sampled, plus rows of another target version and a /v1/completions request,
which must be skipped); the flow (flows/retrain_capture.py, tiny preset, under a Prefect test harness) counts them,
plans the run, trains through `train-head` and runs the shadow test: three vLLM servers (plain and the new head side by
side, then the champion beside the same plain one). A second run finds nothing new captured and trains nothing.
Run: `python -m pytest tests/test_capture_retrain_engine.py` (a few minutes on 2 cores). Needs vLLM's venv.
Not here: the plan's rules (tests/test_capture_retrain.py), the verdict's (tests/test_shadow.py).
"""

from __future__ import annotations

import json

import pytest

from infra.settings import Settings
from infra.vllm_server import vllm_python
from tests.helpers import state_dir_env
from tests.test_capture_retrain import capture, exchange

pytestmark = [pytest.mark.slow, pytest.mark.engine]
NAME = "cap-llama"


@pytest.fixture(scope="module")
def capture_run(engine_target, engine_head, prefect_harness, tmp_path_factory):
    from components.data.traffic_io import load_traffic
    from components.registry.register import HeadToRegister, RegisterConfig, register_head, register_target
    from components.targets.target import weights_sha256
    from infra.mlflow_store import MlflowStore

    state = tmp_path_factory.mktemp("capture-retrain") / ".eagle"
    vllm_python(Settings.local(state))  # a missing vLLM venv fails here with the line that says how to make it
    traffic, heldout = str(engine_target.target_traffic.train), str(engine_target.target_traffic.heldout)
    cfg = state.parent / "pipeline.json"
    cfg.write_text(
        json.dumps(
            {
                "evaluate": {"limit": 3, "spec": {"depth": 3, "max_new_tokens": 16}},
                "capture": {"heldout": 3, "trigger_new": 6, "mix": 0.5},
            }
        )
    )
    with state_dir_env(state):
        from flows.retrain_capture import retrain_on_capture

        store = MlflowStore.connect(Settings.from_env())
        tref = register_target(
            store,
            NAME,
            str(engine_target.target_dir),
            role="base",
            base_model="",
            weights_sha256=weights_sha256(engine_target.target_dir),
            extra_tags={"traffic_train": traffic, "traffic_heldout": heldout},
        )
        with store.run("seed-champion") as run_id:  # the head being served: the engine tests' own
            champ = register_head(
                store,
                RegisterConfig(tau_floor=0.0, gate_speedup="off"),
                HeadToRegister(engine_head.head_dir, tref, "seed", "seed-run", run_id, {"tau": 2.0}, None),
            )
        meta = {"head": champ.uri, "target_name": NAME, "target_version": str(tref.version)}
        chats = [c for c in load_traffic(traffic).conversations if c.messages[-1].content][:12]
        capture(
            state / "capture",
            [
                *(
                    exchange(
                        c.messages[-2].content,
                        c.messages[-1].content,
                        0.0 if i % 3 else 0.7,
                        meta,
                        history=[{"role": m.role, "content": m.content} for m in c.messages[:-2]],
                    )
                    for i, c in enumerate(chats)
                ),
                exchange("q", "a", meta={**meta, "target_version": "9"}),
                exchange("q2", "a", meta={**meta, "target_version": "9"}),
                exchange("def f(", "x", meta=meta, path="/v1/completions"),
            ],
        )
        first = retrain_on_capture(NAME, tref.version, "tiny", str(cfg))
        second = retrain_on_capture(NAME, tref.version, "tiny", str(cfg))
    yield first, second, champ, MlflowStore.connect(Settings.local(state)), state


def test_the_head_trains_on_what_was_served_and_the_registry_says_which(capture_run):
    from components.data.captured_traffic import SHARD, CapturePlan, prompt_key
    from components.data.traffic_io import load_traffic

    first, _, champ, store, state = capture_run
    plan = CapturePlan.read(first["plan"])
    assert first["new"] == 12 and plan.heldout == 3 and 6 <= plan.captured <= 9  # 9 unless prompts repeat
    assert plan.registered == plan.captured  # mix 0.5
    name, version = first["head_uri"].removeprefix("models:/").split("/")
    v = store.get_version(name, int(version))
    assert v.tags["init_from"] == champ.uri  # warm-started from the champion it is meant to replace
    assert v.tags["capture_conversations"] == v.tags["capture_registered"] == str(plan.captured)
    assert int(v.tags["capture_greedy"]) + int(v.tags["capture_sampled"]) == plan.captured
    assert f"served by {NAME}/9, not {NAME}/1: 2" in v.tags["capture_skipped"]
    assert "a /v1/completions request (no chat messages): 1" in v.tags["capture_skipped"]
    files = v.tags["capture_files"].split()
    assert files and all((state / "capture" / NAME / f).is_file() for f in files)
    # the held-out requests were not trained on; the captured answers were, beside the regenerated registered ones
    work = next((state / "runs").glob(f"{NAME}-v1/*/regenerate")).parent
    trained = load_traffic(work / "regenerate" / SHARD).conversations
    held = load_traffic(plan.heldout_file).conversations
    assert len(trained) == plan.captured and not {prompt_key(c) for c in trained} & {prompt_key(c) for c in held}
    assert json.loads((work / "regenerate" / "accounting.json").read_text())["total"] == plan.registered


def test_the_shadow_test_judged_both_heads_in_vllm_before_the_alias_moved(capture_run):
    first, _, champ, store, state = capture_run
    name, version = first["head_uri"].removeprefix("models:/").split("/")
    v = store.get_version(name, int(version))
    assert v.tags["shadow_verdict"] in ("promote", "keep champion") and v.tags["shadow_champion"] == champ.uri
    for key in ("shadow_speedup_lo", "shadow_speedup_hi", "shadow_champion_speedup_lo", "shadow_champion_speedup_hi"):
        assert float(v.tags[key]) > 0
    assert "; shadow: new head " in v.tags["gate"] and v.tags["shadow_reason"] in v.tags["gate"]
    report = json.loads(next((state / "runs").glob(f"{NAME}-v1/*/shadow/shadow.json")).read_text())["result"]
    assert report["prompts"] == 3 and report["new"]["identical"] is True and report["champion"]["identical"] is True
    assert report["new"]["tau"] >= 1.0 and report["champion"]["tau"] >= 1.0
    if v.tags["shadow_verdict"] == "keep champion":
        assert store.get_alias(name, "champion").version == champ.version and first["alias"] == "challenger"


def test_nothing_new_captured_trains_nothing(capture_run):
    _, second, _, store, _ = capture_run
    assert second == {"new": 0, "needed": 6}
    assert len(store.list_versions(f"{NAME}-v1-eagle3")) == 2
