"""Style by tools: ruff's lint rules and its formatter (pyproject.toml `[tool.ruff]`) hold over the whole tree.

Purpose: what a reviewer would otherwise check by eye is checked by ruff, in the fast tier: pyflakes (unused and
undefined names, redefinitions, names shadowed) and pycodestyle's errors and warnings (lines over 120 characters
included). `ruff check --fix .` removes unused imports; the test prints what is left, file and line. Import order
(isort's rules, I) is not selected: ruff rewrites every wrapped import one name per line. The layout is
`ruff format`'s (`[tool.ruff.format]`, its defaults at 120 characters): `ruff format --check .` must find nothing
to change, and `ruff format .` fixes what it finds (the commit that formatted the tree is in .git-blame-ignore-revs).
Run: `python -m pytest tests/test_style.py` (about a second; ruff is installed with the test extras).
Not here: the 450-line rule (tests/test_layout.py), which the formatter's longer files must keep.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes_on_the_whole_tree():
    ruff = Path(sys.executable).with_name("ruff")
    assert ruff.is_file(), f"{ruff}: not installed (pip install -e '.[test]')"
    out = subprocess.run(
        [str(ruff), "check", "--no-cache", "--output-format", "concise", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"ruff check found:\n{out.stdout[-6000:]}{out.stderr[-2000:]}"


def test_ruff_format_finds_nothing_to_change():
    ruff = Path(sys.executable).with_name("ruff")
    assert ruff.is_file(), f"{ruff}: not installed (pip install -e '.[test]')"
    out = subprocess.run(
        [str(ruff), "format", "--check", "--no-cache", "--output-format", "concise", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    fix = "run `.venv/bin/ruff format .`"
    assert out.returncode == 0, (
        f"ruff format would reformat these files ({fix}):\n{out.stdout[-6000:]}{out.stderr[-2000:]}"
    )


def test_ruff_is_configured_for_this_tree():
    """The rules the docstring names are the ones configured (a config that selects nothing would pass)."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert cfg["line-length"] == 120
    assert set(cfg["lint"]["select"]) >= {"E", "F", "W"}
    assert "format" in cfg  # the formatter's section, its defaults at line-length
