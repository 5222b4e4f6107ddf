"""`evaluate.compiled`: vLLM on the CPU compiled (its own default) or eager, the same in what is measured and served.

Purpose: no engine is started (a second):
- an `EngineSpec` on the CPU passes `--enforce-eager` unless it is compiled; one that says nothing is what the run
  says (`Settings.engine_compiled`, put there by the evaluation), one that says is kept; every CPU engine starts with
  vLLM's ahead-of-time artefacts off (they do not load back in vLLM 0.32 with torch 2.13: inductor's cache instead);
- the evaluation hands every stage it runs (the pick, ours, vLLM's, the sweep) settings that say `evaluate.compiled`,
  and records it; the registry keeps it as tag `compiled`, and `serve` runs a head the way it was measured;
- the setting is checked at config load, and is off in the presets (a cold compiled demo overran its budget);
- compiled CPU engines start one at a time (`start_groups`: in `running`, the engine pool's `running` and `launch`),
  eager ones at once.
Run: `python -m pytest tests/test_engine_compiled.py`.
Not here: a compiled engine serving a head with output identical to ours (tests/test_vllm.py `flow_run`).
"""

from __future__ import annotations

import dataclasses

import pytest

from components.config.pipeline import ConfigError, PipelineConfig
from infra.settings import Settings
from infra.vllm_engine_spec import EngineSpec
from infra.vllm_server import VllmServer


def test_a_compiled_cpu_engine_is_not_eager_and_an_unsaid_one_follows_the_run(tmp_path):
    spec = EngineSpec(str(tmp_path), method=None, device="cpu")
    assert "--enforce-eager" in spec.server_args(8000)
    assert "--enforce-eager" not in dataclasses.replace(spec, compiled=True).server_args(8000)
    assert "--enforce-eager" not in dataclasses.replace(spec, device="cuda").server_args(8000)  # a GPU: vLLM's own
    run = dataclasses.replace(Settings.local(tmp_path / ".eagle"), engine_compiled=True)
    assert VllmServer(spec, run).spec.compiled is True
    assert VllmServer(spec, Settings.local(tmp_path / ".eagle")).spec.compiled is False
    assert VllmServer(dataclasses.replace(spec, compiled=False), run).spec.compiled is False  # its own is kept


def test_every_cpu_engine_starts_without_vllms_ahead_of_time_artefacts(tmp_path, monkeypatch):
    import infra.vllm_server as vs

    seen: dict[str, str] = {}

    def launch(python, argv, env, cwd, log_path):
        seen.update(env)
        raise RuntimeError("not started")

    monkeypatch.setattr(vs.vllm_zygote, "launch", launch)
    monkeypatch.setattr(vs, "vllm_python", lambda settings: tmp_path / "python")
    server = VllmServer(EngineSpec(str(tmp_path), method=None, device="cpu"), Settings.local(tmp_path / ".eagle"))
    with pytest.raises(RuntimeError, match="not started"):
        server.launch()
    assert seen["VLLM_USE_AOT_COMPILE"] == "0"


def test_the_setting_is_checked_and_off_in_the_presets():
    # off: a cold compiled demo took 34 min on 2 cores against the 30 budget (bench/README.md "Compiled, not eager")
    assert PipelineConfig.preset("default").evaluate.compiled is False
    assert PipelineConfig.preset("tiny").evaluate.compiled is False  # the tests' engines start in seconds
    with pytest.raises(ConfigError, match="evaluate.compiled: 'yes' is not of type bool"):
        PipelineConfig.preset("tiny").override({"evaluate": {"compiled": "yes"}}, where="test")


def test_the_registry_keeps_how_vllm_ran_and_serve_runs_it_so(monkeypatch):
    import flows.command_serve as cs
    from components.registry.register import _acceptance_tags

    assert _acceptance_tags({"engine_compiled": 1.0})["compiled"] == "true"
    assert _acceptance_tags({"engine_compiled": 0.0})["compiled"] == "false"
    assert "compiled" not in _acceptance_tags({})  # not measured in vLLM: nothing said
    monkeypatch.setattr(cs, "_registered_tags", lambda uri, settings: {"compiled": "true"})
    assert cs._registered_compiled("models:/h/1", None) is True
    monkeypatch.setattr(cs, "_registered_tags", lambda uri, settings: {})
    assert cs._registered_compiled("models:/h/1", None) is False  # a head measured before the tag: eager, as then


def test_compiled_cpu_engines_start_one_at_a_time_and_eager_ones_at_once(tmp_path):
    """While a compiled engine's worker compiles, its engine core busy-polls a core: four such starts at once on 2
    cores took ~320 s each. `running` and the engine pool start them in turn (each process a real `sleep`)."""
    import subprocess
    import threading
    import time

    from infra.engine_pool import EnginePool
    from infra.vllm_server import running, start_groups

    spans: dict[str, tuple[float, float]] = {}
    lock = threading.Lock()

    class Sleeper(VllmServer):
        def __init__(self, name: str, compiled: bool):
            spec = EngineSpec(str(tmp_path), method=None, device="cpu", compiled=compiled, served_model_name=name)
            super().__init__(spec, Settings.local(tmp_path / ".e"))

        def launch(self):
            self.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
            return self

        def start(self):
            t0 = time.monotonic()
            time.sleep(0.3)
            with lock:
                spans[self.spec.served_model_name] = (t0, time.monotonic())
            return self.launch()

        def wait_ready(self):
            return self

    servers = [Sleeper("c1", True), Sleeper("e1", False), Sleeper("c2", True), Sleeper("e2", False)]
    assert [[s.spec.served_model_name for s in g] for g in start_groups(servers)] == [["e1"], ["e2"], ["c1", "c2"]]
    with running(*servers):
        pass
    assert spans["c2"][0] >= spans["c1"][1], "the second compiled start waited for the first"
    assert spans["e2"][0] < spans["e1"][1] and spans["e1"][0] < spans["c1"][1], "the eager ones started at once"
    with EnginePool() as pool:
        first, second = Sleeper("c1", True), Sleeper("c2", True)
        pool.launch(first, second)  # the first compiled one launched early; the taker starts the second
        assert first.proc is not None and second.proc is None and pool.started == 1
