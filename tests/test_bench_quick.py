"""The cheap benchmarks run end to end in `--quick` mode and write result files that make sense.

Purpose: keep bench/ runnable and its verdicts honest. speedup, batch, acceptance_vs_depth, chain_depth,
checkpoint_by_tau, target_path and features_tau (marked engine too: it starts vLLM) run as scripts with `--quick`
(the tiny embedded preset) in one temporary cache directory
(`--cache`, shared so the tiny build, the regenerated traffic and the TTT head are made once), each under a timeout;
the tests read the JSON they write: every method and head is present, greedy outputs equal plain greedy decoding,
ratios are positive, tau counts emitted tokens (tau x verification steps = output tokens after the first), a goal is
met only with 0 mismatches, every file carries the run's metadata (commit, clean flag, CPU). With the greedy
acceptance rule broken on purpose (`eagle.sampling.accept_chain_greedy` patched in process to keep every draft),
speedup must report the mismatches and meet no goal. `write_results` keeps an earlier run of the same name.
Run: `python -m pytest -m slow tests/test_bench_quick.py` (about 2-3 minutes on 2 cores with a cold cache).
Not here: the figures themselves (a tiny target's numbers mean nothing), the benchmarks without a quick row here
(bench/README.md: run them by hand), the benchmarks' checks that need no quick run (tests/test_bench_checks.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
OURS = ("plain", "eagle-chain", "eagle-tree", "lookup", "draft-model")  # lossless, our loop: greedy == plain


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench-cache")


def run_quick(name: str, cache: Path, timeout_s: int = 240, *extra: str, result_name: str = "") -> dict:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--quick", "--cache", str(cache), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, f"{name} --quick failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    if "--setup-only" in extra:
        return {"stdout": proc.stdout}
    result = cache / "results-quick" / f"{result_name or name}.json"
    assert result.is_file() and result.with_suffix(".png").is_file()
    return json.loads(result.read_text())


def check_metadata(r: dict) -> None:
    """The run's metadata that `common.write_results` attaches to every result file."""
    meta = r["metadata"]
    if (ROOT / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}", meta["commit"]) and isinstance(meta["tree_clean"], bool), meta
        assert meta["tree_clean"] == (meta["n_changed_paths"] == 0)
    assert meta["cpu_model"] and isinstance(meta["cpu_caches"], dict) and meta["torch"] and meta["date"]
    assert r["history"][-1]["date"] == meta["date"] and isinstance(r["earlier_runs"], list)


def check_goals(goals: dict, mismatches: int) -> None:
    """Every goal of a run: met exactly when its figure reached it and no lossless output differed."""
    lines = [g for g in goals.values() if isinstance(g, dict)]
    assert lines and all(g["mismatches"] == mismatches for g in lines), goals
    assert all(g["met"] == (g["reached"] and mismatches == 0) for g in lines), goals


def test_speedup_quick(cache: Path) -> None:
    """Two fresh measuring processes (`--runs 2`): every ratio's median, minimum and maximum over the two."""
    r = run_quick("speedup", cache, 300, "--runs", "2", result_name="speedup-runs2")
    check_metadata(r)
    greedy = {row["method"]: row for row in r["tables"]["0"]}
    for row in greedy.values():
        assert len(row["x_plain_runs"]) == 2 and row["x_plain_min"] <= row["x_plain"] <= row["x_plain_max"], row
        assert row["x_plain_min"] == min(row["x_plain_runs"]) and row["x_own_min"] <= row["x_own"], row
    assert greedy["plain"]["x_plain"] == 1.0 and greedy["hf-plain"]["x_own"] == 1.0
    assert "minimum speedup vs plain >= 1.9" in r["goals_T0"]
    assert set(greedy) == {
        "plain",
        "eagle-chain",
        "eagle-tree",
        "lookup",
        "draft-model",
        "hf-plain",
        "hf-lookup",
        "hf-assisted",
    }
    assert r["draft_model"]["x_target_compute"] <= 0.25 and r["draft_model"]["shape"]["tie_word_embeddings"]
    assert all(greedy[name]["mismatch"] == 0 for name in OURS), greedy
    assert all(row["tok_s"] > 0 and row["tok_per_call"] >= 1.0 for row in greedy.values())
    for name in ("eagle-chain", "eagle-tree"):  # tau counts emitted tokens: the output after the prefill's token
        row, n = greedy[name], r["n_prompts"]
        steps = round(row["tokens"] / row["tok_per_call"]) - n  # target passes: prefill + one per verification
        assert row["tau"] * steps == pytest.approx(row["tokens"] - n) and 1.0 <= row["tau"] <= row["tau_raw"], row
    check_goals(r["goals_T0"], 0)


