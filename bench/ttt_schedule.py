"""TTT depth schedules at equal training time: does a head that trains shallow first, deep last, beat one that trains
at the full depth throughout, on the real model's features and the same minutes?

Purpose: a training step's cost grows with the TTT depth K (each unrolled step runs the layer, the draft-vocabulary
`lm_head` and the loss once more), and on 2 cores the benchmark head is compute-bound (bench/README.md: 1,200 steps of
K 5 in ~57 min; more data did not help). Served acceptance is dominated by the first draft position, which every
unrolled step trains alike: at K 1 a step costs a fraction of K 5's, so the head sees several times the tokens in the
same minutes. This trains one fresh head per schedule on one extract run's features (`--extract DIR`), each for
`--minutes` of wall time (held-out evaluation not counted), with the `default` preset's head config, and reports
the simulated held-out tau at the serving depth (`--eval-depth`, the preset's K 5) of each.
A schedule is `K` (one depth throughout) or `K1:F1/K2` (depth K1 for the first fraction F1 of the time, then K2),
e.g. `5`, `1:0.6/5`, `2:0.5/5`. The learning rate follows the preset's warm-up, then a cosine over the schedule's
wall time (so every schedule decays to the same floor at its budget's end), since the steps a budget holds differ.
`--inits random target-layer` also compares how a fresh head starts (`train.head_init`) under each schedule; an
extract made before the stage saved the target's layer gets it from the target named in its manifest.
Run: `python bench/ttt_schedule.py --extract DIR [--minutes 10] [--schedules 5 1:0.6/5 ...] [--inits ...]` on quiet
cores (the comparison is of wall time). Writes `ttt_schedule.json` (+ `.png`: held-out tau against minutes, a line
each).
Not here: the served speedup of the winner (bench/real_head.py trains it through the pipeline, then serves it).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import common  # noqa: F401  (puts the repository on sys.path)
from common import base_args, line_plot, print_table, start, write_results


def parse_schedule(text: str) -> list[tuple[int, float]]:
    """`"1:0.6/5"` -> [(1, 0.6), (5, 1.0)]: (depth, the time fraction at which the phase ends)."""
    phases, end = [], 0.0
    parts = text.split("/")
    for i, part in enumerate(parts):
        k, _, f = part.partition(":")
        last = i == len(parts) - 1
        if last == bool(f):
            raise ValueError(f"{text!r}: every phase but the last needs ':FRACTION' (e.g. 1:0.6/5)")
        end = 1.0 if last else float(f)
        if int(k) < 1 or not 0 < end <= 1 or (phases and end <= phases[-1][1]):
            raise ValueError(f"{text!r}: depths >= 1, fractions rising in (0, 1)")
        phases.append((int(k), end))
    return phases


HELD_OUT = 64  # sequences set aside (the training loop's seeded split, larger than the preset's 32: less noise)


def teacher_kept(extract_dir: str, mib: int):
    """(the features, a teacher cache holding every sequence's teacher): the teacher is computed once per sequence
    in any run (its first epoch), the same for every schedule, so it is paid here, outside the timed minutes."""
    import torch

    from components.config.pipeline import PipelineConfig
    from components.train.data import TeacherCache, TrainingData, ttt_batch
    from components.train.loop import LoopArgs, new_head

    cfg = PipelineConfig.preset("default").train
    data = TrainingData.open(extract_dir)
    if not data.target_layer:  # an extract made before the stage saved the target's layer: read it from the target
        from components.extract.stage import target_layer_tensors

        data.take_target_layer(
            target_layer_tensors(None, data.manifest["target"]["path"], data.manifest["layer_ids"][-1])
        )
    draft_ids = new_head(LoopArgs(cfg, extract_dir, "", None), data).draft_ids()
    cache, t0 = TeacherCache(mib << 20), time.perf_counter()
    for s in range(0, data.n_seqs, cfg.batch_size):
        with torch.no_grad():
            ttt_batch(data, list(range(s, min(s + cfg.batch_size, data.n_seqs))), draft_ids, "cpu", teacher_cache=cache)
    if len(cache._kept) < data.n_seqs:
        raise SystemExit(f"--teacher-cache-mib {mib}: holds {len(cache._kept)} of {data.n_seqs} sequences; raise it")
    print(f"ttt_schedule: teacher of {data.n_seqs} sequences kept ({time.perf_counter() - t0:.0f} s)", flush=True)
    return data, cache


def run(data, cache, schedule: str, minutes: float, eval_every_min: float, eval_depth: int, init: str) -> list[dict]:
    import torch

    from components.config.pipeline import PipelineConfig
    from components.train.data import batches, heldout_split, ttt_batch
    from components.train.loop import LoopArgs, new_head
    from eagle.train import TTTModule, autocast_dtype, heldout_metrics, make_optimizer, train_step

    cfg = dataclasses.replace(PipelineConfig.preset("default").train, head_init=init)
    phases = parse_schedule(schedule)
    train_ids, held_ids = heldout_split(data.n_seqs, HELD_OUT, cfg.seed)
    sizes = (data.offsets[1:] - data.offsets[:-1]).tolist()
    torch.manual_seed(cfg.seed)
    draft = new_head(LoopArgs(cfg, str(data.root), "", None), data)
    opt, _ = make_optimizer(draft.trainable_parameters(), cfg.optim, 1)
    base_lr, o = cfg.optim.lr, cfg.optim
    amp = autocast_dtype(cfg.autocast, "cpu")
    lengths = [sizes[i] for i in train_ids] if cfg.bucket_by_length else None
    eval_ttt = dataclasses.replace(cfg.ttt, ttt_steps=eval_depth)
    budget = minutes * 60.0

    class _NoSched:
        def step(self) -> None:
            pass

    def held(elapsed: float, step: int, tokens: int) -> dict:
        chunks = (held_ids[i : i + cfg.batch_size] for i in range(0, len(held_ids), cfg.batch_size))
        m = heldout_metrics(
            draft, (ttt_batch(data, c, draft.draft_ids(), "cpu", teacher_cache=cache) for c in chunks), eval_ttt, amp
        )
        row = {
            "schedule": schedule,
            "head_init": init,
            "minutes": round(elapsed / 60, 2),
            "step": step,
            "tokens": tokens,
            "heldout_tau": round(m["heldout_tau"], 3),
            "heldout_acc_0": round(m["heldout_acc_0"], 3),
        }
        print(f"ttt_schedule: {schedule} ({init}) at {row['minutes']:.1f} min, step {step}: {row}", flush=True)
        return row

    rows, elapsed, tokens, next_eval = [], 0.0, 0, eval_every_min * 60.0
    step = 0
    for step, pos in batches(len(train_ids), cfg.batch_size, cfg.seed, 0, 0, 1, lengths):
        frac = elapsed / budget
        if frac >= 1.0:
            break
        depth = next(k for k, end in phases if frac < end)
        warm = min(1.0, (step + 1) / o.warmup_steps) if o.warmup_steps else 1.0
        cos = o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        for g in opt.param_groups:
            g["lr"] = base_lr * warm * cos
        ttt = dataclasses.replace(cfg.ttt, ttt_steps=depth)
        t0 = time.perf_counter()
        batch = ttt_batch(
            data, [train_ids[i] for i in pos], draft.draft_ids(), "cpu", every_token=True, teacher_cache=cache
        )
        train_step(TTTModule(draft, ttt), draft, batch, ttt, opt, _NoSched(), o.grad_clip, amp)
        elapsed += time.perf_counter() - t0
        tokens += int(batch.input_ids_BS.numel())
        if elapsed >= next_eval:
            rows.append(held(elapsed, step + 1, tokens))
            next_eval += eval_every_min * 60.0
    if not rows or rows[-1]["step"] != step:
        rows.append(held(elapsed, step, tokens))
    return rows


def main() -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--extract", required=True, help="an extract stage's output directory (the real model's)")
    p.add_argument("--schedules", nargs="+", default=["5", "1:0.6/5", "2:0.5/5"], help="TTT depth schedules")
    p.add_argument(
        "--inits", nargs="+", default=["random"], choices=["random", "target-layer"], help="train.head_init values"
    )
    p.add_argument("--minutes", type=float, default=10.0, help="training wall time per schedule")
    p.add_argument("--eval-every", type=float, default=2.5, help="held-out tau every N training minutes")
    p.add_argument("--eval-depth", type=int, default=5, help="the depth the held-out tau is simulated at")
    p.add_argument("--teacher-cache-mib", type=int, default=4096, help="memory for every sequence's teacher")
    p.set_defaults(threads=2)
    args = p.parse_args()
    if not (Path(args.extract) / "manifest.json").is_file():
        p.error(f"--extract {args.extract}: not an extract stage's output (no manifest.json in it)")
    try:
        for s in args.schedules:
            parse_schedule(s)
    except ValueError as e:
        p.error(str(e))
    if args.minutes <= 0 or args.eval_every <= 0 or args.eval_depth < 1:
        p.error("--minutes and --eval-every must be > 0, --eval-depth >= 1")
    load_before = start(args)
    data, cache = teacher_kept(args.extract, args.teacher_cache_mib)
    out = []
    for s in args.schedules:
        for init in args.inits:
            out += run(data, cache, s, args.minutes, args.eval_every, args.eval_depth, init)
    cols = ["schedule", "head_init", "minutes", "step", "tokens", "heldout_tau", "heldout_acc_0"]
    print_table(out, cols, f"held-out tau (K {args.eval_depth}) by TTT schedule, {args.minutes:g} min each")
    record = {"extract_dir": args.extract, "minutes": args.minutes, "inits": args.inits, "rows": out}
    path = write_results("ttt_schedule", args.quick, record, load_before)
    lines = {}
    for s in args.schedules:
        for init in args.inits:
            pts = [r for r in out if r["schedule"] == s and r["head_init"] == init]
            name = s if len(args.inits) == 1 else f"{s}, {init}"
            lines[name] = ([r["minutes"] for r in pts], [r["heldout_tau"] for r in pts])
    line_plot(
        path.with_suffix(".png"),
        lines,
        "training minutes (2 cores)",
        f"held-out tau (simulated, K {args.eval_depth})",
        "TTT depth schedules at equal time",
    )


if __name__ == "__main__":
    main()
