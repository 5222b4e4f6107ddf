"""The docs a newcomer reads agree with the code: ARCHITECTURE.md's knob index, in every column.

Purpose: each row of the "One-hop index: knobs" table names a pipeline-config section (`train.ttt`), its fields and
where it is defined; the tests walk `PipelineConfig` and check that every section has a row whose fields are exactly
the dataclass's own (nested dataclasses are their own rows), so a new knob cannot land undocumented, and that what a
field's note says holds: its choices (`local/vllm: ...`) are exactly those its config accepts (`one_of`), and every
field with such a check lists them; `default V` is the dataclass default, `V in the `P` preset` preset P's value;
`null:` / `unset:` a field that takes None; `not part of a run's identity` (the fields since the previous note, or
`none of the three ...`: the last three) exactly the fields left out of the run's fingerprint (the `monitor` section,
left out whole, only one way); flags named exist in the CLI, paths named exist; and the "defined in" column names the
section's class and the module that defines it.
Run: `python -m pytest tests/test_docs.py` (a few seconds: it imports the config, and so torch).
Not here: the layer and stage tables (tests/test_docs_tables.py); the README's commands (tests/test_cli.py).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

from components.config.pipeline import PipelineConfig, _identity
from tests.helpers_docs import defines, flags, paths_in, tables

ROOT = Path(__file__).resolve().parents[1]


def _sections(cfg, path: str, out: dict[str, set[str]]) -> dict[str, set[str]]:
    own = set()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            _sections(value, f"{path}.{f.name}" if path else f.name, out)
        else:
            own.add(f.name)
    if path:
        out[path] = own
    return out


def _documented() -> dict[str, set[str]]:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    table = text.split("## One-hop index: knobs", 1)[1]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `([a-z_.]+)` \| (.+?) \| `", line)
        if m:
            fields = re.sub(r"\([^)]*\)", "", m.group(2))  # drop the explanations in parentheses
            rows[m.group(1)] = {f.strip() for f in fields.split(",") if f.strip()}
    return rows


def test_the_knob_index_lists_every_config_field():
    actual = _sections(PipelineConfig.preset("tiny"), "", {})
    documented = _documented()
    assert set(documented) == set(actual), (
        f"sections: missing {set(actual) - set(documented)}, stale {set(documented) - set(actual)}"
    )
    for section, fields in actual.items():
        assert documented[section] == fields, (
            section,
            f"undocumented {fields - documented[section]}",
            f"stale {documented[section] - fields}",
        )


NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5}
IDENTITY = "not part of a run's identity"


def _notes(cell: str) -> list[tuple[str, str]]:
    """A fields cell as (field, its note in parentheses or ""), in order."""
    out, depth, name, note = [], 0, "", ""
    for ch in cell + ",":
        if ch == "(" and depth == 0:
            depth = 1
        elif ch == "(" or (ch == ")" and depth > 1):
            depth += 1 if ch == "(" else -1
            note += ch
        elif ch == ")" and depth == 1:
            depth = 0
        elif depth:
            note += ch
        elif ch == ",":
            if name.strip():
                out.append((name.strip(), note.strip()))
            name, note = "", ""
        else:
            name += ch
    return out


KNOBS = {row[0].strip("`"): row for row in tables("One-hop index: knobs")}
DEFAULTS, TINY = PipelineConfig(), PipelineConfig.preset("tiny")


def _section(cfg, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _value(text: str):
    """A value as the table writes it: false, null, 1, 0.5, gpu, 0, 128, 512 (a tuple)."""
    items = [t.strip() for t in text.split(",")]
    words = {"false": False, "true": True, "null": None, "unset": None}
    parsed = [words[t] if t in words else ast.literal_eval(t) if re.fullmatch(r"-?[\d.e+-]+", t) else t for t in items]
    return tuple(parsed) if len(parsed) > 1 else parsed[0]


def _choices(cls: type) -> dict[str, tuple]:
    """field -> the values `one_of` accepts for it, read from the calls in its module (the class, or a function that
    takes the class) and evaluated there."""
    module = importlib.import_module(cls.__module__)
    src = ast.parse(inspect.getsource(module))
    scopes = [
        n
        for n in src.body
        if (isinstance(n, ast.ClassDef) and n.name == cls.__name__)
        or (
            isinstance(n, ast.FunctionDef)
            and any(a.annotation is not None and ast.unparse(a.annotation) == cls.__name__ for a in n.args.args)
        )
    ]
    names = dict(vars(module))
    local = {
        a.asname or a.name: (imp.module, a.name)
        for s in scopes
        for imp in ast.walk(s)
        if isinstance(imp, ast.ImportFrom)
        for a in imp.names
    }  # function-level imports
    out = {}
    for call in (c for s in scopes for c in ast.walk(s) if isinstance(c, ast.Call)):
        if getattr(call.func, "id", None) == "one_of" and isinstance(call.args[1], ast.Constant):
            expr = ast.Expression(call.args[2])
            for n in (n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and n.id not in names):
                names[n] = getattr(importlib.import_module(local[n][0]), local[n][1])
            out[call.args[1].value] = tuple(eval(compile(expr, module.__file__, "eval"), names))
    return out


def _non_identity(section: str) -> set[str]:
    kept = _identity(TINY)
    for part in section.split("."):
        kept = kept.get(part, {})
    return {f for f in _sections(TINY, "", {})[section] if f not in kept}


@pytest.mark.parametrize("section", sorted(KNOBS))
def test_every_field_note_holds(section):
    _, cell, defined_in = KNOBS[section]
    cfg, tiny = _section(DEFAULTS, section), _section(TINY, section)
    types = {f.name: str(f.type) for f in dataclasses.fields(cfg)}
    choices, listed, identity_free = _choices(type(cfg)), set(), set()
    notes = _notes(cell)
    for i, (name, note) in enumerate(notes):
        where = f"{section}.{name}"
        if m := re.match(r"([\w.-]+(?:/[\w.-]+)+)(?=[:;]|$)", note):
            listed.add(name)
            code = {"null" if c is None else str(c) for c in choices.get(name, ())}
            assert set(m.group(1).split("/")) == code, (where, "choices", code)
        for m in re.finditer(r"(?<![`\w])default ([^:;`]+?)(?=[:;]|$)", note):
            assert _value(m.group(1)) == getattr(cfg, name), (where, "default", getattr(cfg, name))
        for m in re.finditer(r"([\w.-]+),? in the `(\w+)` preset", note):
            got = getattr(_section(PipelineConfig.preset(m.group(2)), section), name)
            assert _value(m.group(1)) == got, (where, f"preset {m.group(2)}", got)
        if re.search(r"(?:^|[;,] )(null|unset):", note):
            assert "None" in types[name], (where, "takes no None", types[name])
        assert all(f in flags() for f in re.findall(r"--[\w-]+", note)), (where, "flag", note)
        assert all((ROOT / p).exists() for p in paths_in(note)), (where, paths_in(note))
        if IDENTITY in note:
            start = max([j + 1 for j in range(i) if notes[j][1]], default=0)
            identity_free |= {n for n, _ in notes[start : i + 1]}
        if m := re.search(r"none of the (\w+) is part of a run's identity", note):
            identity_free |= {n for n, _ in notes[i + 1 - NUMBERS[m.group(1)] : i + 1]}
    assert listed >= {f for f, c in choices.items() if c}, (section, "choices not listed", set(choices) - listed)
    if section.split(".")[0] == "monitor":  # the fingerprint leaves the whole section out: the claim holds one way
        assert TINY.override({"monitor": {"ratio": 0.5}}, where="test").fingerprint() == TINY.fingerprint()
    else:
        assert identity_free == _non_identity(section), (section, "identity", _non_identity(section))
    cls, *_ = re.findall(r"`(\w+)`", defined_in)
    module, *others = paths_in(defined_in)
    assert cls == type(tiny).__name__ and defines(module, cls, ast.ClassDef), (section, defined_in)
    assert all((ROOT / p).exists() for p in others), (section, others)


def test_the_note_reader():
    assert _notes("a, b (x/y: c (d), e), f") == [("a", ""), ("b", "x/y: c (d), e"), ("f", "")]
    assert _value("0, 128") == (0, 128) and _value("false") is False and _value("gpu") == "gpu"
    assert _choices(type(TINY.train))["autocast"] == ("gpu", "auto", "off")
    assert _non_identity("regenerate") >= {"num_workers"} and not _non_identity("train.ttt")
