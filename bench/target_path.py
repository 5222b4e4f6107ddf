"""Which target path our loop should take on this machine, and whether "auto" (eagle/target_path.py) picks it.

Run: `python bench/target_path.py [--quick] [--runs 5] [--prompts N] [--depth 5]`
Methods, batch 1, greedy, on the same held-out prompts, interleaved prompt by prompt (rotating order):
  plain:<path>   `generate_plain` with the target path pinned (lean-packed, lean-torch, hf-packed, hf-torch)
  chain:<path>   `generate_speculative` (the benchmarks' cached 150-step head, chain of `--depth`), path pinned
  hf-plain       stock transformers: `target.generate`
Per process it also records what "auto" chose for each role at its one measurement (`eagle.target_path.measure`:
"decode", the path plain decoding takes and the one judged here, and "verify", the speculative step's; timed before the
decoding) and its reason. Reports tokens/s, × the default path (lean-packed) and × hf-plain; mismatches are
outputs that differ from plain:lean-packed (the paths agree up to rounding only). Goals (`--runs`: medians and
the worst run): the path "auto" chose decodes plain within 5% of the fastest plain path measured in the same
process, and our plain on that path is >= 1.0x stock transformers; both need 0 mismatches.
Writes target_path.json and .png (target_path-runs<N>.*).
Not measured here: batches > 1, GPUs, the head's kernels (always eagle.fastpath.linear).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)
import torch

from common import (
    base_args,
    eos_of,
    goal_line,
    heldout_prompts,
    prepare,
    print_table,
    pyplot,
    results_dir,
    speed_head,
    start,
    until_eos,
    write_results,
)
from timing import fresh_runs, interleaved, tokens_per_s


def methods(target, draft, args, max_new: int) -> dict:
    from eagle.speculative import SpecConfig, generate_plain, generate_speculative
    from eagle.target_path import PATHS

    eos = eos_of(target)
    pad = target.generation_config.pad_token_id or 0

    def ours(fn, *a):
        def run(ids):
            out = fn(target, *a[:-1], torch.tensor([ids]), None, a[-1])
            return out.sequences[0, : int(out.lengths[0])].tolist(), {}

        return run

    def hf(ids):
        x = torch.tensor([ids])
        out = target.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        return until_eos(out[0, x.shape[1] :].tolist(), eos), {}

    ms = {}
    for p in PATHS:
        cfg = SpecConfig(method="chain", depth=args.depth, max_new_tokens=max_new, eos_token_id=eos, path=p)
        ms[f"plain:{p}"] = ours(generate_plain, cfg)
        ms[f"chain:{p}"] = ours(generate_speculative, draft, cfg)
    return {**ms, "hf-plain": hf}


def summarize(runs: dict) -> list[dict]:
    ref, base, hf = runs["plain:lean-packed"], tokens_per_s(runs["plain:lean-packed"]), tokens_per_s(runs["hf-plain"])
    return [
        {
            "method": name,
            "tok_s": tokens_per_s(rs),
            "x_default": tokens_per_s(rs) / base,
            "x_hf_plain": tokens_per_s(rs) / hf,
            "tokens": sum(len(r.tokens) for r in rs),
            "mismatch": sum(r.tokens != p.tokens for r, p in zip(rs, ref)),
        }
        for name, rs in runs.items()
    ]


def verdict(rows: list[dict], chosen: str) -> dict:
    """What auto's pick cost in this process: its plain tokens/s over the fastest plain path's, and over hf-plain."""
    by = {r["method"]: r for r in rows}
    plain = {m[len("plain:") :]: r["tok_s"] for m, r in by.items() if m.startswith("plain:")}
    fastest = max(plain, key=plain.__getitem__)
    return {
        "chosen": chosen,
        "fastest_plain": fastest,
        "chosen_x_fastest": plain[chosen] / plain[fastest],
        "chosen_x_hf_plain": plain[chosen] / by["hf-plain"]["tok_s"],
        "mismatches": sum(r["mismatch"] for m, r in by.items() if m != "hf-plain"),
    }


def goals(picks: list[dict]) -> dict:
    """Over the processes: medians and worst run of auto's pick against the fastest path and stock transformers."""
    bad = max(p["mismatches"] for p in picks)
    x_fast = sorted(p["chosen_x_fastest"] for p in picks)
    x_hf = sorted(p["chosen_x_hf_plain"] for p in picks)
    return {
        "auto within 5% of the fastest plain path": goal_line(
            "auto within 5% of the fastest plain path (median)", statistics.median(x_fast), 0.95, bad
        ),
        "auto within 5% of the fastest plain path, worst run": goal_line(
            "auto within 5% of the fastest plain path (worst run)", x_fast[0], 0.95, bad
        ),
        "our plain on auto's path >= 1.0x hf-plain": goal_line(
            "our plain on auto's path >= 1.0x hf-plain (median)", statistics.median(x_hf), 1.0, bad
        ),
    }


