"""The shadow test's verdict on synthetic intervals, its registry tags, and the extra gate it puts on the alias.

Purpose: components/evaluate/shadow.py `verdict` and `ShadowResult` without vLLM (figures made by hand), and
components/registry/register.py `register_head` honouring `HeadToRegister.extra_gate` in a local MLflow store.
Run: `python -m pytest tests/test_shadow.py` (a few seconds).
Not here: the measurement in vLLM (tests/test_capture_retrain_engine.py).
"""

from __future__ import annotations

import pytest

from components.evaluate.shadow import Figure, ShadowResult, verdict


def fig(
    speedup: float, lo: float, hi: float, reliable: bool = True, identical: bool = True, wide: bool = False
) -> Figure:
    note = "" if reliable else ("the rounds disagree" if wide else "only 2 of 3 rounds fitted in the budget")
    return Figure(speedup, lo, hi, reliable, note, 5, identical, 2.5, wide_only=wide)


@pytest.mark.parametrize(
    "new, champion, promoted, words",
    [
        (fig(1.6, 1.5, 1.7), fig(1.2, 1.1, 1.3), True, "lies wholly above"),
        (fig(1.6, 1.3, 1.7), fig(1.2, 1.1, 1.35), False, "does not lie wholly above"),  # overlapping
        (fig(1.6, 1.3, 1.7), fig(1.2, 1.1, 1.3), False, "does not lie wholly above"),  # touching is not above
        (fig(1.1, 1.0, 1.2), fig(1.5, 1.4, 1.6), False, "does not lie wholly above"),  # worse
        (fig(1.6, 1.5, 1.7, reliable=False), fig(1.2, 1.1, 1.3), False, "unreliable (new head's: only 2 of 3"),
        (fig(1.6, 1.5, 1.7), fig(1.2, 1.1, 1.3, reliable=False), False, "unreliable (champion's"),
        # an interval unreliable only for its width is compared: here it still lies below the new one ...
        (fig(1.16, 1.15, 1.18), fig(0.96, 0.90, 1.08, False, wide=True), True, "judged on a wide interval"),
        # ... and here its width is what keeps the champion
        (fig(1.16, 1.05, 1.18), fig(0.96, 0.90, 1.08, False, wide=True), False, "does not lie wholly above"),
        (fig(1.6, 1.3, 1.9, False, wide=True), fig(1.2, 1.1, 1.25), True, "harder: new head's: the rounds disagree"),
        (fig(1.6, 1.5, 1.7, identical=False), fig(1.2, 1.1, 1.3), False, "differ from plain decoding's"),
    ],
)
def test_the_new_head_is_promoted_only_when_its_interval_lies_above_the_champions(new, champion, promoted, words):
    ok, why = verdict(new, champion)
    assert ok is promoted and words in why
    assert f"new head {new.describe()} vs champion {champion.describe()}" in why


def _result(new: Figure, champion: Figure) -> ShadowResult:
    ok, why = verdict(new, champion)
    return ShadowResult(new, champion, ok, why, 6, 1, "models:/t-v1-eagle3/1", "k", "shadow.json")


def test_tags_hold_the_verdict_and_both_figures():
    res = _result(fig(1.6, 1.5, 1.7), fig(1.2, 1.1, 1.3, reliable=False))
    tags = res.tags()
    assert tags["shadow_verdict"] == "keep champion" and "unreliable" in tags["shadow_reason"]
    assert (tags["shadow_speedup"], tags["shadow_speedup_lo"], tags["shadow_speedup_hi"]) == (
        "1.6000",
        "1.5000",
        "1.7000",
    )
    assert tags["shadow_champion_speedup"] == "unreliable" and tags["shadow_champion_speedup_median"] == "1.2000"
    assert tags["shadow_champion"] == "models:/t-v1-eagle3/1" and tags["shadow_prompts"] == "6"
    assert res.gate() == (False, f"shadow: {res.reason}")
    assert _result(fig(1.6, 1.5, 1.7), fig(1.2, 1.1, 1.3)).tags()["shadow_verdict"] == "promote"


def test_a_failed_shadow_keeps_the_alias_and_says_why(mlflow_store, tmp_path):
    from components.registry.register import HeadToRegister, RegisterConfig, TargetRef, register_head

    head = tmp_path / "head"
    head.mkdir()
    (head / "model.safetensors").write_bytes(b"x")
    target = TargetRef("t", 1, "sha", str(tmp_path))
    cfg = RegisterConfig(tau_floor=1.0, gate_speedup="off")
    res = _result(fig(1.3, 1.2, 1.4), fig(1.3, 1.2, 1.4))
    results = []
    for key, gate in (("first", None), ("second", res.gate())):
        with mlflow_store.run(key) as run_id:
            results.append(
                register_head(
                    mlflow_store,
                    cfg,
                    HeadToRegister(
                        str(head),
                        target,
                        "traffic",
                        key,
                        run_id,
                        {"tau": 2.0},
                        1.5 if gate else None,
                        notes=res.tags() if gate else None,
                        extra_gate=gate,
                    ),
                )
            )
    assert results[0].alias == "champion"
    assert results[1].alias == "challenger" and not results[1].promoted  # the τ gate alone would have promoted it
    assert "; shadow: new head 1.30x [1.20, 1.40] vs champion" in results[1].reason
    v = mlflow_store.get_version(results[1].model_name, results[1].version)
    assert v.tags["shadow_verdict"] == "keep champion" and v.tags["gate"] == results[1].reason
    assert v.tags["shadow_speedup_lo"] == "1.2000" and v.tags["shadow_champion_speedup_hi"] == "1.4000"


def test_the_served_speedup_gate_gets_the_new_heads_figure_when_it_can_be_compared():
    assert _result(fig(1.6, 1.5, 1.7), fig(1.2, 1.1, 1.3)).metrics() == {
        "speedup_shadow": 1.6,
        "speedup_shadow_lo": 1.5,
        "speedup_shadow_hi": 1.7,
    }
    assert _result(fig(1.6, 1.3, 1.9, False, wide=True), fig(1.2, 1.1, 1.3)).metrics()["speedup_shadow_lo"] == 1.3
    assert _result(fig(1.6, 1.5, 1.7, reliable=False), fig(1.2, 1.1, 1.3)).metrics() == {}  # too few rounds
