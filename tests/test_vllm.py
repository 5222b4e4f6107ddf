"""Serving fidelity, proven in the engine: heads trained by the pipeline, served by vLLM (its CPU build), no mocks.

Purpose: a head of the tiny pipeline preset on a real (small, trained) embedded target is exported, loaded
unmodified by vLLM and served next to vLLM's plain decoding on the same held-out prompts:
- greedy output with the head equals vLLM's plain output and this project's own greedy decoding, token for token;
- vLLM's `/metrics` counters (drafts, accepted tokens per position) equal this project's evaluation's counts on the
  same prompts, so tau and every alpha_k agree exactly; vLLM's per-request metrics (drafts accepted per
  verification step, in output order) equal ours step by step, so tau and alpha_1 by output position agree too;
- the same holds for a head trained at custom fused layer ids, for an EAGLE-3.1 head (`train.variant: eagle3.1`:
  vLLM reads `fc_norm` and `norm_output` from its config.json) and for a head in the earlier format (probe beside
  the weights, no ids in config.json, a repeated layer id), which `servable_head` re-exports folded;
- the `train-head` flow with `evaluate.engine: vllm` registers vLLM's tau and alpha_k next to ours (equal), and its
  gate decides on vLLM's tau (`register.gate_tau: engine`); a champion head served on the same prompts gives the
  champion's tau in vLLM; that flow's engines run compiled (`evaluate.compiled`, vLLM's default on the CPU), their
  outputs still identical to ours, and `serve` runs the head compiled as registered (tag `compiled`);
- `eagle-heads serve` resolves the registered champion, starts vLLM and answers a chat completion with the target's
  greedy output; `--print-only` prints the vLLM and SGLang commands; a missing vLLM, an engine that dies at start
  (forked from a zygote, infra/vllm_zygote.py, as every engine here, its engine core forked from it) and one that
  cannot take its port (started in an interpreter of its own, `EAGLE_VLLM_ZYGOTE=0`) are each one clear line.
Run: `python -m pytest tests/test_vllm.py` (about 3 minutes on 2 cores: an engine start takes 3-10 s). Needs
vLLM's venv (`make vllm`; `make test` makes it).
Not here: SGLang itself (not installable here); its capture rule is checked without it in tests/test_export.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from components.evaluate.engine import evaluate_in_vllm, our_outputs, plain_server
from components.evaluate.speed import SpeedupConfig
from components.evaluate.stage import EvaluateConfig, HeadEval, evaluate
from components.extract.stage import ExtractConfig, extract
from components.targets.servable import is_servable, servable_head
from components.train.stage import TrainConfig, train
from eagle.speculative import SpecConfig
from infra.settings import Settings
from infra.vllm_engine_spec import EngineSpec
from infra.vllm_server import EngineError, VllmServer
from infra.vllm_zygote import FORKED_CORE, ZygoteChild
from tests.helpers import our_counts, state_dir_env

pytestmark = [pytest.mark.slow, pytest.mark.engine]
QUIET = dict(progress=lambda s: None)
# position buckets small enough that these short outputs span several: the engine's buckets must equal ours
EVAL = EvaluateConfig(
    spec=SpecConfig(depth=3, max_new_tokens=24), limit=6, speed=SpeedupConfig.tiny(), position_edges=(0, 8, 16, 64)
)
ROOT = Path(__file__).resolve().parent.parent
PICK = (1, 2)  # the flow's K choices at batch size 1 (evaluate.pick): the evaluation then runs at the faster one


@pytest.fixture(scope="module")
def settings(engine_settings):
    return engine_settings


def _train_head(engine_target, ext: Path, root: Path, variant: str = "eagle3") -> str:
    cfg = dataclasses.replace(TrainConfig.tiny(), steps=60, checkpoint_every=60, variant=variant)
    return train(cfg, str(ext), str(root / "train"), engine_target.target_dir).head_dir


@pytest.fixture(scope="module")
def heads(engine_target, engine_head, tmp_path_factory) -> dict[str, str]:
    """The session's default head; one trained at custom fused ids on the same conversations; an EAGLE-3.1 head on
    the default's features; the custom head in the earlier format."""
    root = tmp_path_factory.mktemp("engine-heads")
    custom_ext = root / "custom" / "extract"
    extract(
        ExtractConfig(max_len=192, dtype="float32", seqs_per_shard=8, aux_layer_ids=(2, 3, 4)),
        engine_target.target_dir,
        engine_head.regen_dir,
        str(custom_ext),
        **QUIET,
    )
    custom = _train_head(engine_target, custom_ext, root / "custom")
    eagle3_1 = _train_head(engine_target, Path(engine_head.extract_dir), root / "eagle3.1", variant="eagle3.1")
    return {
        "default": engine_head.head_dir,
        "custom": custom,
        "legacy": str(_as_legacy(Path(custom), root / "legacy")),
        "eagle3.1": eagle3_1,
    }


