"""What the capture mix buys: heads retrained on served (shifted) traffic at several mixes, judged on both domains.

Purpose: issue 48 part 2. A retrain on captured traffic (flows/retrain_capture.py) trains on `capture.mix` captured
conversations and the rest the target version's registered traffic, so that the head does not forget what it was
trained for. This measures what each mix buys and costs, on one target:
1. the champion: a head trained on the target's registered traffic (the base domain), regenerated and extracted
   by the stages (`regenerate`, `extract`), `--steps-champion` steps;
2. what serve would capture once the traffic shifted: the target's own greedy answers to prompts of the other
   domain (the fine-tune's: `finetune-train`), made by the regenerate stage (speculative decoding is lossless, so a
   served completion is exactly this);
3. per mix in `--mixes`: the counts `components.data.captured_traffic.mix_counts` gives (what a retrain on capture uses,
   from `--registered` and `--captured` available), written as a regeneration directory the way a capture plan
   adds captures (registered first, then `shard-captured.jsonl`), extracted, and a head warm-started from the
   champion for `--steps` steps (the preset's warm-start steps);
4. a fresh head trained on the captured conversations alone, as many steps as the champion: the "offline" head the
   issue's goal compares a retrained head with (its τ on the shift >= 0.95x this one's);
5. every head, the champion as mix 0, decoded by the evaluate stage (our loop, chain of depth `--depth`, greedy,
   outputs checked identical to plain decoding) on held-out prompts of the shifted domain and of the base domain.
Prints τ on each domain by mix and writes `capture_mix.json` (+ `.png`: τ on both against the mix).
Run: `python bench/capture_mix.py [--quick | --build DIR] [--mixes 0.25 0.5 0.75 0.9] [--registered N]
[--captured N] [--steps N] [--prompts N]`. Default target: the newest real build of the embedded default under
`.eagle/embedded/real-*` (`make demo` makes it; SmolLM2-135M-Instruct, its fine-tune's traffic as the shift),
trained with the `default` preset's head config in this process (no Ray), stages on the local runtime; `--quick`:
the tiny toy target with the `tiny` preset (a few minutes). Work is cached under `.eagle/bench/capture_mix*/`.
Not here: the served speedup of the heads (components/evaluate/shadow.py measures it in a retrain), capture itself.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import common  # noqa: F401  (puts the repository on sys.path)
from common import ROOT, base_args, print_table, pyplot, start, write_results


TRAFFIC = ("target-train", "target-heldout", "finetune-train", "finetune-heldout")  # a real build's traffic/ files


@dataclasses.dataclass(frozen=True)
class Domains:
    target_dir: Path
    base_train: Path
    base_heldout: Path
    shift_train: Path
    shift_heldout: Path


def domains(args) -> Domains:
    if args.quick:
        emb = common.embedded(common.Preset.quick())
        return Domains(
            emb.target_dir,
            emb.target_traffic.train,
            emb.target_traffic.heldout,
            emb.finetune_traffic.train,
            emb.finetune_traffic.heldout,
        )
    build = Path(args.build) if args.build else newest_real_build()
    return Domains(build / "target", *(build / "traffic" / f"{t}.jsonl" for t in TRAFFIC))


def newest_real_build() -> Path:
    found = sorted((ROOT / ".eagle" / "embedded").glob("real-*/report.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        sys.exit(
            "capture_mix.py: no real build under .eagle/embedded (run `make demo` first, or pass --build DIR "
            "or --quick)"
        )
    return found[-1].parent


def stages(args):
    """(regenerate, extract, train, evaluate) configs: the preset's, in this process on the local runtime."""
    from components.evaluate.stage import EvaluateConfig
    from components.config.pipeline import PipelineConfig
    from components.train.config import RayConfig
    from eagle.speculative import SpecConfig

    cfg = PipelineConfig.preset("tiny" if args.quick else "default")
    regen = dataclasses.replace(cfg.regenerate, engine="local", limit=None)
    ext = dataclasses.replace(cfg.extract, engine="local")
    train = dataclasses.replace(
        cfg.train, ray=RayConfig(num_workers=0), eval_every=0, holdout_seqs=0, select="last", checkpoint_every=10_000
    )
    ev = EvaluateConfig(
        spec=SpecConfig(method="chain", depth=args.depth, max_new_tokens=cfg.evaluate.spec.max_new_tokens),
        limit=args.prompts,
        engine="local",
        time_local=False,
    )  # τ and identity, untimed
    return regen, ext, train, ev


