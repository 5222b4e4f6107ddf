"""Throughput of speculative decoding relative to plain decoding as the batch grows: where does it stop paying?

Run: `python bench/batch.py [--quick] [--batches 1,2,4,8,16,32,64] [--depth 5] [--method chain] [--runs 3]`
For each batch size B, B held-out prompts (cycled when there are fewer) of different lengths are decoded greedily
with `eagle.speculative.generate_plain` and `generate_speculative` (the EAGLE-3 TTT head of
bench/acceptance_vs_depth.py): both once untimed (warm-up at that batch size), then `--runs` timed blocks, each in
the order plain, spec, spec, plain (so drift in the machine's load cancels). Reports tokens/s of each and their
ratio (median over the blocks, the ratio's min and max beside), tau (emitted tokens per verification step,
`SpecStats.tau`), and rows whose output differs from plain greedy decoding; the crossover is the first batch size
whose median ratio falls below 1. Writes batch.json and .png.
Why it falls: a verification pass costs (depth+1) x B tokens of target compute; at small B the CPU step is
dominated by fixed overhead, at large B by arithmetic, where verifying rejected drafts is pure waste.
Not measured here: sampling, dropping finished rows from the batch (rows that finish early keep riding along in
both methods alike).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)
import torch

from common import (
    Setup,
    base_args,
    eos_of,
    heldout_prompts,
    prepare,
    print_table,
    pyplot,
    results_dir,
    spec_figures,
    start,
    train_or_reuse_head,
    with_ttt_steps,
    write_results,
)


def padded(prompts: list[list[int]], B: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B prompts (cycled), left-padded: ids [B, T] and attention mask [B, T]."""
    rows = [prompts[i % len(prompts)] for i in range(B)]
    T = max(len(r) for r in rows)
    ids = torch.full((B, T), pad, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r) :] = torch.tensor(r)
        mask[i, T - len(r) :] = 1
    return ids, mask


def measure_batch(target, draft, ids, mask, cfg, runs: int) -> dict:
    """Both paths once untimed at this batch size (warm-up), then `runs` timed blocks in the order plain, spec, spec,
    plain; per block the ratio of speculative to plain tokens/s. Median and min (and max) over the blocks; every
    speculative output's rows are compared with plain greedy decoding's. Any device (bench/gpu_pipeline.py --more
    runs it on the GPU)."""
    from eagle.speculative import generate_plain, generate_speculative

    paths = {
        "plain": lambda: generate_plain(target, ids, mask, cfg),
        "spec": lambda: generate_speculative(target, draft, ids, mask, cfg),
    }
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)  # an accelerator's kernels finish in the timing
    reference = paths["plain"]()  # warm-up of the plain path; greedy, so every later plain output equals it
    spec = paths["spec"]()  # warm-up of the speculative path
    tok_s: dict[str, list[float]] = {"plain": [], "spec": []}
    ratios, mismatch, seconds = [], 0, 0.0
    for _ in range(runs):
        t, n = {"plain": 0.0, "spec": 0.0}, {"plain": 0, "spec": 0}
        for name in ("plain", "spec", "spec", "plain"):
            sync()
            t0 = time.perf_counter()
            out = paths[name]()
            sync()
            t[name] += time.perf_counter() - t0
            n[name] += int(out.lengths.sum())
            mismatch = max(mismatch, int((out.sequences != reference.sequences).any(1).sum()))
            spec = out if name == "spec" else spec
        for name in t:
            tok_s[name].append(n[name] / t[name])
        ratios.append(tok_s["spec"][-1] / tok_s["plain"][-1])
        seconds += sum(t.values())
    fig = spec_figures([spec.stats])
    return {
        "plain_tok_s": statistics.median(tok_s["plain"]),
        "spec_tok_s": statistics.median(tok_s["spec"]),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_runs": ratios,
        "tau": fig["tau"],
        "tau_raw": fig["tau_raw"],
        "tokens": int(spec.lengths.sum()),
        "mismatch_rows": mismatch,
        "seconds": seconds,
    }


def plot(rows: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    bs = [r["batch"] for r in rows]
    ax.plot(bs, [r["ratio"] for r in rows], marker="o", label="speculative / plain tokens/s")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("batch size")
    ax.set_ylabel("throughput ratio")
    for r in rows:
        ax.annotate(
            f"τ {r['tau']:.1f}",
            (r["batch"], r["ratio"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=7,
        )
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--batches", default="", help="comma-separated batch sizes (default 1..64; quick 1,2,4)")
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--method", default="chain", choices=("chain", "tree"))
    p.add_argument("--max-new", type=int, default=0, help="new tokens per row (0: 64, quick: the preset's)")
    p.add_argument(
        "--runs",
        type=int,
        default=3,
        help="timed blocks per batch size (each: plain, spec, spec, plain); median and min reported",
    )
    args = p.parse_args(argv)
    load0 = start(args)
    run(prepare(args.quick, conversations=args.conversations), args, load0)


def run(setup: Setup, args: argparse.Namespace, load0: list[float]) -> None:
    """The benchmark on a prepared setup (see bench/common.py); prints the table, writes the result files."""
    head = train_or_reuse_head(setup, "eagle3-ttt7", with_ttt_steps(setup.preset.train, 7))
    batches = [int(b) for b in (args.batches or ("1,2,4" if args.quick else "1,2,4,8,16,32,64")).split(",")]
    max_new = args.max_new or (setup.preset.max_new_tokens if args.quick else 64)

    from components.targets.target import load_target
    from eagle.export import load_head
    from eagle.speculative import SpecConfig

    target, tok = load_target(setup.target_dir)
    draft = load_head(head.head_dir, target).eval()
    prompts = heldout_prompts(tok, setup.heldout_traffic, max(batches))
    pad = target.generation_config.pad_token_id or 0
    cfg = SpecConfig(
        method=args.method, depth=args.depth, max_new_tokens=max_new, eos_token_id=eos_of(target), pad_token_id=pad
    )
    rows = []
    with torch.no_grad():
        for B in batches:
            ids, mask = padded(prompts, B, pad)
            rows.append({"batch": B, **measure_batch(target, draft, ids, mask, cfg, args.runs)})
            r = rows[-1]
            print(
                f"batch {B}: ratio {r['ratio']:.2f} (median of {args.runs} runs, min {r['ratio_min']:.2f})", flush=True
            )
    crossover = next((r["batch"] for r in rows if r["ratio"] < 1.0), None)
    title = f"{args.method} depth {args.depth}, T=0, {max_new} new tokens per row, median and min of {args.runs} runs"
    table = print_table(
        rows, ["batch", "plain_tok_s", "spec_tok_s", "ratio", "ratio_min", "tau", "tokens", "mismatch_rows"], title
    )
    print(f"crossover (first batch with ratio < 1): {crossover if crossover else 'none up to %d' % batches[-1]}")
    png = results_dir(args.quick) / "batch.png"
    plot(rows, png, title)
    write_results(
        "batch",
        args.quick,
        {"args": vars(args), "rows": rows, "crossover": crossover, "table": table, "plot": str(png)},
        load0,
    )


if __name__ == "__main__":
    main()
