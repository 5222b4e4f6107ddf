"""Does keeping the checkpoint with the best held-out simulated tau beat keeping the last one?

Run: `python bench/checkpoint_by_tau.py [--quick] [--steps 600] [--eval-every 25] [--holdout 32] [--ttt 3]
[--prompts 16]`
One long training run on the embedded default's regenerated traffic (bench/common.py: 512 conversations, offline
features), long enough to pass through several epochs (`components.train.stage.train`, in process, `select="best_tau"`):
every `--eval-every` steps it measures the head's TTT loss and simulated tau on `--holdout` sequences held out of
training, and exports the best. The last weights are exported from the run's final checkpoint by the same stage
with `select="last"` (it resumes at the end and trains nothing). Both heads then decode real held-out traffic with
the evaluate stage (`components.evaluate.stage.evaluate`, local engine, chain of depth `--depth`, T=0, `--prompts`
first user turns of the embedded target's held-out conversations: not the slice used for the selection), outputs
checked identical to plain greedy decoding.
Prints the held-out tau and loss against steps, and best vs last: step, simulated held-out tau, decoded tau,
alpha_1, alpha_depth, speedup. Writes checkpoint_by_tau.json and .png (held-out tau and loss against steps, the
selected step marked).
Not measured here: other selection rules (held-out loss, early stopping), sampling (T > 0), vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)

from common import (
    Setup,
    base_args,
    prepare,
    print_table,
    pyplot,
    results_dir,
    setup_threads,
    start,
    train_or_reuse_head,
    write_results,
)
from components.train.stage import TrainConfig, train


def train_both(setup: Setup, cfg: TrainConfig) -> dict[str, dict]:
    """The best-tau head (trained once, cached) and the last-step head exported from its final checkpoint."""
    best = train_or_reuse_head(setup, f"select-ttt{cfg.ttt.ttt_steps}", cfg)
    run_dir = best.head_dir.parent
    last_dir = run_dir.with_name(run_dir.name + "-last")
    if not (last_dir / "head" / "model.safetensors").is_file():
        shutil.rmtree(last_dir, ignore_errors=True)
        shutil.copytree(run_dir / "checkpoints", last_dir / "checkpoints")
        with setup_threads():
            train(dataclasses.replace(cfg, select="last"), str(setup.extract_dir), str(last_dir))
    heads = {}
    for name, d in (("best", run_dir), ("last", last_dir)):
        lineage = json.loads((d / "head" / "eagle_head.json").read_text())["lineage"]
        heads[name] = {
            "head_dir": str(d / "head"),
            "step": lineage["selected_step"],
            "heldout_tau": lineage["selected_heldout_tau"],
            "rule": lineage["selection_rule"],
        }
    heads["best"]["train_s"] = best.seconds
    return heads


def heldout_curve(history: Path) -> list[dict]:
    rows = [json.loads(x) for x in history.read_text().splitlines() if x.strip()]
    return [
        {
            "step": r["step"],
            "train_loss": r["loss"],
            "train_sim_tau": r["tau"],
            "heldout_loss": r["heldout_loss"],
            "heldout_acc_0": r["heldout_acc_0"],
            "heldout_tau": r["heldout_tau"],
        }
        for r in rows
        if "heldout_tau" in r
    ]


def decode(setup: Setup, heads: dict[str, dict], args: argparse.Namespace) -> None:
    """Decode held-out traffic with each head through the evaluate stage; adds tau, alphas, speedup to `heads`."""
    from components.evaluate.stage import EvaluateConfig, HeadEval, evaluate
    from eagle.speculative import SpecConfig

    cfg = EvaluateConfig(
        spec=SpecConfig(method="chain", depth=args.depth, max_new_tokens=setup.preset.max_new_tokens),
        limit=args.prompts or setup.preset.eval_prompts,
        engine="local",
    )
    for name, h in heads.items():
        out = setup.work / "checkpoint_by_tau" / f"eval-{name}-{Path(h['head_dir']).parent.name}"
        r = evaluate(
            cfg,
            HeadEval(str(setup.target_dir), h["head_dir"], str(setup.heldout_traffic), str(out)),
            progress=lambda _m: None,
        )
        h.update(
            tau=r.tau,
            a1=r.acceptance[0],
            **{f"a{args.depth}": r.acceptance[-1]},
            speedup=r.speedup,
            identical=r.identical,
            prompts=r.n_samples,
            tokens=r.n_tokens,
        )


def plot(curve: list[dict], heads: dict[str, dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 4.0))
    steps = [r["step"] for r in curve]
    ax.plot(steps, [r["heldout_tau"] for r in curve], marker="o", ms=3, label="held-out simulated τ")
    ax.plot(steps, [r["train_sim_tau"] for r in curve], ls=":", label="simulated τ, training batch")
    for name, ls in (("best", "--"), ("last", "-.")):
        h = heads[name]
        ax.axvline(h["step"], color="grey", ls=ls, lw=1, label=f"{name}: step {h['step']}, decoded τ {h['tau']:.3f}")
    ax.set_xlabel("training step")
    ax.set_ylabel("τ")
    ax.grid(True, alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(steps, [r["heldout_loss"] for r in curve], color="tab:red", alpha=0.6, label="held-out TTT loss")
    ax2.set_ylabel("held-out TTT loss", color="tab:red")
    lines = ax.get_legend_handles_labels()
    more = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="lower right")
    ax.set_title("Held-out τ during training; best-by-τ vs last checkpoint")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=0, help="training steps (0: 600; quick: 16)")
    p.add_argument("--eval-every", type=int, default=0, help="held-out evaluation every N steps (0: 25; quick: 4)")
    p.add_argument("--holdout", type=int, default=32, help="sequences held out of training for the selection")
    p.add_argument("--ttt", type=int, default=3, help="TTT steps K of the head")
    p.add_argument("--depth", type=int, default=5, help="chain depth of the decoding measurement")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts decoded per head (quick: the preset's)")
    args = p.parse_args(argv)
    load0 = start(args)
    run(prepare(args.quick, conversations=args.conversations), args, load0)


def run(setup: Setup, args: argparse.Namespace, load0: list[float]) -> None:
    """The benchmark on a prepared setup (see bench/common.py); prints the tables, writes the result files."""
    steps = args.steps or (16 if args.quick else 600)
    base = setup.preset.train
    cfg = dataclasses.replace(
        base,
        steps=steps,
        ttt=dataclasses.replace(base.ttt, ttt_steps=args.ttt),
        checkpoint_every=steps,
        eval_every=args.eval_every or (4 if args.quick else 25),
        holdout_seqs=4 if args.quick else args.holdout,
        select="best_tau",
    )
    if args.quick:
        args.prompts = 0
    heads = train_both(setup, cfg)
    curve = heldout_curve(Path(heads["best"]["head_dir"]).parent / "history.jsonl")
    decode(setup, heads, args)
    for r in curve:
        r["best"] = "*" if r["step"] == heads["best"]["step"] else ""
    curve_table = print_table(
        curve,
        ["step", "train_loss", "train_sim_tau", "heldout_loss", "heldout_acc_0", "heldout_tau", "best"],
        f"held-out slice ({cfg.holdout_seqs} sequences held out of training): TTT loss and "
        f"simulated tau, K={cfg.ttt.ttt_steps}, every {cfg.eval_every} steps (* selected)",
    )
    rows = [
        {
            "head": n,
            "step": h["step"],
            "heldout_tau": h["heldout_tau"],
            "tau": h["tau"],
            "a1": h["a1"],
            f"a{args.depth}": h[f"a{args.depth}"],
            "speedup": h["speedup"],
            "identical": h["identical"],
        }
        for n, h in heads.items()
    ]
    heads_table = print_table(
        rows,
        ["head", "step", "heldout_tau", "tau", "a1", f"a{args.depth}", "speedup", "identical"],
        f"best-by-tau vs last: decoded on {heads['best']['prompts']} held-out prompts, chain "
        f"depth {args.depth}, T=0 (heldout_tau: simulated, on the selection slice)",
    )
    b, last = heads["best"], heads["last"]
    verdict = (
        "the best was the last step: the same head"
        if b["step"] == last["step"]
        else f"best-by-tau {'beats' if b['tau'] > last['tau'] else 'does not beat'} last: decoded tau "
        f"{b['tau']:.3f} (step {b['step']}) vs {last['tau']:.3f} (step {last['step']}), "
        f"ratio {b['tau'] / last['tau']:.3f}"
    )
    print(f"answer: {verdict}; selection: {b['rule']}", flush=True)
    png = results_dir(args.quick) / "checkpoint_by_tau.png"
    plot(curve, heads, png)
    write_results(
        "checkpoint_by_tau",
        args.quick,
        {
            "args": vars(args),
            "train_config": dataclasses.asdict(cfg),
            "heldout": curve,
            "heads": heads,
            "selected_step": b["step"],
            "answer": verdict,
            "tables": [curve_table, heads_table],
            "plot": str(png),
        },
        load0,
    )


if __name__ == "__main__":
    main()
