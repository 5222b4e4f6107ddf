"""Stages 4 and 5 and the pipeline config: evaluation of a real tiny head, registration in a SQLite MLflow.

Purpose: evaluation reports tau, acceptance by position, per-segment figures and plots, and proves outputs
identical; a broken verification rule is caught (NotLosslessError, report still written). Registration: the
promotion gate (floor, champion's tau), idempotency on run_key and on a target's weights hash, lineage tags, and
refusal to put a head among a target's versions. Pipeline config: strict loading, presets, a stable fingerprint.
Run: `python -m pytest tests/test_evaluate_register.py` (about 20 s once the tiny embedded default is built).
Not here: mocks of MLflow; the one monkeypatch breaks the verification rule on purpose.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from components.data.traffic_io import load_traffic
from components.evaluate.stage import EvaluateConfig, HeadEval, NotLosslessError, evaluate
from components.extract.stage import ExtractConfig, extract
from components.regenerate.stage import RegenerateConfig, regenerate
from components.registry.register import (HeadToRegister, RegisterConfig, TargetRef, identical_of, register_head,
                                          tag_float, register_target)
from components.targets.target import weights_sha256
from components.train.stage import TrainConfig, train
from infra.mlflow_store import CHALLENGER, CHAMPION, RegistryCollision

QUIET = dict(progress=lambda s: None)


@pytest.fixture(scope="module")
def head(tiny_embedded, tmp_path_factory):
    """A head trained by the real stages (regenerate -> extract -> train) on the tiny target."""
    root = tmp_path_factory.mktemp("head")
    regenerate(RegenerateConfig(max_new_tokens=12, temperature=1.0, shard_size=8, limit=8), tiny_embedded.target_dir,
               str(tiny_embedded.target_traffic.train), str(root / "regen"), **QUIET)
    extract(ExtractConfig(max_len=160, seqs_per_shard=8), tiny_embedded.target_dir, str(root / "regen"),
            str(root / "ext"), **QUIET)
    return train(TrainConfig.tiny(), str(root / "ext"), str(root / "train"))


# ---- evaluate ---------------------------------------------------------------------------------------------------


def test_evaluate_reports_acceptance_and_identical_outputs(tiny_embedded, head, tmp_path):
    cfg = EvaluateConfig.tiny()
    heldout = str(tiny_embedded.target_traffic.heldout)
    res = evaluate(cfg, HeadEval(tiny_embedded.target_dir, head.head_dir, heldout, str(tmp_path / "eval"),
                                 baseline_dir=head.head_dir, history_file=head.history_file), **QUIET)
    assert res.identical is True and res.n_samples == cfg.limit
    assert 1.0 <= res.tau <= cfg.spec.depth + 1
    assert len(res.acceptance) == len(res.acceptance_cumulative) == cfg.spec.depth
    assert all(0.0 <= a <= 1.0 for a in res.acceptance + res.acceptance_cumulative)
    assert all(b <= a + 1e-9 for a, b in zip(res.acceptance_cumulative, res.acceptance_cumulative[1:]))
    segments = [c.segment for c in load_traffic(heldout).conversations[: cfg.limit]]
    assert set(res.per_segment) == set(segments)
    assert sum(s["verify_steps"] for s in res.per_segment.values()) > 0
    assert res.baseline_tau == pytest.approx(res.tau)  # the same head as its own baseline, same prompts
    assert res.n_tokens > 0 and res.speedup > 0 and res.plain_tokens_per_s > 0
    # the speedup: rounds of plain and speculative decoding interleaved (components/evaluate/speed.py), median and
    # interval
    assert res.speedup_rounds == cfg.speed.min_rounds and res.speedup_lo <= res.speedup <= res.speedup_hi
    assert res.speedup_reliable == (not res.speedup_note)
    report = json.loads(Path(res.report_file).read_text())
    assert report["result"]["tau"] == res.tau and len(report["samples"]) == cfg.limit
    assert len(report["speed"]["plain_s"]) == res.speedup_rounds and len(report["speed"]["plain_s"][0]) == cfg.limit
    assert {Path(p).name for p in res.plots} == {"acceptance_by_position.png", "acceptance_by_output_position.png",
                                                 "training_curves.png"}
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in res.plots)
    assert res.metrics()["identical"] == 1.0 and res.metrics()["alpha_1"] == res.acceptance[0]
    # by output position: every step of these short outputs starts in the first bucket, whose τ is then the τ
    first, *rest = res.by_position
    assert (first["lo"], first["hi"]) == cfg.position_edges[:2] and not any(b["steps"] for b in rest)
    assert first["steps"] == sum(s["verify_steps"] for s in res.per_segment.values())
    assert first["tau"] == pytest.approx(res.tau) and res.metrics()["tau_pos_0_128"] == pytest.approx(res.tau)
    assert report["by_position_raw"][0]["tau"] == pytest.approx(res.tau_raw)


def test_untimed_our_evaluation_decodes_once_each_way_and_reports_no_speedup(tiny_embedded, head, tmp_path):
    """`time_local: false` (the demo, where vLLM times the head): the same outputs, τ and acceptance as a timed
    evaluation, each prompt decoded once each way, and no speedup of ours anywhere (nan fields, no metric)."""
    heldout = str(tiny_embedded.target_traffic.heldout)
    timed = evaluate(EvaluateConfig.tiny(), HeadEval(tiny_embedded.target_dir, head.head_dir, heldout,
                                                     str(tmp_path / "timed")), **QUIET)
    cfg = dataclasses.replace(EvaluateConfig.tiny(), time_local=False)
    lines: list[str] = []
    res = evaluate(cfg, HeadEval(tiny_embedded.target_dir, head.head_dir, heldout, str(tmp_path / "untimed")),
                   progress=lines.append)
    assert (res.identical, res.tau, res.acceptance, res.n_tokens) == (True, timed.tau, timed.acceptance,
                                                                      timed.n_tokens)
    assert res.speedup != res.speedup and not res.timed and timed.timed and res.speedup_rounds == 0
    assert not res.speedup_reliable and "time_local" in res.speedup_note
    assert not any(k.startswith(("speedup", "plain_tokens", "spec_tokens")) for k in res.metrics())
    assert not any(line.startswith("speedup") for line in lines), lines  # no timed round ran
    assert lines[-1] == "evaluate: speedup not timed (evaluate.time_local false); outputs identical"
    report = json.loads(Path(res.report_file).read_text())
    assert report["speed"] is None and not any("plain_s" in s for s in report["samples"])
    with pytest.raises(ValueError, match="time_local must be true or false"):
        dataclasses.replace(cfg, time_local="no")


def test_cli_evaluate_takes_method_depth_and_limit(tiny_embedded, head, tmp_path, monkeypatch, capsys):
    """`eagle-heads evaluate --depth/--method/--limit` override the preset's evaluation; a bad count exits 2."""
    from flows import cli

    monkeypatch.setenv("EAGLE_HOME", str(tmp_path / ".eagle"))
    out = tmp_path / "eval.json"
    args = ["evaluate", "--head", str(head.head_dir), "--target", str(tiny_embedded.target_dir), "--traffic",
            str(tiny_embedded.target_traffic.heldout), "--preset", "tiny", "--json", str(out)]
    assert cli.main([*args, "--depth", "2", "--limit", "2"]) == 0
    res = json.loads(out.read_text())
    assert len(res["acceptance"]) == 2 and res["n_samples"] == 2 and res["identical"] is True
    assert cli.main([*args, "--method", "tree", "--depth", "3"]) == 0
    assert len(json.loads(out.read_text())["acceptance"]) == 3
    with pytest.raises(SystemExit) as e:
        cli.main([*args, "--depth", "0"])
    assert e.value.code == 2 and "--depth" in capsys.readouterr().err


