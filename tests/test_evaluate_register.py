"""Stage 4 and the pipeline config: evaluation of a real tiny head (the `head` fixture, also tests/test_register.py's).

Purpose: evaluation reports tau, acceptance by position, per-segment figures and plots, and proves outputs
identical; a broken verification rule is caught (NotLosslessError, report still written). Pipeline config: strict
loading, presets, a stable fingerprint.
Run: `python -m pytest tests/test_evaluate_register.py` (about 15 s once the tiny embedded default is built).
Not here: registration (tests/test_register.py); mocks of MLflow; the one monkeypatch breaks the verification rule on
purpose.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from components.data.traffic_io import load_traffic
from components.evaluate.stage import EvaluateConfig, HeadEval, NotLosslessError, evaluate
from components.extract.stage import ExtractConfig, extract
from components.regenerate.stage import RegenerateConfig, regenerate
from components.train.stage import TrainConfig, train

QUIET = dict(progress=lambda s: None)


@pytest.fixture(scope="module")
def head(tiny_embedded, tmp_path_factory):
    """A head trained by the real stages (regenerate -> extract -> train) on the tiny target."""
    root = tmp_path_factory.mktemp("head")
    regenerate(
        RegenerateConfig(max_new_tokens=12, temperature=1.0, shard_size=8, limit=8),
        tiny_embedded.target_dir,
        str(tiny_embedded.target_traffic.train),
        str(root / "regen"),
        **QUIET,
    )
    extract(
        ExtractConfig(max_len=160, seqs_per_shard=8),
        tiny_embedded.target_dir,
        str(root / "regen"),
        str(root / "ext"),
        **QUIET,
    )
    return train(TrainConfig.tiny(), str(root / "ext"), str(root / "train"))


# ---- evaluate ---------------------------------------------------------------------------------------------------


def test_evaluate_reports_acceptance_and_identical_outputs(tiny_embedded, head, tmp_path):
    cfg = EvaluateConfig.tiny()
    heldout = str(tiny_embedded.target_traffic.heldout)
    res = evaluate(
        cfg,
        HeadEval(
            tiny_embedded.target_dir,
            head.head_dir,
            heldout,
            str(tmp_path / "eval"),
            baseline_dir=head.head_dir,
            history_file=head.history_file,
        ),
        **QUIET,
    )
    assert res.identical is True and res.n_samples == cfg.limit
    assert 1.0 <= res.tau <= cfg.spec.depth + 1
    assert len(res.acceptance) == len(res.acceptance_cumulative) == cfg.spec.depth
    assert all(0.0 <= a <= 1.0 for a in res.acceptance + res.acceptance_cumulative)
    assert all(b <= a + 1e-9 for a, b in zip(res.acceptance_cumulative, res.acceptance_cumulative[1:]))
    segments = [c.segment for c in load_traffic(heldout).conversations[: cfg.limit]]
    assert set(res.per_segment) == set(segments)
    assert sum(s["verify_steps"] for s in res.per_segment.values()) > 0
    assert res.baseline_tau == pytest.approx(res.tau)  # the same head as its own baseline, same prompts
    assert res.n_tokens > 0 and res.speedup > 0 and res.plain_tokens_per_s > 0
    # the speedup: rounds of plain and speculative decoding interleaved (components/evaluate/speed.py), median and
    # interval
    assert res.speedup_rounds == cfg.speed.min_rounds and res.speedup_lo <= res.speedup <= res.speedup_hi
    assert res.speedup_reliable == (not res.speedup_note)
    report = json.loads(Path(res.report_file).read_text())
    assert report["result"]["tau"] == res.tau and len(report["samples"]) == cfg.limit
    assert len(report["speed"]["plain_s"]) == res.speedup_rounds and len(report["speed"]["plain_s"][0]) == cfg.limit
    assert {Path(p).name for p in res.plots} == {
        "acceptance_by_position.png",
        "acceptance_by_output_position.png",
        "training_curves.png",
    }
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in res.plots)
    assert res.metrics()["identical"] == 1.0 and res.metrics()["alpha_1"] == res.acceptance[0]
    # by output position: every step of these short outputs starts in the first bucket, whose τ is then the τ
    first, *rest = res.by_position
    assert (first["lo"], first["hi"]) == cfg.position_edges[:2] and not any(b["steps"] for b in rest)
    assert first["steps"] == sum(s["verify_steps"] for s in res.per_segment.values())
    assert first["tau"] == pytest.approx(res.tau) and res.metrics()["tau_pos_0_128"] == pytest.approx(res.tau)
    assert report["by_position_raw"][0]["tau"] == pytest.approx(res.tau_raw)


def test_untimed_our_evaluation_decodes_once_each_way_and_reports_no_speedup(tiny_embedded, head, tmp_path):
    """`time_local: false` (the demo, where vLLM times the head): the same outputs, τ and acceptance as a timed
    evaluation, each prompt decoded once each way, and no speedup of ours anywhere (nan fields, no metric)."""
    heldout = str(tiny_embedded.target_traffic.heldout)
    timed = evaluate(
        EvaluateConfig.tiny(),
        HeadEval(tiny_embedded.target_dir, head.head_dir, heldout, str(tmp_path / "timed")),
        **QUIET,
    )
    cfg = dataclasses.replace(EvaluateConfig.tiny(), time_local=False)
    lines: list[str] = []
    res = evaluate(
        cfg,
        HeadEval(tiny_embedded.target_dir, head.head_dir, heldout, str(tmp_path / "untimed")),
        progress=lines.append,
    )
    assert (res.identical, res.tau, res.acceptance, res.n_tokens) == (True, timed.tau, timed.acceptance, timed.n_tokens)
    assert res.speedup != res.speedup and not res.timed and timed.timed and res.speedup_rounds == 0
    assert not res.speedup_reliable and "time_local" in res.speedup_note
    assert not any(k.startswith(("speedup", "plain_tokens", "spec_tokens")) for k in res.metrics())
    assert not any(line.startswith("speedup") for line in lines), lines  # no timed round ran
    assert lines[-1] == "evaluate: speedup not timed (evaluate.time_local false); outputs identical"
    report = json.loads(Path(res.report_file).read_text())
    assert report["speed"] is None and not any("plain_s" in s for s in report["samples"])
    with pytest.raises(ValueError, match="time_local must be true or false"):
        dataclasses.replace(cfg, time_local="no")


def test_cli_evaluate_takes_method_depth_and_limit(tiny_embedded, head, tmp_path, monkeypatch, capsys):
    """`eagle-heads evaluate --depth/--method/--limit` override the preset's evaluation; a bad count exits 2."""
    from flows import cli

    monkeypatch.setenv("EAGLE_HOME", str(tmp_path / ".eagle"))
    out = tmp_path / "eval.json"
    args = [
        "evaluate",
        "--head",
        str(head.head_dir),
        "--target",
        str(tiny_embedded.target_dir),
        "--traffic",
        str(tiny_embedded.target_traffic.heldout),
        "--preset",
        "tiny",
        "--json",
        str(out),
    ]
    assert cli.main([*args, "--depth", "2", "--limit", "2"]) == 0
    res = json.loads(out.read_text())
    assert len(res["acceptance"]) == 2 and res["n_samples"] == 2 and res["identical"] is True
    assert cli.main([*args, "--method", "tree", "--depth", "3"]) == 0
    assert len(json.loads(out.read_text())["acceptance"]) == 3
    with pytest.raises(SystemExit) as e:
        cli.main([*args, "--depth", "0"])
    assert e.value.code == 2 and "--depth" in capsys.readouterr().err