def first_lines(src: Path, n: int, dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    lines = src.read_text().splitlines(keepends=True)
    if len(lines) < n:
        sys.exit(f"capture_mix.py: {src} holds {len(lines)} conversations, fewer than the {n} asked")
    dest.write_text("".join(lines[:n]))
    return dest


def regenerated(regen_cfg, target_dir: Path, traffic: Path, n: int, out: Path) -> list[str]:
    """The target's answers to the first `n` conversations of `traffic` (cached in `out`), as shard lines."""
    from components.regenerate.stage import regenerate

    done = out / "lines.jsonl"
    if not done.is_file():
        src = first_lines(traffic, n, out / "asked.jsonl")
        regenerate(regen_cfg, str(target_dir), str(src), str(out / "regen"), progress=lambda _m: None)
        lines = [
            line
            for p in sorted((out / "regen").glob("shard-*.jsonl"))
            for line in p.read_text().splitlines()
            if line.strip()
        ]
        done.write_text("".join(x + "\n" for x in lines))
    return done.read_text().splitlines()


def mixed_extract(ext_cfg, target_dir: Path, registered: list[str], captured: list[str], out: Path) -> Path:
    """A regeneration directory of `registered` then `captured` (as a capture plan adds them), extracted."""
    from components.data.captured_traffic import SHARD
    from components.extract.stage import extract

    if not (out / "extract" / "manifest.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        regen = out / "regen"
        regen.mkdir(parents=True)
        if registered:
            (regen / "shard-00000.jsonl").write_text("".join(x + "\n" for x in registered))
        if captured:
            (regen / SHARD).write_text("".join(x + "\n" for x in captured))
        extract(ext_cfg, str(target_dir), str(regen), str(out / "extract"), progress=lambda _m: None)
    return out / "extract"


def trained(train_cfg, ext_dir: Path, target_dir: Path, out: Path, warm: Path | None) -> Path:
    from components.train.stage import TrainSetup, train

    head = out / "head"
    if not (head / "model.safetensors").is_file():
        setup = TrainSetup(init_head_dir=str(warm) if warm else None)
        train(train_cfg, str(ext_dir), str(out), target_dir=str(target_dir), setup=setup)
    return head


def judged(ev_cfg, d: Domains, head: Path, out: Path) -> dict:
    from components.evaluate.stage import HeadEval, evaluate

    row = {}
    for name, traffic in (("shift", d.shift_heldout), ("base", d.base_heldout)):
        r = evaluate(
            ev_cfg,
            HeadEval(str(d.target_dir), str(head), str(traffic), str(out / f"eval-{name}")),
            progress=lambda _m: None,
        )
        row[f"tau_{name}"] = round(r.tau, 3)
        row[f"identical_{name}"] = r.identical
    return row


def main(argv: list[str] | None = None) -> int:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--build", help="a real build of the embedded default (default: the newest under .eagle)")
    p.add_argument("--mixes", type=float, nargs="+", default=[0.25, 0.5, 0.75, 0.9])
    p.add_argument(
        "--registered",
        type=int,
        default=0,
        help="registered conversations available (0: the preset's regenerate.limit)",
    )
    p.add_argument("--captured", type=int, default=0, help="captured conversations available (0: as --registered)")
    p.add_argument("--steps", type=int, default=0, help="steps of each warm-started head (0: the preset's)")
    p.add_argument("--steps-champion", type=int, default=0, help="steps of the champion (0: the preset's)")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts decoded per domain")
    p.add_argument("--depth", type=int, default=5, help="draft depth of the decoding")
    args = p.parse_args(argv)
    if args.quick and args.build:
        p.error("--quick and --build exclude each other")
    if not args.mixes or not all(0 < m < 1 for m in args.mixes):
        p.error("each --mixes value must lie in (0, 1), as capture.mix does")
    if min(args.registered, args.captured, args.steps, args.steps_champion) < 0 or args.prompts < 1 or args.depth < 1:
        p.error("--registered, --captured, --steps and --steps-champion must be >= 0; --prompts and --depth >= 1")
    if args.build:
        build = Path(args.build)
        missing = [
            str(build / f)
            for f in ("target/config.json", *(f"traffic/{t}.jsonl" for t in TRAFFIC))
            if not (build / f).is_file()
        ]
        if missing:
            p.error(f"--build {args.build}: not a real build of the embedded default (missing {', '.join(missing)})")
    load_before = start(args)
    from components.data.captured_traffic import mix_counts
    from components.config.pipeline import PipelineConfig

    d = domains(args)
    regen, ext, train, ev = stages(args)
    preset = PipelineConfig.preset("tiny" if args.quick else "default")
    n_reg = args.registered or preset.regenerate.limit
    n_cap = args.captured or n_reg
    champ_cfg = dataclasses.replace(train, steps=args.steps_champion or train.steps)
    warm_cfg = dataclasses.replace(train, steps=args.steps or train.warm_start_steps or train.steps)
    work = common.CACHE / ("capture_mix-quick" if args.quick else f"capture_mix-{d.target_dir.parent.name}")
    print(
        f"capture_mix: {d.target_dir}; {n_reg} registered and {n_cap} captured conversations, champion "
        f"{champ_cfg.steps} steps, warm-started heads {warm_cfg.steps} steps; cache {work}",
        file=sys.stderr,
    )
    with common.setup_threads():
        registered = regenerated(regen, d.target_dir, d.base_train, n_reg, work / f"registered-{n_reg}")
        captured = regenerated(regen, d.target_dir, d.shift_train, n_cap, work / f"captured-{n_cap}")
        champ_ext = mixed_extract(ext, d.target_dir, registered, [], work / "champion")
        champion = trained(champ_cfg, champ_ext, d.target_dir, work / f"champion-{champ_cfg.steps}", None)
        rows = [
            {
                "mix": 0.0,
                "captured": 0,
                "registered": len(registered),
                "head": "champion",
                **judged(ev, d, champion, work / f"champion-{champ_cfg.steps}"),
            }
        ]
        print(f"capture_mix: champion: {rows[-1]}", file=sys.stderr)
        off_ext = mixed_extract(ext, d.target_dir, [], captured, work / f"offline-c{len(captured)}")
        offline = trained(
            champ_cfg, off_ext, d.target_dir, work / f"offline-c{len(captured)}" / f"train-{champ_cfg.steps}", None
        )
        off = {
            "mix": 1.0,
            "captured": len(captured),
            "registered": 0,
            "head": f"offline {champ_cfg.steps} steps",
            **judged(ev, d, offline, work / f"offline-c{len(captured)}" / f"train-{champ_cfg.steps}"),
        }
        print(f"capture_mix: offline head on the shifted traffic: {off}", file=sys.stderr)
        for m in sorted(args.mixes):
            c, r = mix_counts(len(captured), len(registered), m)
            out = work / f"mix-{m:g}-c{c}-r{r}"
            ext_dir = mixed_extract(ext, d.target_dir, registered[:r], captured[len(captured) - c :], out)
            head = trained(warm_cfg, ext_dir, d.target_dir, out / f"train-{warm_cfg.steps}", champion)
            rows.append(
                {
                    "mix": m,
                    "captured": c,
                    "registered": r,
                    "head": f"warm {warm_cfg.steps} steps",
                    **judged(ev, d, head, out / f"train-{warm_cfg.steps}"),
                }
            )
            print(f"capture_mix: mix {m:g}: {rows[-1]}", file=sys.stderr)
    for r in rows:
        r["x_offline_shift"] = round(r["tau_shift"] / off["tau_shift"], 3)
    off["x_offline_shift"] = 1.0
    rows.append(off)
    print_table(
        rows,
        [
            "mix",
            "captured",
            "registered",
            "head",
            "tau_shift",
            "x_offline_shift",
            "tau_base",
            "identical_shift",
            "identical_base",
        ],
        "tau on the shifted and the base held-out prompts, by capture mix (last: a fresh head on the shift)",
    )
    best = max((r for r in rows[1:-1]), key=lambda r: r["tau_shift"])
    print(
        f"goal retrained tau on the shift >= 0.95x the offline head's: mix {best['mix']:g} "
        f"{best['x_offline_shift']:.3f} -> {'met' if best['x_offline_shift'] >= 0.95 else 'MISSED'}"
    )
    mismatched = [r["mix"] for r in rows if not (r["identical_shift"] and r["identical_base"])]
    if mismatched:
        print(f"capture_mix: outputs NOT identical to plain decoding at mix {mismatched}: the figures measure nothing")
    path = write_results(
        "capture_mix",
        args.quick,
        {
            "target_dir": str(d.target_dir),
            "shift": str(d.shift_train),
            "base": str(d.base_train),
            "champion_steps": champ_cfg.steps,
            "warm_steps": warm_cfg.steps,
            "depth": args.depth,
            "prompts": args.prompts,
            "rows": rows,
            "goal": {
                "name": "retrained tau on the shift >= 0.95x the offline head's",
                "mix": best["mix"],
                "measured": best["x_offline_shift"],
                "met": best["x_offline_shift"] >= 0.95,
            },
        },
        load_before,
    )
    plot(rows, path.with_suffix(".png"))
    return 1 if mismatched else 0


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    off, rows = rows[-1], rows[:-1]
    xs = [r["mix"] for r in rows]
    ax.plot(xs, [r["tau_shift"] for r in rows], marker="o", label="shifted domain (what is served now)")
    ax.plot(xs, [r["tau_base"] for r in rows], marker="s", label="base domain (what it was trained for)")
    ax.axhline(off["tau_shift"], color="grey", ls="--", lw=1, label="a fresh head trained on the shift alone")
    ax.set_xlabel("capture.mix (0: the champion, not retrained)")
    ax.set_ylabel("τ (our loop, greedy)")
    ax.set_title("What the capture mix buys and costs")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
