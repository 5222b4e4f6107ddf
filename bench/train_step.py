"""What a training iteration costs on one extract run's features, four ways side by side: fp32, bf16 autocast, bf16
with batches of like length, and those with the teacher kept.

Purpose: the `default` preset trains the real model's head with three speed-ups (components/config/presets.py): bf16
autocast where the CPU has bf16 units (`train.autocast: auto`), batches of like-length sequences
(`train.bucket_by_length`) and each sequence's teacher computed once and kept (`train.teacher_cache_mib`). This
times whole iterations (the batch built from the shards, the teacher, the forward and backward, the optimiser step)
of a fresh head with the preset's head config on `--extract DIR`'s features, `--steps` iterations a way (the first
`--warmup` left out), the four ways in an order that rotates between `--reps` repetitions. The teacher-kept way
first builds its batches once (what the first epoch pays), then is timed on the same batches (every later epoch).
Reports sequence tokens (not padding) per second of each way, its median over repetitions, the padding share, and
the ratio to fp32.
Run: `python bench/train_step.py --extract DIR [--reps 3] [--steps 12] [--warmup 2]` (about 2 min a repetition on
2 cores on the real model). Writes `train_step.json`.
Not here: what the head learns (bench/data_curve.py), the step's FLOPs (bench/README.md, "The training step against
the machine").
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import common  # noqa: F401  (puts the repository on sys.path)
from common import base_args, goal_line, print_table, start, write_results

WAYS = ("fp32", "bf16", "bf16+bucket", "bf16+bucket+teacher")


def iterations(extract_dir: str, way: str, steps: int, warmup: int) -> dict[str, float]:
    """`steps` training iterations of a fresh head the `way` way: sequence tokens/s past the warm-up, padding."""
    import torch

    from components.config.pipeline import PipelineConfig
    from components.train.data import TeacherCache, TrainingData, batches, ttt_batch
    from components.train.loop import LoopArgs, new_head
    from eagle.train import TTTModule, make_optimizer, train_step

    cfg = PipelineConfig.preset("default").train
    data = TrainingData.open(extract_dir)
    sizes = (data.offsets[1:] - data.offsets[:-1]).tolist()
    torch.manual_seed(cfg.seed)
    draft = new_head(LoopArgs(cfg, extract_dir, "", None), data)
    opt, sched = make_optimizer(draft.trainable_parameters(), cfg.optim, cfg.steps)
    model = TTTModule(draft, cfg.ttt)
    amp = None if way == "fp32" else torch.bfloat16
    order = batches(data.n_seqs, cfg.batch_size, cfg.seed, 0, 0, 1, sizes if "bucket" in way else None)
    steps_idx = [pos for (_s, pos), _ in zip(order, range(steps))]
    cache = TeacherCache(8 << 30) if "teacher" in way else None
    if cache is not None:
        for pos in steps_idx:
            ttt_batch(data, pos, draft.draft_ids(), "cpu", every_token=True, teacher_cache=cache)
    seconds = tokens = padded = 0.0
    for j, pos in enumerate(steps_idx):
        t0 = time.perf_counter()
        batch = ttt_batch(data, pos, draft.draft_ids(), "cpu", every_token=True, teacher_cache=cache)
        train_step(model, draft, batch, cfg.ttt, opt, sched, cfg.optim.grad_clip, amp)
        if j >= warmup:
            seconds += time.perf_counter() - t0
            tokens += sum(sizes[i] for i in pos)
            padded += batch.input_ids_BS.numel()
    return {"tokens_per_s": tokens / seconds, "padding": 1 - tokens / padded}


def main() -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--extract", required=True, help="an extract stage's output directory")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.set_defaults(threads=2)
    args = p.parse_args()
    if not (Path(args.extract) / "manifest.json").is_file():
        p.error(f"--extract {args.extract}: not an extract stage's output (no manifest.json in it)")
    if args.reps < 1 or not 0 <= args.warmup < args.steps:
        p.error("--reps must be >= 1 and --warmup in [0, --steps)")
    load_before = start(args)
    rows = []
    for rep in range(args.reps):
        for way in WAYS[rep % len(WAYS) :] + WAYS[: rep % len(WAYS)]:
            got = iterations(args.extract, way, args.steps, args.warmup)
            rows.append({"rep": rep, "way": way, **{k: round(v, 3) for k, v in got.items()}})
            print(
                f"train_step: rep {rep + 1}/{args.reps} {way}: {got['tokens_per_s']:.0f} sequence tokens/s, "
                f"{100 * got['padding']:.0f}% padding",
                flush=True,
            )
    med = {w: statistics.median(r["tokens_per_s"] for r in rows if r["way"] == w) for w in WAYS}
    summary = [
        {
            "way": w,
            "tokens_per_s": round(med[w]),
            "min": round(min(r["tokens_per_s"] for r in rows if r["way"] == w)),
            "padding": statistics.median(r["padding"] for r in rows if r["way"] == w),
            "vs_fp32": round(med[w] / med["fp32"], 2),
        }
        for w in WAYS
    ]
    print_table(
        summary,
        ["way", "tokens_per_s", "min", "padding", "vs_fp32"],
        f"training iterations, sequence tokens/s (median of {args.reps}), {args.extract}",
    )
    goal = goal_line(
        "the default preset's iteration against fp32 (median)",
        med[WAYS[-1]] / med["fp32"],
        2.0,
        0,
        method=f"{args.reps} repetitions of {args.steps - args.warmup} timed iterations a way",
    )
    write_results(
        "train_step",
        args.quick,
        {"summary": summary, "rows": rows, "goal": goal, "extract_dir": args.extract},
        load_before,
    )


if __name__ == "__main__":
    main()
