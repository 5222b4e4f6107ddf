"""Layout rules, checked by reading the source (ast): package boundaries, environment access, docstrings, size.

Purpose: keep the layer rules of ARCHITECTURE.md true as the code grows:
    eagle/       imports no prefect, mlflow, ray, infra, components, flows (it runs with torch alone)
    components/  imports no prefect (no decorators there) and no flows
    infra/       imports no eagle, components, flows (adapters sit below the pipeline); any package may import
                 the SHARED_MODULES (eagle.errors: the bad-input base class, which imports nothing)
    bench/       imports no tests (tests may import bench's references, e.g. bench/reference_ttt.py)
    only infra/ touches environment variables (os.environ, os.getenv, ...); exceptions go in ENV_ALLOWLIST
    every non-empty module has a docstring; every file is under MAX_LINES lines
Run: `python -m pytest tests/test_layout.py` (well under a second; nothing is imported).
Not here: style or naming checks, anything that needs importing the code.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".venv", ".git", ".eagle", "build", "dist", "node_modules", "__pycache__"}
MAX_LINES = 450

FORBIDDEN_IMPORTS = {
    "eagle": {"prefect", "mlflow", "ray", "infra", "components", "flows"},
    "components": {"prefect", "flows"},
    "infra": {"eagle", "components", "flows"},
    "bench": {"tests"},  # a benchmark runs from a checkout without the suite's helpers; shared references live in bench/
}
# modules any package may import: they hold no logic and import nothing of ours
SHARED_MODULES = {"eagle.errors": "BadInput, the one bad-input error type that every layer's errors subclass"}
# path relative to the repo root -> why that file may touch the environment. Keep it empty if you can.
ENV_ALLOWLIST: dict[str, str] = {
    # eagle/ imports no infra, and the pin must reach every process that decodes (Ray workers, benchmark children,
    # the device's scripts), most of which never build a Settings
    "eagle/target_path.py": "EAGLE_TARGET_PATH, the process-wide pin of the target path, and "
                            "EAGLE_TARGET_PATH_TIMINGS, the file its timings are kept in across processes",
}
_ENV_ATTRS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


@dataclass(frozen=True)
class Module:
    path: Path
    rel: str  # posix path relative to the repo root
    package: str  # first directory under the root ("" for top-level files)
    tree: ast.Module
    n_lines: int


def _python_files() -> list[Path]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if any(p in SKIP_DIRS or p.endswith(".egg-info") or (p.startswith(".") and p != ".") for p in parts[:-1]):
            continue
        out.append(path)
    return out


def _load(path: Path) -> Module:
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(ROOT).as_posix()
    package = rel.split("/")[0] if "/" in rel else ""
    return Module(path, rel, package, ast.parse(text, filename=rel), len(text.splitlines()))


MODULES = [_load(p) for p in _python_files()]


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    """Absolute dotted name of a `from ... import` (relative imports resolved against the file's package)."""
    if not node.level:
        return node.module or ""
    pkg = module.rel[: -len(".py")].split("/")[:-1]
    base = pkg[: len(pkg) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imported_roots(module: Module) -> dict[str, int]:
    """Top-level names of every import in the module (any scope, importlib calls too) -> first line."""
    found: dict[str, int] = {}
    for node in ast.walk(module.tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [_absolute(module, node)]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        for name in names:
            if name and name not in SHARED_MODULES:
                found.setdefault(name.split(".")[0], node.lineno)
    return found


def env_accesses(module: Module) -> list[int]:
    """Lines that touch environment variables through the os module (however it was imported)."""
    os_names = {"os"}
    lines = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for a in node.names if a.name in _ENV_ATTRS]
    for node in ast.walk(module.tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in _ENV_ATTRS
            and isinstance(node.value, ast.Name)
            and node.value.id in os_names
        ):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_rules_see_what_they_should():
    sample = Module(
        ROOT / "eagle/x.py", "eagle/x.py", "eagle",
        ast.parse("import os as o\nfrom . import y\nfrom ..infra import s\ndef f():\n"
                  "    import mlflow.artifacts\n    importlib.import_module('ray')\n    return o.environ"),
        7,
    )
    assert set(imported_roots(sample)) == {"os", "eagle", "infra", "mlflow", "ray"}
    assert env_accesses(sample) == [7]
    assert len(MODULES) > 10 and any(m.package == "infra" for m in MODULES)


@pytest.mark.parametrize("package", sorted(FORBIDDEN_IMPORTS))
def test_package_boundaries(package):
    bad = [
        f"{m.rel}:{line} imports {root}"
        for m in MODULES
        if m.package == package
        for root, line in imported_roots(m).items()
        if root in FORBIDDEN_IMPORTS[package]
    ]
    assert not bad, f"{package}/ may not import {sorted(FORBIDDEN_IMPORTS[package])}:\n" + "\n".join(bad)


def test_only_infra_touches_the_environment():
    bad = [
        f"{m.rel}:{line}"
        for m in MODULES
        if m.package not in ("infra", "tests") and m.rel not in ENV_ALLOWLIST
        for line in env_accesses(m)
    ]
    assert not bad, "read settings through infra.settings.Settings.from_env(), not os.environ:\n" + "\n".join(bad)
    stale = [rel for rel in ENV_ALLOWLIST if not (ROOT / rel).exists()]
    assert not stale, f"ENV_ALLOWLIST names files that are gone: {stale}"


def test_every_module_has_a_docstring():
    missing = [m.rel for m in MODULES if m.tree.body and ast.get_docstring(m.tree) is None]
    assert not missing, "module docstring (purpose / how to run / what not) missing in:\n" + "\n".join(missing)


def test_files_stay_small():
    big = [f"{m.rel}: {m.n_lines} lines" for m in MODULES if m.n_lines >= MAX_LINES]
    assert not big, f"split files of {MAX_LINES}+ lines:\n" + "\n".join(big)