def test_a_broken_verification_rule_is_caught(tiny_embedded, head, tmp_path, monkeypatch):
    """Accept every draft, whatever the target says: outputs change, and evaluation must fail loudly."""
    from eagle import sampling
    from eagle.export import export_head, load_head

    def accept_all(logits_BKV, draft_BK):
        n_B = torch.full((draft_BK.shape[0],), draft_BK.shape[1], dtype=torch.long)
        return n_B, logits_BKV[:, -1].argmax(-1)

    noisy = load_head(head.head_dir)  # a head whose drafts are mostly wrong, so accepting them changes outputs
    torch.manual_seed(0)
    torch.nn.init.normal_(noisy.lm_head.weight, std=1.0)
    noisy_dir = export_head(noisy, tmp_path / "noisy")
    monkeypatch.setattr(sampling, "accept_chain_greedy", accept_all)
    with pytest.raises(NotLosslessError, match="differ from plain greedy"):
        evaluate(EvaluateConfig.tiny(), HeadEval(tiny_embedded.target_dir, str(noisy_dir),
                                                 str(tiny_embedded.target_traffic.heldout), str(tmp_path / "eval")),
                 **QUIET)
    report = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    assert report["result"]["identical"] is False and not all(s["identical"] for s in report["samples"])
    assert report["target_path"]["chosen"] in ("lean-packed", "lean-torch", "hf-packed", "hf-torch")


