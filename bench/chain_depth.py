"""How deep to draft: tokens/s over plain decoding and tau of our head's chains at several depths, side by side.

Run: `python bench/chain_depth.py [--quick] [--depths 5,6,7,8,9] [--trees 7,2,12] [--head-steps N]
[--conversations N] [--runs N]`
One run measures plain decoding (`eagle.speculative.generate_plain`) and a chain of every listed depth (and any
`--trees` depth,topk,budget shapes, `;`-separated) with the same head on the same held-out prompts, at T=0 and batch
1, interleaved prompt by prompt (rotating order), so the ratios compare like with like. Every output is checked
identical to plain greedy decoding. The head is `bench/speedup.py`'s (the same cached one for the same
`--head-steps` and `--conversations`). Prints the table (ratio to plain, tau and per-position acceptance of the
emitted tokens (`SpecStats`), tokens per target pass), the goals tau >= 4 and >= 2.0x plain for the fastest
configuration (met only with 0 mismatches over all of them), and writes chain_depth*.json and .png (`-head<N>`,
`-conv<N>` name non-default heads).
Why: a deeper chain pays while the head's per-position acceptance stays high (TTT keeps it flat) and a head step is
cheap next to a target pass; where the extra head step costs more than the extra accepted tokens is a property of
the head and the hardware, so it is measured, not assumed.
`--runs N` repeats the whole measurement in N fresh processes and reports each ratio's median, min and max
(`chain_depth*-runs<N>.json`): the same code and data in another process read several percent apart here.
Not measured here: T > 0, batches > 1, transformers' methods (bench/speedup.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)
import torch

from common import (
    Setup,
    base_args,
    eos_of,
    goal_line,
    heldout_prompts,
    prepare,
    print_table,
    pyplot,
    results_dir,
    spec_figures,
    speed_head,
    start,
    write_results,
)
from timing import fresh_runs, interleaved, tokens_per_s


def configs(args: argparse.Namespace, max_new: int, eos) -> dict:
    from eagle.speculative import SpecConfig

    base = SpecConfig(method="chain", max_new_tokens=max_new, eos_token_id=eos)
    out = {f"chain-{d}": dataclasses.replace(base, depth=d) for d in (int(x) for x in args.depths.split(","))}
    for shape in filter(None, args.trees.split(";")):
        depth, topk, budget = (int(x) for x in shape.split(","))
        out[f"tree-{depth},{topk},{budget}"] = dataclasses.replace(
            base, method="tree", depth=depth, topk=topk, budget=budget
        )
    return {"plain": base, **out}


def measure(target, draft, prompts: list[list[int]], cfgs: dict) -> list[dict]:
    from eagle.speculative import generate_plain, generate_speculative

    def method(name: str, cfg):
        def run(ids):
            x = torch.tensor([ids])
            out = (
                generate_plain(target, x, None, cfg)
                if name == "plain"
                else generate_speculative(target, draft, x, None, cfg)
            )
            n = int(out.lengths[0])
            if out.stats is None:
                return out.sequences[0, :n].tolist(), {"calls": n}
            steps = int((out.stats.accept_lengths >= 0).sum())
            return out.sequences[0, :n].tolist(), {"calls": 1 + steps, "stats": out.stats}

        return run

    with torch.no_grad():
        runs = interleaved({name: method(name, cfg) for name, cfg in cfgs.items()}, prompts)
    base = tokens_per_s(runs["plain"])
    rows = []
    for name, rs in runs.items():
        stats = [r.extra["stats"] for r in rs if "stats" in r.extra]
        fig = spec_figures(stats) if stats else {}  # emitted tau / alpha (SpecStats), the raw tau beside
        toks = sum(len(r.tokens) for r in rs)
        rows.append(
            {
                "method": name,
                "tok_s": tokens_per_s(rs),
                "x_plain": tokens_per_s(rs) / base,
                "tau": fig.get("tau"),
                "tau_raw": fig.get("tau_raw"),
                "tok_per_call": toks / max(sum(r.extra["calls"] for r in rs), 1),
                "tokens": toks,
                "mismatch": sum(r.tokens != p.tokens for r, p in zip(rs, runs["plain"])),
                "alpha": fig.get("alpha", []),
            }
        )
    return rows


def goals(rows: list[dict], best: dict, ratio: str = "x_plain") -> dict:
    """The project's goals for the fastest configuration (`common.goal_line`: met only when no output of any
    configuration differed from plain greedy decoding)."""
    bad = sum(r["mismatch"] for r in rows)
    return {
        "mismatches": bad,
        "tau >= 4": goal_line("tau >= 4", best["tau"], 4.0, bad, method=best["method"]),
        "speedup vs plain >= 2.0": goal_line("speedup vs plain >= 2.0", best[ratio], 2.0, bad, method=best["method"]),
    }


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    chains = [r for r in rows if r["method"].startswith("chain-")]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    d = [int(r["method"].split("-")[1]) for r in chains]
    ax.plot(d, [r["x_plain"] for r in chains], marker="o", color="#3a7", label="× plain (tokens/s)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("chain depth")
    ax.set_ylabel("speedup over plain decoding")
    ax2 = ax.twinx()
    ax2.plot(d, [r["tau"] for r in chains], marker="s", ls="--", color="#c84", label="τ")
    ax2.set_ylabel("τ (tokens per verification)")
    for r in rows:
        if r["method"].startswith("tree-"):
            ax.axhline(r["x_plain"], color="#888", ls=":", lw=1)
            ax.text(d[0], r["x_plain"], f" {r['method']}", fontsize=7, va="bottom")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--depths", default="5,6,7,8,9", help="chain depths")
    p.add_argument("--trees", default="", help="tree shapes depth,topk,budget separated by ';' (none by default)")
    p.add_argument("--prompts", type=int, default=0, help="held-out prompts (0: the preset's)")
    p.add_argument("--head-steps", type=int, default=0, help="the head of `speedup.py --head-steps N`")
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="repeat the whole measurement in N fresh processes and report each ratio's median and range "
        "(one process's memory layout moves every ratio by several percent on this machine)",
    )
    p.add_argument("--out", default="", help=argparse.SUPPRESS)  # where a child process of --runs writes its JSON
    args = p.parse_args(argv)
    load0 = start(args)
    if args.runs > 1:
        repeat(args, argv if argv is not None else sys.argv[1:], load0)
        return
    run(prepare(args.quick, conversations=args.conversations), args, load0)


def repeat(args: argparse.Namespace, argv: list[str], load0: list[float]) -> None:
    """`--runs N`: the same measurement in N fresh processes, one after the other; per method the median, min and
    max of its ratio to plain decoding (tau is the same in every run: greedy decoding is deterministic)."""
    runs = fresh_runs(
        __file__,
        argv,
        args.runs,
        lambda i, r: print(
            f"run {i + 1}/{args.runs}: " + ", ".join(f"{x['method']} {x['x_plain']:.3f}" for x in r["rows"][1:]),
            flush=True,
        ),
    )
    rows = []
    for j, first in enumerate(runs[0]["rows"]):
        x = sorted(r["rows"][j]["x_plain"] for r in runs)
        rows.append(
            {
                **first,
                "x_plain_median": statistics.median(x),
                "x_plain_min": x[0],
                "x_plain_max": x[-1],
                "x_plain_runs": x,
                "tok_s_median": statistics.median(r["rows"][j]["tok_s"] for r in runs),
                "mismatch": max(r["rows"][j]["mismatch"] for r in runs),
            }
        )
    table = print_table(
        rows,
        ["method", "tok_s_median", "x_plain_median", "x_plain_min", "x_plain_max", "tau", "tok_per_call", "mismatch"],
        f"{args.runs} fresh processes, T=0, batch 1, {runs[0]['n_prompts']} held-out prompts, head "
        f"{Path(runs[0]['head']).parent.name}",
    )
    best = max(rows[1:], key=lambda r: r["x_plain_median"])
    print(
        f"fastest: {best['method']} at {best['x_plain_median']:.2f}x plain (median of {args.runs} runs, "
        f"{best['x_plain_min']:.2f}-{best['x_plain_max']:.2f})"
    )
    g = goals(rows, best, "x_plain_median")
    name = Path(runs[0]["plot"]).stem + f"-runs{args.runs}"
    png = results_dir(args.quick) / f"{name}.png"
    plot([{**r, "x_plain": r["x_plain_median"]} for r in rows], png)
    write_results(
        name,
        args.quick,
        {
            "args": vars(args),
            "n_prompts": runs[0]["n_prompts"],
            "rows": rows,
            "fastest": best["method"],
            "goals": g,
            "head": runs[0]["head"],
            "table": table,
            "plot": str(png),
        },
        load0,
    )


def run(setup: Setup, args: argparse.Namespace, load0: list[float]) -> None:
    """The benchmark on a prepared setup (see bench/common.py); prints the table, writes the result files."""
    head, suffix = speed_head(setup, args.head_steps, args.conversations)
    name = "chain_depth" + suffix

    from components.targets.target import load_target
    from eagle.export import load_head

    target, tok = load_target(setup.target_dir)
    draft = load_head(head.head_dir, target).eval()
    prompts = heldout_prompts(tok, setup.heldout_traffic, args.prompts or setup.preset.eval_prompts)
    rows = measure(target, draft, prompts, configs(args, setup.preset.max_new_tokens, eos_of(target)))
    best = max((r for r in rows if r["method"] != "plain"), key=lambda r: r["x_plain"])
    table = print_table(
        rows,
        ["method", "tok_s", "x_plain", "tau", "tok_per_call", "tokens", "mismatch"],
        f"T=0, batch 1, {len(prompts)} held-out prompts, max {setup.preset.max_new_tokens} new "
        f"tokens, head {head.head_dir.parent.name}",
    )
    print(f"fastest: {best['method']} at {best['x_plain']:.2f}x plain (tau {best['tau']:.2f})")
    png = results_dir(args.quick) / f"{name}.png"
    payload = {
        "args": vars(args),
        "n_prompts": len(prompts),
        "rows": rows,
        "fastest": best["method"],
        "head": str(head.head_dir),
        "table": table,
        "plot": str(png),
    }
    if args.out:  # a child of --runs: its parent aggregates, checks the goals and writes the result files
        Path(args.out).write_text(json.dumps(payload, default=str))
        return
    payload["goals"] = goals(rows, best)
    plot(rows, png)
    write_results(name, args.quick, payload, load0)


if __name__ == "__main__":
    main()
