"""tests/module_seconds.py, the figures that order the suite's modules longest first: read from a JUnit XML run.

Purpose: setup, call and teardown summed per module from a JUnit XML (classes folded into their module), the
committed figures load, and a file that is not JUnit XML is refused in one line (exit 2).
Run: `python -m pytest tests/test_module_seconds.py` (about a second).
Not here: the order itself (tests/conftest.py `pytest_collection_modifyitems`).
"""

from __future__ import annotations

from pathlib import Path


def test_module_seconds_sum_a_junit_run_by_module(tmp_path):
    """tests/module_seconds.py: setup, call and teardown of every test summed per module (classes folded into their
    module) from a JUnit XML; the committed figures load as module path -> seconds."""
    from tests.module_seconds import from_junit, load

    xml = tmp_path / "run.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="t1" time="1.25"/>'
        '<testcase classname="tests.test_a.TestX" name="t2" time="2.5"/>'
        '<testcase classname="tests.test_b" name="t3" time="7"/></testsuite></testsuites>'
    )
    assert from_junit(xml) == {"tests/test_b.py": 7.0, "tests/test_a.py": 3.8}
    committed = load()
    assert committed and all(m.startswith("tests/test_") and s >= 0 for m, s in committed.items())


def test_module_seconds_refuses_a_file_that_is_not_junit_in_one_line(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "run.xml"
    bad.write_text("not xml")
    script = Path(__file__).resolve().parent / "module_seconds.py"
    for arg in (str(bad), str(tmp_path / "missing.xml")):
        proc = subprocess.run([sys.executable, str(script), arg], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"{arg}: not a readable JUnit XML"), proc.stderr
