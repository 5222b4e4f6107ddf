"""Where the target runs: this process, or the serving engine (vLLM) with its scale. One object, built once per config.

Purpose: `TargetRuntime.from_config(cfg)` (cfg a components.config.pipeline.PipelineConfig, whose `cfg.runtime` is
this object built once) decides where each stage that runs the target runs it. `target.runtime` "vllm" puts
regeneration, extraction and evaluation in the engine and the promotion gate on the engine's τ; "local" leaves each
stage to its own knob (`regenerate.engine`, `extract.engine`, `evaluate.engine`, `register.gate_tau`), which a config
may still set one by one. The stage sections keep the values the user wrote; nothing rewrites them. The stages ask
the object (`regenerates_in_engine`, `extracts_in_engine`, `evaluates_in_engine`, `loads_target`, `gate_on_engine`)
and never compare engine names; a stage called on its own (tests, benchmarks, `eagle-heads evaluate`) builds it from
its section with `TargetRuntime.from_sections(extract=cfg)`. `engine_settings(settings)` puts the engine's scale
(`target`'s tensor/pipeline/data parallel sizes) in the Settings every vLLM of the run is started with; `resolved()`
is what the resolved config states for the four knobs (`eagle-heads config show`, the run's fingerprint: the same
JSON and run keys as when `target.runtime: vllm` wrote them into the sections). A combination the engine cannot run
(online features, Ray actors beside an engine) is refused here, naming the key, when the runtime is built.
Also here: `TargetConfig`, the config's `target` section (who runs the target, and vLLM's scale), and `StageContext`,
what a stage that runs the target (regenerate, extract) runs in beside its config and paths.
Adding a runtime (SGLang, a remote endpoint): a row of `KINDS` and its tests; ARCHITECTURE.md shows the steps.
Run: `python -m pytest tests/test_target_runtime.py`.
Not here: starting an engine (infra/vllm_server.py), what a stage sends it (components/*_engine.py), the scale's
flags (infra/vllm_scale.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from eagle.config_checks import NOT_IDENTITY, FieldError, at_least, one_of

ENGINE = "vllm"  # the serving engine a stage's own knob names (`extract.engine: vllm`)
STAGE_ENGINES = ("local", ENGINE)  # the values of a stage's `engine` knob
GATE_TAUS = ("local", "engine")  # the values of `register.gate_tau`: whose τ the promotion gate decides on
TARGET_STAGES = ("regenerate", "extract", "evaluate")  # the stages that run the target


@dataclass(frozen=True)
class RuntimeKind:
    """What a value of `target.runtime` means: the engine it runs the target in (None: none of its own), the stages
    it puts there (the others keep their own knob), whether the promotion gate then decides on the engine's τ, and
    whether this process loads the target to measure the head itself (this project's own evaluation)."""

    engine: str | None = None
    stages: tuple[str, ...] = ()  # of TARGET_STAGES
    gate_on_engine: bool = False
    loads_target: bool = True


KINDS = {
    "local": RuntimeKind(),
    "vllm": RuntimeKind(engine=ENGINE, stages=TARGET_STAGES, gate_on_engine=True, loads_target=False),
}
RUNTIMES = tuple(KINDS)


@dataclass(frozen=True)
class TargetConfig:
    """Who runs the target. `runtime` "local": this process (or Ray actors) loads it with transformers; "vllm": the
    serving engine runs it in every stage (regenerate, extract, evaluate; the gate decides on vLLM's τ) and this
    process reads only the embedding, final norm and lm_head by tensor name. The scale fields are vLLM's own
    (infra/vllm_scale.py `EngineScale`) and reach every vLLM the run starts."""

    runtime: str = "local"
    # how the engine spreads the target does not change the head: none of the four is part of a run's identity
    tensor_parallel_size: int = field(default=1, metadata=NOT_IDENTITY)
    pipeline_parallel_size: int = field(default=1, metadata=NOT_IDENTITY)
    data_parallel_size: int = field(default=1, metadata=NOT_IDENTITY)
    distributed_executor_backend: str | None = field(default=None, metadata=NOT_IDENTITY)  # mp, ray, uni, ...

    def __post_init__(self) -> None:
        from infra.vllm_scale import EXECUTOR_BACKENDS

        one_of(self, "runtime", RUNTIMES)
        at_least(self, {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1})
        one_of(self, "distributed_executor_backend", EXECUTOR_BACKENDS)

    def engine_scale(self):
        """The scale as infra.vllm_scale.EngineScale."""
        from infra.vllm_scale import EngineScale

        return EngineScale(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.data_parallel_size,
            self.distributed_executor_backend,
        )


@dataclass(frozen=True)
class TargetRuntime:
    """Where the target runs in each stage of one run. Build it with `from_config` or `from_sections`."""

    name: str = "local"  # the `target.runtime` it was built from
    scale: Any = None  # infra.vllm_scale.EngineScale: how every engine of the run spreads the target (None: one device)
    engine_stages: frozenset[str] = frozenset()  # of TARGET_STAGES: those whose target runs in the engine
    gate_on_engine: bool = False  # the promotion gate decides on the engine's τ
    loads_target: bool = True  # this process loads the target (this project's own evaluation runs)

    @classmethod
    def from_config(cls, cfg: Any) -> "TargetRuntime":
        """The runtime of a whole PipelineConfig (its `target` section and the stages' own knobs)."""
        return cls.from_sections(
            cfg.target, regenerate=cfg.regenerate, extract=cfg.extract, evaluate=cfg.evaluate, register=cfg.register
        )

    @classmethod
    def from_sections(
        cls,
        target: TargetConfig | None = None,
        *,
        regenerate: Any = None,
        extract: Any = None,
        evaluate: Any = None,
        register: Any = None,
    ) -> "TargetRuntime":
        """The runtime from the sections given (None: that section's knob is not asked; `target` None: "local", one
        device). FieldError naming the key (`extract.num_workers`, or `target.runtime` when it put the stage in the
        engine) when a section asks what its runtime cannot run."""
        target = target or TargetConfig()
        kind = KINDS[target.runtime]
        sections = {"regenerate": regenerate, "extract": extract, "evaluate": evaluate}
        own = {s for s, sec in sections.items() if sec is not None and sec.engine == ENGINE}  # the stage's own knob
        stages = frozenset(kind.stages) | own
        for stage, sec in sections.items():
            problem = sec.engine_conflict(stage in stages) if sec is not None else None
            if problem is None:
                continue
            key, reason = problem
            if stage in kind.stages and stage not in own:  # the runtime put it there, not the section
                raise FieldError(
                    "TargetRuntime",
                    "target.runtime",
                    f"{target.runtime!r} runs the {stage} stage in the engine: {stage}.{key} {reason}",
                )
            raise FieldError("TargetRuntime", f"{stage}.{key}", reason)
        gate = kind.gate_on_engine or (register is not None and register.gate_tau == "engine")
        return cls(target.runtime, target.engine_scale(), stages, gate, kind.loads_target)

    @property
    def regenerates_in_engine(self) -> bool:
        """Regeneration asks an engine started for the run (unless the section names a server by URL)."""
        return "regenerate" in self.engine_stages

    @property
    def extracts_in_engine(self) -> bool:
        """The hidden states come from an engine started for the run (`extract_hidden_states`)."""
        return "extract" in self.engine_stages

    @property
    def evaluates_in_engine(self) -> bool:
        """The head is also served by the engine and measured there (and the load sweep can run)."""
        return "evaluate" in self.engine_stages

    @property
    def gate_tau(self) -> str:
        """Whose τ the promotion gate decides on, as the registry tags it: "engine" or "local"."""
        return "engine" if self.gate_on_engine else "local"

    def engine_of(self, stage: str) -> str:
        """Who runs `stage`'s target, as recorded (the extraction manifest's `engine`, the `extract_engine` tag, the
        resolved config): the engine's name, or "local"."""
        if stage not in TARGET_STAGES:
            raise ValueError(f"{stage!r} runs no target; stages that do: {', '.join(TARGET_STAGES)}")
        return ENGINE if stage in self.engine_stages else "local"

    def tag(self) -> str:
        """The `target_runtime` tag of a registered head: the runtime's name, empty for "local" (no tag)."""
        return self.name if KINDS[self.name].engine else ""

    def resolved(self) -> dict[str, dict[str, str]]:
        """The four knobs as this runtime decides them, by section and key: what the resolved config states."""
        return {**{s: {"engine": self.engine_of(s)} for s in TARGET_STAGES}, "register": {"gate_tau": self.gate_tau}}

    def engine_settings(self, settings: Any) -> Any:
        """`settings` (infra.settings.Settings) carrying this runtime's scale to every vLLM the run starts
        (infra/vllm_server.py `VllmServer` reads `Settings.engine_scale`)."""
        return dataclasses.replace(settings, engine_scale=self.scale)


@dataclass(frozen=True)
class StageContext:
    """What a stage that runs the target (components/regenerate/stage.py `regenerate`, components/extract/stage.py
    `extract`) runs in, beside its config and paths: whether the target's own code may run (`trust_remote_code`),
    the Settings that say where Ray runs and where vLLM's venv is (`settings`; None: from the environment, where the
    stage needs them), and where the target runs (`runtime`; None: the one the stage's section alone says,
    `TargetRuntime.from_sections`). The flow builds one per stage from its Settings and the run's runtime
    (flows/tasks.py); a stage called on its own (tests, benchmarks) names what it needs, or takes the default."""

    trust_remote_code: bool = False
    settings: Any = None  # infra.settings.Settings
    runtime: TargetRuntime | None = None


def with_resolved(values: dict[str, Any], runtime: TargetRuntime) -> dict[str, Any]:
    """A config's sections as a dict (`dataclasses.asdict`, or the fingerprint's identity fields) with the knobs the
    runtime decides stated as it decides them: a new dict, the sections' own values untouched."""
    out = dict(values)
    for section, knobs in runtime.resolved().items():
        if section in out:
            out[section] = {**out[section], **knobs}
    return out
