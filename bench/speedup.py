"""End-to-end decoding speed on held-out traffic: our EAGLE-3 head against plain decoding, prompt lookup and a small
draft model, each both inside our own loop and in transformers' `generate`, at T=0 and T=1.

Run: `python bench/speedup.py [--quick] [--prompts N] [--depth 5] [--tree 5,4,12] [--head-steps N]`
Methods, all at batch 1 on the same held-out prompts, interleaved prompt by prompt (rotating order):
  plain          `eagle.speculative.generate_plain` (the baseline the goals refer to)
  eagle-chain    our head, chain of `--depth` drafts (`generate_speculative`)
  eagle-tree     our head, EAGLE-2 dynamic tree (depth, top-k, budget)
  lookup         prompt lookup in our loop (`eagle.drafters.PromptLookupDrafter`, the same n-gram size and draft
                 length as hf-lookup: `--lookup-ngram`, `--lookup`)
  draft-model    the small draft model in our loop (`eagle.drafters.ModelDrafter`), chain of `--depth`, drafting
                 stopped below the draft's top probability `--assistant-threshold` (as transformers' assistant does)
  hf-plain       `target.generate` (transformers' own loop, the baseline of its speculative methods)
  hf-lookup      `target.generate(prompt_lookup_num_tokens=..., max_matching_ngram_size=...)`
  hf-assisted    `target.generate(assistant_model=...)` with the same small draft model and transformers' defaults
                 (its documented usage: `num_assistant_tokens` 20, constant schedule, confidence threshold 0.4)
The small draft model (bench/draft_model.py): the target's tokenizer, tied embeddings, half the width and 2 layers
(~0.2x the target's per-token matrix work), trained on the same regenerated conversations as the head for the
head's training time. The head is the EAGLE-3 TTT head of bench/acceptance_vs_depth.py (the same cached one).
Reports tokens/s, speedup over our plain (`x_plain`), over the method's own implementation's plain (`x_own`: ours
over plain, hf-* over hf-plain: the speculation gain alone), over hf-plain, tokens per target forward pass (prefill
included; counted by a hook on the HF decoder for transformers' methods, from the outputs for ours) and our tau
(tokens emitted per verification step, `SpecStats.tau`; the rule's raw count `tau_raw` is kept in the JSON); at
T=0 every method's output is compared with plain greedy decoding, mismatches reported. Goals checked at T=0
(`goal_line`: met only with 0 mismatches in all of our methods): our tau >= 4 (>= 5.5 for the best head), >= 2.0x
plain, >= 1.5x each transformers method, and the head's speculation gain >= 1.5x that of prompt lookup and of the
draft model in the same (our) loop. Writes speedup.json and .png. The methods, the table's rows and the goals are
built in bench/speedup_methods.py.
Not measured here: batches > 1 (bench/batch.py), GPU timings, vLLM (bench/vllm_speedup.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)
import draft_model
import torch

from common import (
    Setup,
    base_args,
    heldout_prompts,
    prepare,
    print_table,
    pyplot,
    results_dir,
    speed_head,
    start,
    write_results,
)
from speedup_methods import CallCounter, goals, methods, summarize
from timing import fresh_runs, interleaved


def plot(tables: dict[str, list[dict]], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(tables), figsize=(5.2 * len(tables), 3.8), squeeze=False)
    for ax, (temp, rows) in zip(axes[0], tables.items()):
        names = [r["method"] for r in rows]
        ax.bar(
            names,
            [r["x_plain"] for r in rows],
            color=[
                "#888" if "plain" in n else "#3a7" if "eagle" in n else "#c84" if n.startswith("hf-") else "#58b"
                for n in names
            ],
        )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("speedup over plain (tokens/s ratio)")
        ax.set_title(f"T = {temp}")
        ax.tick_params(axis="x", rotation=35)
        for i, r in enumerate(rows):
            ax.text(i, r["x_plain"], f"{r['x_plain']:.2f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=0, help="held-out prompts (0: the preset's)")
    p.add_argument("--depth", type=int, default=5, help="chain depth")
    p.add_argument("--tree", default="5,4,12", help="tree depth,topk,budget")
    p.add_argument(
        "--lookup",
        type=int,
        default=10,
        help="prompt lookup's draft length (hf: prompt_lookup_num_tokens; ours: chain depth)",
    )
    p.add_argument(
        "--lookup-ngram",
        type=int,
        default=2,
        help="longest n-gram prompt lookup matches (hf: max_matching_ngram_size, its default 2)",
    )
    p.add_argument(
        "--assistant-threshold",
        type=float,
        default=0.4,
        help="the draft model in our loop stops drafting below this top probability (transformers' "
        "assistant_confidence_threshold default)",
    )
    p.add_argument("--temperatures", default="0,1")
    p.add_argument(
        "--draft-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the head's weights at inference (the target stays float32)",
    )
    p.add_argument(
        "--min-draft-prob",
        type=float,
        default=0.0,
        help="also run the chain with early exit at this draft confidence (row eagle-chain-exit)",
    )
    p.add_argument(
        "--head-steps",
        type=int,
        default=0,
        help="train the head this many steps instead of the preset's (results go to speedup-head<N>.*)",
    )
    p.add_argument(
        "--setup-only",
        action="store_true",
        help="prepare the data, the head and the assistant draft LM (cached), then stop without measuring: "
        "run the setup while the machine is busy, measure later on quiet cores",
    )
    p.add_argument(
        "--draft-model-seconds",
        type=float,
        default=0.0,
        help="train the draft model this long instead of the head's training time (0): not like for "
        "like, so the result name says -dm<S> and the draft-model goal line names the ratio",
    )
    p.add_argument(
        "--side-by-side",
        action="store_true",
        help="train the head and the draft model at the same time, half the cores each, the draft model "
        "until the head is done: the same CPU-minutes for both in the time of one training",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="repeat the measurement in N fresh processes (after one setup); the table gives each ratio's "
        "median and minimum, the goals use the medians (results in <name>-runs<N>.*)",
    )
    p.add_argument("--out", default="", help=argparse.SUPPRESS)  # where a child process of --runs writes its JSON
    args = p.parse_args(argv)
    if args.side_by_side and args.draft_model_seconds:
        p.error("--side-by-side trains the draft model for the head's time; drop --draft-model-seconds")
    load0 = start(args)
    setup = prepare(args.quick, conversations=args.conversations)
    if args.runs > 1:
        run(setup, argparse.Namespace(**{**vars(args), "setup_only": True}), load0)  # train once, outside the runs
        repeat(args, argv if argv is not None else sys.argv[1:], load0)
        return
    run(setup, args, load0)


RATIOS = ("tok_s", "x_plain", "x_own", "x_hf_plain")


def _draft_model_beside(setup: Setup, args: argparse.Namespace):
    """`--side-by-side`: when the head is not trained yet, start the draft model's training in a child process
    (`bench/draft_model.py --beside`) and give each of the two half the cores; the child stops when the head is
    done, so both train for the same wall time on the same share of the machine. None when the head is cached."""
    import subprocess

    from common import head_work_dir, speed_head_config

    cfg = speed_head_config(setup, args.head_steps)
    work = head_work_dir(setup, "eagle3-ttt7", cfg)
    if (work / "bench_train.json").is_file():
        return None
    half = max(1, (os.cpu_count() or 2) // 2)
    common.SETUP_THREADS = half
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("draft_model.py")),
        "--beside",
        str(work),
        "--head-steps",
        str(cfg.steps),
        "--setup-threads",
        str(half),
        "--threads",
        str(half),
        "--conversations",
        str(args.conversations),
        *(["--quick"] if args.quick else []),
        *(["--cache", args.cache] if args.cache else []),
    ]
    print(f"side by side: the head and the draft model train at once, {half} torch thread(s) each", flush=True)
    ready = draft_model.Beside(work, cfg.steps).ready_file
    ready.unlink(missing_ok=True)
    child = subprocess.Popen(cmd)
    t0 = time.monotonic()
    while not ready.is_file():  # start the head with the draft model's first step, not before
        if child.poll() is not None:
            raise RuntimeError(f"the draft model beside the head failed to start (exit {child.returncode})")
        if time.monotonic() - t0 > 600:
            child.kill()
            raise RuntimeError("the draft model beside the head was not ready within 10 min")
        time.sleep(0.2)
    return child, work


def _join(beside) -> None:
    """Wait for the draft model trained beside the head (it stops within seconds of the head); a failed head
    stops it."""
    import subprocess

    child, work = beside
    if not (work / "bench_train.json").is_file():
        child.terminate()
    try:
        rc = child.wait(timeout=600)
    except subprocess.TimeoutExpired:
        child.kill()
        raise RuntimeError("the draft model beside the head did not stop within 10 min of the head") from None
    if rc not in (0, -signal.SIGTERM):  # SIGTERM: stopped above, after a failed head
        raise RuntimeError(f"the draft model beside the head failed (exit {rc}); see its output above")


def repeat(args: argparse.Namespace, argv: list[str], load0: list[float]) -> None:
    """`--runs N`: the measurement in N fresh processes, one after the other; per temperature and method the
    median, minimum and maximum of tokens/s and of each ratio, the worst mismatch count; tau and tokens per call
    from the first run with every run's kept (`tau_runs`)."""
    import statistics

    def say(i: int, payload: dict) -> None:
        t0 = {r["method"]: r for r in payload["tables"].get("0", [])}
        print(
            f"run {i + 1}/{args.runs}: " + ", ".join(f"{m} {r['x_plain']:.3f}" for m, r in t0.items() if m != "plain"),
            flush=True,
        )

    runs = fresh_runs(__file__, argv, args.runs, say)
    first = runs[0]
    tables, texts = {}, []
    for temp, rows0 in first["tables"].items():
        rows = []
        for j, row in enumerate(rows0):
            per = [r["tables"][temp][j] for r in runs]
            agg = {**row, "tau_runs": [x["tau"] for x in per], "runs": args.runs}
            for key in RATIOS:
                xs = sorted(x[key] for x in per)
                agg.update({key: statistics.median(xs), f"{key}_min": xs[0], f"{key}_max": xs[-1], f"{key}_runs": xs})
            if row["mismatch"] is not None:
                agg["mismatch"] = max(x["mismatch"] for x in per)
            rows.append(agg)
        tables[temp] = rows
        texts.append(
            print_table(
                rows,
                [
                    "method",
                    "tok_s",
                    "x_plain",
                    "x_plain_min",
                    "x_own",
                    "x_own_min",
                    "x_hf_plain",
                    "tok_per_call",
                    "tau",
                    "mismatch",
                ],
                f"T={temp}, batch 1, {first['n_prompts']} held-out prompts, median and minimum of "
                f"{args.runs} fresh processes",
            )
        )
    g = goals(tables["0"], first["draft_model"]["seconds"] / first["head_train_seconds"]) if "0" in tables else {}
    name = first["name"] + f"-runs{args.runs}"
    png = results_dir(args.quick) / f"{name}.png"
    plot(tables, png)
    write_results(
        name,
        args.quick,
        {
            **{k: v for k, v in first.items() if k not in ("tables", "text", "name")},
            "args": vars(args),
            "tables": tables,
            "goals_T0": g,
            "text": texts,
            "target_path_runs": [r.get("target_path") for r in runs],
            "plot": str(png),
        },
        load0,
    )


