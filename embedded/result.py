"""The result of an embedded build: paths, hashes and measured metrics, and its `report.json` form.

Purpose: small frozen dataclasses returned by `build_embedded` and written as `report.json` in the build directory
(paths relative to that directory, so a build can be moved); `load_result(build_dir)` reads one back.
Not here: building or measuring anything.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedded.config import EmbeddedConfig
from embedded.lm_train import TrainStats

REPORT = "report.json"


@dataclass(frozen=True)
class TrafficFiles:
    """OpenAI-`messages` JSONL files of one domain; train and held-out share no source file."""

    train: Path
    heldout: Path
    train_sha256: str
    heldout_sha256: str
    train_conversations: int
    heldout_conversations: int


@dataclass(frozen=True)
class DomainInfo:
    name: str  # "stdlib", "stdlib-tests" (or "stdlib-docstrings" where a Python ships without tests)
    train_files: int
    heldout_files: int
    sha256: str  # over the paths and contents of every file used, with their split


@dataclass(frozen=True)
class Continuation:
    domain: str
    segment: str
    prompt: str  # the last user turn
    reference: str  # the real answer from the corpus
    target: str  # greedy, from the base target
    finetune: str  # greedy, from the fine-tune


@dataclass(frozen=True)
class Metrics:
    build_seconds: float
    tokenizer_seconds: float
    target_train: TrainStats
    finetune_train: TrainStats
    heldout_loss: float  # base target on held-out base-domain windows (raw chunks and chat samples, half each)
    heldout_perplexity: float
    # loss[model][domain][kind]: model "target"|"finetune", kind "raw"|"chat", on held-out files of the domain
    loss: dict[str, dict[str, dict[str, float]]]
    top1_agreement: dict[str, float]  # base vs fine-tune argmax agreement on held-out windows, per domain
    continuations: tuple[Continuation, ...]


@dataclass(frozen=True)
class EmbeddedResult:
    build_dir: Path
    build_hash: str
    cached: bool  # True when this call found the build on disk and skipped it
    tokenizer_dir: Path
    target_dir: Path
    finetune_dir: Path
    target_traffic: TrafficFiles  # base domain (stdlib modules)
    finetune_traffic: TrafficFiles  # fine-tune domain (stdlib tests)
    weights_sha256: dict[str, dict[str, str]]  # {"target"|"finetune": {file name: sha256}}
    domains: tuple[DomainInfo, DomainInfo]  # (base, fine-tune)
    metrics: Metrics
    config: EmbeddedConfig
    environment: dict[str, str]  # versions, device, torch threads, CPU count, load average when the build ended


def write_report(result: EmbeddedResult) -> Path:
    d = _to_json(result, result.build_dir)
    d.pop("build_dir")
    d.pop("cached")
    path = result.build_dir / REPORT
    path.write_text(json.dumps(d, indent=2, ensure_ascii=False) + "\n")
    return path


def load_result(build_dir: Path | str, cached: bool = True) -> EmbeddedResult:
    build_dir = Path(build_dir)
    d = json.loads((build_dir / REPORT).read_text())
    d["config"] = EmbeddedConfig.from_dict(d["config"])
    return _from_json(EmbeddedResult, {**d, "build_dir": build_dir, "cached": cached}, build_dir)


def _to_json(obj: Any, base: Path) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_json(getattr(obj, f.name), base) for f in dataclasses.fields(obj)}
    if isinstance(obj, Path):
        return obj.relative_to(base).as_posix() if obj.is_relative_to(base) else str(obj)
    if isinstance(obj, (list, tuple)):
        return [_to_json(v, base) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_json(v, base) for k, v in obj.items()}
    return obj


def _from_json(kind: Any, value: Any, base: Path) -> Any:
    if dataclasses.is_dataclass(kind) and isinstance(value, dict):
        hints = typing.get_type_hints(kind)
        return kind(**{f.name: _from_json(hints[f.name], value[f.name], base) for f in dataclasses.fields(kind)})
    if kind is Path:
        return value if isinstance(value, Path) else base / value
    origin = typing.get_origin(kind)
    if origin is tuple:
        args = typing.get_args(kind)
        items = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        return tuple(_from_json(a, v, base) for a, v in zip(items, value))
    return value  # scalars, dicts of scalars, and values already of their type
