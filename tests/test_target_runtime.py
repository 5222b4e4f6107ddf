"""`TargetRuntime`: where the target runs, built once from the config, asked by the stages that run it.

Purpose: no engine is started, nothing is loaded (well under a second):
- built from each config variant (`tiny`, `default`, `target.runtime: vllm`, one stage's own `engine: vllm`), it says
  what each stage asks: regenerate/extract/evaluate in the engine, the gate's τ, whether this process loads the target,
  the recorded engine names and the registry's `target_runtime` tag;
- the sections keep the values as written (nothing rewrites them) while `config show` (`to_dict`) and the run's
  fingerprint state the four knobs as the runtime decides them, the same as the knobs written out by hand;
- a stage called alone builds it from its section; what the engine cannot run is refused naming the key;
- the stages ask it: regeneration's endpoint, the gate's inputs; no stage compares engine names (read from the source).
Run: `python -m pytest tests/test_target_runtime.py`.
Not here: the pipeline run by vLLM (tests/test_runtime_vllm.py), the scale on vLLM's command line
(tests/test_engine_scale.py), the config loader's other rules (tests/test_config.py).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from components.config.pipeline import PipelineConfig
from components.extract.stage import ExtractConfig
from components.regenerate.endpoint import engine_endpoint
from components.regenerate.stage import RegenerateConfig
from components.registry.register import RegisterConfig, _gate_inputs
from components.targets.runtime import TargetConfig, TargetRuntime
from eagle.config_checks import FieldError
from infra.settings import Settings
from infra.vllm_scale import EngineScale

ROOT = Path(__file__).resolve().parent.parent
VLLM = {"target": {"runtime": "vllm"}}


def _asks(rt: TargetRuntime) -> tuple:
    return (rt.regenerates_in_engine, rt.extracts_in_engine, rt.evaluates_in_engine, rt.gate_on_engine, rt.loads_target)


def test_each_config_variant_gives_what_each_stage_asks():
    tiny = PipelineConfig.tiny().runtime
    assert _asks(tiny) == (False, False, False, False, True) and tiny.tag() == "" and tiny.gate_tau == "local"
    default = PipelineConfig.default().runtime  # regeneration, extraction and evaluation vLLM's, its target loaded here
    assert _asks(default) == (True, True, True, True, True) and default.tag() == ""
    vllm = PipelineConfig.tiny().override(VLLM).runtime
    assert _asks(vllm) == (True, True, True, True, False) and vllm.tag() == "vllm" and vllm.gate_tau == "engine"
    assert [vllm.engine_of(s) for s in ("regenerate", "extract", "evaluate")] == ["vllm"] * 3
    one = PipelineConfig.tiny().override({"extract": {"engine": "vllm"}}).runtime  # the demo's fine-tune
    assert _asks(one) == (False, True, False, False, True) and one.engine_of("regenerate") == "local"
    with pytest.raises(ValueError, match="'train' runs no target"):
        one.engine_of("train")


def test_the_runtime_is_built_once_per_config():
    cfg = PipelineConfig.tiny().override(VLLM)
    assert cfg.runtime is cfg.runtime and cfg.runtime == TargetRuntime.from_config(cfg)


def test_the_sections_keep_their_values_and_the_resolved_config_states_the_runtimes():
    cfg = PipelineConfig.tiny().override(VLLM)
    assert (cfg.regenerate.engine, cfg.extract.engine, cfg.evaluate.engine, cfg.register.gate_tau) == (
        "local",
        "local",
        "local",
        "local",
    )  # as written: nothing rewritten behind the reader's back
    shown = cfg.to_dict()
    assert (
        shown["regenerate"]["engine"],
        shown["extract"]["engine"],
        shown["evaluate"]["engine"],
        shown["register"]["gate_tau"],
    ) == ("vllm", "vllm", "vllm", "engine")
    assert cfg.extract == PipelineConfig.tiny().extract  # to_dict made a new dict, the section is untouched
    spelled = PipelineConfig.tiny().override(
        {
            **VLLM,
            "regenerate": {"engine": "vllm"},
            "extract": {"engine": "vllm"},
            "evaluate": {"engine": "vllm"},
            "register": {"gate_tau": "engine"},
        }
    )
    assert spelled.fingerprint() == cfg.fingerprint() and spelled.to_dict() == shown
    assert cfg.fingerprint() != PipelineConfig.tiny().fingerprint()
    back = PipelineConfig.tiny().override(json.loads(json.dumps(shown)))  # `config show`'s JSON as a config file
    assert back.runtime == cfg.runtime and back.fingerprint() == cfg.fingerprint()


def test_the_scale_reaches_the_settings_each_engine_reads(tmp_path):
    cfg = PipelineConfig.tiny().override({"target": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}})
    settings = cfg.runtime.engine_settings(Settings.local(tmp_path / ".eagle"))
    assert settings.engine_scale == EngineScale(2, 1, 1, "mp") and cfg.runtime.scale == settings.engine_scale
    assert cfg.fingerprint() == PipelineConfig.tiny().fingerprint()  # how vLLM spreads the target: the same head


def test_a_stage_alone_builds_it_from_its_section_and_refusals_name_the_key():
    assert TargetRuntime.from_sections(extract=ExtractConfig(engine="vllm")).extracts_in_engine
    assert not TargetRuntime.from_sections(extract=ExtractConfig()).extracts_in_engine
    assert TargetRuntime.from_sections(register=RegisterConfig(gate_tau="engine")).gate_on_engine
    assert TargetRuntime.from_sections(
        TargetConfig(runtime="vllm"), regenerate=RegenerateConfig()
    ).regenerates_in_engine
    for sections, words in (
        ({"extract": ExtractConfig(engine="vllm", mode="online")}, "extract.engine 'vllm' needs"),
        ({"extract": ExtractConfig(engine_replicas=2)}, "extract.engine_replicas 2 needs engine"),
        ({"regenerate": RegenerateConfig(engine="vllm", num_workers=2)}, "regenerate.num_workers must be 0"),
    ):
        with pytest.raises(FieldError, match=words):
            TargetRuntime.from_sections(**sections)
    with pytest.raises(FieldError, match="target.runtime 'vllm' runs the extract stage in the engine: extract.engine"):
        TargetRuntime.from_sections(TargetConfig(runtime="vllm"), extract=ExtractConfig(mode="online"))
    # a regeneration answered by a server named by URL runs beside Ray actors, whoever runs the target
    url = RegenerateConfig(endpoint_url="http://127.0.0.1:8000", num_workers=2)
    assert TargetRuntime.from_sections(TargetConfig(runtime="vllm"), regenerate=url).regenerates_in_engine


def test_regeneration_asks_the_runtime_not_its_engine_string():
    cfg = RegenerateConfig(engine="vllm")
    with engine_endpoint(cfg, "no-target", runtime=TargetRuntime()) as run_cfg:  # a local runtime starts no engine
        assert run_cfg is cfg
    url = RegenerateConfig(endpoint_url="http://127.0.0.1:9")
    with engine_endpoint(url, "no-target", runtime=PipelineConfig.tiny().override(VLLM).runtime) as run_cfg:
        assert run_cfg is url  # a server given by URL answers: nothing started


def test_the_gate_asks_the_runtime_whose_tau_decides():
    head = SimpleNamespace(metrics={"tau": 3.0, "tau_vllm": 2.0}, champion_tau=2.5, champion_tau_engine=1.5)
    assert _gate_inputs(PipelineConfig.tiny().runtime, head) == (3.0, 2.5)
    assert _gate_inputs(PipelineConfig.tiny().override(VLLM).runtime, head) == (2.0, 1.5)
    with pytest.raises(ValueError, match="not measured in vLLM"):
        _gate_inputs(PipelineConfig.tiny().override(VLLM).runtime, SimpleNamespace(metrics={"tau": 3.0}))


KNOBS = {"engine", "runtime", "gate_tau"}
NAMES = {"vllm", "local", "engine"}
# files that still compare a knob with a name, and why (empty is the goal)
COMPARE_ALLOWLIST = {
    "components/targets/runtime.py": "the one place that reads the knobs",
}


def _knob_comparisons(path: Path) -> list[int]:
    """Lines of `x.engine == "vllm"`-like comparisons (a knob attribute against a runtime or engine name)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            knob = any(isinstance(s, ast.Attribute) and s.attr in KNOBS for s in sides)
            name = any(isinstance(s, ast.Constant) and s.value in NAMES for s in sides)
            if knob and name:
                out.append(node.lineno)
    return out


def test_no_stage_compares_engine_names_outside_the_runtime():
    found = {}
    for package in ("components", "flows", "infra"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in COMPARE_ALLOWLIST and (lines := _knob_comparisons(path)):
                found[rel] = lines
    assert not found, f"ask components/targets/runtime.py's TargetRuntime instead: {found}"