def _as_legacy(head: Path, out: Path) -> Path:
    """The head in the format exported before engines could load it: probe beside the weights, no layer ids in
    config.json, and a repeated id (2, 3, 3) in our metadata (the fc block of id 4 becomes a second block of 3)."""
    shutil.copytree(head, out)
    shutil.move(out / "probe" / "probe.safetensors", out / "probe.safetensors")
    (out / "probe").rmdir()
    cfg = json.loads((out / "config.json").read_text())
    for k in ("eagle_aux_hidden_state_layer_ids", "eagle_config", "num_aux_hidden_states"):
        cfg.pop(k, None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    meta = json.loads((out / "eagle_head.json").read_text())
    meta["draft_config"]["aux_layer_ids"] = [2, 3, 3]
    (out / "eagle_head.json").write_text(json.dumps(meta, indent=2))
    return out


@pytest.fixture(scope="module")
def plain_run(engine_target, settings):
    """vLLM without speculation, started once and run beside each head's server."""
    with plain_server(EVAL, engine_target.target_dir, settings) as srv:
        yield srv


@pytest.mark.parametrize("kind", ["default", "custom", "legacy", "eagle3.1"])
def test_vllm_serves_the_head_losslessly_with_our_acceptance(kind, heads, engine_target, settings, plain_run, tmp_path):
    head = heads[kind]
    assert is_servable(head) == (kind != "legacy")
    engine_cfg = json.loads((Path(head) / "config.json").read_text())
    assert engine_cfg.get("fc_norm", False) == engine_cfg.get("norm_output", False) == (kind == "eagle3.1")
    served = servable_head(head, engine_target.target_dir, tmp_path / "servable")
    assert is_servable(served)
    heldout = str(engine_target.target_traffic.heldout)
    ours = evaluate(EVAL, HeadEval(engine_target.target_dir, head, heldout, str(tmp_path / "local")), **QUIET)
    assert ours.identical
    champion = head if kind == "legacy" else None  # served as the champion too: re-exported, same prompts
    res = evaluate_in_vllm(
        EVAL,
        HeadEval(engine_target.target_dir, str(served), heldout, str(tmp_path / "vllm"), baseline_dir=champion),
        settings,
        ours=our_outputs(ours.report_file),
        plain=plain_run,
        **QUIET,
    )
    assert res.identical_to_plain and res.identical_to_ours
    # its engine core was forked from the server (infra/vllm_zygote.py), and its outputs are the target's, as above
    assert isinstance(plain_run.proc, ZygoteChild) and FORKED_CORE in plain_run.log_path.read_text()
    assert res.speedup_rounds == EVAL.speed.min_rounds and res.speedup_lo <= res.speedup <= res.speedup_hi
    assert res.baseline_tau == (pytest.approx(res.tau) if champion else None)  # the gate's champion τ in vLLM
    steps, per_pos = our_counts(ours.report_file, EVAL.spec.depth)
    assert (res.drafts, res.accepted_per_pos) == (steps, per_pos)
    # vLLM counts what the rule accepted (also past EOS and the length limit): ours counted alike is equal
    assert res.tau == pytest.approx(ours.tau_raw) and res.acceptance == pytest.approx(ours.acceptance_raw)
    assert ours.tau <= ours.tau_raw  # the emitted figure never exceeds it
    # by output position: vLLM's per-request steps are ours, step for step, so the buckets are equal
    local = json.loads(Path(ours.report_file).read_text())
    engine = json.loads(Path(res.report_file).read_text())
    assert [s["accept_lengths"] for s in engine["samples"]] == [s["accept_lengths"] for s in local["samples"]]
    assert res.by_position == local["by_position_raw"] and sum(b["steps"] > 0 for b in res.by_position) >= 2
    assert res.metrics()["tau_vllm_pos_0_8"] == pytest.approx(local["by_position_raw"][0]["tau"])
    assert (Path(res.report_file).parent / "acceptance_by_output_position_vllm.png").is_file()
    assert sum(per_pos) > 0, "a head that never gets a draft accepted proves little"


@pytest.fixture(scope="module")
def flow_run(engine_target, settings, prefect_harness, tmp_path_factory):
    """The `train-head` flow (tiny preset) with `evaluate.engine: vllm`: the head is measured in vLLM too and both
    engines' figures land in the registry. Our decoder untimed (`time_local: false`, as the demo runs it): vLLM's
    pair starts beside our evaluation (flows/evaluate_head.py `start_pair_early`)."""
    cfg = tmp_path_factory.mktemp("engine-flow") / "pipeline.json"
    cfg.write_text(
        json.dumps(
            {
                "train": {"steps": 60},
                "register": {"gate_tau": "engine"},
                "evaluate": {
                    "engine": "vllm",
                    "limit": EVAL.limit,
                    "time_local": False,
                    "spec": {"depth": EVAL.spec.depth, "max_new_tokens": EVAL.spec.max_new_tokens},
                    "pick": {"choices": list(PICK), "requests": 2, "repeats": 1},
                    "compiled": True,  # vLLM's own default on the CPU: what `serve` then runs (tag `compiled`)
                },
            }
        )
    )
    with state_dir_env(settings.state_dir):
        from flows.train_head import train_head

        yield train_head(
            str(engine_target.target_dir),
            str(engine_target.target_traffic.train),
            str(engine_target.target_traffic.heldout),
            "tiny",
            str(cfg),
            "engine-tiny",
        )


def test_pipeline_with_engine_vllm_registers_both_engines_figures(flow_run, settings):
    from infra.mlflow_store import MlflowStore

    assert flow_run.alias == "champion" and flow_run.vllm.identical_to_ours is True
    name, version = flow_run.head_uri.split("/")[1:]
    tags = MlflowStore.connect(settings).get_version(name, int(version)).tags
    assert tags["identical_vllm"] == "true"
    # the same counts in both engines: vLLM's τ is ours counted as vLLM counts (tau_raw); the emitted τ is at most it
    assert float(tags["tau_vllm"]) == pytest.approx(float(tags["tau_raw"]), abs=1e-4)
    assert float(tags["tau"]) <= float(tags["tau_raw"])
    assert tags["acceptance_vllm"] == tags["acceptance_raw"]
    # by output position (default buckets): these short outputs start every step in 0-128, in both engines
    assert tags["tau_by_position"] == f"0-128:{tags['tau']}"
    assert tags["tau_by_position_vllm"] == f"0-128:{tags['tau_vllm']}"
    assert tags["gate_tau"] == "engine" and tags["gate"].startswith("vLLM tau")  # the engine's τ decided
    # our decoder untimed: no speedup of ours registered, the reason said; vLLM's is the figure
    assert "speedup" not in tags and "time_local" in tags["speedup_note"] and "speedup_vllm" in tags
    # measured compiled (`evaluate.compiled`): vLLM's compiled engines gave outputs identical to ours and to plain
    assert tags["compiled"] == "true"


def test_the_k_measured_fastest_at_batch_1_is_the_one_evaluated_registered_and_served(flow_run, settings):
    from components.evaluate.depth_pick import REPORT, choose, read_pick
    from flows.command_serve import _registered_depth
    from infra.mlflow_store import MlflowStore

    name, version = flow_run.head_uri.split("/")[1:]
    tags = MlflowStore.connect(settings).get_version(name, int(version)).tags
    reports = list((Path(settings.state_dir) / "runs").rglob(REPORT))  # (and a copy among the run's artifacts)
    assert len(reports) == 1, reports
    pick = read_pick(reports[0])
    assert set(pick.tokens_per_s) == {0, *PICK} and all(t > 0 for t in pick.tokens_per_s.values())
    assert pick.depth == choose(pick.tokens_per_s) and tags["depth"] == str(pick.depth)
    assert float(tags["depth_pick_speedup"]) == pytest.approx(
        pick.tokens_per_s[pick.depth] / pick.tokens_per_s[0], 1e-3
    )
    # everything after the pick ran at its K: vLLM's acceptance by position and ours have that many positions
    assert len(tags["acceptance_vllm"].split()) == pick.depth == len(tags["acceptance"].split())
    assert _registered_depth(flow_run.head_uri, settings) == pick.depth  # what `serve` drafts without a schedule


def _cli_env(settings: Settings) -> dict[str, str]:
    return {**os.environ, "EAGLE_HOME": str(settings.state_dir), "PYTHONPATH": str(ROOT)}


def test_serve_command_starts_vllm_with_the_champion(flow_run, engine_target, settings):
    from transformers import AutoTokenizer

    uri = flow_run.head_uri.rsplit("/", 1)[0] + "@champion"
    env = _cli_env(settings)
    cmd = [sys.executable, "-m", "flows.cli", "serve", "--head", uri, "--k", "3"]
    printed = subprocess.run([*cmd, "--print-only"], env=env, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert "vllm serve" in printed.stdout and '"method": "eagle3"' in printed.stdout
    assert "--speculative-algorithm EAGLE3" in printed.stdout and "--speculative-draft-model-path" in printed.stdout
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        url = _wait_for_url(proc, seen)
        msgs = [{"role": "user", "content": "def add(a, b):"}]
        body = {"model": "engine-tiny", "messages": msgs, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
        req = urllib.request.Request(
            url + "/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(90)
    assert rc in (0, 130)
    # this vLLM's CPU build verifies sampled drafts wrongly (infra/vllm_sampling.py): serve says to send greedy requests
    assert any("serve: note: this vLLM's CPU build verifies sampled drafts wrongly" in ln for ln in seen), seen
    assert any("compiled, as it was measured" in ln for ln in seen), seen  # the registered tag `compiled`
    from components.data.chat import prompt_ids
    from components.targets.target import load_target
    from eagle.speculative import generate_plain
    import torch

    tok = AutoTokenizer.from_pretrained(engine_target.target_dir)
    ids = prompt_ids(tok, msgs)
    assert answer["prompt_token_ids"] == ids  # the engine applied the same chat template
    target = load_target(engine_target.target_dir)[0]
    plain = generate_plain(
        target,
        torch.tensor([ids]),
        None,
        SpecConfig(max_new_tokens=16, eos_token_id=target.generation_config.eos_token_id),
    )
    assert answer["choices"][0]["token_ids"] == plain.sequences[0, : int(plain.lengths[0])].tolist()
    port = url.rsplit(":", 1)[1].split("/")[0]
    assert not _engine_processes(port), "the serve command left vLLM processes behind"


def _wait_for_url(proc: subprocess.Popen, seen: list[str], timeout_s: float = 300.0) -> str:
    """The URL `serve` reports ready at; every line it printed until then is appended to `seen`."""
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if "serve: ready at " in line:
            return line.split("serve: ready at ", 1)[1].split()[0]
    raise AssertionError("serve did not report ready:\n" + "".join(seen[-30:]))


def _engine_processes(port: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [ln for ln in out if "vllm.entrypoints" in ln and f"--port {port}" in ln]


def test_missing_vllm_and_a_dying_engine_are_one_clear_line(engine_target, tmp_path):
    s = Settings.local(tmp_path / ".eagle", vllm_python=str(tmp_path / "nope" / "python"))
    with pytest.raises(EngineError, match="make vllm"):
        VllmServer(EngineSpec(engine_target.target_dir, method=None), s).start()
    broken = tmp_path / "broken-target"
    shutil.copytree(engine_target.target_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    srv = VllmServer(EngineSpec(str(broken), method=None), Settings.local(tmp_path / ".eagle2"))
    with pytest.raises(EngineError, match="exited with code 1"):
        srv.start()
    assert isinstance(srv.proc, ZygoteChild) and srv.proc.poll() == 1  # forked from a zygote (the default)


def test_an_engine_that_cannot_take_its_port_is_never_reported_ready(engine_target, tmp_path):
    """Another process answers /health on the port: the engine we start fails to bind, and start() says so
    instead of taking the other one for ours (it waits for our engine's own "listening" log line)."""
    import http.server
    import threading

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        own = Settings.local(tmp_path / ".eagle", vllm_zygote=False)  # an interpreter of its own: EAGLE_VLLM_ZYGOTE=0
        srv = VllmServer(
            EngineSpec(engine_target.target_dir, method=None), own, port=other.server_address[1], start_timeout_s=300
        )
        with pytest.raises(EngineError, match="exited with code") as e:
            srv.start()
        assert "address already in use" in str(e.value).lower() and isinstance(srv.proc, subprocess.Popen)
    finally:
        other.shutdown()
