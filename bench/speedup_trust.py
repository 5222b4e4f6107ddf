"""Can a user trust the registered speedup? The evaluate stage's figure in fresh processes, quiet and under load.

Purpose: issue 27's goal for `evaluate`'s speedup (components/evaluate/speed.py: plain and speculative decoding
interleaved prompt by prompt, in rounds, the median of the rounds' ratios): the figure each fresh process would
register, on quiet cores and with another job beside it (a torch matrix-product loop on `--load-threads` threads),
compared with the median of the quiet processes. Beside it, in the same processes, the figure the stage registered
before: one pass of each (round 0's ratio), so the two estimators are read side by side.
- `--engine local` (default): this project's decoder, the pipeline's `default` evaluation (16 held-out prompts,
  chain depth 5, 96 new tokens) on the benchmarks' speed head.
- `--engine vllm`: the same in vLLM (a plain and a speculative server side by side, components/evaluate/engine.py).
Goal: every reliable figure within +-10% of the quiet median, quiet and loaded; an unreliable one counts as flagged
(the registry says "unreliable"), never as a number; 0 mismatches. Writes `speedup_trust[-vllm].json`.
Run: `python bench/speedup_trust.py [--quick] [--runs 5] [--engine local|vllm] [--head-steps N]
[--head DIR|models:/... --target DIR|models:/... --heldout FILE]` (e.g. the demo's fine-tune champion)
(~1-2 min per local process on the default preset, ~3 per vLLM one; `--quick`: the tiny preset, for tests).
Target-path timings are kept across the run's processes as the CLI keeps them (eagle/target_path.py,
`EAGLE_TARGET_PATH_TIMINGS`): in a new file per run by default, so the first process starts from nothing as on a
new machine; `--timings state` uses the state dir's file (what the pipeline's later processes read), `--timings off`
none (each process picks from its own timing alone, as before 2026-12-03's second session).
Not here: throughput under concurrency (issue 27 items 1-4).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common  # noqa: E402  (puts the repository on sys.path)
from common import base_args, goal_line, prepare, print_table, speed_head, start, write_results

from components.config.pipeline import PipelineConfig
from components.evaluate.speed import SpeedupConfig
from components.evaluate.stage import EvaluateConfig, HeadEval, evaluate
from eagle import target_path
from infra.settings import env_with

BAND = 0.10
LOAD_JOB = (
    "import torch, sys; torch.set_num_threads(int(sys.argv[1])); a = torch.randn(384, 384)\n"
    "while True:\n    a = (a @ a).tanh()"
)


def eval_config(quick: bool) -> EvaluateConfig:
    if quick:
        return dataclasses.replace(EvaluateConfig.tiny(), speed=SpeedupConfig(min_rounds=2, max_rounds=3))
    return dataclasses.replace(PipelineConfig.preset("default").evaluate, time_local=True)  # the demo's: untimed


def subject(args: argparse.Namespace) -> tuple[str, str, str]:
    """(target dir, head dir, held-out traffic): `--head`/`--target`/`--heldout` (directories or models:/ URIs),
    else the benchmarks' speed head on the embedded default."""
    if args.head:
        from infra.mlflow_store import MlflowStore
        from infra.settings import Settings

        def local(uri: str) -> str:
            return str(MlflowStore.connect(Settings.from_env()).resolve(uri)) if uri.startswith("models:/") else uri

        return local(args.target), local(args.head), args.heldout
    setup = prepare(args.quick, conversations=args.conversations)
    head, _ = speed_head(setup, args.head_steps, args.conversations)
    return str(setup.target_dir), str(head.head_dir), str(setup.heldout_traffic)


