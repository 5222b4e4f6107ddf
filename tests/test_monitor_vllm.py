"""Closing the loop, end to end with the real engine and a live Prefect: a drop in served acceptance retrains the head.

Purpose: the tiny embedded target (trained long enough that its answers depend on the prompt) gets a champion head
trained on code traffic (completions, continuations: `eagle-heads train`), which vLLM then serves. `eagle-heads
monitor --once` scrapes vLLM's `/metrics` after each batch of requests:
- steady traffic (the very held-out prompts the head was evaluated on): window τ equals the registered τ, verdict
  `ok`, no event;
- traffic of another kind, asked another way (requests to explain code, answered by sampling at temperature 1:
  the head was trained and evaluated on greedy code completions; on vLLM's CPU build most of the fall is the
  engine's own sampled verification, see `RATIO`): window τ falls below the configured 0.95 x
  registered, the monitor emits `eagle.acceptance.dropped` to the live Prefect server, whose
  `retrain-on-drop` trigger (prefect.yaml) makes the process worker run `retrain` for that target on the newest
  traffic snapshot, which registers a new head version trained on that snapshot;
- more of the same drop before the retrain finished: verdict `announced`, no second event, one retrain run;
- the server stopped: one line, exit 1, no event.
Run: `python -m pytest tests/test_monitor_vllm.py` (about 2-3 minutes on 2 cores). Needs vLLM's venv (`make vllm`).
Not here: the window arithmetic and the other error lines (tests/test_monitor.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.live_prefect import BIN, ROOT, live_prefect  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.live, pytest.mark.timeout(1200)]
TARGET = "drift-llama"
CODE = {"complete", "continue", "followup"}
# The drop threshold this test configures (monitor.ratio). Steady traffic reproduces the registered τ exactly, so any
# ratio below 1 keeps it quiet. The drift is explain-code prompts sampled at temperature 1. Explain-code alone is not
# a drop on every CPU kind (the tiny target's weights differ by kind): greedy, it gave 1.35 against 1.70 on an Intel
# Xeon but 1.68 against 1.51 on an AMD EPYC. Sampling lowers acceptance where drafts are verified correctly (our loop,
# the demo's base head: α 0.71 greedy, 0.31 at T = 1, bench/vllm_sampled.py), but on vLLM's CPU build most of this
# drop is the engine's: it verifies sampled drafts against an unset per-token temperature (infra/vllm_sampling.py),
# so this window reads 1.00 on an Intel Xeon (α 0.00 over 235 drafts, 2026-12-05; 1.37 against 1.51 in an AMD EPYC
# run). The monitor reads counters, not temperatures (HARDENING.md): what is tested here is the loop from a drop in
# the served acceptance to a retrain, whatever made the drop.
RATIO = 0.95
DRIFT_TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def drift_target(tmp_path_factory):
    """The tiny embedded default with 1500 LM steps (its answers vary with the prompt) and 96 train conversations."""
    from embedded.build import build_embedded
    from embedded.config import EmbeddedConfig

    c = EmbeddedConfig.tiny()
    c = dataclasses.replace(
        c,
        train=dataclasses.replace(c.train, steps=1500),
        traffic=dataclasses.replace(c.traffic, train_conversations=96, heldout_conversations=16),
    )
    return build_embedded(c, tmp_path_factory.mktemp("drift-embedded"), progress=False)


def _kind(src: Path, segments: set[str], dest: Path) -> Path:
    rows = [line for line in src.read_text().splitlines(keepends=True) if json.loads(line)["segment"] in segments]
    assert rows, f"{src}: no conversation of {segments}"
    dest.write_text("".join(rows))
    return dest


def _retrain_on_drop_yaml(dest: Path, config: Path) -> Path:
    """prefect.yaml's retrain-on-drop deployment as declared, run with the tiny preset and this test's config."""
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    (dep,) = [d for d in spec["deployments"] if d["name"] == "retrain-on-drop"]
    assert dep["triggers"][0]["expect"] == ["eagle.acceptance.dropped"]
    dep["triggers"][0]["parameters"].update(preset="tiny", config_path=str(config))
    spec["deployments"] = [dep]
    out = dest / "prefect.yaml"
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


def _window(out: str) -> tuple[float, float, str]:
    """(window tau, registered tau, verdict) from the monitor's line."""
    m = re.search(r"window tau ([\d.]+) \(registered ([\d.]+), .*: (\w+)$", out, re.M)
    assert m, out
    return float(m.group(1)), float(m.group(2)), m.group(3)


@pytest.fixture
def drift(drift_target, tmp_path):
    """Traffic by kind (code to train and evaluate the champion on, explain-code as the drift), the newest
    production snapshot (every kind) under a traffic directory, the pipeline config naming it, and a cheaper one
    for the retrain the trigger runs (30 steps on 16 conversations: the test asks that it registers a head)."""
    emb = drift_target
    snapshot = tmp_path / "traffic" / "2026-12-02"
    snapshot.mkdir(parents=True)
    (snapshot / "train.jsonl").write_text(emb.target_traffic.train.read_text())
    (snapshot / "heldout.jsonl").write_text(emb.target_traffic.heldout.read_text())
    config = tmp_path / "pipeline.json"
    config.write_text(
        json.dumps(
            {
                "regenerate": {"max_new_tokens": 48, "limit": 64},
                "train": {"steps": 300, "checkpoint_every": 300},
                "evaluate": {"spec": {"max_new_tokens": 48}, "limit": None},
                "monitor": {"traffic_dir": str(tmp_path / "traffic"), "ratio": RATIO},
            }
        )
    )
    retrain = tmp_path / "retrain.json"  # what the trigger runs: that a head is registered is tested, not its τ
    retrain.write_text(
        json.dumps(
            {
                "regenerate": {"max_new_tokens": 24, "limit": 16},
                "train": {"steps": 30, "checkpoint_every": 30},
                "evaluate": {"spec": {"max_new_tokens": 24}, "limit": 4},
                "monitor": {"traffic_dir": str(tmp_path / "traffic"), "ratio": RATIO},
            }
        )
    )
    return {
        "train": _kind(emb.target_traffic.train, CODE, tmp_path / "code-train.jsonl"),
        "heldout": _kind(emb.target_traffic.heldout, CODE, tmp_path / "code-heldout.jsonl"),
        "explain": _kind(emb.target_traffic.train, {"explain"}, tmp_path / "explain.jsonl"),
        "snapshot": snapshot,
        "config": config,
        "retrain_config": retrain,
    }


