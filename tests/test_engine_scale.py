"""The `target` section: who runs the target (`runtime`) and vLLM's scale settings, on every engine command line.

Purpose: no engine is started (a second or two):
- `target.runtime: vllm` is one setting: it puts regeneration, extraction and evaluation on the engine and the gate
  on vLLM's τ; combinations the engine cannot run (online features, Ray actors) are refused naming both keys;
- `tensor_parallel_size`, `pipeline_parallel_size`, `data_parallel_size`, `distributed_executor_backend` are checked
  at load, stay out of the run's fingerprint, and reach the command line of every vLLM a run starts: an
  `EngineSpec` given a scale, and any spec handed to `VllmServer` with the run's scale in `Settings.engine_scale`
  (regeneration's, extraction's and the evaluation's specs alike);
- an architecture vLLM does not run is one clear line, without vLLM's list of every architecture it has.
Run: `python -m pytest tests/test_engine_scale.py`.
Not here: the pipeline run by vLLM (tests/test_runtime_vllm.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from components.config.pipeline import ConfigError, PipelineConfig
from infra.settings import Settings
from infra.vllm_scale import EngineScale
from infra.vllm_engine_spec import EngineSpec
from infra.vllm_server import VllmServer

SCALE = {
    "tensor_parallel_size": 4,
    "pipeline_parallel_size": 2,
    "data_parallel_size": 3,
    "distributed_executor_backend": "ray",
}
FLAGS = [
    "--tensor-parallel-size",
    "4",
    "--pipeline-parallel-size",
    "2",
    "--data-parallel-size",
    "3",
    "--distributed-executor-backend",
    "ray",
]


def _flags(args: list[str]) -> list[str]:
    keep = {f for f in FLAGS if f.startswith("--")}
    return [a for i, a in enumerate(args) if a in keep or (i and args[i - 1] in keep)]


def test_runtime_vllm_is_one_setting_for_every_stage():
    cfg = PipelineConfig.tiny().override({"target": {"runtime": "vllm"}})
    rt = cfg.runtime  # the stages ask it; the sections keep what was written
    assert (rt.regenerates_in_engine, rt.extracts_in_engine, rt.evaluates_in_engine, rt.gate_on_engine) == (True,) * 4
    shown = cfg.to_dict()  # what `config show` prints: the knobs as the runtime decides them
    assert (
        shown["regenerate"]["engine"],
        shown["extract"]["engine"],
        shown["evaluate"]["engine"],
        shown["register"]["gate_tau"],
    ) == ("vllm", "vllm", "vllm", "engine")
    assert cfg.fingerprint() != PipelineConfig.tiny().fingerprint()
    local = PipelineConfig.tiny()
    assert (local.target.runtime, local.regenerate.engine, local.extract.engine) == ("local", "local", "local")
    for bad, words in (
        ({"extract": {"mode": "online"}}, "target.runtime 'vllm' runs the extract stage"),
        ({"extract": {"num_workers": 2}}, "extract.num_workers must be 0"),
        ({"regenerate": {"num_workers": 2}}, "regenerate.num_workers must be 0"),
    ):
        with pytest.raises(ConfigError, match=words) as e:
            PipelineConfig.tiny().override({"target": {"runtime": "vllm"}, **bad}, where="cfg.json")
        assert "\n" not in str(e.value) and str(e.value).startswith("cfg.json: ")


def test_scale_settings_are_checked_and_not_part_of_a_runs_identity():
    cfg = PipelineConfig.tiny().override({"target": SCALE})
    assert cfg.target.engine_scale() == EngineScale(4, 2, 3, "ray") and cfg.target.engine_scale().args() == FLAGS
    assert cfg.fingerprint() == PipelineConfig.tiny().fingerprint()  # how vLLM spreads the target: same head
    assert EngineScale().args() == []  # one device: vLLM's defaults, nothing added
    for bad, words in (
        ({"tensor_parallel_size": 0}, "target.tensor_parallel_size must be an integer >= 1"),
        ({"data_parallel_size": 1.5}, "target.data_parallel_size: 1.5 is not of type int"),
        ({"distributed_executor_backend": "slurm"}, "target.distributed_executor_backend must be one"),
        ({"runtime": "gpu"}, "target.runtime must be one of 'local', 'vllm'"),
    ):
        with pytest.raises(ConfigError, match=words):
            PipelineConfig.tiny().override({"target": bad}, where="cfg.json")


def test_every_engine_a_run_starts_carries_the_scale(tmp_path):
    from components.evaluate.engine import eval_spec
    from components.evaluate.stage import EvaluateConfig
    from infra.vllm_extract import hidden_states_spec

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"max_position_embeddings": 512}')
    scale = EngineScale(4, 2, 3, "ray")
    assert _flags(EngineSpec(str(target), method=None, scale=scale).server_args(8000)) == FLAGS
    assert _flags(EngineSpec(str(target), method=None).server_args(8000)) == []
    settings = dataclasses.replace(Settings.local(tmp_path / ".eagle"), engine_scale=scale)
    specs = {
        "regenerate": EngineSpec(str(target), method=None),
        "extract": hidden_states_spec(str(target), [2, 4, 5, 8], tmp_path / "hs", 193, "float32"),
        "evaluate": eval_spec(EvaluateConfig.tiny(), str(target), str(tmp_path / "head")),
        "evaluate-plain": eval_spec(EvaluateConfig.tiny(), str(target)),
    }
    for stage, spec in specs.items():
        server = VllmServer(spec, settings)  # not started: the command it would run
        args = server.spec.server_args(server.port)
        assert _flags(args) == FLAGS, stage
        assert args.count("--tensor-parallel-size") == 1, stage
    own = EngineScale(tensor_parallel_size=2)  # a spec that states its own scale keeps it
    assert _flags(VllmServer(EngineSpec(str(target), method=None, scale=own), settings).spec.server_args(1)) == [
        "--tensor-parallel-size",
        "2",
    ]
    assert "--tensor-parallel-size 4" in EngineSpec(str(target), method=None, scale=scale).launch_command()


def test_an_architecture_vllm_does_not_run_is_one_clear_line(tmp_path):
    settings = Settings.local(tmp_path / ".eagle")
    server = VllmServer(EngineSpec(str(tmp_path), method=None), settings, log_dir=tmp_path)
    archs = ", ".join(f"'Arch{i}ForCausalLM'" for i in range(300))
    server.log_path.write_text(
        "INFO starting\nTraceback (most recent call last):\n"
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        f"  Value error, Model architectures ['NopeForCausalLM'] are not supported for now. Supported "
        f"architectures: dict_keys([{archs}]) [type=value_error]\n"
    )
    line = server.last_error()
    assert "\n" not in line and len(line) < 600
    assert "['NopeForCausalLM'] are not supported" in line and "target.runtime 'local'" in line
    assert "Arch1ForCausalLM" not in line


def test_a_relative_target_or_head_directory_reaches_the_engine_absolute(tmp_path, monkeypatch):
    """vLLM runs in its log's directory, where `target` or `heads/h` would be read as a hub id: a directory that
    exists here goes to the engine as its absolute path; a hub id goes as given."""
    (tmp_path / "target").mkdir()
    (tmp_path / "heads" / "h").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    args = EngineSpec("target", head_dir="heads/h").server_args(8000)
    assert args[args.index("--model") + 1] == str(tmp_path / "target")
    assert f'"model": "{tmp_path / "heads" / "h"}"' in args[args.index("--speculative-config") + 1]
    assert EngineSpec("org/model", method=None).server_args(8000)[1] == "org/model"