def test_our_evaluation_decodes_and_times_on_its_thread_count(tiny_embedded, head, tmp_path, monkeypatch):
    """`evaluate.threads`: the timed decoding runs on that many torch threads (default 1: on 2 cores torch's two
    threads turned a 1.35x head into 0.97x), the caller's setting is back afterwards, and 0 keeps the caller's."""
    import components.evaluate.stage as ev

    seen: list[int] = []
    real = ev.measure_speedup

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(ev, "measure_speedup", spy)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for threads in (1, 0):
            evaluate(dataclasses.replace(EvaluateConfig.tiny(), threads=threads),
                     HeadEval(tiny_embedded.target_dir, head.head_dir, str(tiny_embedded.target_traffic.heldout),
                              str(tmp_path / f"t{threads}")), **QUIET)
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2] and EvaluateConfig().threads == 1
    with pytest.raises(ValueError, match="threads"):
        EvaluateConfig(threads=-1)


# ---- register ---------------------------------------------------------------------------------------------------


@pytest.fixture
def target_ref(mlflow_store, tiny_embedded) -> TargetRef:
    sha = weights_sha256(tiny_embedded.target_dir)
    return register_target(mlflow_store, "tiny", tiny_embedded.target_dir, role="base", base_model="",
                           weights_sha256=sha)


def _head(store, target: TargetRef, head_dir: str, key: str, tau: float, champion_tau: float | None,
          **metrics: float):
    run_id = store.start_run(f"head-{key}")
    return HeadToRegister(head_dir=head_dir, target=target, traffic_sha256="t" * 64, run_key=key, run_id=run_id,
                          metrics={"tau": tau, "speedup": 1.1, **metrics}, champion_tau=champion_tau,
                          params={"config": {"steps": 12}})


def test_promotion_gate_and_idempotent_registration(mlflow_store, target_ref, head):
    cfg = RegisterConfig(tau_floor=1.5)
    name = "tiny-v1-eagle3"
    first = register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k1", 3.0, None))
    assert (first.model_name, first.version, first.alias, first.promoted) == (name, 1, CHAMPION, True)
    v1 = mlflow_store.get_version(name, 1)
    assert v1.tags["target_weights_sha256"] == target_ref.weights_sha256 and v1.tags["tau"] == "3.0000"
    assert v1.tags["target_name"] == "tiny" and v1.tags["target_version"] == "1" and v1.run_id == first.run_id

    worse = register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k2", 2.5, 3.0))
    assert (worse.version, worse.alias, worse.promoted) == (2, CHALLENGER, False)
    assert "champion" in worse.reason
    assert mlflow_store.get_alias(name, CHAMPION).version == 1  # the champion stays

    low = register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k3", 1.2, 1.0))
    assert (low.version, low.alias, low.promoted) == (3, CHALLENGER, False) and "floor" in low.reason
    assert mlflow_store.get_alias(name, CHAMPION).version == 1

    again = register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k1", 3.0, None))
    assert (again.version, again.alias) == (1, CHAMPION)
    assert [v.version for v in mlflow_store.list_versions(name)] == [1, 2, 3]  # no second version for k1

    better = register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k4", 3.5, 3.0))
    assert (better.version, better.promoted) == (4, True) and mlflow_store.get_alias(name, CHAMPION).version == 4


