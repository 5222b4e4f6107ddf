"""Acceptance against the amount of training traffic: tau of heads trained on 1/8, 1/4, 1/2 and all of it.

Run: `python bench/data_scaling.py [--quick] [--fractions 0.125,0.25,0.5,1] [--depth 4] [--steps 100] [--ttt 3]`
The regenerated training traffic of bench/common.py is cut to its first fraction f of conversations, extracted
(offline features, `components.extract`), and an EAGLE-3 TTT head is trained on each with the same budget (steps x
batch, so smaller sets are seen for more epochs; `components.train`, in process). To keep four trainings inside
about ten minutes the heads are cheaper than the other benchmarks' (K=3 TTT steps, 100 steps; `--steps`, `--ttt`). Each head drafts chains at
T=0 on the same held-out prompts (`generate_speculative`, outputs checked identical to plain greedy decoding).
Reports per fraction: conversations, trained tokens, tau, alpha_1 and alpha_depth (of emitted tokens, `SpecStats`;
the raw tau is kept in the JSON), and the training run's simulated tau and final loss. Writes data_scaling.json and
.png.
Other settings than the defaults name their files (`data_scaling-conv2000-steps400-ttt7-depth7.json`): with
`--conversations 2000` the pool is the embedded traffic's 2,000 training conversations instead of 512.
Not measured here: a budget that grows with the data (every head gets the same steps), wall-clock speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)
import torch

from common import (Setup, base_args, eos_of, heldout_prompts, prepare, print_table, pyplot, results_dir,
                    spec_figures, start, train_or_reuse_head, with_ttt_steps, write_results)
from components.extract import extract


def subset_extract(setup: Setup, fraction: float) -> tuple[Path, dict]:
    """Extract dir of the first `fraction` of the regenerated conversations (the whole set's own dir at 1)."""
    if fraction >= 1:
        return setup.extract_dir, json.loads((setup.extract_dir / "manifest.json").read_text())
    lines = [ln for p in sorted(setup.regen_dir.glob("shard-*.jsonl")) for ln in p.read_text().splitlines() if ln]
    k = max(2, round(len(lines) * fraction))
    root = setup.work / f"subset-{k}"
    ext_dir = root / "extract"
    if not (ext_dir / "manifest.json").is_file():
        (root / "regenerate").mkdir(parents=True, exist_ok=True)
        (root / "regenerate" / "shard-00000.jsonl").write_text("\n".join(lines[:k]) + "\n")
        extract(setup.preset.extract, str(setup.target_dir), str(root / "regenerate"), str(ext_dir),
                progress=lambda _m: None)
    return ext_dir, json.loads((ext_dir / "manifest.json").read_text())


def tau_of(target, draft, prompts: list[list[int]], cfg) -> dict:
    from eagle.speculative import generate_plain, generate_speculative

    stats, mismatch = [], 0
    for ids in prompts:
        x = torch.tensor([ids])
        out = generate_speculative(target, draft, x, None, cfg)
        mismatch += int(not torch.equal(out.sequences, generate_plain(target, x, None, cfg).sequences))
        stats.append(out.stats)
    return {**spec_figures(stats), "mismatches": mismatch}  # emitted tau / alpha (SpecStats), raw ones beside


def plot(rows: list[dict], path: Path, depth: int) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    x = [r["trained_tokens"] for r in rows]
    ax.plot(x, [r["tau"] for r in rows], marker="o", label=f"τ, chain depth {depth}, held-out (T = 0)")
    ax.plot(x, [r["sim_tau"] for r in rows], marker="s", ls="--", label="simulated τ, last training batch")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{r['fraction']:g}\n{r['conversations']} conv" for r in rows])
    ax.set_xlabel("fraction of the training traffic (same steps for every head)")
    ax.set_ylabel("τ")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--fractions", default="0.125,0.25,0.5,1")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--steps", type=int, default=0, help="training steps per head (0: 100, quick: the preset's)")
    p.add_argument("--ttt", type=int, default=3, help="TTT steps K of every head")
    p.add_argument("--prompts", type=int, default=0, help="held-out prompts (0: the preset's)")
    args = p.parse_args(argv)
    load0 = start(args)
    run(prepare(args.quick, conversations=args.conversations), args, load0)


def run(setup: Setup, args: argparse.Namespace, load0: list[float]) -> None:
    """The benchmark on a prepared setup (see bench/common.py); prints the table, writes the result files."""
    cfg_train = dataclasses.replace(with_ttt_steps(setup.preset.train, args.ttt),
                                    steps=args.steps or (setup.preset.train.steps if args.quick else 100))
    fractions = [float(f) for f in args.fractions.split(",")]
    heads = []
    for f in fractions:
        ext_dir, manifest = subset_extract(setup, f)
        head = train_or_reuse_head(setup, f"eagle3-ttt{cfg_train.ttt.ttt_steps}", cfg_train, ext_dir)
        heads.append((f, manifest, head))

    from components.targets import load_target
    from eagle.export import load_head
    from eagle.speculative import SpecConfig

    target, tok = load_target(setup.target_dir)
    prompts = heldout_prompts(tok, setup.heldout_traffic, args.prompts or setup.preset.eval_prompts)
    spec = SpecConfig(method="chain", depth=args.depth, max_new_tokens=setup.preset.max_new_tokens,
                      eos_token_id=eos_of(target))
    rows = []
    with torch.no_grad():
        for f, manifest, head in heads:
            r = tau_of(target, load_head(head.head_dir, target).eval(), prompts, spec)
            rows.append({"fraction": f, "conversations": manifest["n_seqs"],
                         "trained_tokens": manifest["n_trained_tokens"], "tau": r["tau"], "tau_raw": r["tau_raw"],
                         "a1": r["alpha"][0], f"a{args.depth}": r["alpha"][-1], "alpha": r["alpha"],
                         "sim_tau": head.final_metrics.get("tau"),
                         "train_loss": head.final_metrics.get("loss"), "mismatch": r["mismatches"],
                         "epochs": cfg_train.steps * cfg_train.batch_size / manifest["n_seqs"]})
    table = print_table(rows, ["fraction", "conversations", "trained_tokens", "epochs", "tau", "a1",
                               f"a{args.depth}", "sim_tau", "train_loss", "mismatch"],
                        f"tau vs training data, {cfg_train.steps} steps x batch {cfg_train.batch_size} each, "
                        f"chain depth {args.depth}, T=0, {len(prompts)} held-out prompts")
    name = "data_scaling" + "".join(f"-{k}{v}" for k, v in (("conv", args.conversations), ("steps", args.steps),
                                                             ("ttt", args.ttt if args.ttt != 3 else 0),
                                                             ("depth", args.depth if args.depth != 4 else 0)) if v)
    png = results_dir(args.quick) / f"{name}.png"
    plot(rows, png, args.depth)
    write_results(name, args.quick, {"args": vars(args), "train_config": dataclasses.asdict(cfg_train),
                                               "rows": rows, "table": table, "plot": str(png)}, load0)


if __name__ == "__main__":
    main()
