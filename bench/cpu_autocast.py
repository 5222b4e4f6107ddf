"""Does bf16 autocast train a head faster on this CPU? fp32 against bf16 steps, side by side, same data and seed.

Purpose: `train.autocast: auto` (eagle/train.py `autocast_dtype`) trains in bf16 on a CPU with Intel AMX units;
this measures whether that pays and what it does to the loss. On the features of one extract run (`--extract DIR`,
e.g. a demo head's `runs/<name>/<run>/extract`; default: the benchmarks' cached setup, bench/common.py `prepare`),
with the `default` preset's head config (TTT depth 5, batch 8, draft vocabulary 2,048), `--reps` repetitions of two
fresh heads (the same seed and batches), one trained in fp32 and one under bf16 autocast, `--steps` optimiser steps
each (the order of the two alternating between repetitions), on `--threads` torch threads (default 2: the demo's
worker has both cores). Per repetition: the median seconds of a step (the first `--warmup` steps left out) and the
TTT loss of the last step, each side. Reports the ratio fp32 / bf16 of the step medians (its median and minimum over
repetitions) and the loss difference; whether the CPU has AMX (`cpu_has_bf16_units`) is in the result.
Goal (on a CPU with AMX): ratio >= 1.2 with the last losses within 1% of each other.
`--whole-run` also trains one head each way for the preset's whole run (`components.train.stage.train` in this process,
`train.autocast` gpu against auto, the same seed) and reports the held-out simulated tau at every evaluation.
Run: `python bench/cpu_autocast.py [--quick] [--extract DIR] [--reps 5] [--steps 25] [--warmup 5] [--threads 2]
[--whole-run]` (about 2 minutes on 2 cores with the defaults, 4 more with `--whole-run`). Writes `cpu_autocast.json`.
Not here: GPUs (there bf16 is the default), the head's tau after a whole run (a demo's table shows it).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import common  # noqa: F401  (puts the repository on sys.path)
from common import base_args, goal_line, prepare, print_table, start, write_results

GOAL_RATIO, LOSS_BAND = 1.2, 0.01


def steps_of(extract_dir: str, cfg, amp, steps: int, warmup: int) -> tuple[float, float]:
    """A fresh head trained `steps` steps on `extract_dir` under autocast `amp` (None: fp32): (median step seconds
    past the warm-up, the last step's loss)."""
    import torch

    from components.train.data import TrainingData, batches, ttt_batch
    from components.train.loop import LoopArgs, new_head
    from eagle.train import TTTModule, make_optimizer, train_step

    data = TrainingData.open(extract_dir)
    torch.manual_seed(cfg.seed)
    draft = new_head(LoopArgs(cfg, extract_dir, "", None), data)
    opt, sched = make_optimizer(draft.trainable_parameters(), cfg.optim, cfg.steps)
    model = TTTModule(draft, cfg.ttt)
    times, loss = [], float("nan")
    for step, pos in batches(data.n_seqs, cfg.batch_size, cfg.seed, 0, 0, 1):
        if step >= steps:
            break
        batch = ttt_batch(data, list(pos), draft.draft_ids(), "cpu", None)
        t0 = time.perf_counter()
        out = train_step(model, draft, batch, cfg.ttt, opt, sched, cfg.optim.grad_clip, amp)
        times.append(time.perf_counter() - t0)
        loss = float(out.loss.detach())
    return statistics.median(times[warmup:]), loss


def main() -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--extract", default="", help="an extract stage's output directory (default: the cached setup)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--whole-run", action="store_true", help="also the preset's whole run each way: held-out tau")
    p.set_defaults(threads=2)
    args = p.parse_args()
    if args.reps < 1 or args.steps < 1 or not 0 <= args.warmup < args.steps:
        p.error(
            f"--reps and --steps must be >= 1 and --warmup in [0, --steps), got --reps {args.reps} --steps "
            f"{args.steps} --warmup {args.warmup}"
        )
    if args.extract and not (Path(args.extract) / "manifest.json").is_file():
        p.error(f"--extract {args.extract}: not an extract stage's output (no manifest.json in it)")
    load_before = start(args)
    import torch

    from components.config.pipeline import PipelineConfig
    from eagle.train import cpu_has_bf16_units

    if args.quick:
        args.reps, args.steps, args.warmup = 2, 4, 1
    extract_dir = args.extract or str(prepare(args.quick).extract_dir)
    cfg = PipelineConfig.preset("tiny" if args.quick else "default").train
    amx = cpu_has_bf16_units()
    rows = []
    for rep in range(args.reps):
        order = ("fp32", "bf16") if rep % 2 == 0 else ("bf16", "fp32")
        got = {
            m: steps_of(extract_dir, cfg, torch.bfloat16 if m == "bf16" else None, args.steps, args.warmup)
            for m in order
        }
        rows.append(
            {
                "rep": rep,
                "order": list(order),
                "fp32_step_s": got["fp32"][0],
                "bf16_step_s": got["bf16"][0],
                "ratio": got["fp32"][0] / got["bf16"][0],
                "fp32_loss": got["fp32"][1],
                "bf16_loss": got["bf16"][1],
            }
        )
        print(
            f"cpu_autocast: rep {rep + 1}/{args.reps}: fp32 {got['fp32'][0]:.3f} s/step, bf16 {got['bf16'][0]:.3f} "
            f"s/step ({rows[-1]['ratio']:.2f}x); last loss {got['fp32'][1]:.4f} / {got['bf16'][1]:.4f}",
            flush=True,
        )
    ratios = [r["ratio"] for r in rows]
    loss_gap = max(abs(r["bf16_loss"] / r["fp32_loss"] - 1) for r in rows)
    summary = {
        "amx": amx,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "loss_gap_max": loss_gap,
        "extract_dir": extract_dir,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
    }
    print_table(
        [{**r, "order": "/".join(r["order"])} for r in rows],
        ["rep", "order", "fp32_step_s", "bf16_step_s", "ratio", "fp32_loss", "bf16_loss"],
        f"fp32 against bf16 autocast, {args.steps} steps a head (AMX: {'yes' if amx else 'no'})",
    )
    goal = goal_line(
        "bf16 step speed-up (fp32 s / bf16 s, median over repetitions)",
        summary["ratio_median"],
        GOAL_RATIO,
        0 if loss_gap <= LOSS_BAND else 1,
        method=f"min {summary['ratio_min']:.2f}x; last losses within {100 * loss_gap:.2f}% (a loss "
        f"gap over {100 * LOSS_BAND:.0f}% counts as a mismatch)",
    )
    runs = whole_runs(cfg, extract_dir) if args.whole_run else {}
    write_results(
        "cpu_autocast", args.quick, {"summary": summary, "goal": goal, "rows": rows, "whole_runs": runs}, load_before
    )


def whole_runs(cfg, extract_dir: str) -> dict[str, list]:
    """The preset's whole training run in this process, `train.autocast` gpu (fp32 here) and auto: each held-out
    evaluation's (step, simulated tau)."""
    import dataclasses
    import json
    import tempfile

    from components.train.stage import RayConfig, train

    out = {}
    for mode in ("gpu", "auto"):
        with tempfile.TemporaryDirectory() as tmp:
            train(dataclasses.replace(cfg, autocast=mode, ray=RayConfig(num_workers=0)), extract_dir, tmp, None)
            rows = [json.loads(line) for line in Path(tmp, "history.jsonl").read_text().splitlines()]
        out[mode] = [(r["step"], r["heldout_tau"]) for r in rows if "heldout_tau" in r]
        print(
            f"cpu_autocast: whole run, autocast {mode}: held-out tau "
            + ", ".join(f"{t:.3f} at {s}" for s, t in out[mode]),
            flush=True,
        )
    return out


if __name__ == "__main__":
    main()
