"""The docs a newcomer reads agree with the code: ARCHITECTURE.md's knob index lists every config field.

Purpose: each row of the "One-hop index: knobs" table names a pipeline-config section (`train.ttt`) and its fields;
the test walks `PipelineConfig` and checks that every section has a row whose fields are exactly the dataclass's
own (nested dataclasses are their own rows), so a new knob cannot land undocumented.
Run: `python -m pytest tests/test_docs.py` (a second).
Not here: the README's commands (tests/test_cli.py).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from components.pipeline_config import PipelineConfig

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
    assert set(documented) == set(actual), f"sections: missing {set(actual) - set(documented)}, " \
                                           f"stale {set(documented) - set(actual)}"
    for section, fields in actual.items():
        assert documented[section] == fields, (section, f"undocumented {fields - documented[section]}",
                                               f"stale {documented[section] - fields}")