def _champion_and_trigger(live, emb, drift, tmp_path) -> dict:
    """`eagle-heads train` registers the champion; the retrain-on-drop deployment and a worker wait for events."""
    out = live.cli(
        str(BIN / "eagle-heads"),
        "train",
        "--target",
        emb.target_dir,
        "--name",
        TARGET,
        "--traffic",
        str(drift["train"]),
        "--heldout",
        str(drift["heldout"]),
        "--preset",
        "tiny",
        "--config",
        str(drift["config"]),
        timeout=600,
    )
    assert f"head=models:/{TARGET}-v1-eagle3/1" in out, out
    prefect = str(BIN / "prefect")
    live.cli(prefect, "work-pool", "create", "eagle-local", "--type", "process")
    deployments = _retrain_on_drop_yaml(tmp_path, drift["retrain_config"])
    live.cli(prefect, "deploy", "--all", "--prefect-file", str(deployments), timeout=180)
    live.start("worker", prefect, "worker", "start", "--pool", "eagle-local")
    return live.deployment("retrain", "retrain-on-drop")


def _scrape(live, monitor: list[str]) -> tuple[str, float, float, str]:
    out = live.cli(*monitor)
    print(out.strip())  # the figures, shown with `pytest -s`
    return (out, *_window(out))


def test_a_drop_in_served_acceptance_retrains_the_head(live_prefect, drift_target, drift, tmp_path):
    from components.config.pipeline import PipelineConfig
    from components.data.traffic_io import traffic_sha256
    from components.evaluate.engine import engine_prompts
    from infra.mlflow_store import CHAMPION, MlflowStore
    from infra.settings import Settings
    from infra.vllm_engine_spec import EngineSpec
    from infra.vllm_server import VllmServer

    live, emb = live_prefect, drift_target
    cfg = PipelineConfig.load(drift["config"], "tiny")
    live.wait_healthy()
    drop = _champion_and_trigger(live, emb, drift, tmp_path)
    settings = Settings.local(Path(live.env["EAGLE_HOME"]))
    store = MlflowStore.connect(settings)
    head_name = f"{TARGET}-v1-eagle3"
    spec = EngineSpec(
        emb.target_dir,
        str(store.resolve(store.get_alias(head_name, CHAMPION).uri)),
        num_speculative_tokens=cfg.evaluate.spec.depth,
        max_model_len=512,
    )

    def serve(srv, traffic: Path, temperature: float = 0.0) -> None:
        for _, ids in engine_prompts(cfg.evaluate, emb.target_dir, str(traffic), settings):
            srv.complete(ids, cfg.evaluate.spec.max_new_tokens, temperature)

    with VllmServer(spec, settings) as srv:
        monitor = [
            str(BIN / "eagle-heads"),
            "monitor",
            "--target",
            f"models:/{TARGET}/1",
            "--once",
            "--preset",
            "tiny",
            "--config",
            str(drift["config"]),
            "--metrics-url",
            f"{srv.base_url}/metrics",
        ]
        assert _scrape(live, monitor)[3] == "warming"  # one reading: no window yet
        serve(srv, drift["heldout"])
        out, window, registered, verdict = _scrape(live, monitor)
        assert (window, verdict) == (registered, "ok"), out  # the evaluated prompts: vLLM's τ is the registered one
        assert "announced" not in out
        serve(srv, drift["explain"], DRIFT_TEMPERATURE)
        out, window, _, verdict = _scrape(live, monitor)
        assert verdict == "dropped" and window < RATIO * registered, out
        assert f"announced eagle.acceptance.dropped for models:/{TARGET}/1" in out, out
        serve(srv, drift["explain"], DRIFT_TEMPERATURE)  # the drop goes on while the retrain runs: no second event
        out, *_, verdict = _scrape(live, monitor)
        assert verdict == "announced" and "announced eagle" not in out, out

    run = live.wait_run(drop["id"], f"retrain-on-drop for {TARGET} v1 (fired by eagle.acceptance.dropped)", timeout=600)
    assert run["parameters"]["model_name"] == TARGET and int(run["parameters"]["version"]) == 1
    versions = store.list_versions(head_name)
    assert [v.version for v in versions] == [1, 2], "the retrain registered one new head version"
    assert versions[1].tags["traffic_sha256"] == traffic_sha256(str(drift["snapshot"] / "train.jsonl"))
    assert len(live.runs_of(drop["id"])) == 1

    stopped = subprocess.run(monitor, cwd=ROOT, env=live.env, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 1 and "monitor: cannot read" in stopped.stdout, stopped.stdout
    assert "announced" not in stopped.stdout
