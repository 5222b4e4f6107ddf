"""The head variant chosen by measurement (`train.variants`, components/registry/variant_choice.py) and its config key.

The selection rule on a table of figures (ties, unreliable figures, missing vLLM figures), the registry tags, the
config validation (at load, naming the key path), and one run of `train-head` on the tiny embedded default with
`train.variants: [eagle3, eagle3.1]` and the local evaluation only (no vLLM): the registered version's tags carry
both variants' figures and name the variant the rule picks from the two evaluations.
"""

import json
from pathlib import Path

import pytest

from components.registry.variant_choice import Speedup, VariantSink, choose_variant, served_key, variant_tags


def fig(value, lo, hi, reliable=True, key="speedup_vllm", tau=2.0):
    """Metrics as the evaluation stages report them, with one speedup figure `key`."""
    tau_key = "tau_vllm" if key == "speedup_vllm" else "tau"
    return {
        key: value,
        f"{key}_lo": lo,
        f"{key}_hi": hi,
        f"{key}_reliable": float(reliable),
        f"{key}_rounds": 5.0,
        tau_key: tau,
    }


def both(m3, m31):
    return {"eagle3": m3, "eagle3.1": m31}


LOCAL = dict(key="speedup")
CASES = [
    # (name, metrics, chosen, decided by, words in the reason)
    ("above wins", both(fig(1.2, 1.15, 1.25), fig(1.5, 1.4, 1.6)), "eagle3.1", "speedup_vllm", "beaten by eagle3.1"),
    (
        "overlap ties to the simpler",
        both(fig(1.2, 1.1, 1.3), fig(1.3, 1.25, 1.4)),
        "eagle3",
        "speedup_vllm",
        "ties (intervals overlap)",
    ),
    ("touching intervals tie", both(fig(1.2, 1.1, 1.3), fig(1.4, 1.3, 1.5)), "eagle3", "speedup_vllm", "ties"),
    (
        "simpler above wins",
        both(fig(1.5, 1.4, 1.6), fig(1.2, 1.15, 1.25)),
        "eagle3",
        "speedup_vllm",
        "eagle3.1 is beaten by eagle3",
    ),
    (
        "unreliable simpler above a reliable one: not beaten, it stays",
        both(fig(1.6, 1.5, 1.7, False), fig(1.2, 1.15, 1.25)),
        "eagle3",
        "speedup_vllm",
        "eagle3.1 lies below",
    ),
    (
        "unreliable above cannot beat reliable",
        both(fig(1.2, 1.15, 1.25), fig(1.8, 1.5, 2.1, reliable=False)),
        "eagle3",
        "speedup_vllm",
        "unreliable and eagle3 is not",
    ),
    (
        "reliable above beats unreliable",
        both(fig(1.0, 0.7, 1.1, reliable=False), fig(1.5, 1.4, 1.6)),
        "eagle3.1",
        "speedup_vllm",
        "beaten by eagle3.1",
    ),
    (
        "both unreliable, above wins",
        both(fig(1.0, 0.7, 1.1, False), fig(1.6, 1.2, 2.0, False)),
        "eagle3.1",
        "speedup_vllm",
        "beaten",
    ),
    (
        "unreliable wide simpler ties",
        both(fig(1.3, 0.9, 1.7, reliable=False), fig(1.4, 1.35, 1.45)),
        "eagle3",
        "speedup_vllm",
        "ties",
    ),
    (
        "no vLLM figures: ours decide",
        both(fig(1.2, 1.15, 1.25, **LOCAL), fig(1.5, 1.4, 1.6, **LOCAL)),
        "eagle3.1",
        "speedup",
        "speedup (this project's decoder)",
    ),
    (
        "vLLM figure missing for one: ours for both",
        both({**fig(1.2, 1.15, 1.25, **LOCAL), **fig(2.0, 1.9, 2.1)}, fig(1.5, 1.4, 1.6, **LOCAL)),
        "eagle3.1",
        "speedup",
        "beaten by eagle3.1",
    ),
    (
        "vLLM wins over ours when both measured",
        both(
            {**fig(1.9, 1.8, 2.0, **LOCAL), **fig(1.2, 1.15, 1.25)},
            {**fig(1.1, 1.0, 1.2, **LOCAL), **fig(1.5, 1.4, 1.6)},
        ),
        "eagle3.1",
        "speedup_vllm",
        "vLLM speedup",
    ),
    ("no interval: the point", both({"speedup": 1.2}, {"speedup": 1.3}), "eagle3.1", "speedup", "beaten"),
    (
        "nan figure: no figure",
        both(fig(float("nan"), 1.0, 1.0), fig(1.5, 1.4, 1.6)),
        "eagle3",
        "",
        "no speedup measured",
    ),
    ("nothing measured: the simplest", both({"tau": 2.0}, {"tau": 3.0}), "eagle3", "", "the simplest"),
]


@pytest.mark.parametrize("name,metrics,chosen,key,words", CASES, ids=[c[0] for c in CASES])
def test_choose_variant(name, metrics, chosen, key, words):
    choice = choose_variant(metrics)
    assert (choice.variant, choice.key) == (chosen, key), choice.reason
    assert choice.reason.startswith(chosen) and words in choice.reason, choice.reason
    # the order the variants are listed in does not matter: the rule orders them by complexity
    assert choose_variant(dict(reversed(list(metrics.items())))) == choice


def test_beats_is_strict_and_respects_reliability():
    a, b = Speedup(1.5, 1.4, 1.6, True), Speedup(1.2, 1.1, 1.3, True)
    assert a.beats(b) and not b.beats(a) and not a.beats(a)
    assert not Speedup(1.5, 1.4, 1.6, False).beats(b) and a.beats(Speedup(1.2, 1.1, 1.3, False))
    assert served_key({"eagle3": {"speedup": 1.0}, "eagle3.1": {"speedup_vllm": 1.0}}) == ""


