"""Preflight's checks of model files: the weights of a target or head are whole, a head directory is complete.

Purpose: `check_safetensors(path)` reads a safetensors file's header and size only (a truncated copy is caught in
milliseconds, before a stage loads it); `check_weights(directory)` does so for every `*.safetensors` file there;
`check_head(head)` checks an exported head directory (its metadata and config parse, its weights are whole). Each
refusal is `BadInput` naming the file and what to do.
Run: through flows/preflight.py (the commands' preflights, the train flow's `check_inputs`).
Not here: whether the tensors fit a target (found when both are loaded), the target's own checks
(components/targets/target.py). Imports nothing heavy: no torch, no safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

from components.data import safe_read
from eagle.errors import BadInput

HEAD_META = "eagle_head.json"  # eagle.export.META, named here without importing torch


def check_safetensors(path: Path) -> None:
    """The file's safetensors header parses and the tensors it lists fit in the file (a truncated copy does not)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as e:
        raise BadInput(f"{path}: not a readable safetensors file ({e}); copy or export it again") from None
    if 8 + n + end > size:
        raise BadInput(
            f"{path}: truncated: its tensors need {8 + n + end} bytes, the file has {size}; copy or export it again"
        )


def check_weights(directory: str | Path, recursive: bool = False) -> None:
    """Every `*.safetensors` file of `directory` (and below it with `recursive`) passes `check_safetensors`."""
    d = Path(directory)
    for f in sorted(d.rglob("*.safetensors") if recursive else d.glob("*.safetensors")):
        check_safetensors(f)


def read_json(path: Path) -> dict:
    """A JSON object from `path`; `BadInput` naming the file when it is missing, unreadable
    (components/data/safe_read.py: not a regular UTF-8 file without a byte-order mark, too large or too deep) or not an
    object."""
    data = safe_read.read_json(path, bom_ok=False)
    if not isinstance(data, dict):
        raise BadInput(f"{path}: a JSON object was expected, got {type(data).__name__}")
    return data


def check_head(head: str) -> None:
    """An exported head directory: `eagle_head.json` and `config.json` parse, and its weights are whole."""
    d = Path(head)
    if not d.is_dir():
        raise BadInput(f"--head {head}: not a directory; pass an exported head directory or models:/NAME@ALIAS")
    safe_read.check_model_files(d, recursive=True)  # no named pipe, device or link loop among them (a read would hang)
    read_json(d / HEAD_META)
    read_json(d / "config.json")
    if not (d / "model.safetensors").is_file():
        raise BadInput(f"{d}: model.safetensors is missing; the head is incomplete: export it again")
    check_weights(d, recursive=True)