def test_a_broken_verification_rule_is_caught(tiny_embedded, head, tmp_path, monkeypatch):
    """Accept every draft, whatever the target says: outputs change, and evaluation must fail loudly."""
    from eagle import sampling
    from eagle.export import export_head, load_head

    def accept_all(logits_BKV, draft_BK):
        n_B = torch.full((draft_BK.shape[0],), draft_BK.shape[1], dtype=torch.long)
        return n_B, logits_BKV[:, -1].argmax(-1)

    noisy = load_head(head.head_dir)  # a head whose drafts are mostly wrong, so accepting them changes outputs
    torch.manual_seed(0)
    torch.nn.init.normal_(noisy.lm_head.weight, std=1.0)
    noisy_dir = export_head(noisy, tmp_path / "noisy")
    monkeypatch.setattr(sampling, "accept_chain_greedy", accept_all)
    with pytest.raises(NotLosslessError, match="differ from plain greedy"):
        evaluate(
            EvaluateConfig.tiny(),
            HeadEval(
                tiny_embedded.target_dir,
                str(noisy_dir),
                str(tiny_embedded.target_traffic.heldout),
                str(tmp_path / "eval"),
            ),
            **QUIET,
        )
    report = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    assert report["result"]["identical"] is False and not all(s["identical"] for s in report["samples"])
    assert report["target_path"]["chosen"] in ("lean-packed", "lean-torch", "hf-packed", "hf-torch")


def test_our_evaluation_decodes_and_times_on_its_thread_count(tiny_embedded, head, tmp_path, monkeypatch):
    """`evaluate.threads`: the timed decoding runs on that many torch threads (default 1: on 2 cores torch's two
    threads turned a 1.35x head into 0.97x), the caller's setting is back afterwards, and 0 keeps the caller's."""
    import components.evaluate.stage as ev

    seen: list[int] = []
    real = ev.measure_speedup

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(ev, "measure_speedup", spy)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for threads in (1, 0):
            evaluate(
                dataclasses.replace(EvaluateConfig.tiny(), threads=threads),
                HeadEval(
                    tiny_embedded.target_dir,
                    head.head_dir,
                    str(tiny_embedded.target_traffic.heldout),
                    str(tmp_path / f"t{threads}"),
                ),
                **QUIET,
            )
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2] and EvaluateConfig().threads == 1
    with pytest.raises(ValueError, match="threads"):
        EvaluateConfig(threads=-1)
