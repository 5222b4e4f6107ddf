"""The seconds each test module took in a measured run of the whole suite, so that the workers start the longest
modules first (tests/conftest.py `pytest_collection_modifyitems`).

Purpose: `--dist loadfile` hands whole modules to the 2 workers in the order the collection gives them; a long
module handed out last runs alone at the end while the other worker idles (a 179 s module did, 2026-12-04: the
suite then kept about 1.7 of its 2 cores busy). Longest first, the two workers finish within about one short module
of each other (1,268 s of tests instead of 1,428, bench/README.md). `tests/module_seconds.json` holds the figures;
refresh it from any whole-suite run's JUnit XML:
`python tests/module_seconds.py RUN.xml` (e.g. `make test PYTEST_ARGS=--junitxml=RUN.xml`). A module not in the
file (a new one) is ranked as `UNKNOWN_S`, or `UNKNOWN_HEAVY_S` when it has an engine, live or slow test.
Not here: which tests run (the markers), how many workers (the Makefile's TEST_WORKERS).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

FILE = Path(__file__).with_suffix(".json")
UNKNOWN_S = 5.0
UNKNOWN_HEAVY_S = 60.0


def load() -> dict[str, float]:
    """Module path (tests/test_x.py) -> seconds; empty when the file is missing or unreadable (order then by
    the unknown weights alone)."""
    try:
        return {m: float(s) for m, s in json.loads(FILE.read_text())["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def from_junit(path: str | Path) -> dict[str, float]:
    """Seconds per module (setup, call and teardown of its tests summed) from a JUnit XML of the suite."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(path).iter("testcase"):
        module = "/".join(case.get("classname", "").split(".")[:2]) + ".py"  # tests.test_x[.Class] -> tests/test_x.py
        seconds[module] += float(case.get("time") or 0.0)
    return {m: round(s, 1) for m, s in seconds.most_common()}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/module_seconds.py RUN.xml  (a whole-suite run's --junitxml)", file=sys.stderr)
        return 2
    try:
        seconds = from_junit(argv[0])
    except (OSError, ET.ParseError) as e:
        print(f"{argv[0]}: not a readable JUnit XML ({e})", file=sys.stderr)
        return 2
    if not seconds:
        print(f"{argv[0]}: no test cases", file=sys.stderr)
        return 1
    FILE.write_text(json.dumps({"source": Path(argv[0]).name, "seconds": seconds}, indent=1) + "\n")
    print(f"{FILE}: {len(seconds)} modules, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