def test_the_identical_verdict_is_a_version_tag_read_back_as_it_was(mlflow_store, target_ref, head):
    cfg = RegisterConfig(tau_floor=1.0)
    verdicts = {"k1": {"identical": 1.0}, "k2": {"identical": 0.0}, "k3": {}}  # greedy, greedy, sampled
    for i, (key, metrics) in enumerate(verdicts.items()):
        register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, key, 3.0 + i,
                                               2.0 + i if i else None, **metrics))
    versions = mlflow_store.list_versions("tiny-v1-eagle3")
    assert [v.tags.get("identical") for v in versions] == ["true", "false", None]
    assert [identical_of(v) for v in versions] == [True, False, None]


def test_an_unreliable_speedup_is_registered_as_such_with_its_reason(mlflow_store, target_ref, head):
    cfg = RegisterConfig(tau_floor=1.0)
    steady = _head(mlflow_store, target_ref, head.head_dir, "k1", 3.0, None, speedup_lo=1.05, speedup_hi=1.15,
                   speedup_reliable=1.0, speedup_rounds=5, speedup_vllm=1.4, speedup_vllm_reliable=1.0)
    register_head(mlflow_store, cfg, steady)
    tags = mlflow_store.get_version("tiny-v1-eagle3", 1).tags
    assert (tags["speedup"], tags["speedup_lo"], tags["speedup_hi"], tags["speedup_rounds"]) == (
        "1.1000", "1.0500", "1.1500", "5")
    assert tags["speedup_vllm"] == "1.4000" and "speedup_note" not in tags
    noisy = dataclasses.replace(
        _head(mlflow_store, target_ref, head.head_dir, "k2", 3.1, 3.0, speedup_lo=0.6, speedup_hi=1.6,
              speedup_reliable=0.0, speedup_rounds=9), notes={"speedup_note": "the rounds disagree"})
    register_head(mlflow_store, cfg, noisy)
    tags = mlflow_store.get_version("tiny-v1-eagle3", 2).tags
    assert (tags["speedup"], tags["speedup_median"], tags["speedup_note"]) == ("unreliable", "1.1000",
                                                                               "the rounds disagree")
    assert tag_float(tags, "speedup") is None and tag_float(tags, "speedup_median") == 1.1


def test_a_head_cannot_skip_the_champion_comparison(mlflow_store, target_ref, head):
    cfg = RegisterConfig(tau_floor=1.0)
    register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k1", 3.0, None))
    with pytest.raises(ValueError, match="champion"):  # champion_tau=None claims there is no champion
        register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k2", 2.0, None))
    assert mlflow_store.get_alias("tiny-v1-eagle3", CHAMPION).version == 1


def test_register_target_is_idempotent_on_weights(mlflow_store, tiny_embedded, target_ref):
    sha = target_ref.weights_sha256
    again = register_target(mlflow_store, "tiny", tiny_embedded.target_dir, role="base", base_model="",
                            weights_sha256=sha)
    assert again.version == target_ref.version == 1
    assert [v.version for v in mlflow_store.list_versions("tiny")] == [1]
    tags = mlflow_store.get_version("tiny", 1).tags
    assert (tags["weights_sha256"], tags["base_model"], tags["role"]) == (sha, "", "base")
    ft_sha = weights_sha256(tiny_embedded.finetune_dir)
    ft = register_target(mlflow_store, "tiny", tiny_embedded.finetune_dir, role="finetune", base_model="tiny/1",
                         weights_sha256=ft_sha)
    assert ft.version == 2 and mlflow_store.get_version("tiny", 2).tags["base_model"] == "tiny/1"
    assert {m.name: m.tags["kind"] for m in mlflow_store.list_models()} == {"tiny": "causal-lm-target"}


def test_a_head_never_lands_among_a_targets_versions(mlflow_store, tiny_embedded, head):
    sha = weights_sha256(tiny_embedded.target_dir)
    register_target(mlflow_store, "tiny-v1-eagle3", tiny_embedded.target_dir, role="base", base_model="",
                    weights_sha256=sha)
    target = TargetRef("tiny", 1, sha, tiny_embedded.target_dir)
    with pytest.raises(RegistryCollision, match="tiny-v1-eagle3"):
        register_head(mlflow_store, RegisterConfig(), _head(mlflow_store, target, head.head_dir, "k1", 3.0, None))
    assert [v.version for v in mlflow_store.list_versions("tiny-v1-eagle3")] == [1]


