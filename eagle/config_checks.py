"""Range checks for the frozen config dataclasses, with errors that name the field.

Purpose: a config's `__post_init__` calls `at_least`, `finite` or `one_of` per field (or raises `FieldError` for a
rule across fields). `FieldError` keeps the field's name apart from the reason, so a loader that knows where the
config sits in a file (components/config/pipeline.py) reports the key's whole path, `train.ttt.ttt_steps must be
an integer >= 1, got 0`, while code that builds the dataclass directly reads `TTTConfig.ttt_steps must be ...`.
`NOT_IDENTITY` is the metadata of a field that changes how fast a stage runs but not what it writes: a run's
fingerprint leaves such fields out (components/config/pipeline.py `fingerprint`).
Not here: type coercion of JSON values (the loader's job) or any config itself.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

from eagle.errors import BadInput

NOT_IDENTITY = {"identity": False}  # `field(metadata=NOT_IDENTITY)`: not part of a run's identity


class FieldError(BadInput):
    """A config field whose value is out of range: `owner` (the class), `field` and `reason` (what it must be)."""

    def __init__(self, owner: object, field: str, reason: str):
        self.owner = type(owner).__name__ if not isinstance(owner, str) else owner
        self.field, self.reason = field, reason
        super().__init__(f"{self.owner}.{field} {reason}")


def at_least(cfg: object, fields: dict[str, int]) -> None:
    """Each named field an integer (not a bool) >= its lower bound."""
    for name, low in fields.items():
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise FieldError(cfg, name, f"must be an integer >= {low}, got {v!r}")


def finite(cfg: object, name: str, ok: Callable[[float], bool], want: str) -> None:
    """The field a finite number (not a bool) for which `ok` holds; `want` says the range in words."""
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
        raise FieldError(cfg, name, f"must be a finite number {want}, got {v!r}")


def one_of(cfg: object, name: str, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    v = getattr(cfg, name)
    if v not in choices:
        raise FieldError(cfg, name, f"must be one of {', '.join(repr(c) for c in choices)}, got {v!r}")
