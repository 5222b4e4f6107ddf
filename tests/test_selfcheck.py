"""`python -m eagle.selfcheck` end to end (short): trains, exports, reloads, checks the probe and losslessness."""

import json

import pytest

from eagle import selfcheck


@pytest.mark.slow
def test_selfcheck_passes(tmp_path):
    assert selfcheck.main(["--out", str(tmp_path), "--steps", "20", "--samples", "16", "--new-tokens", "24"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["probe_max_abs_diff"] < 1e-4
    assert report["chain"]["identical"] and report["tree"]["identical"]
    assert (tmp_path / "head" / "config.json").is_file() and (tmp_path / "target" / "config.json").is_file()