def test_the_gate_can_decide_on_the_engines_tau(mlflow_store, target_ref, head):
    cfg = RegisterConfig(tau_floor=1.5, gate_tau="engine")
    name = "tiny-v1-eagle3"
    first = register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k1", 3.0, None,
                                                   tau_vllm=2.0))
    assert first.promoted and first.reason.startswith("vLLM tau 2.000 >= floor 1.5")
    assert "local tau 3.000" in first.reason
    v1 = mlflow_store.get_version(name, 1)
    assert (v1.tags["gate_tau"], v1.tags["tau"], v1.tags["tau_vllm"]) == ("engine", "3.0000", "2.0000")
    # locally better than the champion (3.2 > 3.0) but worse in vLLM on the same prompts (1.9 < 2.0): not promoted
    h = dataclasses.replace(_head(mlflow_store, target_ref, head.head_dir, "k2", 3.2, 3.0, tau_vllm=1.9),
                            champion_tau_engine=2.0)
    worse = register_head(mlflow_store, cfg, h)
    assert (worse.alias, worse.promoted) == (CHALLENGER, False) and "< champion's 2.000" in worse.reason
    with pytest.raises(ValueError, match="champion τ was given for the engine gate"):
        register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k3", 3.5, 3.0, tau_vllm=2.5))
    with pytest.raises(ValueError, match="not measured in vLLM: set evaluate.engine"):
        register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k4", 3.5, None))


def test_the_gate_can_require_throughput_at_the_users_concurrency(mlflow_store, target_ref, head):
    cfg = RegisterConfig(tau_floor=1.0, gate_concurrency=8, gate_min_speedup=1.0)
    fast = register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k1", 3.0, None,
                                                  speedup_at_1=1.4, speedup_at_8=1.05))
    assert fast.promoted and "at concurrency 8 it serves 1.05x plain >= 1.0" in fast.reason
    slow = register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k2", 3.5, 3.0,
                                                  speedup_at_1=1.5, speedup_at_8=0.8))
    assert not slow.promoted and "0.80x plain < 1.0" in slow.reason  # a better tau, but slower under the load
    with pytest.raises(ValueError, match="did not measure concurrency 8"):
        register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k3", 3.5, 3.0))


def test_the_served_speedup_gate_keeps_a_head_that_does_not_pay_from_champion(mlflow_store, target_ref, head):
    """By default a head is champion only where its batch-1 speedup interval lies above 1 (vLLM's figure where
    served, else ours), the first head of a target included; it is registered as challenger with the reason."""
    cfg = RegisterConfig(tau_floor=1.5)
    assert cfg.gate_speedup == "served"
    name = "tiny-v1-eagle3"
    across = register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k1", 1.6, None,
                                                    speedup_vllm=0.96, speedup_vllm_lo=0.90, speedup_vllm_hi=1.01))
    assert (across.alias, across.promoted) == (CHALLENGER, False)  # the first head, and still not champion
    assert "served in vLLM 0.96x plain at batch 1 [0.90, 1.01] is not surely above 1" in across.reason
    assert mlflow_store.get_alias(name, CHAMPION) is None
    assert mlflow_store.get_version(name, 1).tags["gate"] == across.reason
    # ours decides where vLLM did not measure: 1.1 (no interval) is surely above 1
    ours = register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k2", 2.0, None))
    assert ours.promoted and "in our decoder 1.10x plain at batch 1 [1.10, 1.10]" in ours.reason
    pays = register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k3", 2.5, 2.0,
                                                  speedup_vllm=1.4, speedup_vllm_lo=1.3, speedup_vllm_hi=1.5,
                                                  speedup=0.8))  # vLLM's figure, the served one, decides
    assert pays.promoted and pays.alias == CHAMPION and "served in vLLM 1.40x" in pays.reason
    untimed = register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k4", 2.6, 2.5,
                                                     speedup=float("nan")))
    assert untimed.promoted and "speedup not measured" in untimed.reason
    off = register_head(mlflow_store, RegisterConfig(tau_floor=1.5, gate_speedup="off"),
                        _head(mlflow_store, target_ref, head.head_dir, "k5", 2.7, 2.6, speedup_vllm=0.5))
    assert off.promoted and "speedup" not in off.reason
