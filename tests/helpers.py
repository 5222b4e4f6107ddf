"""Small helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def target_copy(tiny_embedded, tmp_path: Path, edit=None) -> Path:
    """A copy of the tiny embedded target under tmp_path, its config.json edited in place by `edit(cfg)`."""
    d = tmp_path / "target"
    shutil.copytree(tiny_embedded.target_dir, d)
    if edit:
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return d
