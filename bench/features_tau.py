"""tau of heads trained on engine features vs local features: what features from vLLM buy (issue 24, item 5).

Run: `python bench/features_tau.py [--quick] [--seeds 3] [--engine local|vllm] [--steps N] [--depth 5] [--prompts N]`
The benchmark setup's regenerated training traffic (bench/common.py: the embedded default, `--quick` the tiny one) is
extracted twice with the preset's extraction config (its stored dtype, bf16 for both presets): by this process
(`extract.engine: local`, the setup's cached features) and by vLLM started for the run (`extract.engine: vllm`,
components/extract/engine.py, cached under `<work>/extract-vllm/`; a finished extraction is not repeated). On each,
TTT heads (K = 7, the preset's training config: `speed_head`'s, `--steps` to shorten it) are trained in process with
`components.train.stage.train` for seeds 0..`--seeds`-1, the same data, steps and seeds for both feature sets (cached
per config and data by `common.train_or_reuse_head`: the local seed-0 head is `speedup.py`'s). Each head's tau on the
same held-out prompts, greedy, chain of depth `--depth`:
  --engine local   our decoder (`eagle.speculative.generate_speculative`): tau of emitted tokens (`SpecStats.tau`),
                   tau raw beside it, outputs checked identical to plain greedy decoding (mismatches counted);
  --engine vllm    the head served by vLLM (one server per head, `method: eagle3`): tau raw from the engine's spec-
                   decode counters (what the acceptance rule accepted, as vLLM counts it), outputs compared with
                   plain vLLM's (one more server).
tau is deterministic given the head and prompts (greedy), so the machine's load does not move it.
Prints one row per (features, seed): tau, tau raw, mismatches, training seconds; then per features the median, min,
max and range of tau over the seeds; the ratio of medians engine/local; and the goal line:
|ratio - 1| <= the seed-to-seed range (max - min over seeds, the larger of the two feature sets, over the local
median): heads trained on engine features are as good as heads trained on local features, within seed noise.
Also the features' max relative difference (max |a - b| / max |a| over all shards; bench/extract_engine.py).
Writes features_tau.json (bench/results/, or .eagle/bench/results-quick/ with --quick; `-steps<N>`, `-vllm` in the
name for non-default settings).
Not measured here: extraction speed (bench/extract_engine.py), wall-clock speedup of the heads, sampling (T > 0),
features in fp8 or fp32 storage, engine features of a bf16 target.
"""

from __future__ import annotations

import dataclasses
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
    spec_figures,
    speed_head_config,
    start,
    train_or_reuse_head,
    write_results,
)
from components.extract.stage import extract
from components.targets.runtime import StageContext
from extract_engine import max_rel_diff
from infra.settings import Settings

FEATURES = ("local", "vllm")


def engine_features(setup) -> Path:
    """The setup's traffic extracted by vLLM with the preset's extraction config (resumed; skipped when done)."""
    out = setup.work / "extract-vllm"
    cfg = dataclasses.replace(setup.preset.extract, engine="vllm", num_workers=0)
    common._say(f"bench: extracting features through vLLM into {out} (once)")
    extract(
        cfg,
        str(setup.target_dir),
        str(setup.regen_dir),
        str(out),
        progress=lambda s: None,
        context=StageContext(settings=Settings.from_env()),
    )
    return out


def tau_local(setup, heads: dict[tuple[str, int], Path], prompts, depth: int) -> dict:
    """Our chain, greedy, per head: emitted and raw tau, mismatches with plain greedy decoding."""
    from components.targets.target import load_target
    from eagle.export import load_head
    from eagle.speculative import SpecConfig, generate_plain, generate_speculative

    target = load_target(str(setup.target_dir))[0]
    cfg = SpecConfig(
        method="chain",
        depth=depth,
        temperature=0.0,
        max_new_tokens=setup.preset.max_new_tokens,
        eos_token_id=eos_of(target),
    )
    out = {}
    with torch.no_grad():
        plain = [generate_plain(target, torch.tensor([ids]), None, cfg).sequences for ids in prompts]
        for key, head_dir in heads.items():
            draft = load_head(head_dir, target).eval()
            stats, bad = [], 0
            for ids, ref in zip(prompts, plain):
                g = generate_speculative(target, draft, torch.tensor([ids]), None, cfg)
                stats.append(g.stats)
                bad += int(not torch.equal(g.sequences, ref))
            fig = spec_figures(stats)
            out[key] = {"tau": fig["tau"], "tau_raw": fig["tau_raw"], "alpha": fig["alpha"], "mismatches": bad}
            common._say(f"bench: {key[0]} seed {key[1]}: tau {fig['tau']:.3f}")
    return out


def tau_vllm(setup, heads: dict[tuple[str, int], Path], prompts, depth: int) -> dict:
    """vLLM, greedy, one server per head: raw tau from the engine's counters, mismatches with plain vLLM."""
    sys.path.insert(0, str(Path(__file__).parent))
    from vllm_speedup import engine_run

    settings, max_new = Settings.from_env(), setup.preset.max_new_tokens
    plain = engine_run("plain", setup, Path(), prompts, depth, max_new, settings)["outputs"]
    out = {}
    for key, head_dir in heads.items():
        r = engine_run("eagle3", setup, head_dir, prompts, depth, max_new, settings)
        out[key] = {
            "tau": r["tau"],
            "tau_raw": r["tau"],
            "alpha": r["acceptance"],
            "mismatches": sum(a != b for a, b in zip(plain, r["outputs"])),
        }
        common._say(f"bench: {key[0]} seed {key[1]}: tau in vLLM {r['tau']:.3f}")
    return out