def run(setup: Setup, args: argparse.Namespace, load0: list[float]) -> None:
    """The benchmark on a prepared setup (see bench/common.py); prints the table, writes the result files."""
    beside = _draft_model_beside(setup, args) if args.side_by_side else None
    try:
        head, suffix = speed_head(setup, args.head_steps, args.conversations)
    finally:
        if beside is not None:
            _join(beside)
    name = "speedup" + suffix
    if args.depth != 5:
        name += f"-depth{args.depth}"
    if args.draft_dtype != "float32":
        name += f"-{args.draft_dtype}"
    if args.min_draft_prob:
        name += f"-exit{args.min_draft_prob:g}"
    if args.tree != "5,4,12":
        name += "-tree" + args.tree.replace(",", "_")
    if args.temperatures != "0,1":
        name += "-T" + args.temperatures.replace(",", "_")
    if args.draft_model_seconds:
        name += f"-dm{args.draft_model_seconds:g}"
    lm_dir, lm_info = draft_model.ensure(setup, args.draft_model_seconds or head.seconds)
    if args.setup_only:
        print(
            f"setup done: head {head.head_dir} ({head.seconds:.0f} s of training), draft model {lm_dir} "
            f"({lm_info['seconds']:.0f} s, {lm_info['x_target_compute']}x the target's compute)",
            flush=True,
        )
        return

    from components.targets.target import load_target
    from eagle.export import load_head

    target, tok = load_target(setup.target_dir)
    assistant = _load_lm(lm_dir)  # load_target refuses < 4 layers (it checks for an EAGLE-3 target)
    draft = load_head(head.head_dir, target, dtype=getattr(torch, args.draft_dtype)).eval()
    counter = CallCounter(target)
    prompts = heldout_prompts(tok, setup.heldout_traffic, args.prompts or setup.preset.eval_prompts)
    tables, texts = {}, []
    with torch.no_grad():
        for temp in (float(t) for t in args.temperatures.split(",")):
            ms = methods(target, draft, assistant, temp, args, setup.preset.max_new_tokens, counter)
            rows = summarize(interleaved(ms, prompts), temp == 0)
            tables[f"{temp:g}"] = rows
            texts.append(
                print_table(
                    rows,
                    ["method", "tok_s", "x_plain", "x_own", "x_hf_plain", "tok_per_call", "tau", "tokens", "mismatch"],
                    f"T={temp:g}, batch 1, {len(prompts)} held-out prompts, "
                    f"max {setup.preset.max_new_tokens} new tokens",
                )
            )
    from eagle import target_path

    payload = {
        "args": vars(args),
        "n_prompts": len(prompts),
        "tables": tables,
        "head_train_seconds": head.seconds,
        "target_path": target_path.record(target),  # how our loop ran the target (timed at its first pass)
        "draft_model": {"dir": str(lm_dir), **lm_info},
        "head_x_target_compute": round(draft_model.head_macs(draft.cfg) / lm_info["target_macs_per_token"], 3),
        "text": texts,
    }
    if args.out:  # a child of --runs: its parent aggregates, checks the goals and writes the result files
        Path(args.out).write_text(json.dumps({**payload, "name": name}, default=str))
        return
    g = goals(tables["0"], lm_info["seconds"] / head.seconds) if "0" in tables else {}
    png = results_dir(args.quick) / f"{name}.png"
    plot(tables, png)
    write_results(name, args.quick, {**payload, "goals_T0": g, "plot": str(png)}, load0)


def _load_lm(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


if __name__ == "__main__":
    main()
