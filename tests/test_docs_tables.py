"""ARCHITECTURE.md's layer table, rooms table and stage index agree with the code in every column.

Purpose: a newcomer follows these tables one hop to the code, so each cell is checked against the source (ast, no
imports: no torch here): the layers exist and may not import exactly what tests/test_layout.py forbids; every path
named exists; every `Name` (a class, function or constant, `Class.member`, `module.Name`) is defined in a module its
cell names (or, for the Prefect tasks, flows/tasks.py); a config column's class is the type of the section it names
(`evaluate.speed`) and has the fields it names; flows, CLI commands and flags named are declared. The rooms table
names every room of components/ (tests/test_rooms.py `ROOMS`), each with every module in it and nothing else, and the
rooms it may import as tests/test_rooms.py allows them.
Run: `python -m pytest tests/test_docs_tables.py` (well under a second).
Not here: the knob index (tests/test_docs.py, which imports the config).
"""

from __future__ import annotations

import ast
import re

import pytest

from tests.helpers_docs import (
    ROOT,
    NAME_RE,
    backticked,
    cli_mention_problems,
    defines,
    flow_names,
    has_member,
    paths_in,
    resolves,
    tables,
    tree,
)

LAYERS = tables("Layers and what each may import")
ROOMS_TABLE = tables("Rooms of components/")
STAGES = tables("One-hop index: stages")


def _missing_paths(cell: str) -> list[str]:
    return [p for p in paths_in(cell) if not (ROOT / p).exists()]


def _unresolved(cell: str, modules: list[str]) -> list[str]:
    """Backticked identifiers of `cell` defined in none of `modules`; a bare lowercase name may also be a member of
    a class the cell names (`Drafter`: `begin`, `propose`)."""
    names = [n for n in backticked(cell) if NAME_RE.fullmatch(n.removesuffix("()"))]
    classes = [n for n in names if n[0].isupper() and "." not in n and resolves(n, modules)]
    out = []
    for name in names:
        if (
            resolves(name, modules)
            or _is_key(name)
            or _is_parameter(modules, name)
            or (name.islower() and "." in name and _says(modules, name))
        ):
            continue
        if any(
            has_member(p, c, name.removesuffix("()"))
            for c in classes
            for p in modules
            if p.endswith(".py") and defines(p, c)
        ):
            continue
        out.append(name)
    return out


def _is_key(name: str) -> bool:
    """`monitor.rollback.floor_tau`: a pipeline-config key."""
    section, _, key = name.rpartition(".")
    return bool(section) and section_class(section) is not None and key in _fields(section_class(section))


def _is_parameter(modules: list[str], name: str) -> bool:
    """`name` is a parameter of a top-level function of one of `modules` (`capture_plan` of train_head)."""
    return any(
        isinstance(n, ast.FunctionDef) and name in {a.arg for a in n.args.args + n.args.kwonlyargs}
        for p in modules
        if p.endswith(".py") and (ROOT / p).is_file()
        for n in tree(p).body
    )


def _says(modules: list[str], text: str) -> bool:
    """One of `modules` holds the string constant `text` (an event's name, `eagle.head.rolled_back`)."""
    return any(
        isinstance(n, ast.Constant) and n.value == text
        for p in modules
        if p.endswith(".py") and (ROOT / p).is_file()
        for n in ast.walk(tree(p))
    )


def _forbidden_imports() -> dict[str, set[str]]:
    for node in tree("tests/test_layout.py").body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "FORBIDDEN_IMPORTS":
            return {k: set(v) for k, v in ast.literal_eval(node.value).items()}
    raise AssertionError("tests/test_layout.py has no FORBIDDEN_IMPORTS")


