"""One config for a whole pipeline run: a section per stage, presets, strict loading from JSON.

Purpose: `PipelineConfig` groups who runs the target (`target`: this process or vLLM, and vLLM's scale; its
`runtime`, components/targets/runtime.py, is where each stage runs the target, built once per config), the stage
configs (`regenerate`, `extract`, `train`, `evaluate`, `register`), the acceptance monitor's (`monitor`) and how a
retrain on served traffic uses it (`capture`: components/data/captured_traffic.py);
`PipelineConfig.preset(name)` builds a named preset from its sections (all of them live in components/config/presets.py,
which builds sections only and never imports this module); `PipelineConfig.load(path)` reads a JSON file (a regular
UTF-8 file, a byte-order mark allowed, of sane size and depth: components/data/safe_read.py) whose sections override a
preset key by key, and refuses an unknown section or key, naming it; `resolve(name, path,
assignments)` is the config a command runs with (then the `--set key.path=value` assignments, checked the same way);
`monitor_config(preset, path, **flags)` adds the monitor's command-line values on top, checked the same way.
`fingerprint()` is a stable hash of the config but its `monitor` section (part of a run's identity).
Not here: where things run (infra/ settings) or what to run (flows/).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence, Union

from components.config import presets
from components.data.captured_traffic import CapturedTrafficConfig
from components.data.safe_read import UnreadableFile, read_json
from components.evaluate.stage import EvaluateConfig
from components.extract.stage import ExtractConfig
from components.regenerate.stage import RegenerateConfig
from components.registry.register import RegisterConfig
from components.serving.monitor import MonitorConfig
from components.targets.runtime import TargetConfig, TargetRuntime, with_resolved
from components.train.stage import TrainConfig
from eagle.config import PARALLEL_VARIANTS
from eagle.config_checks import FieldError
from eagle.errors import BadInput


class ConfigError(BadInput):
    """A config file or override that names an unknown section or key, or has a value of the wrong type."""


@dataclass(frozen=True)
class PipelineConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    register: RegisterConfig = field(default_factory=RegisterConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    capture: CapturedTrafficConfig = field(default_factory=CapturedTrafficConfig)

    def __post_init__(self) -> None:
        _ = self.runtime  # built now: a stage its runtime cannot run is refused at load, naming the key

    @functools.cached_property
    def runtime(self) -> TargetRuntime:
        """Where the target runs in each stage (components/targets/runtime.py), built once per config: the stages
        ask it; the sections keep the values as written."""
        return TargetRuntime.from_config(self)

    def check(self, where: str = "config") -> "PipelineConfig":
        """Rules across sections (each section checks its own values when built); returns self."""
        rt = self.runtime
        if rt.gate_on_engine and not rt.evaluates_in_engine:
            raise ConfigError(
                f"{where}: register.gate_tau 'engine' needs evaluate.engine 'vllm' (the gate's τ is "
                "vLLM's); set register.gate_tau to 'local' to gate on this project's τ"
            )
        c, load = self.register.gate_concurrency, self.evaluate.load
        if c and (not rt.evaluates_in_engine or c not in load.concurrency):  # else registration fails, at the end
            raise ConfigError(
                f"{where}: register.gate_concurrency {c} needs the load sweep to measure concurrency {c} "
                f"(evaluate.engine 'vllm', {c} in evaluate.load.concurrency; now engine "
                f"{rt.engine_of('evaluate')!r}, concurrency {list(load.concurrency)}); 0 turns this gate "
                "off"
            )
        par = [v for v in PARALLEL_VARIANTS if v in (self.train.variant, *self.train.variants)]
        if par and self.evaluate.spec.method != "chain":  # else refused when evaluation starts
            raise ConfigError(
                f"{where}: train.variant {par[0]!r} drafts chains (vLLM's parallel drafting), not a "
                f"{self.evaluate.spec.method}: set evaluate.spec.method to 'chain'"
            )
        return self

    @classmethod
    def tiny(cls) -> "PipelineConfig":
        """The `tiny` preset (components/config/presets.py)."""
        return cls.preset("tiny")

    @classmethod
    def default(cls) -> "PipelineConfig":
        """The `default` preset (components/config/presets.py): the demo on 2 CPU cores, on the embedded default."""
        return cls.preset("default")

    @classmethod
    def preset(cls, name: str) -> "PipelineConfig":
        """The named preset (components/config/presets.py returns its sections); `ConfigError` naming the known ones."""
        if name not in presets.PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(presets.PRESETS)}")
        return cls(**presets.PRESETS[name]())

    def override(self, data: dict[str, Any], where: str = "config") -> "PipelineConfig":
        """This config with `data`'s values (sections, keys and nested sections such as `train.ttt`) put in,
        each checked against its field's type and range; errors name the key's whole path."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: the config must be a mapping of sections")
        sections = {f.name for f in dataclasses.fields(self)}
        unknown = [k for k in data if k not in sections]
        if unknown:
            raise ConfigError(f"{where}: unknown section {unknown[0]!r}; known: {sorted(sections)}")
        return override_values(self, data, where).check(where)

    @classmethod
    def load(cls, path: str | Path | None, preset: str = "default") -> "PipelineConfig":
        base = cls.preset(preset)
        if path is None:
            return base
        try:  # a regular UTF-8 file (a byte-order mark allowed), of sane size and depth: components/data/safe_read.py
            data = read_json(path)
        except UnreadableFile as e:
            raise ConfigError(f"{path}: cannot read the config: {e.reason}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the config must be a JSON object of sections")
        return base.override(data, where=str(path))

    def to_dict(self) -> dict[str, Any]:
        """Every section's values, with the four knobs the runtime decides stated as it decides them
        (`target.runtime: vllm` shows `regenerate.engine: vllm`, ...): what `config show` prints and a flow's config
        file holds, which loads back to the same runtime and fingerprint."""
        return with_resolved(dataclasses.asdict(self), self.runtime)

    def fingerprint(self) -> str:
        """The hash of what makes a head: every section but `monitor` (watching a head does not change it), less
        the fields marked `metadata={"identity": False}` (how fast a stage runs, e.g. regenerate.num_workers); the
        knobs the runtime decides count as it decides them (`target.runtime: vllm` and each stage's `engine: vllm`
        written out make the same head)."""
        made = {k: v for k, v in with_resolved(_identity(self), self.runtime).items() if k != "monitor"}
        return hashlib.sha256(json.dumps(made, sort_keys=True).encode()).hexdigest()

    def regenerate_fingerprint(self) -> str:
        """The hash of what decides the regenerated answers (components/regenerate/reuse.py: runs of one target
        version share them): the `target` and `regenerate` sections as `fingerprint` counts them, less
        `regenerate.limit` (how many conversations, not their answers; each shard's ids are checked)."""
        made = with_resolved(_identity(self), self.runtime)
        part = {"target": made["target"], "regenerate": {k: v for k, v in made["regenerate"].items() if k != "limit"}}
        return hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()


