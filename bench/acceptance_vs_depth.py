"""Acceptance per draft position: EAGLE-3 with TTT vs EAGLE-3 without TTT vs an EAGLE-1-style head.

Run: `python bench/acceptance_vs_depth.py [--quick] [--steps N] [--prompts N]`
Three heads trained on the same regenerated traffic with the same budget (steps x batch, optimiser, lr):
  eagle3-ttt7   EAGLE-3 head, training-time test over K = 7 steps (components.train.stage, ttt_steps=7)
  eagle3-ttt1   the same head trained on step 0 only (ttt_steps=1): no exposure to its own drafts
  eagle1        top-layer feature only, feature regression + 0.1 x token loss (bench/eagle1.py), no TTT
Each drafts a chain of depth 7 at temperature 0 on held-out prompts (`eagle.speculative.generate_speculative`),
every output checked identical to plain greedy decoding. Prints per-position conditional acceptance
alpha_k = P(draft k accepted | drafts 1..k-1 accepted), the verify steps that reached depth k, tau (tokens per
verification, bonus included) and alpha_7 / alpha_1, all of emitted tokens (`SpecStats`: drafts accepted past EOS or
the token budget do not count; the raw figures are kept in the JSON as tau_raw, alpha_raw). The claim checked: with
TTT acceptance stays flat across depth (alpha_7 / alpha_1 >= 0.9); without, it decays; a claim holds only when the
heads involved had 0 mismatches (`common.goal_line`). Writes acceptance_vs_depth.json and .png.
Not measured here: wall-clock speed (bench/speedup.py); sampling (T > 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from safetensors.torch import load_file, save_file

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
    start,
    train_or_reuse_head,
    with_ttt_steps,
    write_results,
)
from components.train.stage import TrainConfig
from eagle1 import Eagle1Draft, eagle1_batch, eagle1_head, eagle1_loss

DEPTH = 7


def train_eagle1(setup: Setup, cfg: TrainConfig) -> tuple[Path, float]:
    """Train the EAGLE-1-style head with the same data order, steps, batch, optimiser and lr as the others."""
    from components.targets.target import load_target
    from components.train.data import TrainingData, batches
    from eagle.export import head_state_dict
    from eagle.train import make_optimizer

    out = setup.work / "heads" / f"eagle1-{common.fingerprint(cfg, str(setup.extract_dir))}"
    if (out / "head.safetensors").is_file():
        return out, json.loads((out / "info.json").read_text())["seconds"]
    common._say(f"bench: training head eagle1 ({cfg.steps} steps) into {out}")
    torch.manual_seed(cfg.seed)
    data = TrainingData.open(setup.extract_dir)
    target, _ = load_target(setup.target_dir)
    draft = eagle1_head(target, data.token_counts, cfg.draft_vocab_size).train()
    opt, sched = make_optimizer(draft.trainable_parameters(), cfg.optim, cfg.steps)
    t0, history = time.perf_counter(), []
    for step, idx in batches(data.n_seqs, cfg.batch_size, cfg.seed):
        if step >= cfg.steps:
            break
        seqs = [data.sequence(i) for i in idx]
        width = max(len(s) for s, _ in seqs)
        ids, mask = torch.zeros(len(idx), width, dtype=torch.long), torch.zeros(len(idx), width, dtype=torch.long)
        for r, (s, m) in enumerate(seqs):
            ids[r, : len(s)], mask[r, : len(s)] = s, m
        att = (torch.arange(width)[None] < torch.tensor([len(s) for s, _ in seqs])[:, None]).long()
        loss, metrics = eagle1_loss(draft, eagle1_batch(target, draft, ids, mask, att))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.trainable_parameters(), cfg.optim.grad_clip)
        opt.step()
        sched.step()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            history.append({"step": step + 1, **metrics})
    seconds = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    save_file(head_state_dict(draft), str(out / "head.safetensors"))
    (out / "info.json").write_text(
        json.dumps({"seconds": seconds, "config": draft.cfg.to_dict(), "history": history}) + "\n"
    )
    return out, seconds


def load_eagle1(path: Path, target):
    from eagle.config import DraftConfig

    draft = Eagle1Draft(DraftConfig.from_dict(json.loads((path / "info.json").read_text())["config"]))
    draft.load_state_dict(load_file(str(path / "head.safetensors")), strict=False)
    draft.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.detach())
    return draft.eval()


def measure(target, heads: dict, prompts: list[list[int]], max_new: int) -> dict[str, dict]:
    """Chain depth 7, greedy: accept lengths per head over all prompts, and identity with plain decoding."""
    from eagle.speculative import SpecConfig, generate_plain, generate_speculative

    cfg = SpecConfig(method="chain", depth=DEPTH, temperature=0.0, max_new_tokens=max_new, eos_token_id=eos_of(target))
    stats: dict[str, list] = {n: [] for n in heads}
    mismatches = {n: 0 for n in heads}
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            plain = generate_plain(target, x, None, cfg)
            for name, draft in heads.items():
                out = generate_speculative(target, draft, x, None, cfg)
                stats[name].append(out.stats)
                mismatches[name] += int(not torch.equal(out.sequences, plain.sequences))
    res = {}
    for name, parts in stats.items():
        fig = spec_figures(parts)  # emitted tau / alpha; the raw ones beside (tau_raw, alpha_raw)
        res[name] = {
            **fig,
            "mismatches": mismatches[name],
            "alpha7_over_alpha1": fig["alpha"][-1] / max(fig["alpha"][0], 1e-9),
        }
    return res


def claims(res: dict[str, dict]) -> dict[str, dict]:
    """The claims checked (`common.goal_line`: holds only when the heads involved changed no output)."""
    flat, m = res["eagle3-ttt7"]["alpha7_over_alpha1"], {n: r["mismatches"] for n, r in res.items()}
    out = {
        "ttt_flat (a7/a1 >= 0.9)": goal_line(
            "ttt_flat (a7/a1 >= 0.9)", flat, 0.9, m["eagle3-ttt7"], method="eagle3-ttt7", label="claim"
        )
    }
    for head in ("eagle3-ttt1", "eagle1"):
        name = f"{head.replace('eagle3-', '')}_decays (a7/a1 < ttt7's)"
        out[name] = goal_line(
            name,
            res[head]["alpha7_over_alpha1"],
            flat,
            m[head] + m["eagle3-ttt7"],
            below=True,
            method=head,
            label="claim",
        )
    return out


def plot(res: dict[str, dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    k = list(range(1, DEPTH + 1))
    for name, r in res.items():
        ax.plot(k, r["alpha"], marker="o", label=f"{name} (τ = {r['tau']:.2f})")
    ax.set_xlabel("draft position k (chain depth 7, T = 0)")
    ax.set_ylabel("α_k = P(accept k | accepted k-1)")
    ax.set_ylim(0, 1.02)
    ax.set_xticks(k)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Acceptance by draft position, held-out traffic")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=0, help="training steps per head (0: the preset's)")
    p.add_argument("--prompts", type=int, default=0, help="held-out prompts (0: the preset's)")
    args = p.parse_args(argv)
    load0 = start(args)
    run(prepare(args.quick, conversations=args.conversations), args, load0)


def run(setup: Setup, args: argparse.Namespace, load0: list[float]) -> None:
    """The benchmark on a prepared setup (see bench/common.py); prints the table, writes the result files."""
    base = setup.preset.train
    base = dataclasses.replace(base, steps=args.steps or base.steps)
    trained = {
        "eagle3-ttt7": train_or_reuse_head(setup, "eagle3-ttt7", with_ttt_steps(base, 7)),
        "eagle3-ttt1": train_or_reuse_head(setup, "eagle3-ttt1", with_ttt_steps(base, 1)),
    }
    e1_dir, e1_seconds = train_eagle1(setup, base)

    from components.targets.target import load_target
    from eagle.export import load_head

    target, tok = load_target(setup.target_dir)
    heads = {n: load_head(t.head_dir, target).eval() for n, t in trained.items()}
    heads["eagle1"] = load_eagle1(e1_dir, target)
    prompts = heldout_prompts(tok, setup.heldout_traffic, args.prompts or setup.preset.eval_prompts)
    res = measure(target, heads, prompts, setup.preset.max_new_tokens)
    seconds = {**{n: t.seconds for n, t in trained.items()}, "eagle1": e1_seconds}
    rows = [
        {
            "head": n,
            **{f"a{k + 1}": a for k, a in enumerate(r["alpha"])},
            "tau": r["tau"],
            "a7/a1": r["alpha7_over_alpha1"],
            "steps": r["verify_steps"],
            "reach7": r["reached"][-1],
            "mismatch": r["mismatches"],
            "train_s": seconds[n],
        }
        for n, r in res.items()
    ]
    table = print_table(
        rows,
        ["head", *[f"a{k}" for k in range(1, DEPTH + 1)], "tau", "a7/a1", "steps", "reach7", "mismatch", "train_s"],
        f"acceptance by position, chain depth {DEPTH}, T=0, {len(prompts)} held-out prompts",
    )
    checked = claims(res)
    png = results_dir(args.quick) / "acceptance_vs_depth.png"
    plot(res, png)
    write_results(
        "acceptance_vs_depth",
        args.quick,
        {
            "train_config": dataclasses.asdict(base),
            "n_prompts": len(prompts),
            "max_new_tokens": setup.preset.max_new_tokens,
            "depth": DEPTH,
            "heads": res,
            "train_seconds": seconds,
            "claims": checked,
            "table": table,
            "plot": str(png),
        },
        load0,
    )


if __name__ == "__main__":
    main()
