"""The benchmarks' own checks that need no quick run: bad arguments refused, the call counter, the ratio pairing.

Purpose: keep bench/'s scripts honest where a quick run would not show it: real_head.py, capture_mix.py and
proxy_overhead.py refuse bad arguments in one line (exit 2) before any work; speedup's `CallCounter`
(bench/speedup_methods.py) hooks the target only while counting (a hook anywhere makes our loops leave their lean
decoder); proxy_overhead.py's ratios pair the direct and proxy cells of each round. Marked slow, as the quick runs
in tests/test_bench_quick.py, whose module they were part of.
Run: `python -m pytest -m slow tests/test_bench_checks.py` (1-2 minutes on 2 busy cores: each refusal is a fresh
process).
Not here: the quick runs and their result files (tests/test_bench_quick.py), the figures (bench/README.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_call_counter_hooks_the_target_only_while_counting() -> None:
    """speedup.py counts transformers' passes with a forward hook; outside `counting()` the target must have none,
    or our loops would leave their lean decoder (slower plain and speculative decoding alike)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "bench"))
    from speedup_methods import CallCounter

    from eagle.fastpath import LeanDecoder

    target = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=64,
        )
    ).eval()
    counter = CallCounter(target)
    assert LeanDecoder.of(target) is not None
    with counter.counting(), torch.no_grad():
        target(torch.tensor([[1, 2, 3]]))
        assert counter.n == 1
    assert LeanDecoder.of(target) is not None


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--runs", "-1"], "--runs must not be negative"),
        (["--summary", "/no/such/summary.json"], "does not exist"),
        (["--head", ".", "--summary", "."], "give one"),
    ],
)
def test_real_head_refuses_bad_arguments_in_one_line_before_any_work(argv, says):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "real_head.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and says in out.stderr.strip().splitlines()[-1], out.stderr


def test_proxy_overhead_ratios_pair_the_cells_of_each_round() -> None:
    """proxy_overhead.py's ratio is per round (a direct and a proxy cell back to back), its median the goal's figure,
    min and max its interval; the per-mode medians are over rounds."""
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "bench"))
    from proxy_overhead import summarize

    def cell(tok_s, ttft):
        return SimpleNamespace(output_tokens_per_s=tok_s, median_ttft_ms=ttft)

    keys = [
        (1, "direct"),
        (1, "proxy"),
        (16, "direct"),
        (16, "proxy"),
        (1, "proxy"),
        (1, "direct"),
        (16, "proxy"),
        (16, "direct"),
        (1, "direct"),
        (1, "proxy"),
        (16, "direct"),
        (16, "proxy"),
    ]
    cells = [
        cell(100, 10),
        cell(98, 12),
        cell(400, 50),
        cell(400, 60),
        cell(90, 10),
        cell(80, 10),
        cell(380, 50),
        cell(400, 50),
        cell(110, 10),
        cell(110, 14),
        cell(500, 50),
        cell(450, 50),
    ]
    out = summarize(keys, cells)
    assert out[1]["tok_s_ratio_by_round"] == [0.98, 90 / 80, 1.0]  # rounds pair by order of each mode's cells
    assert (out[1]["tok_s_ratio"], out[1]["tok_s_ratio_min"], out[1]["tok_s_ratio_max"]) == (1.0, 0.98, 90 / 80)
    assert out[16]["tok_s_ratio"] == 0.95 and out[16]["direct"]["tok_s"] == 400 and out[1]["ttft_ratio"] == 1.2
    with pytest.raises(ValueError, match="concurrency 1: 1 direct and 0 proxy"):
        summarize([(1, "direct")], [cell(1, 1)])


@pytest.mark.parametrize(
    "script, argv, says",
    [
        ("capture_mix", ["--mixes", "1.0"], "must lie in (0, 1)"),
        ("capture_mix", ["--build", "/no/such/build"], "not a real build of the embedded default"),
        ("capture_mix", ["--quick", "--build", "."], "exclude each other"),
        ("proxy_overhead", ["--target", "."], "go together"),
        ("proxy_overhead", ["--target", ".", "--heldout", "/no/such.jsonl"], "not a model directory"),
        ("proxy_overhead", ["--prompts", "8"], "--prompts >= 16"),
    ],
)
def test_bench_serving_scripts_refuse_bad_arguments_in_one_line_before_any_work(script, argv, says):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{script}.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and says in out.stderr.strip().splitlines()[-1], out.stderr