def resolve(name: str, config_path: str | None = None, assignments: Sequence[tuple[str, Any]] = ()) -> PipelineConfig:
    """Preset `name`, then the JSON file's sections, then the `--set` assignments (errors say `--set` and the key)."""
    cfg = PipelineConfig.load(config_path, name)
    return cfg.override(presets.assignments_tree(assignments), where="--set") if assignments else cfg


def monitor_config(preset: str, config_path: str | None, **overrides: Any) -> PipelineConfig:
    """The pipeline config with the `monitor` values given (None: keep the config's), checked like a file's: a flag
    and its config key share one definition of their bounds (`MonitorConfig`)."""
    values = {k: v for k, v in overrides.items() if v is not None}
    return PipelineConfig.load(config_path, preset).override({"monitor": values}, where="command line")


def _identity(cfg: Any) -> Any:
    if not dataclasses.is_dataclass(cfg):
        return list(cfg) if isinstance(cfg, tuple) else cfg
    return {
        f.name: _identity(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.metadata.get("identity", True)
    }


def override_values(cfg: Any, values: Any, where: str, path: str = "") -> Any:
    """The frozen dataclass `cfg` with `values` (a mapping; a nested dataclass field takes a nested mapping) put
    in. An unknown key, a value of the wrong type or out of range raises ConfigError naming `path.key`."""
    if not isinstance(values, dict):
        what = path if "." in path else f"section {path!r}" if path else "the config"
        raise ConfigError(f"{where}: {what} must be a mapping, got {values!r}")
    fields = {f.name for f in dataclasses.fields(cfg)}
    hints = typing.get_type_hints(type(cfg))
    changes = {}
    for k, v in values.items():
        key = f"{path}.{k}" if path else k
        if k not in fields:
            raise ConfigError(f"{where}: unknown key {key}; known: {sorted(fields)}{_moved_hint(cfg, k, path)}")
        current = getattr(cfg, k)
        changes[k] = (
            override_values(current, v, where, key)
            if dataclasses.is_dataclass(current)
            else _typed(v, hints[k], f"{where}: {key}")
        )
    try:
        return dataclasses.replace(cfg, **changes)
    except FieldError as e:
        raise ConfigError(f"{where}: {f'{path}.' if path else ''}{e.field} {e.reason}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {path or 'config'}: {e}") from None


def _moved_hint(cfg: Any, key: str, path: str) -> str:
    """'; did you mean train.optim.lr?' when `key` is a field of one of `cfg`'s nested sections."""
    for f in dataclasses.fields(cfg):
        sub = getattr(cfg, f.name)
        if dataclasses.is_dataclass(sub) and key in {g.name for g in dataclasses.fields(sub)}:
            return f"; did you mean {f'{path}.' if path else ''}{f.name}.{key}?"
    return ""


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if origin is Literal:
        return value in typing.get_args(hint)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (tuple, list):
        return isinstance(value, (tuple, list)) and all(_fits(v, h) for v, h in zip(value, _item_hints(hint, value)))
    return hint is Any or not isinstance(hint, type) or isinstance(value, hint)


def _item_hints(hint: Any, value: Any) -> list[Any]:
    """The annotation of each item of a `tuple[X, ...]`, `tuple[X, Y]` or `list[X]` value (Any when unstated)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and args and args[-1] is not Ellipsis:
        return list(args) if len(args) == len(value) else [None] * len(value)  # None fits nothing: wrong length
    return [args[0] if args else Any] * len(value)


def _typed(value: Any, hint: Any, what: str) -> Any:
    """`value` checked against the field's annotation (JSON ints become floats, arrays tuples, where declared)."""
    if not _fits(value, hint):
        if typing.get_origin(hint) is Literal:
            raise ConfigError(f"{what} must be one of {list(typing.get_args(hint))}, got {value!r}")
        raise ConfigError(f"{what}: {value!r} is not of type {hint.__name__ if isinstance(hint, type) else hint}")
    if hint is float or (
        typing.get_origin(hint) in (Union, types.UnionType)
        and float in typing.get_args(hint)
        and isinstance(value, int)
    ):
        return float(value)
    if isinstance(value, list) and (
        typing.get_origin(hint) is tuple
        or any(typing.get_origin(h) is tuple and _fits(value, h) for h in typing.get_args(hint))
    ):
        return tuple(value)  # a JSON array for a tuple field (also inside `int | tuple[int, ...] | None`)
    return value