def child(args: argparse.Namespace) -> None:
    """One fresh process: evaluate the head once, write the figures to `--out`."""
    target, head_dir, heldout = subject(args)
    cfg = eval_config(args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        res = evaluate(cfg, HeadEval(target, head_dir, heldout, tmp), progress=lambda s: None)
        report = json.loads(Path(res.report_file).read_text())
        mismatches = sum(not s["identical"] for s in report["samples"])
        path = report.get("target_path", {})
        row = {
            "target_path": f"decode {path.get('decode', path).get('chosen', '')}, verify {path.get('chosen', '')}",
            "path_ms": {role: path[role].get("ms_per_pass") for role in ("decode", "verify") if role in path},
            "path_timings_kept": path.get("measurements_kept", 0),
            "plain_s_per_round": statistics.median(sum(r) for r in report["speed"]["plain_s"]),
            "spec_s_per_round": statistics.median(sum(r) for r in report["speed"]["spec_s"]),
            "speedup": res.speedup,
            "lo": res.speedup_lo,
            "hi": res.speedup_hi,
            "reliable": res.speedup_reliable,
            "note": res.speedup_note,
            "rounds": res.speedup_rounds,
            "tau": res.tau,
            "mismatches": mismatches,
            "single_pass": report["speed"]["round_ratios"][0],
            "other_load": report["speed"].get("other_load"),
        }
        if args.engine == "vllm":
            from components.evaluate.engine import evaluate_in_vllm, our_outputs
            from infra.settings import Settings

            v = evaluate_in_vllm(
                cfg,
                HeadEval(target, head_dir, heldout, str(Path(tmp) / "vllm")),
                Settings.from_env(),
                ours=our_outputs(res.report_file),
                progress=lambda s: None,
            )
            speed = json.loads(Path(v.report_file).read_text())["speed"]
            row = {
                **{k: row[k] for k in ("target_path", "path_ms", "path_timings_kept")},
                "speedup": v.speedup,
                "lo": v.speedup_lo,
                "hi": v.speedup_hi,
                "reliable": v.speedup_reliable,
                "note": v.speedup_note,
                "rounds": v.speedup_rounds,
                "tau": v.tau,
                "mismatches": sum(
                    not s["identical_to_plain"] for s in json.loads(Path(v.report_file).read_text())["samples"]
                ),
                "single_pass": speed["round_ratios"][0],
                "other_load": speed.get("other_load"),
            }
    Path(args.out).write_text(json.dumps(row) + "\n")


def _cores(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} cores"


def path_store(timings: str, run_dir: Path) -> str:
    """The file the children keep target-path timings in ("" for none): see the module doc."""
    if timings == "state":
        from infra.settings import Settings

        return str(Settings.from_env().target_path_timings)
    return str(run_dir / "target_paths.json") if timings == "run" else ""


def fresh(argv: list[str], runs: int, load_threads: int, label: str, env: dict[str, str]) -> list[dict]:
    """`runs` fresh child processes, one after the other; with a load job beside each when `load_threads` > 0."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            out = Path(tmp) / f"{label}{i}.json"
            load = subprocess.Popen([sys.executable, "-c", LOAD_JOB, str(load_threads)]) if load_threads else None
            try:
                subprocess.run(
                    [sys.executable, __file__, *argv, "--child", "--out", str(out)],
                    check=True,
                    stdout=subprocess.DEVNULL,
                    env=env,
                )
            finally:
                if load is not None:
                    load.kill()
                    load.wait()
            rows.append({"condition": label, **json.loads(out.read_text())})
            r = rows[-1]
            print(
                f"  {label} {i + 1}/{runs}: {r['speedup']:.3f}x [{r['lo']:.3f}, {r['hi']:.3f}] "
                f"{'reliable' if r['reliable'] else 'UNRELIABLE'} in {r['rounds']} rounds; "
                f"single pass {r['single_pass']:.3f}x; other load {_cores(r.get('other_load'))}; "
                f"mismatches {r['mismatches']}; target path "
                f"{r.get('target_path') or '-'} {r.get('path_ms', {})} (timings kept over "
                f"{r.get('path_timings_kept', 0)} processes)",
                flush=True,
            )
    return rows


def verdict(rows: list[dict]) -> dict:
    """Each figure against the quiet median: within the band, outside it, or flagged unreliable."""
    ref = statistics.median(r["speedup"] for r in rows if r["condition"] == "quiet")
    out = {"reference": ref, "band": BAND, "by_condition": {}}
    for cond in sorted({r["condition"] for r in rows}):
        rs = [r for r in rows if r["condition"] == cond]
        dev = [abs(r["speedup"] / ref - 1) for r in rs if r["reliable"]]
        single = [abs(r["single_pass"] / ref - 1) for r in rs]
        out["by_condition"][cond] = {
            "runs": len(rs),
            "reliable": len(dev),
            "flagged_unreliable": len(rs) - len(dev),
            "reliable_within_band": sum(d <= BAND for d in dev),
            "max_deviation": max(dev, default=None),
            "single_pass_within_band": sum(d <= BAND for d in single),
            "single_pass_max_deviation": max(single),
            "median": statistics.median(r["speedup"] for r in rs),
            "single_pass_median": statistics.median(r["single_pass"] for r in rs),
        }
    return out


def plot(rows: list[dict], v: dict, path: Path, engine: str) -> None:
    """Each process's figure with its interval (filled: reliable; hollow: flagged) and its single-pass figure (x),
    quiet then loaded, against the quiet median and the +-10% band."""
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ref = v["reference"]
    ax.axhspan(ref * (1 - BAND), ref * (1 + BAND), color="0.9", label=f"quiet median +-{BAND:.0%}")
    ax.axhline(ref, color="0.5", lw=1)
    for i, r in enumerate(rows):
        color = "C0" if r["condition"] == "quiet" else "C3"
        ax.errorbar(
            [i],
            [r["speedup"]],
            yerr=[[r["speedup"] - r["lo"]], [r["hi"] - r["speedup"]]],
            fmt="o",
            color=color,
            mfc=color if r["reliable"] else "white",
            capsize=3,
        )
        ax.plot([i], [r["single_pass"]], "x", color="0.3")
    ax.set_xticks(range(len(rows)), [f"{r['condition'][0]}{i}" for i, r in enumerate(rows)])
    ax.set_ylabel("speedup over plain")
    ax.set_title(f"registered speedup per fresh process ({engine}); q quiet, l loaded; x one pass")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict | None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="fresh processes per condition (quiet, loaded)")
    p.add_argument("--engine", choices=("local", "vllm"), default="local")
    p.add_argument("--head-steps", type=int, default=0, help="the speed head's training steps (0: the preset's)")
    p.add_argument("--load-threads", type=int, default=1, help="threads of the load job in the loaded condition")
    p.add_argument("--head", default="", help="head directory or models:/... (default: the benchmarks' speed head)")
    p.add_argument("--target", default="", help="the head's target (directory or models:/...), with --head")
    p.add_argument("--heldout", default="", help="held-out traffic, with --head")
    p.add_argument("--name", default="", help="suffix of the result file (e.g. demo-finetune)")
    p.add_argument(
        "--timings",
        choices=("run", "state", "off"),
        default="run",
        help="where target-path timings are kept across processes: a new file for this run (default), the "
        "state dir's (as the CLI), or nowhere",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    load_before = start(args)
    if args.child:
        child(args)
        return None
    subject(args)  # the cache (or the registry lookups), once, before any timed process
    passed = common.argv_without(common.argv_without(argv, "--runs"), "--load-threads")
    with tempfile.TemporaryDirectory() as keep:
        env = env_with({target_path.STORE_ENV: path_store(args.timings, Path(keep))})
        rows = fresh(passed, args.runs, 0, "quiet", env) + fresh(passed, args.runs, args.load_threads, "loaded", env)
    v = verdict(rows)
    mism = sum(r["mismatches"] for r in rows)
    cols = ["condition", "speedup", "lo", "hi", "reliable", "rounds", "single_pass", "other_load", "tau", "mismatches"]
    print_table([{k: r.get(k) for k in cols} for r in rows], cols)
    goals = {
        cond: goal_line(
            f"{cond}: largest deviation of a reliable figure from the quiet median "
            f"{v['reference']:.3f}x "
            f"({c['reliable']}/{c['runs']} reliable, {c['flagged_unreliable']} flagged unreliable; the "
            f"single pass: {c['single_pass_max_deviation']:.1%})",
            c["max_deviation"],
            BAND + 1e-9,
            mism,
            below=True,
            label="goal",
        )
        for cond, c in v["by_condition"].items()
    }
    name = "speedup_trust" + ("-vllm" if args.engine == "vllm" else "") + ("-" + args.name if args.name else "")
    path = write_results(
        name,
        args.quick,
        {
            "engine": args.engine,
            "timings": args.timings,
            "runs": rows,
            "verdict": v,
            "goals": goals,
            "mismatches": mism,
        },
        load_before,
    )
    plot(rows, v, path.with_suffix(".png"), args.engine)
    return {"verdict": v, "goals": goals, "mismatches": mism}


if __name__ == "__main__":
    main()
