"""The cheap benchmarks run end to end in `--quick` mode and write result files that make sense.

Purpose: keep bench/ runnable. speedup, batch, acceptance_vs_depth, chain_depth and checkpoint_by_tau run as
scripts with `--quick` (the tiny embedded preset) in one temporary cache directory (`--cache`, shared so the tiny
build, the regenerated traffic and the TTT head are made once), each under a timeout; the tests read the JSON they
write: every method and head is present, greedy outputs equal plain greedy decoding, ratios are positive.
Run: `python -m pytest -m slow tests/test_bench_quick.py` (about 2-3 minutes on 2 cores with a cold cache).
Not here: the figures themselves (a tiny target's numbers mean nothing), data_scaling and train_throughput
(several trainings or Ray starts each; run them by hand).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench-cache")


def run_quick(name: str, cache: Path, timeout_s: int = 240, *extra: str) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), "--quick", "--cache", str(cache),
                           *extra], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{name} --quick failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    if "--setup-only" in extra:
        return {"stdout": proc.stdout}
    result = cache / "results-quick" / f"{name}.json"
    assert result.is_file() and result.with_suffix(".png").is_file()
    return json.loads(result.read_text())


def test_speedup_quick(cache: Path) -> None:
    r = run_quick("speedup", cache)
    greedy = {row["method"]: row for row in r["tables"]["0"]}
    assert set(greedy) == {"plain", "eagle-chain", "eagle-tree", "hf-plain", "hf-lookup", "hf-assisted"}
    assert all(row["mismatch"] == 0 for name, row in greedy.items() if name.startswith(("plain", "eagle"))), greedy
    assert all(row["tok_s"] > 0 and row["tok_per_call"] >= 1.0 for row in greedy.values())
    assert greedy["eagle-chain"]["tau"] >= 1.0 and "speedup vs plain >= 2.0" in r["goals_T0"]


def test_batch_quick(cache: Path) -> None:
    r = run_quick("batch", cache)
    assert [row["batch"] for row in r["rows"]] == [1, 2, 4]
    assert all(row["mismatch_rows"] == 0 and row["ratio"] > 0 for row in r["rows"]), r["rows"]


def test_acceptance_vs_depth_quick(cache: Path) -> None:
    r = run_quick("acceptance_vs_depth", cache)
    assert set(r["heads"]) == {"eagle3-ttt7", "eagle3-ttt1", "eagle1"}
    for head in r["heads"].values():
        assert len(head["alpha"]) == 7 and all(0 <= a <= 1 for a in head["alpha"])
        assert head["mismatches"] == 0 and head["tau"] >= 1.0


def test_speedup_setup_only_with_more_conversations(cache: Path) -> None:
    """`--conversations N` regenerates N conversations in a cache directory of its own; `--setup-only` trains and
    stops before measuring (no result file)."""
    r = run_quick("speedup", cache, 240, "--conversations", "12", "--setup-only", "--head-steps", "4")
    assert "setup done: head" in r["stdout"]
    work = [d for d in cache.glob("*-target-quick-c12") if d.is_dir()]
    assert len(work) == 1 and json.loads((work[0] / "prepared.json").read_text())["n_seqs"] <= 12
    assert list(work[0].glob("heads/eagle3-ttt7-*/head/model.safetensors"))
    assert not (cache / "results-quick" / "speedup-head4-conv12.json").exists()



def test_chain_depth_quick(cache: Path) -> None:
    r = run_quick("chain_depth", cache, 240, "--depths", "2,3", "--trees", "3,2,4")
    rows = {row["method"]: row for row in r["rows"]}
    assert list(rows) == ["plain", "chain-2", "chain-3", "tree-3,2,4"]
    assert all(row["mismatch"] == 0 and row["tok_s"] > 0 for row in rows.values()), rows
    assert len(rows["chain-3"]["alpha"]) == 3 and rows["chain-2"]["tau"] >= 1.0 and r["fastest"] in rows


def test_checkpoint_by_tau_quick(cache: Path) -> None:
    r = run_quick("checkpoint_by_tau", cache)
    assert [row["step"] for row in r["heldout"]] == [4, 8, 12, 16]  # --quick: 16 steps, evaluated every 4
    best, last = r["heads"]["best"], r["heads"]["last"]
    assert best["step"] == r["selected_step"] == max(r["heldout"], key=lambda x: (x["heldout_tau"],
                                                                                 -x["heldout_loss"]))["step"]
    assert last["step"] == 16 and last["rule"].startswith("last step 16")
    assert all(h["identical"] and h["tau"] >= 1.0 and 0 <= h["a1"] <= 1 for h in (best, last)), r["heads"]


def test_chain_depth_runs_in_fresh_processes(cache: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "chain_depth.py"), "--quick", "--cache", str(cache),
                           "--depths", "2", "--runs", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("run ") >= 2 and "median of 2 runs" in proc.stdout
    r = json.loads((cache / "results-quick" / "chain_depth-runs2.json").read_text())
    row = {row["method"]: row for row in r["rows"]}["chain-2"]
    assert len(row["x_plain_runs"]) == 2 and row["x_plain_min"] <= row["x_plain_median"] <= row["x_plain_max"]
    assert row["mismatch"] == 0


def test_call_counter_hooks_the_target_only_while_counting() -> None:
    """speedup.py counts transformers' passes with a forward hook; outside `counting()` the target must have none,
    or our loops would leave their lean decoder (slower plain and speculative decoding alike)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "bench"))
    from speedup import CallCounter

    from eagle.fastpath import LeanDecoder

    target = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=2, num_key_value_heads=2, vocab_size=64)).eval()
    counter = CallCounter(target)
    assert LeanDecoder.of(target) is not None
    with counter.counting(), torch.no_grad():
        target(torch.tensor([[1, 2, 3]]))
        assert counter.n == 1
    assert LeanDecoder.of(target) is not None