def test_speedup_with_a_broken_acceptance_rule_meets_no_goal(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The greedy rule made to keep every draft (right or wrong) and to emit the target's runner-up as the bonus
    token (the tiny quick target is so repetitive that its head drafts right every time, so keeping every draft
    alone changes nothing): the chain's outputs differ from plain decoding, the table says so, and no goal is met,
    although the inflated tau reaches its goal."""
    import torch

    import eagle.sampling

    def broken_rule(target_logits_BKV: torch.Tensor, draft_BK: torch.Tensor):
        n_B = torch.full(draft_BK.shape[:1], draft_BK.shape[1], dtype=torch.long, device=draft_BK.device)
        return n_B, target_logits_BKV[:, -1].topk(2, dim=-1).indices[:, 1]

    monkeypatch.setattr(eagle.sampling, "accept_chain_greedy", broken_rule)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import speedup

    threads = torch.get_num_threads()
    try:
        speedup.main(["--quick", "--cache", str(cache), "--temperatures", "0"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    r = json.loads((cache / "results-quick" / "speedup-T0.json").read_text())
    greedy = {row["method"]: row for row in r["tables"]["0"]}
    bad = sum(greedy[name]["mismatch"] for name in OURS)
    assert greedy["eagle-chain"]["mismatch"] > 0 and bad == r["goals_T0"]["mismatches_ours"], greedy
    check_goals(r["goals_T0"], bad)
    assert not any(g["met"] for g in r["goals_T0"].values() if isinstance(g, dict))
    assert r["goals_T0"]["tau >= 4"]["reached"], r["goals_T0"]  # depth 5, every draft kept: tau near 6
    assert "-> met" not in out and f"{bad} mismatches -> NOT MET" in out, out[-3000:]


def test_write_results_keeps_earlier_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import common

    monkeypatch.setattr(common, "CACHE", tmp_path)
    path = common.write_results("probe", True, {"figure": 1}, [0.0, 0.0, 0.0])
    first = json.loads(path.read_text())
    check_metadata(first)
    assert first["figure"] == 1 and first["earlier_runs"] == [] and len(first["history"]) == 1
    assert common.write_results("probe", True, {"figure": 2}, [0.0, 0.0, 0.0]) == path
    r = json.loads(path.read_text())
    check_metadata(r)
    assert r["figure"] == 2 and [e["figure"] for e in r["earlier_runs"]] == [1]
    assert r["earlier_runs"][0]["metadata"] == first["metadata"] and len(r["history"]) == 2
    out = capsys.readouterr().out
    assert "run 2 of probe" in out and f"earlier run(s) of {first['metadata']['date']}" in out, out


def test_batch_quick(cache: Path) -> None:
    r = run_quick("batch", cache)
    check_metadata(r)
    assert [row["batch"] for row in r["rows"]] == [1, 2, 4]
    for row in r["rows"]:  # --runs 3 (the default): median and min of three timed blocks, after a warm-up
        assert row["mismatch_rows"] == 0 and len(row["ratio_runs"]) == 3, row
        assert 0 < row["ratio_min"] <= row["ratio"] <= row["ratio_max"] and 1.0 <= row["tau"] <= row["tau_raw"], row


def test_acceptance_vs_depth_quick(cache: Path) -> None:
    r = run_quick("acceptance_vs_depth", cache)
    assert set(r["heads"]) == {"eagle3-ttt7", "eagle3-ttt1", "eagle1"}
    for head in r["heads"].values():
        assert len(head["alpha"]) == 7 and all(0 <= a <= 1 for a in head["alpha"])
        assert head["mismatches"] == 0 and 1.0 <= head["tau"] <= head["tau_raw"]
        assert head["reached"][0] == head["verify_steps"]  # every live step emits at least one token
    assert all(c["met"] == c["reached"] for c in r["claims"].values()), r["claims"]  # 0 mismatches


def test_speedup_setup_only_with_more_conversations(cache: Path) -> None:
    """`--conversations N` regenerates N conversations in a cache directory of its own; `--setup-only` trains and
    stops before measuring (no result file)."""
    r = run_quick("speedup", cache, 240, "--conversations", "12", "--setup-only", "--head-steps", "4")
    assert "setup done: head" in r["stdout"]
    work = [d for d in cache.glob("*-target-quick-c12") if d.is_dir()]
    assert len(work) == 1 and json.loads((work[0] / "prepared.json").read_text())["n_seqs"] <= 12
    assert list(work[0].glob("heads/eagle3-ttt7-*/head/model.safetensors"))
    assert not (cache / "results-quick" / "speedup-head4-conv12.json").exists()


def test_speedup_side_by_side_trains_the_draft_model_for_the_heads_time(cache: Path) -> None:
    """`--side-by-side`: the draft model trains in a second process while the head trains, half the cores each,
    and stops when the head is done; the measurement then finds both cached and names the time ratio."""
    import os

    r = run_quick(
        "speedup",
        cache,
        300,
        "--side-by-side",
        "--head-steps",
        "6",
        "--temperatures",
        "0",
        result_name="speedup-head6-T0",
    )
    dm, half = r["draft_model"], max(1, (os.cpu_count() or 2) // 2)
    assert dm["side_by_side"]["head_seconds"] == pytest.approx(r["head_train_seconds"], abs=0.1)
    assert dm["steps"] > 0 and dm["torch_threads"] == half, dm
    assert dm["budget_s"] == max(10.0, round(r["head_train_seconds"]))  # cached where ensure(head.seconds) looks
    assert r["args"]["side_by_side"] and all(
        row["mismatch"] == 0 for row in r["tables"]["0"] if row["method"] in OURS
    ), r["tables"]["0"]


def test_chain_depth_quick(cache: Path) -> None:
    r = run_quick("chain_depth", cache, 240, "--depths", "2,3", "--trees", "3,2,4")
    rows = {row["method"]: row for row in r["rows"]}
    assert list(rows) == ["plain", "chain-2", "chain-3", "tree-3,2,4"]
    assert all(row["mismatch"] == 0 and row["tok_s"] > 0 for row in rows.values()), rows
    assert len(rows["chain-3"]["alpha"]) == 3 and rows["chain-2"]["tau"] >= 1.0 and r["fastest"] in rows
    check_goals(r["goals"], 0)


def test_checkpoint_by_tau_quick(cache: Path) -> None:
    r = run_quick("checkpoint_by_tau", cache)
    assert [row["step"] for row in r["heldout"]] == [4, 8, 12, 16]  # --quick: 16 steps, evaluated every 4
    best, last = r["heads"]["best"], r["heads"]["last"]
    assert (
        best["step"]
        == r["selected_step"]
        == max(r["heldout"], key=lambda x: (x["heldout_tau"], -x["heldout_loss"]))["step"]
    )
    assert last["step"] == 16 and last["rule"].startswith("last step 16")
    assert all(h["identical"] and h["tau"] >= 1.0 and 0 <= h["a1"] <= 1 for h in (best, last)), r["heads"]


def test_target_path_quick(cache: Path) -> None:
    """Every path decodes (plain and chain) the tokens of the default path; auto's pick is one of them and its
    goals follow the figures."""
    from eagle.target_path import PATHS

    r = run_quick("target_path", cache)
    check_metadata(r)
    rows = {row["method"]: row for row in r["rows"]}
    assert set(rows) == {f"{m}:{p}" for m in ("plain", "chain") for p in PATHS} | {"hf-plain"}
    assert all(row["mismatch"] == 0 and row["tok_s"] > 0 for row in rows.values()), rows
    for role in ("decode", "verify"):
        auto = r["auto"][role]
        assert auto["chosen"] in PATHS and set(auto["ms_per_pass"]) == set(PATHS) and auto["reason"]
    assert r["auto"]["chosen"] == r["auto"]["verify"]["chosen"]
    pick = r["pick"]  # plain decoding runs on the decode role's pick
    assert pick["chosen"] == r["auto"]["decode"]["chosen"] and 0 < pick["chosen_x_fastest"] <= 1.0
    assert pick["chosen_x_fastest"] == pytest.approx(
        rows[f"plain:{pick['chosen']}"]["tok_s"] / rows[f"plain:{pick['fastest_plain']}"]["tok_s"]
    )
    check_goals(r["goals"], 0)


def test_chain_depth_runs_in_fresh_processes(cache: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "chain_depth.py"),
            "--quick",
            "--cache",
            str(cache),
            "--depths",
            "2",
            "--runs",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("run ") >= 2 and "median of 2 runs" in proc.stdout
    r = json.loads((cache / "results-quick" / "chain_depth-runs2.json").read_text())
    row = {row["method"]: row for row in r["rows"]}["chain-2"]
    assert len(row["x_plain_runs"]) == 2 and row["x_plain_min"] <= row["x_plain_median"] <= row["x_plain_max"]
    assert row["mismatch"] == 0


def test_speedup_trust_quick(cache: Path) -> None:
    """bench/speedup_trust.py: fresh processes quiet and under a load job, each figure against the quiet median."""
    r = run_quick("speedup_trust", cache, 600, "--runs", "1")
    check_metadata(r)
    assert [x["condition"] for x in r["runs"]] == ["quiet", "loaded"]
    assert all(x["lo"] <= x["speedup"] <= x["hi"] and x["rounds"] >= 2 for x in r["runs"])
    assert set(r["verdict"]["by_condition"]) == {"quiet", "loaded"}
    # the target-path timings are kept across the run's processes: each fresh process adds one measurement
    assert r["timings"] == "run" and [x["path_timings_kept"] for x in r["runs"]] == [1, 2]
    check_goals(r["goals"], r["mismatches"])


@pytest.mark.engine
def test_features_tau_quick(cache: Path) -> None:
    """bench/features_tau.py: heads trained on local and on vLLM features, the same seeds, tau per head and the
    per-features summary; starts vLLM for the engine extraction (a missing `.venv-vllm` fails with its line)."""
    r = run_quick("features_tau", cache, 400, "--seeds", "2")
    check_metadata(r)
    assert [(row["features"], row["seed"]) for row in r["rows"]] == [
        ("local", 0),
        ("local", 1),
        ("vllm", 0),
        ("vllm", 1),
    ]
    assert all(row["mismatch"] == 0 and 1.0 <= row["tau"] <= row["tau_raw"] for row in r["rows"]), r["rows"]
    for s in r["summary"].values():
        assert s["seeds"] == 2 and s["min"] <= s["median"] <= s["max"] and s["range"] == s["max"] - s["min"]
    assert r["engine_over_local"] == pytest.approx(r["summary"]["vllm"]["median"] / r["summary"]["local"]["median"])
    assert r["features_max_rel_diff"] < 1e-2  # bf16 storage of the same features
    check_goals(r["goals"], 0)


@pytest.mark.engine
def test_long_variants_quick(cache: Path) -> None:
    """bench/long_variants.py: heads of two variants on the long traffic (ignore_eos, each prompt to its own limit),
    tau by output-position bucket in our loop and in vLLM, the speedup over vLLM plain; 0 mismatches."""
    r = run_quick("long_variants", cache, 600)
    check_metadata(r)
    assert r["target"] == "base+ignore_eos" and r["edges"] == [0, 128, 512, 2048]
    assert [row["variant"] for row in r["rows"]] == ["eagle3", "eagle3.1"]
    for row in r["rows"]:
        assert row["mismatch vLLM"] == 0 and row["mismatch ours"] == 0 and row["x vLLM plain"] > 0, row
        assert 1.0 <= row["tau ours 0-128"] and 1.0 <= row["tau vLLM 0-128"] and "tau vLLM 128-512" in row, row
    for rd in r["per_round"]:  # ignore_eos: every request ran to its sample's limit
        assert all(m["tokens"] == sum(r["limits"]) for m in rd.values()), rd
    check_goals(r["goals"], 0)


def test_capture_mix_quick(cache: Path) -> None:
    """capture_mix.py: the champion, a head per mix with the counts a retrain on capture would use, and a fresh head
    on the captured conversations alone, each decoded on both domains with outputs identical to plain decoding."""
    from components.data.captured_traffic import mix_counts

    r = run_quick("capture_mix", cache, 300, "--mixes", "0.25", "0.75", "--prompts", "2")
    check_metadata(r)
    champion, *mixed, offline = r["rows"]
    assert champion["head"] == "champion" and champion["captured"] == 0 and offline["registered"] == 0
    assert [m["mix"] for m in mixed] == [0.25, 0.75]
    for m in mixed:
        assert (m["captured"], m["registered"]) == mix_counts(offline["captured"], champion["registered"], m["mix"])
    for row in r["rows"]:
        assert row["identical_shift"] and row["identical_base"] and row["tau_shift"] >= 1 and row["tau_base"] >= 1
        assert row["x_offline_shift"] == round(row["tau_shift"] / offline["tau_shift"], 3)
    assert r["goal"]["met"] == (r["goal"]["measured"] >= 0.95)
