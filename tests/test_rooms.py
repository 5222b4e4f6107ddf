"""The rooms of components/: every module in one, each room importing only what the rules allow it.

Purpose: components/ is grouped by stage (ARCHITECTURE.md "Rooms of components/"), so that a newcomer finds a stage's
code in one folder and what two stages share in a folder of its own. Checked by reading the source (ast, no imports):
    every module sits in a room, components/<room>/<module>.py (ROOMS); a room's __init__.py is its docstring alone
                 (nothing re-exported: an importer names the module, so no old name lives on as an alias)
    a room imports its own modules, the shared rooms (SHARED_ROOMS: what two stages share lives there, and a shared
                 room imports no stage room) and the stage rooms ROOM_IMPORTS allows it, each with its reason; any
                 import counts (module level or in a function), as in tests/test_layout.py's cycle rule
    across rooms as anywhere, only public names cross modules and no room imports flows/ (tests/test_layout.py:
                 the private-name rule and FORBIDDEN_IMPORTS)
Run: `python -m pytest tests/test_rooms.py` (well under a second).
Not here: the layers' own boundaries and cycles (tests/test_layout.py), the rooms table of ARCHITECTURE.md
(tests/test_docs_tables.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layout import CYCLE_PACKAGES, MODULES, ROOT, Module, _module_name, imported_modules

# room -> what it holds (ARCHITECTURE.md's rooms table names the same rooms)
SHARED_ROOMS = {
    "data": "traffic, chat rendering, regenerated and captured conversations, atomic writes, safe reads",
    "targets": "the target directory, GGUF conversion, where the target runs, the head an engine loads",
}
STAGE_ROOMS = {
    "regenerate": "stage 1",
    "extract": "stage 2",
    "train": "stage 3",
    "evaluate": "stage 4",
    "registry": "stage 5",
    "serving": "the serving loop",
    "config": "the whole run's config",
}
ROOMS = {**SHARED_ROOMS, **STAGE_ROOMS}
# room -> {stage room it may import: why}; every room may import the shared rooms
ROOM_IMPORTS: dict[str, dict[str, str]] = {
    "config": {r: "the pipeline config is made of every stage's section" for r in STAGE_ROOMS if r != "config"},
    "serving": {"registry": "the monitor reads the served head's registry entry (its model name, registered tau)"},
}


def room_of(name: str) -> str | None:
    """'components.extract.stage' -> 'extract'; None outside a room."""
    parts = name.split(".")
    return parts[1] if parts[0] == "components" and len(parts) > 2 else None


def allowed_rooms(room: str) -> set[str]:
    """The rooms a module of `room` may import."""
    if room in SHARED_ROOMS:
        return set(SHARED_ROOMS)
    return {room, *SHARED_ROOMS, *ROOM_IMPORTS.get(room, {})}


def room_crossings(module: Module, ours: set[str]) -> list[str]:
    """`line: imports X` for each module of a room that `module`'s room may not import."""
    room = room_of(_module_name(module.rel))
    if room is None:
        return []
    found = sorted(imported_modules(module, ours).items(), key=lambda kv: kv[1])
    return [
        f"{line}: imports {target}"
        for target, line in found
        if target.startswith("components.") and room_of(target) not in allowed_rooms(room)
    ]


def test_the_room_rule_sees_what_it_should():
    ours = {"components.data.chat", "components.extract.stage", "components.train.stage", "components.registry.x"}

    def module(rel: str, src: str) -> Module:
        return Module(ROOT / rel, rel, "components", ast.parse(src), src.count("\n") + 1)

    train = module(
        "components/train/x.py",
        "from components.data.chat import a\ndef f():\n    from components.extract import stage\n",
    )
    assert room_crossings(train, ours) == ["3: imports components.extract.stage"]  # a function-level import counts
    data = module("components/data/x.py", "import components.train.stage")
    assert room_crossings(data, ours) == ["1: imports components.train.stage"]  # a shared room imports no stage
    serving = module("components/serving/x.py", "from components.registry.x import y")
    assert room_crossings(serving, ours) == []  # allowed by ROOM_IMPORTS, with its reason


def test_components_live_in_rooms():
    mods = [m for m in MODULES if m.package == "components"]
    loose = [
        m.rel
        for m in mods
        if m.rel != "components/__init__.py" and (len(Path(m.rel).parts) != 3 or Path(m.rel).parts[1] not in ROOMS)
    ]
    assert not loose, f"a module of components/ goes in one of the rooms {sorted(ROOMS)}:\n" + "\n".join(loose)
    missing = [r for r in ROOMS if not (ROOT / "components" / r / "__init__.py").is_file()]
    assert not missing, f"rooms without an __init__.py: {missing}"
    shims = [m.rel for m in mods if m.rel.endswith("__init__.py") and len(m.tree.body) > 1]
    assert not shims, "a room's __init__.py is its docstring alone (import the module):\n" + "\n".join(shims)


def test_rooms_import_only_shared_rooms_and_what_room_imports_allows():
    mods = [m for m in MODULES if m.package in CYCLE_PACKAGES]
    ours = {_module_name(m.rel) for m in mods}
    bad = [f"{m.rel}:{hit}" for m in mods if m.package == "components" for hit in room_crossings(m, ours)]
    assert not bad, (
        "a room imports another stage's room (move what both need to a shared room, "
        f"{sorted(SHARED_ROOMS)}, or allow it in ROOM_IMPORTS with its reason):\n" + "\n".join(bad)
    )
    stale = [f"{a} -> {b}" for a, to in ROOM_IMPORTS.items() for b in to if a not in ROOMS or b not in STAGE_ROOMS]
    assert not stale, f"ROOM_IMPORTS names rooms that are not stage rooms: {stale}"