def summary(taus: dict[tuple[str, int], dict]) -> dict[str, dict]:
    out = {}
    for f in FEATURES:
        xs = [r["tau"] for (g, _), r in taus.items() if g == f]
        out[f] = {
            "features": f,
            "seeds": len(xs),
            "median": statistics.median(xs),
            "min": min(xs),
            "max": max(xs),
            "range": max(xs) - min(xs),
        }
    return out


def plot(rows: list[dict], summ: dict[str, dict], label: str, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    for i, f in enumerate(FEATURES):
        xs = [r["tau"] for r in rows if r["features"] == f]
        ax.scatter([i] * len(xs), xs, label=f"{f} features (median {summ[f]['median']:.2f})")
        ax.hlines(summ[f]["median"], i - 0.2, i + 0.2, color="k")
    ax.set_xticks(range(len(FEATURES)), [f"{f} features" for f in FEATURES])
    ax.set_xlim(-0.6, len(FEATURES) - 0.4)
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("tau of heads trained on engine vs local features, one point per seed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3, help="training seeds per feature set (0..N-1)")
    p.add_argument(
        "--engine",
        choices=("local", "vllm"),
        default="local",
        help="where tau is measured: our decoder (local) or vLLM serving each head (one server per head)",
    )
    p.add_argument("--steps", type=int, default=0, help="training steps per head (0: the preset's)")
    p.add_argument("--depth", type=int, default=5, help="chain depth / speculative tokens per step")
    p.add_argument("--prompts", type=int, default=0, help="held-out prompts (0: the preset's)")
    args = p.parse_args(argv)
    load = start(args)
    setup = prepare(args.quick, conversations=args.conversations)
    dirs = {"local": setup.extract_dir, "vllm": engine_features(setup)}
    diff = max_rel_diff(dirs["local"], dirs["vllm"])
    base = speed_head_config(setup, args.steps)
    heads, trained = {}, {}
    for seed in range(args.seeds):
        for f in FEATURES:
            t = train_or_reuse_head(setup, "eagle3-ttt7", dataclasses.replace(base, seed=seed), dirs[f])
            heads[(f, seed)], trained[(f, seed)] = t.head_dir, t
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(setup.target_dir)
    prompts = heldout_prompts(tok, setup.heldout_traffic, args.prompts or setup.preset.eval_prompts)
    taus = (tau_vllm if args.engine == "vllm" else tau_local)(setup, heads, prompts, args.depth)
    rows = [
        {
            "features": f,
            "seed": s,
            "tau": r["tau"],
            "tau_raw": r["tau_raw"],
            "mismatch": r["mismatches"],
            "train_s": trained[(f, s)].seconds,
            "final_acc_0": trained[(f, s)].final_metrics.get("acc_0"),
        }
        for (f, s), r in sorted(taus.items(), key=lambda kv: (FEATURES.index(kv[0][0]), kv[0][1]))
    ]
    label = "tau emitted (our decoder)" if args.engine == "local" else "tau raw (vLLM's counters)"
    print_table(
        rows,
        ["features", "seed", "tau", "tau_raw", "mismatch", "train_s", "final_acc_0"],
        f"{label}, chain depth {args.depth}, T=0, {len(prompts)} held-out prompts, heads of {base.steps} "
        f"steps ({setup.preset.name} preset); features max rel diff engine/local {diff:.1e}",
    )
    summ = summary(taus)
    print_table(list(summ.values()), ["features", "seeds", "median", "min", "max", "range"], "tau over seeds")
    ratio = summ["vllm"]["median"] / summ["local"]["median"]
    spread = max(summ["vllm"]["range"], summ["local"]["range"]) / summ["local"]["median"]
    print(f"ratio of medians engine/local: {ratio:.3f}; seed-to-seed range / local median: {spread:.3f}")
    bad = sum(r["mismatches"] for r in taus.values())
    goal = goal_line(
        "seed range - |engine/local - 1| >= 0",
        spread - abs(ratio - 1),
        0.0,
        bad,
        method="heads on engine vs local features",
        label="goal",
    )  # |ratio - 1| <= range
    name = "features_tau" + (f"-steps{base.steps}" if args.steps else "") + ("-vllm" if args.engine == "vllm" else "")
    png = results_dir(args.quick) / f"{name}.png"
    plot(rows, summ, label, png)
    write_results(
        name,
        args.quick,
        {
            "args": vars(args),
            "train_config": dataclasses.asdict(base),
            "tau_engine": args.engine,
            "tau_kind": label,
            "depth": args.depth,
            "n_prompts": len(prompts),
            "max_new_tokens": setup.preset.max_new_tokens,
            "features_max_rel_diff": diff,
            "feature_dirs": {f: str(d) for f, d in dirs.items()},
            "rows": rows,
            "summary": summ,
            "engine_over_local": ratio,
            "seed_range_rel": spread,
            "mismatches": bad,
            "goals": {"engine_same_as_local": goal},
            "plot": str(png),
        },
        load,
    )


if __name__ == "__main__":
    main()