def _class_paths() -> dict[str, str]:
    """Class name -> the module of components/ or eagle/ that defines it."""
    out = {}
    for pkg in ("components", "eagle"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            out.update({n.name: rel for n in tree(rel).body if isinstance(n, ast.ClassDef)})
    return out


def _fields(cls: str) -> dict[str, str]:
    """A config class's fields -> their annotations (source text)."""
    node = next(n for n in tree(_class_paths()[cls]).body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {
        i.target.id: ast.unparse(i.annotation)
        for i in node.body
        if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)
    }


def section_class(path: str) -> str | None:
    """The config class of a section path (`evaluate.speed` -> SpeedupConfig), read from the annotations."""
    cls = "PipelineConfig"
    for part in path.split("."):
        cls = _fields(cls).get(part)
        if cls not in _class_paths():
            return None
    return cls


def test_the_tables_are_read():
    assert [r[0] for r in LAYERS][:3] == ["`eagle/`", "`components/`", "`embedded/`"]
    assert len(STAGES) >= 10 and all(len(r) == 5 for r in STAGES), [len(r) for r in STAGES]
    assert section_class("evaluate.speed") == "SpeedupConfig" and section_class("nope") is None
    assert _unresolved("`Verifier` `Drafter`: `propose` `nope` components/x.py", ["eagle/verify.py"]) == ["nope"]
    assert cli_mention_problems("`eagle-heads serve --follow-alias --nope`") == ["`eagle-heads serve` has no --nope"]
    assert _is_key("monitor.rollback.floor_tau") and not _is_key("monitor.rollback.nope")


@pytest.mark.parametrize("row", LAYERS, ids=[r[0].strip("`/") for r in LAYERS])
def test_layer_row(row):
    layer, holds, forbidden = row
    name = layer.strip("`/")
    assert (ROOT / name).is_dir(), layer
    assert not _missing_paths(holds), _missing_paths(holds)
    modules = paths_in(holds) + [str(p.relative_to(ROOT)) for p in sorted((ROOT / name).rglob("*.py"))]
    stems = {p.stem for p in (ROOT / name).rglob("*.py")}
    unresolved = [n for n in _unresolved(holds, modules) if n.split(".")[0] not in stems]
    assert not unresolved, f"{layer}: {unresolved} named but not defined in its modules"
    documented = set() if forbidden == "—" else {f.strip() for f in forbidden.split(",")}
    assert documented == _forbidden_imports().get(name, set()), (layer, "tests/test_layout.py FORBIDDEN_IMPORTS")


@pytest.mark.parametrize("row", STAGES, ids=[r[0] for r in STAGES])
def test_stage_row(row):
    stage, component, config, task, tests = row
    for cell in row:
        assert not _missing_paths(cell), (stage, _missing_paths(cell))
        assert not cli_mention_problems(cell), (stage, cli_mention_problems(cell))
    unresolved = _unresolved(component, paths_in(component))
    assert not unresolved, f"{stage}: {unresolved} not defined in the modules its component cell names"
    names = backticked(config)
    if config.startswith("`"):
        cls, inner = names[0], names[1:]
        assert cls in _class_paths(), (stage, f"no config class {cls}")
        for name in inner:
            if "." in name:
                assert section_class(name) == cls, (stage, f"`{name}` is not a {cls}")
            elif not name.startswith("eagle-heads"):
                assert name in _fields(cls) or section_class(name) == cls, (stage, f"{cls} has no field {name}")
        assert any(section_class(p) == cls for p in _section_paths()), (stage, f"{cls} is no section's type")
    else:
        assert config.startswith("—"), (stage, config)
    flows_named = re.findall(r"flow `([\w-]+)`", task) + [n for n in backticked(task) if "-" in n and " " not in n]
    assert set(flows_named) <= flow_names(), (stage, set(flows_named) - flow_names())
    task_names = [n for n in backticked(task) if "-" not in n and " " not in n]
    unresolved = _unresolved(" ".join(f"`{n}`" for n in task_names), paths_in(task) + ["flows/tasks.py"])
    assert not unresolved, f"{stage}: {unresolved} not defined in flows/tasks.py or the modules its cell names"
    assert paths_in(tests) and all(p.startswith(("tests/", "bench/")) for p in paths_in(tests)), (stage, tests)


def _section_paths() -> list[str]:
    out, todo = [], [""]
    while todo:
        prefix = todo.pop()
        for name, ann in _fields(section_class(prefix) if prefix else "PipelineConfig").items():
            if ann in _class_paths():
                out.append(f"{prefix}.{name}" if prefix else name)
                todo.append(out[-1])
    return out


def test_rooms_table():
    from tests.test_rooms import ROOMS, allowed_rooms

    assert {r[0].strip("`/") for r in ROOMS_TABLE} == set(ROOMS), [r[0] for r in ROOMS_TABLE]
    for room, holds, _, imports in ROOMS_TABLE:
        name = room.strip("`/")
        modules = {f"components/{name}/{p.name}" for p in (ROOT / "components" / name).glob("*.py")} - {
            f"components/{name}/__init__.py"
        }
        assert set(paths_in(holds)) == modules, (room, "modules", sorted(modules ^ set(paths_in(holds))))
        unresolved = _unresolved(holds, sorted(modules))
        assert not unresolved, f"{room}: {unresolved} not defined in the modules its row names"
        said = {w.strip() for w in re.sub(r"\([^)]*\)", "", imports).split(",")}
        said = set(ROOMS) if said == {"every room"} else said | {name}
        assert said == allowed_rooms(name), (room, "may import", sorted(allowed_rooms(name)))
