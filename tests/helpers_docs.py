"""Reading ARCHITECTURE.md's tables and the code they name, for tests/test_docs.py and tests/test_docs_tables.py.

Purpose: `tables(heading)` returns a table's rows as cells; `Source` answers, from the source text alone (ast, no
imports), whether a module defines a name (`defines`), a class has a member (`has_member`), a CLI command or flag
exists (`commands`, `flags`) and a Prefect flow of that name is declared (`flow_names`); `paths_in` and
`backticked` pull the file paths and the `names` out of a cell.
Not here: the assertions (the test modules).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH_RE = re.compile(r"(?<![\w./`-])((?:eagle|components|flows|infra|embedded|bench|tests)/[\w./-]*)")
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def architecture() -> str:
    return (ROOT / "ARCHITECTURE.md").read_text()


def tables(heading: str) -> list[list[str]]:
    """The body rows (cells stripped) of the first table under `## heading`."""
    section = architecture().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip().strip("|").split(" | ")] for ln in lines[2:]]


def paths_in(cell: str) -> list[str]:
    """Repository paths named in a cell (`components/train/stage.py`, `tests/faultinject/`), trailing punctuation
    dropped."""
    return [p.rstrip(".,;:)") for p in PATH_RE.findall(cell)]


def backticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def module_of(path: str) -> str:
    return path[:-3].replace("/", ".")


@functools.cache
def tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text())


def _top_level(path: str) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for node in tree(path).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def defines(path: str, name: str, kind: type | tuple[type, ...] = ast.AST) -> bool:
    """`path` defines `name` at its top level (a class, function or assignment; not an import)."""
    return isinstance(_top_level(path).get(name), kind)


def has_member(path: str, cls: str, member: str) -> bool:
    """Class `cls` of `path` has `member` (a method, property or class attribute, its own)."""
    node = _top_level(path).get(cls)
    if not isinstance(node, ast.ClassDef):
        return False
    for item in node.body:
        names = []
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [item.name]
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names = [item.target.id]
        elif isinstance(item, ast.Assign):
            names = [t.id for t in item.targets if isinstance(t, ast.Name)]
        if member in names:
            return True
    return False


def resolves(name: str, modules: list[str]) -> bool:
    """`name` (`Thing`, `Thing.member`, `module.Thing`, `Thing.method()`) is defined in one of `modules` (paths)."""
    name = name.removesuffix("()")
    first, _, rest = name.partition(".")
    for path in modules:
        if not path.endswith(".py") or not (ROOT / path).is_file():
            continue
        if Path(path).stem == first and rest:  # `regenerate.ShardWorker` beside components/regenerate/stage.py
            first, _, rest = rest.partition(".")
        if defines(path, first) and (not rest or has_member(path, first, rest.split(".")[0])):
            return True
    return False


def _calls(path: str, func: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree(path))
        if isinstance(n, ast.Call) and (getattr(n.func, "id", None) == func or getattr(n.func, "attr", None) == func)
    ]


def _const(node: ast.AST) -> object:
    return node.value if isinstance(node, ast.Constant) else None


@functools.cache
def commands() -> dict[str, set[str]]:
    """CLI command -> its flags, from flows/commands.py: each `Command(name, help, builder, ...)` and the
    `add_argument` calls of its builder and of the module's functions that builder calls."""
    path = "flows/commands.py"
    funcs = {n.name: n for n in tree(path).body if isinstance(n, ast.FunctionDef)}

    def flags_of(fn: str, seen: set[str]) -> set[str]:
        seen.add(fn)
        out = set()
        for call in (n for n in ast.walk(funcs[fn]) if isinstance(n, ast.Call)):
            if getattr(call.func, "attr", None) == "add_argument":
                out |= {a.value for a in call.args if isinstance(_const(a), str) and a.value.startswith("--")}
                if any(k.arg == "action" and "BooleanOptional" in ast.unparse(k.value) for k in call.keywords):
                    out |= {"--no-" + a.value[2:] for a in call.args if isinstance(_const(a), str)}
            callee = getattr(call.func, "id", None)
            if callee in funcs and callee not in seen:
                out |= flags_of(callee, seen)
        return out

    out = {}
    for call in _calls(path, "Command"):
        name, builder = _const(call.args[0]), call.args[2]
        out[name] = flags_of(builder.id, set()) if isinstance(builder, ast.Name) else set()
    return out


def flags() -> set[str]:
    return set().union(*commands().values())


@functools.cache
def flow_names() -> set[str]:
    """The names of the Prefect flows declared in flows/ (`@flow(name=...)`)."""
    out = set()
    for path in sorted((ROOT / "flows").glob("*.py")):
        for call in _calls(str(path.relative_to(ROOT)), "flow"):
            out |= {k.value.value for k in call.keywords if k.arg == "name" and isinstance(_const(k.value), str)}
    return out


def cli_mention_problems(text: str) -> list[str]:
    """`eagle-heads CMD --flag ...` mentions in `text` whose command or flags the parser lacks."""
    problems = []
    for m in re.finditer(r"eagle-heads (\w[\w-]*)((?: --[\w-]+)*)", text):
        cmd, flags_given = m.group(1), m.group(2).split()
        if cmd not in commands():
            problems.append(f"no CLI command {cmd!r}")
            continue
        problems += [f"`eagle-heads {cmd}` has no {f}" for f in flags_given if f not in commands()[cmd]]
    return problems
