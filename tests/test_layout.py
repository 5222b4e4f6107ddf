"""Layout rules, checked by reading the source (ast): package boundaries, environment access, docstrings, size.

Purpose: keep the layer rules of ARCHITECTURE.md true as the code grows:
    eagle/       imports no prefect, mlflow, ray, infra, components, flows (it runs with torch alone)
    components/  imports no prefect (no decorators there), no flows and no embedded (the stages never need the
                 builder of the embedded default)
    embedded/    the embedded default's builder: imports no prefect, mlflow, ray, infra, flows (torch, transformers
                 and tokenizers; components.data.traffic_io, the traffic format it writes)
    infra/       imports no eagle, components, flows (adapters sit below the pipeline); any package may import
                 the SHARED_MODULES (eagle.errors: the bad-input base class, which imports nothing)
    bench/       imports no tests (tests may import bench's references, e.g. bench/reference_ttt.py)
    components/  grouped in rooms, one subpackage per stage and two shared ones: their rules in tests/test_rooms.py
    no import cycle among the modules of eagle/, components/, flows/, infra/, embedded/ (CYCLE_PACKAGES): every import
                 statement counts, module level, inside a function or under `if TYPE_CHECKING:`, and so does
                 importlib.import_module('name'); an import names the longest prefix of its dotted name that is
                 one of our modules (`from a.b import c` names a.b.c when c is a submodule, else a.b). A package's
                 own submodules: its __init__ importing them is an edge like any other, but a submodule is not
                 taken to import its package by being inside it (Python runs a/__init__.py before a/b.py; that
                 implicit import is not counted), so embedded/__init__.py re-exporting
                 embedded.build is no cycle; build.py importing a name of that __init__ would be one
    only infra/ touches environment variables (os.environ, os.getenv, ...); exceptions go in ENV_ALLOWLIST
    no `from X import _name` of another of our modules in PRIVATE_RULE_PACKAGES (bench/'s scripts importing each
                 other count): a name another module needs is public where it is defined; tests/ is exempt
                 (a test may reach a module's internals to test them, and test modules share helpers)
    every non-empty module has a docstring; every file is under MAX_LINES lines
    no date (20YY-MM-DD) in the code of CYCLE_PACKAGES: a dated measurement goes to bench/README.md
    no function of SIGNATURE_PACKAGES takes more than MAX_PARAMS parameters (self/cls not counted; related ones go
                 in a config object), but those in PARAMS_ALLOWLIST, each with its reason
Run: `python -m pytest tests/test_layout.py` (well under a second; nothing is imported).
Not here: style or naming checks, anything that needs importing the code.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".venv", ".git", ".eagle", "build", "dist", "node_modules", "__pycache__"}
MAX_LINES = 450

FORBIDDEN_IMPORTS = {
    "eagle": {"prefect", "mlflow", "ray", "infra", "components", "flows"},
    "components": {"prefect", "flows", "embedded"},
    "embedded": {"prefect", "mlflow", "ray", "infra", "flows"},
    "infra": {"eagle", "components", "flows"},
    # a benchmark runs from a checkout without the suite's helpers; shared references live in bench/
    "bench": {"tests"},
}
CYCLE_PACKAGES = ("eagle", "components", "flows", "infra", "embedded")
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
PRIVATE_RULE_PACKAGES = (*CYCLE_PACKAGES, "bench")  # tests/ is exempt: it tests internals
SIGNATURE_PACKAGES = ("components", "flows")
MAX_PARAMS = 7
# "path:function" -> why it keeps more than MAX_PARAMS parameters
PARAMS_ALLOWLIST: dict[str, str] = {
    # a Prefect flow's parameters are its deployments' (prefect.yaml, the UI, event triggers), each set by name
    "flows/train_head.py:train_head": "a Prefect flow: each parameter is one of the train-head deployment's",
}


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


def _module_name(rel: str) -> str:
    """'embedded/__init__.py' -> 'embedded'; 'eagle/x.py' -> 'eagle.x'."""
    parts = rel[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(module: Module, ours: set[str]) -> dict[str, int]:
    """The modules in `ours` that `module` imports (any scope, importlib calls too) -> first line: each import names
    the longest prefix of its dotted name in `ours` (a submodule imported by `from pkg import sub` included)."""
    dotted: list[tuple[str, int]] = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            dotted += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            dotted += [(f"{base}.{alias.name}" if base else alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                dotted.append((node.args[0].value, node.lineno))
    found: dict[str, int] = {}
    for name, line in dotted:
        parts = name.split(".")
        target = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in ours), None)
        if target and target != _module_name(module.rel):
            found.setdefault(target, line)
    return found


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a path [a, b, ..., a]) per strongly connected group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graphs here are a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_within(graph, group) for group in groups]


def _path_within(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """A shortest cycle through the first module of `group` (breadth-first inside the group)."""
    start = min(group)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w in group and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in {group}")


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


def private_imports(module: Module, ours: set[str]) -> list[str]:
    """`line: from X import _name` for every private name `module` imports from another module whose top-level
    name is in `ours` (any scope; dunder names are not private)."""
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source.split(".")[0] not in ours or source == _module_name(module.rel):
                continue
            found += [
                f"{node.lineno}: from {source} import {alias.name}"
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.endswith("__")
            ]
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_the_rules_see_what_they_should():
    sample = Module(
        ROOT / "eagle/x.py",
        "eagle/x.py",
        "eagle",
        ast.parse(
            "import os as o\nfrom . import y\nfrom ..infra import s\ndef f():\n"
            "    import mlflow.artifacts\n    importlib.import_module('ray')\n    return o.environ"
        ),
        7,
    )
    assert set(imported_roots(sample)) == {"os", "eagle", "infra", "mlflow", "ray"}
    assert env_accesses(sample) == [7]
    assert len(MODULES) > 10 and any(m.package == "infra" for m in MODULES)


def test_the_cycle_rule_sees_what_it_should():
    ours = {"p", "p.a", "p.b", "p.c"}
    src = {
        "p/__init__.py": "from p.a import x",
        "p/a.py": "def f():\n    from p import b",
        "p/b.py": "import importlib\nimportlib.import_module('p.c.y')",
        "p/c.py": "from . import a",
    }

    def graph() -> dict[str, dict[str, int]]:
        return {
            _module_name(rel): imported_modules(Module(ROOT / rel, rel, "p", ast.parse(text), 1), ours)
            for rel, text in src.items()
        }

    assert graph() == {"p": {"p.a": 1}, "p.a": {"p.b": 2}, "p.b": {"p.c": 2}, "p.c": {"p.a": 1}}
    assert import_cycles(graph()) == [["p.a", "p.b", "p.c", "p.a"]]  # a function-level import and importlib count
    src["p/c.py"] = "import json"
    assert import_cycles(graph()) == []  # p.a's `from p import b` names the submodule, not p's __init__
    src["p/c.py"] = "from p import x"
    assert import_cycles(graph()) == [["p", "p.a", "p.b", "p.c", "p"]]  # a name of the package's __init__: a cycle


def test_no_import_cycles():
    mods = [m for m in MODULES if m.package in CYCLE_PACKAGES]
    ours = {_module_name(m.rel) for m in mods}
    graph = {_module_name(m.rel): imported_modules(m, ours) for m in mods}
    cycles = import_cycles(graph)
    text = [" -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}" for c in cycles]
    assert not cycles, (
        "import cycles (move what both sides need into a module both import, or the worker into "
        "its stage's module):\n" + "\n".join(text)
    )


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


def test_the_private_import_rule_sees_what_it_should():
    src = (
        "from eagle.speculative import GenOutput, _Emitted\nfrom . import _helper\nfrom mlflow.x import _y\n"
        "from eagle.x import __version__\ndef f():\n    from common import _say as say\n"
    )
    sample = Module(ROOT / "eagle/x.py", "eagle/x.py", "eagle", ast.parse(src), 6)
    assert private_imports(sample, {"eagle", "common"}) == [
        "1: from eagle.speculative import _Emitted",
        "2: from eagle import _helper",
        "6: from common import _say",
    ]
    own = Module(ROOT / "eagle/x.py", "eagle/x.py", "eagle", ast.parse("from eagle.x import _self"), 1)
    assert private_imports(own, {"eagle"}) == []  # a module importing from itself crosses nothing


def test_no_private_names_cross_modules():
    ours = {*CYCLE_PACKAGES, "bench", "tests"}
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")}  # bench/'s scripts import each other by bare name
    bad = [
        f"{m.rel}:{hit}"
        for m in MODULES
        if m.package in PRIVATE_RULE_PACKAGES
        for hit in private_imports(m, ours | scripts if m.package == "bench" else ours)
    ]
    assert not bad, (
        "private names imported across modules (make the name public where it is defined, or move it "
        "to a module both import):\n" + "\n".join(bad)
    )


def test_every_module_has_a_docstring():
    missing = [m.rel for m in MODULES if m.tree.body and ast.get_docstring(m.tree) is None]
    assert not missing, "module docstring (purpose / how to run / what not) missing in:\n" + "\n".join(missing)


def test_files_stay_small():
    big = [f"{m.rel}: {m.n_lines} lines" for m in MODULES if m.n_lines >= MAX_LINES]
    assert not big, f"split files of {MAX_LINES}+ lines:\n" + "\n".join(big)


def test_no_dates_in_the_code():
    """Comments say why, not when: a dated measurement belongs in bench/README.md ("Figures moved from code
    comments"), the code keeping the reason it supports."""
    date = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
    dated = [
        f"{m.rel}:{i}"
        for m in MODULES
        if m.package in CYCLE_PACKAGES
        for i, line in enumerate(m.path.read_text().splitlines(), 1)
        if date.search(line)
    ]
    assert not dated, "dates in code (move the figure to bench/README.md):\n" + "\n".join(dated)


def too_many_parameters(module: Module) -> dict[str, int]:
    """ "path:function" (methods as Class.method) -> its parameters (positional and keyword-only, *args and **kwargs
    not counted, nor self/cls) of every function of `module` taking more than MAX_PARAMS."""
    found = {}
    for parent in ast.walk(module.tree):
        for node in ast.iter_child_nodes(parent):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            names = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]
            n = len(names) - (names[:1] in (["self"], ["cls"]))
            if n > MAX_PARAMS:
                found[f"{module.rel}:{parent.name + '.' if isinstance(parent, ast.ClassDef) else ''}{node.name}"] = n
    return found


def test_functions_take_few_parameters():
    sample = Module(
        ROOT / "flows/x.py",
        "flows/x.py",
        "flows",
        ast.parse(
            "def f(a, b, c, d, e, f, g, *, h): pass\ndef g(a, b, c, d, e, f, g, *args, **kw): pass\n"
            "class C:\n    def m(self, a, b, c, d, e, f, g): pass\n    def n(self, a, b, c, d, e, f, g, h): pass"
        ),
        4,
    )
    assert too_many_parameters(sample) == {"flows/x.py:f": 8, "flows/x.py:C.n": 8}
    found = {k: n for m in MODULES if m.package in SIGNATURE_PACKAGES for k, n in too_many_parameters(m).items()}
    bad = [f"{k}: {n} parameters" for k, n in found.items() if k not in PARAMS_ALLOWLIST]
    assert not bad, (
        f"more than {MAX_PARAMS} parameters (group related ones in a frozen dataclass, or a config "
        "section):\n" + "\n".join(bad)
    )
    stale = sorted(set(PARAMS_ALLOWLIST) - set(found))
    assert not stale, f"allowed more than {MAX_PARAMS} parameters but no longer takes them: {stale}"
