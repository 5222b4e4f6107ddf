"""Stage 5: registration of a real tiny head in a SQLite MLflow.

Purpose: the promotion gate (floor, champion's tau; on the engine's tau, on throughput at the user's concurrency, on
the served speedup), idempotency on run_key and on a target's weights hash, lineage and figures as version tags (the
identical verdict, an unreliable speedup with its reason), and refusal to put a head among a target's versions.
Run: `python -m pytest tests/test_register.py` (about 15 s once the tiny embedded default is built: the head is
tests/test_evaluate_register.py's `head`, trained once for this module).
Not here: mocks of MLflow; the evaluation (tests/test_evaluate_register.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from components.registry.register import (
    HeadToRegister,
    RegisterConfig,
    TargetRef,
    identical_of,
    register_head,
    tag_float,
    register_target,
)
from components.targets.target import weights_sha256
from infra.mlflow_store import CHALLENGER, CHAMPION, RegistryCollision
from tests.test_evaluate_register import head  # noqa: F401  (the fixture, by name)


@pytest.fixture
def target_ref(mlflow_store, tiny_embedded) -> TargetRef:
    sha = weights_sha256(tiny_embedded.target_dir)
    return register_target(
        mlflow_store, "tiny", tiny_embedded.target_dir, role="base", base_model="", weights_sha256=sha
    )


def _head(store, target: TargetRef, head_dir: str, key: str, tau: float, champion_tau: float | None, **metrics: float):
    run_id = store.start_run(f"head-{key}")
    return HeadToRegister(
        head_dir=head_dir,
        target=target,
        traffic_sha256="t" * 64,
        run_key=key,
        run_id=run_id,
        metrics={"tau": tau, "speedup": 1.1, **metrics},
        champion_tau=champion_tau,
        params={"config": {"steps": 12}},
    )


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
        register_head(
            mlflow_store,
            cfg,
            _head(mlflow_store, target_ref, head.head_dir, key, 3.0 + i, 2.0 + i if i else None, **metrics),
        )
    versions = mlflow_store.list_versions("tiny-v1-eagle3")
    assert [v.tags.get("identical") for v in versions] == ["true", "false", None]
    assert [identical_of(v) for v in versions] == [True, False, None]


def test_an_unreliable_speedup_is_registered_as_such_with_its_reason(mlflow_store, target_ref, head):
    cfg = RegisterConfig(tau_floor=1.0)
    steady = _head(
        mlflow_store,
        target_ref,
        head.head_dir,
        "k1",
        3.0,
        None,
        speedup_lo=1.05,
        speedup_hi=1.15,
        speedup_reliable=1.0,
        speedup_rounds=5,
        speedup_vllm=1.4,
        speedup_vllm_reliable=1.0,
    )
    register_head(mlflow_store, cfg, steady)
    tags = mlflow_store.get_version("tiny-v1-eagle3", 1).tags
    assert (tags["speedup"], tags["speedup_lo"], tags["speedup_hi"], tags["speedup_rounds"]) == (
        "1.1000",
        "1.0500",
        "1.1500",
        "5",
    )
    assert tags["speedup_vllm"] == "1.4000" and "speedup_note" not in tags
    noisy = dataclasses.replace(
        _head(
            mlflow_store,
            target_ref,
            head.head_dir,
            "k2",
            3.1,
            3.0,
            speedup_lo=0.6,
            speedup_hi=1.6,
            speedup_reliable=0.0,
            speedup_rounds=9,
        ),
        notes={"speedup_note": "the rounds disagree"},
    )
    register_head(mlflow_store, cfg, noisy)
    tags = mlflow_store.get_version("tiny-v1-eagle3", 2).tags
    assert (tags["speedup"], tags["speedup_median"], tags["speedup_note"]) == (
        "unreliable",
        "1.1000",
        "the rounds disagree",
    )
    assert tag_float(tags, "speedup") is None and tag_float(tags, "speedup_median") == 1.1


def test_a_head_cannot_skip_the_champion_comparison(mlflow_store, target_ref, head):
    cfg = RegisterConfig(tau_floor=1.0)
    register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k1", 3.0, None))
    with pytest.raises(ValueError, match="champion"):  # champion_tau=None claims there is no champion
        register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k2", 2.0, None))
    assert mlflow_store.get_alias("tiny-v1-eagle3", CHAMPION).version == 1


def test_register_target_is_idempotent_on_weights(mlflow_store, tiny_embedded, target_ref):
    sha = target_ref.weights_sha256
    again = register_target(
        mlflow_store, "tiny", tiny_embedded.target_dir, role="base", base_model="", weights_sha256=sha
    )
    assert again.version == target_ref.version == 1
    assert [v.version for v in mlflow_store.list_versions("tiny")] == [1]
    tags = mlflow_store.get_version("tiny", 1).tags
    assert (tags["weights_sha256"], tags["base_model"], tags["role"]) == (sha, "", "base")
    ft_sha = weights_sha256(tiny_embedded.finetune_dir)
    ft = register_target(
        mlflow_store, "tiny", tiny_embedded.finetune_dir, role="finetune", base_model="tiny/1", weights_sha256=ft_sha
    )
    assert ft.version == 2 and mlflow_store.get_version("tiny", 2).tags["base_model"] == "tiny/1"
    assert {m.name: m.tags["kind"] for m in mlflow_store.list_models()} == {"tiny": "causal-lm-target"}


def test_a_head_never_lands_among_a_targets_versions(mlflow_store, tiny_embedded, head):
    sha = weights_sha256(tiny_embedded.target_dir)
    register_target(
        mlflow_store, "tiny-v1-eagle3", tiny_embedded.target_dir, role="base", base_model="", weights_sha256=sha
    )
    target = TargetRef("tiny", 1, sha, tiny_embedded.target_dir)
    with pytest.raises(RegistryCollision, match="tiny-v1-eagle3"):
        register_head(mlflow_store, RegisterConfig(), _head(mlflow_store, target, head.head_dir, "k1", 3.0, None))
    assert [v.version for v in mlflow_store.list_versions("tiny-v1-eagle3")] == [1]


def test_the_gate_can_decide_on_the_engines_tau(mlflow_store, target_ref, head):
    cfg = RegisterConfig(tau_floor=1.5, gate_tau="engine")
    name = "tiny-v1-eagle3"
    first = register_head(
        mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k1", 3.0, None, tau_vllm=2.0)
    )
    assert first.promoted and first.reason.startswith("vLLM tau 2.000 >= floor 1.5")
    assert "local tau 3.000" in first.reason
    v1 = mlflow_store.get_version(name, 1)
    assert (v1.tags["gate_tau"], v1.tags["tau"], v1.tags["tau_vllm"]) == ("engine", "3.0000", "2.0000")
    # locally better than the champion (3.2 > 3.0) but worse in vLLM on the same prompts (1.9 < 2.0): not promoted
    h = dataclasses.replace(
        _head(mlflow_store, target_ref, head.head_dir, "k2", 3.2, 3.0, tau_vllm=1.9), champion_tau_engine=2.0
    )
    worse = register_head(mlflow_store, cfg, h)
    assert (worse.alias, worse.promoted) == (CHALLENGER, False) and "< champion's 2.000" in worse.reason
    with pytest.raises(ValueError, match="champion τ was given for the engine gate"):
        register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k3", 3.5, 3.0, tau_vllm=2.5))
    with pytest.raises(ValueError, match="not measured in vLLM: set evaluate.engine"):
        register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k4", 3.5, None))


def test_the_gate_can_require_throughput_at_the_users_concurrency(mlflow_store, target_ref, head):
    cfg = RegisterConfig(tau_floor=1.0, gate_concurrency=8, gate_min_speedup=1.0)
    fast = register_head(
        mlflow_store,
        cfg,
        _head(mlflow_store, target_ref, head.head_dir, "k1", 3.0, None, speedup_at_1=1.4, speedup_at_8=1.05),
    )
    assert fast.promoted and "at concurrency 8 it serves 1.05x plain >= 1.0" in fast.reason
    slow = register_head(
        mlflow_store,
        cfg,
        _head(mlflow_store, target_ref, head.head_dir, "k2", 3.5, 3.0, speedup_at_1=1.5, speedup_at_8=0.8),
    )
    assert not slow.promoted and "0.80x plain < 1.0" in slow.reason  # a better tau, but slower under the load
    with pytest.raises(ValueError, match="did not measure concurrency 8"):
        register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k3", 3.5, 3.0))


def test_the_served_speedup_gate_keeps_a_head_that_does_not_pay_from_champion(mlflow_store, target_ref, head):
    """By default a head is champion only where its batch-1 speedup interval lies above 1 (vLLM's figure where
    served, else ours), the first head of a target included; it is registered as challenger with the reason."""
    cfg = RegisterConfig(tau_floor=1.5)
    assert cfg.gate_speedup == "served"
    name = "tiny-v1-eagle3"
    across = register_head(
        mlflow_store,
        cfg,
        _head(
            mlflow_store,
            target_ref,
            head.head_dir,
            "k1",
            1.6,
            None,
            speedup_vllm=0.96,
            speedup_vllm_lo=0.90,
            speedup_vllm_hi=1.01,
        ),
    )
    assert (across.alias, across.promoted) == (CHALLENGER, False)  # the first head, and still not champion
    assert "served in vLLM 0.96x plain at batch 1 [0.90, 1.01] is not surely above 1" in across.reason
    assert mlflow_store.get_alias(name, CHAMPION) is None
    assert mlflow_store.get_version(name, 1).tags["gate"] == across.reason
    # ours decides where vLLM did not measure: 1.1 (no interval) is surely above 1
    ours = register_head(mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k2", 2.0, None))
    assert ours.promoted and "in our decoder 1.10x plain at batch 1 [1.10, 1.10]" in ours.reason
    pays = register_head(
        mlflow_store,
        cfg,
        _head(
            mlflow_store,
            target_ref,
            head.head_dir,
            "k3",
            2.5,
            2.0,
            speedup_vllm=1.4,
            speedup_vllm_lo=1.3,
            speedup_vllm_hi=1.5,
            speedup=0.8,
        ),
    )  # vLLM's figure, the served one, decides
    assert pays.promoted and pays.alias == CHAMPION and "served in vLLM 1.40x" in pays.reason
    untimed = register_head(
        mlflow_store, cfg, _head(mlflow_store, target_ref, head.head_dir, "k4", 2.6, 2.5, speedup=float("nan"))
    )
    assert untimed.promoted and "speedup not measured" in untimed.reason
    off = register_head(
        mlflow_store,
        RegisterConfig(tau_floor=1.5, gate_speedup="off"),
        _head(mlflow_store, target_ref, head.head_dir, "k5", 2.7, 2.6, speedup_vllm=0.5),
    )
    assert off.promoted and "speedup" not in off.reason
    # a retrain on served traffic: its shadow test's figure on the held-out captured requests decides before vLLM's
    # on the registered held-out traffic (across 1 here)
    shadow = register_head(
        mlflow_store,
        cfg,
        _head(
            mlflow_store,
            target_ref,
            head.head_dir,
            "k6",
            2.8,
            2.7,
            speedup_vllm=1.04,
            speedup_vllm_lo=0.95,
            speedup_vllm_hi=1.11,
            speedup_shadow=1.15,
            speedup_shadow_lo=1.12,
            speedup_shadow_hi=1.16,
        ),
    )
    assert shadow.promoted and "on the held-out captured requests (shadow test) 1.15x" in shadow.reason