def plot(rows: list[dict], chosen: list[str], path: Path) -> Path:
    """Bars: tokens/s of each method (median over processes), the paths auto chose marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["method"] for r in rows]
    colors = ["tab:green" if n.split(":")[-1] in chosen else "tab:gray" for n in names]
    ax.barh(names, [r["tok_s"] for r in rows], color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (batch 1, greedy)")
    ax.set_title(f"target paths; green: chosen by auto ({', '.join(sorted(set(chosen)))})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=0, help="held-out prompts (0: the preset's)")
    p.add_argument("--depth", type=int, default=5, help="chain depth of the head's rows")
    p.add_argument("--runs", type=int, default=1, help="repeat in N fresh processes (after one setup)")
    p.add_argument("--out", default="", help=argparse.SUPPRESS)  # where a child process of --runs writes its JSON
    args = p.parse_args(argv)
    load0 = start(args)
    setup = prepare(args.quick)
    speed_head(setup, 0, 0)  # train (or find) the head once, outside the measured processes
    if args.runs > 1:
        children = fresh_runs(
            __file__,
            argv if argv is not None else sys.argv[1:],
            args.runs,
            lambda i, d: print(
                f"run {i + 1}/{args.runs}: auto chose {d['pick']['chosen']}, "
                f"{d['pick']['chosen_x_fastest']:.3f}x the fastest plain path "
                f"({d['pick']['fastest_plain']}), "
                f"{d['pick']['chosen_x_hf_plain']:.3f}x hf-plain",
                flush=True,
            ),
        )
        rows = []
        for j, row in enumerate(children[0]["rows"]):
            per = sorted(c["rows"][j]["x_default"] for c in children)
            tps = sorted(c["rows"][j]["tok_s"] for c in children)
            rows.append(
                {
                    **row,
                    "tok_s": statistics.median(tps),
                    "x_default": statistics.median(per),
                    "x_default_min": per[0],
                    "x_default_max": per[-1],
                    "x_hf_plain": statistics.median(c["rows"][j]["x_hf_plain"] for c in children),
                    "mismatch": max(c["rows"][j]["mismatch"] for c in children),
                }
            )
        text = print_table(
            rows,
            ["method", "tok_s", "x_default", "x_default_min", "x_hf_plain", "tokens", "mismatch"],
            f"batch 1, greedy, {children[0]['n_prompts']} held-out prompts, median of {args.runs} fresh processes",
        )
        picks = [c["pick"] for c in children]
        name = f"target_path-runs{args.runs}"
        png = plot(rows, [p["chosen"] for p in picks], results_dir(args.quick) / f"{name}.png")
        write_results(
            name,
            args.quick,
            {
                "args": vars(args),
                "rows": rows,
                "picks": picks,
                "auto": [c["auto"] for c in children],
                "goals": goals(picks),
                "text": text,
                "plot": str(png),
            },
            load0,
        )
        return
    run(setup, args, load0)


def run(setup, args: argparse.Namespace, load0: list[float]) -> None:
    from components.targets.target import load_target
    from eagle import target_path
    from eagle.export import load_head
    from eagle.runners import time_paths

    head, _ = speed_head(setup, 0, 0)
    target, tok = load_target(setup.target_dir)
    draft = load_head(head.head_dir, target).eval()
    prompts = heldout_prompts(tok, setup.heldout_traffic, args.prompts or setup.preset.eval_prompts)
    auto = target_path.measure(target, time_paths)  # what "auto" picks in this process, measured before any decoding
    with torch.no_grad():
        rows = summarize(interleaved(methods(target, draft, args, setup.preset.max_new_tokens), prompts))
    decode = auto.by_role["decode"]  # plain decoding runs on the "decode" role's pick (1-token passes)
    pick = verdict(rows, decode.chosen)
    text = print_table(
        rows,
        ["method", "tok_s", "x_default", "x_hf_plain", "tokens", "mismatch"],
        f"batch 1, greedy, {len(prompts)} held-out prompts, max {setup.preset.max_new_tokens} new "
        f"tokens; auto chose {decode.chosen} to decode ({decode.reason}), {auto.chosen} to verify "
        f"({auto.reason})",
    )
    payload = {"n_prompts": len(prompts), "rows": rows, "auto": auto.as_dict(), "pick": pick, "text": text}
    if args.out:
        Path(args.out).write_text(json.dumps(payload, default=str))
        return
    png = plot(rows, [decode.chosen], results_dir(args.quick) / "target_path.png")
    write_results(
        "target_path", args.quick, {"args": vars(args), **payload, "goals": goals([pick]), "plot": str(png)}, load0
    )


if __name__ == "__main__":
    main()
