"""Head training against the machine: the TTT step's FLOPs per token, and its measured rate as a share of the cores'
matmul peak.

Run: `python bench/train_flops.py --target DIR --history RUN/train/history.jsonl [--threads 2] [--seq 320]`
(`--draft-vocab`, `--ttt-steps` as the run had them: the default preset's 2048 and 5).
FLOPs per token of one training step (forward + backward, backward counted as twice the forward; the frozen
embedding gets no gradient), per part: `fc` (3H -> H, once), per TTT step the attention projections (input 2H), the
attention itself (a query against half the sequence on average, plus its TTT diagonal), the MLP, the draft
`lm_head` (Vd rows); and the teacher, forward only, once per token: the target's full-vocabulary `lm_head` (V rows,
its argmax and the draft-vocabulary softmax). The peak: a square fp32 matmul (and bf16 where the CPU runs it
faster) on `--threads` threads, the best of a few repetitions. The run's rate: the median `tokens_per_s` of its
history (padded tokens, as the training loop counts them), times the FLOPs per token.
Writes train_flops.json. Read it beside the run it names: the machine must be as quiet as it was for that run.
Not measured here: memory traffic (the step is small-matrix work: its rate is bound by more than the peak).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)

from common import write_results


def flops_per_token(cfg, draft_vocab: int, ttt_steps: int, seq: int) -> dict[str, float]:
    """Forward+backward FLOPs of one trained token, by part (a multiply-add is 2 FLOPs)."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    train = 3  # forward, and a backward of twice its cost
    per_step = {"attn_proj": 2 * (2 * H * (q + 2 * kv) + q * H), "mlp": 2 * 3 * H * I, "draft_lm_head": 2 * H * draft_vocab}
    parts = {"fc": train * 2 * 3 * H * H}
    parts.update({k: train * ttt_steps * v for k, v in per_step.items()})
    parts["attention"] = train * sum(2 * 2 * q * (seq / 2 + k) for k in range(ttt_steps))
    parts["teacher_lm_head"] = 2 * H * V  # no gradient
    parts["total"] = sum(parts.values())
    return parts


def matmul_peak(threads: int, n: int = 2048, reps: int = 5) -> dict[str, float]:
    """GFLOP/s of an n x n x n matmul on `threads` threads, fp32 and bf16, the best of `reps`."""
    import torch

    torch.set_num_threads(threads)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        best = min(_timed(lambda: a @ b) for _ in range(reps))
        out[name] = 2 * n ** 3 / best / 1e9
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="the target directory (its config.json)")
    p.add_argument("--history", required=True, type=Path, help="a training run's train/history.jsonl")
    p.add_argument("--draft-vocab", type=int, default=2048)
    p.add_argument("--ttt-steps", type=int, default=5)
    p.add_argument("--seq", type=int, default=320, help="the batches' padded sequence length, on average")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    load = list(os.getloadavg())
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(args.target)
    parts = flops_per_token(cfg, args.draft_vocab, args.ttt_steps, args.seq)
    rates = [json.loads(line).get("tokens_per_s") for line in args.history.read_text().splitlines() if line.strip()]
    rate = statistics.median(r for r in rates if r)
    peak = matmul_peak(args.threads)
    achieved = rate * parts["total"] / 1e9
    print(f"FLOPs per trained token (MFLOP): " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in parts.items()))
    print(f"rate {rate:.0f} tokens/s -> {achieved:.1f} GFLOP/s; matmul peak on {args.threads} threads: "
          + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in peak.items())
          + f"; the step runs at {achieved / peak['fp32']:.0%} of the fp32 peak")
    print(write_results("train_flops", False, {
        "target": args.target, "history": str(args.history), "draft_vocab": args.draft_vocab,
        "ttt_steps": args.ttt_steps, "seq": args.seq, "mflop_per_token": {k: v / 1e6 for k, v in parts.items()},
        "tokens_per_s_median": rate, "achieved_gflops": achieved, "peak_gflops": peak,
        "share_of_fp32_peak": achieved / peak["fp32"]}, load))


if __name__ == "__main__":
    main()
