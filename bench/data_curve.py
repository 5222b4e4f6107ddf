"""How a head's held-out τ grows with the conversations it trains on and its steps, on one extract run's features.

Purpose: is a head data-limited or step-limited on this target? On the features of one extract run (`--extract
DIR`, e.g. a demo head's `runs/<name>/<run>/extract`: the real SmolLM2's), the same held-out sequences are set aside
(the training loop's own seeded split) and a fresh head is trained on the first 1/4, 1/2 and all of the other
sequences (`--fractions`), `--steps` steps each, with the `default` preset's head config (its TTT depth, batch,
draft vocabulary, optimiser, loss on every token, batches of like length, the teacher kept); every `--eval-every`
steps the simulated held-out τ (eagle/train.py `heldout_metrics`, what the training run records) is taken. A
data-limited head keeps climbing with more conversations at the same steps; a step-limited one with more steps.
Prints a table (fraction, sequences, step, held-out τ) and, where matplotlib is installed, plots τ against steps, one
line per fraction.
Run: `python bench/data_curve.py --extract DIR [--fractions 0.25 0.5 1] [--steps 200] [--eval-every 50]` (2 cores:
about 1.5 s a step on the real model in bf16, so ~15 min with the defaults). Writes `data_curve.json` (+ `.png`).
Not here: the served speedup (bench/vllm_speedup.py), the regeneration that makes more conversations.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import common  # noqa: F401  (puts the repository on sys.path)
from common import base_args, line_plot, print_table, start, write_results


def curve(extract_dir: str, fraction: float, steps: int, eval_every: int) -> tuple[int, list[dict]]:
    """A fresh head on the first `fraction` of the training sequences: (sequences trained on, [{step, heldout_tau,
    seconds}])."""
    import torch

    from components.config.pipeline import PipelineConfig
    from components.train.data import TeacherCache, TrainingData, batches, heldout_split, ttt_batch
    from components.train.loop import LoopArgs, new_head, holdout_size
    from eagle.train import TTTModule, autocast_dtype, heldout_metrics, make_optimizer, train_step

    cfg = dataclasses.replace(PipelineConfig.preset("default").train, steps=steps)
    data = TrainingData.open(extract_dir)
    train_ids, held_ids = heldout_split(data.n_seqs, holdout_size(cfg, data.n_seqs), cfg.seed)
    train_ids = train_ids[: max(cfg.batch_size, round(len(train_ids) * fraction))]
    sizes = (data.offsets[1:] - data.offsets[:-1]).tolist()
    torch.manual_seed(cfg.seed)
    draft = new_head(LoopArgs(cfg, extract_dir, "", None), data)
    opt, sched = make_optimizer(draft.trainable_parameters(), cfg.optim, cfg.steps)
    model, amp = TTTModule(draft, cfg.ttt), autocast_dtype(cfg.autocast, "cpu")
    cache = TeacherCache(cfg.teacher_cache_mib << 20)
    lengths = [sizes[i] for i in train_ids] if cfg.bucket_by_length else None
    rows, t0 = [], time.perf_counter()
    for step, pos in batches(len(train_ids), cfg.batch_size, cfg.seed, 0, 0, 1, lengths):
        if step >= steps:
            break
        batch = ttt_batch(
            data,
            [train_ids[i] for i in pos],
            draft.draft_ids(),
            "cpu",
            every_token=cfg.loss_on == "all",
            teacher_cache=cache,
        )
        train_step(model, draft, batch, cfg.ttt, opt, sched, cfg.optim.grad_clip, amp)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            chunks = (held_ids[i : i + cfg.batch_size] for i in range(0, len(held_ids), cfg.batch_size))
            held = heldout_metrics(
                draft, (ttt_batch(data, c, draft.draft_ids(), "cpu", teacher_cache=cache) for c in chunks), cfg.ttt, amp
            )
            rows.append(
                {
                    "step": step + 1,
                    "heldout_tau": round(held["heldout_tau"], 3),
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            )
            print(
                f"data_curve: {fraction:g} of the data ({len(train_ids)} sequences), step {step + 1}: held-out tau "
                f"{held['heldout_tau']:.2f} ({rows[-1]['seconds']:.0f} s)",
                flush=True,
            )
    return len(train_ids), rows


def main() -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--extract", required=True, help="an extract stage's output directory")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=50)
    p.set_defaults(threads=2)
    args = p.parse_args()
    if not (Path(args.extract) / "manifest.json").is_file():
        p.error(f"--extract {args.extract}: not an extract stage's output (no manifest.json in it)")
    if args.steps < 1 or args.eval_every < 1 or not all(0 < f <= 1 for f in args.fractions):
        p.error("--steps and --eval-every must be >= 1 and each fraction in (0, 1]")
    load_before = start(args)
    out = []
    for f in sorted(args.fractions):
        n, rows = curve(args.extract, f, args.steps, args.eval_every)
        out.extend({"fraction": f, "sequences": n, **r} for r in rows)
    print_table(
        out,
        ["fraction", "sequences", "step", "heldout_tau", "seconds"],
        f"held-out tau by data and steps ({args.extract})",
    )
    path = write_results("data_curve", args.quick, {"extract_dir": args.extract, "rows": out}, load_before)
    lines = {}
    for f in sorted(args.fractions):
        pts = [r for r in out if r["fraction"] == f]
        label = f"{pts[0]['sequences']} sequences" if pts else str(f)
        lines[label] = ([r["step"] for r in pts], [r["heldout_tau"] for r in pts])
    line_plot(
        path.with_suffix(".png"), lines, "training step", "held-out tau (simulated)", "held-out tau by data and steps"
    )


if __name__ == "__main__":
    main()