def test_choose_variant_refuses_unknown_or_no_variants():
    with pytest.raises(ValueError, match="eagle9"):
        choose_variant({"eagle3": fig(1, 1, 1), "eagle9": fig(1, 1, 1)})
    with pytest.raises(ValueError):
        choose_variant({})


def test_tags_carry_every_variant_and_the_reason():
    metrics = both(
        {**fig(1.2, 1.15, 1.25, **LOCAL, tau=2.5), **fig(1.3, 1.2, 1.4, tau=2.4)},
        {**fig(1.4, 1.3, 1.5, False, **LOCAL, tau=2.9), **fig(1.6, 1.45, 1.7, tau=2.8)},
    )
    choice = choose_variant(metrics)
    tags = variant_tags(metrics, choice)
    assert tags["variant"] == choice.variant == "eagle3.1" and tags["variants"] == "eagle3 eagle3.1"
    assert tags["variant_choice"] == choice.reason
    assert tags["variant_eagle3_tau"] == "2.5000" and tags["variant_eagle3.1_tau_vllm"] == "2.8000"
    assert tags["variant_eagle3.1_speedup_vllm"] == "1.6000" and tags["variant_eagle3.1_speedup_vllm_lo"] == "1.4500"
    assert tags["variant_eagle3.1_speedup"] == "unreliable"  # as the version's own tags say it
    assert tags["variant_eagle3.1_speedup_median"] == "1.4000" and tags["variant_eagle3_speedup_rounds"] == "5"


def test_variant_sink_prefixes_the_variant():
    got = []

    class Sink:
        def log(self, step, metrics):
            got.append((step, metrics))

    VariantSink(Sink(), "eagle3.1").log(3, {"loss": 1.0})
    assert got == [(3, {"eagle3.1/loss": 1.0})]


@pytest.mark.parametrize(
    "value,words",
    [
        (["eagle3", "eagle4"], "unknown variant"),
        (["eagle3", "eagle3"], "twice"),
        (["eagle3.1"], "two or more"),
        ("eagle3", "is not of type"),
    ],
)
def test_config_refuses_bad_variants_naming_the_key(tmp_path, value, words):
    from components.config.pipeline import ConfigError, PipelineConfig

    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps({"train": {"variants": value}}))
    with pytest.raises(ConfigError, match="train.variants") as e:
        PipelineConfig.load(path, "tiny")
    assert words in str(e.value)


def test_config_accepts_variants_and_they_change_the_run_identity(tmp_path):
    from components.config.pipeline import PipelineConfig
    from components.train.stage import TrainConfig
    from eagle.config_checks import FieldError

    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps({"train": {"variants": ["eagle3.1", "eagle3"]}}))
    cfg = PipelineConfig.load(path, "tiny")
    assert cfg.train.variants == ("eagle3.1", "eagle3") and PipelineConfig.tiny().train.variants == ()
    assert cfg.fingerprint() != PipelineConfig.tiny().fingerprint()
    with pytest.raises(FieldError, match="TrainConfig.variants names an unknown variant"):
        TrainConfig(variants=("eagle3", "parallel-9"))


@pytest.mark.slow
def test_train_head_registers_the_chosen_variant_with_both_figures(tiny_embedded, prefect_harness, tmp_path):
    from components.evaluate.stage import EvaluateResult
    from infra.mlflow_store import MlflowStore
    from infra.settings import Settings
    from tests.helpers import state_dir_env

    state = tmp_path / ".eagle"
    cfg = tmp_path / "pipeline.json"
    cfg.write_text(json.dumps({"train": {"variants": ["eagle3", "eagle3.1"]}}))
    with state_dir_env(state):
        from flows.train_head import train_head

        run = train_head(
            str(tiny_embedded.target_dir),
            str(tiny_embedded.target_traffic.train),
            str(tiny_embedded.target_traffic.heldout),
            "tiny",
            str(cfg),
            "variants-tiny",
        )
    work = Path(run.work_dir)
    metrics = {}
    for v in ("eagle3", "eagle3.1"):  # each variant trained on the one extraction, evaluated on its own
        assert (work / f"train-{v}" / "head" / "model.safetensors").is_file()
        report = json.loads((work / f"evaluate-{v}" / "evaluation.json").read_text())["result"]
        metrics[v] = EvaluateResult(**report).metrics()
    assert not (work / "train").exists() and len(list((work / "extract").glob("manifest.json"))) == 1
    expected = choose_variant(metrics)
    name, version = run.head_uri.split("/")[1:]
    tags = MlflowStore.connect(Settings.local(state)).get_version(name, int(version)).tags
    assert tags["variant"] == expected.variant and tags["variant_choice"] == expected.reason == run.variant_choice
    assert tags["variants"] == "eagle3 eagle3.1" and expected.key == "speedup"  # no vLLM: ours decide
    for v in ("eagle3", "eagle3.1"):
        assert tags[f"variant_{v}_tau"] == f"{metrics[v]['tau']:.4f}"
        assert f"variant_{v}_speedup" in tags and f"variant_{v}_speedup_vllm" not in tags
    assert tags["tau"] == tags[f"variant_{expected.variant}_tau"]  # the version's own figures: the chosen head's
    assert run.train.head_dir == str(work / f"train-{expected.variant}" / "head")
    meta = json.loads((Path(run.train.head_dir) / "eagle_head.json").read_text())
    assert meta["draft_config"]["variant"] == expected.variant
    assert tags["gate"] == run.gate and run.alias in ("champion", "challenger")  # the gate, as for one head
