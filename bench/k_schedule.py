"""Does the K schedule hold? A head served in vLLM at every concurrency: plain, the best fixed K, the schedule.

Purpose: issue 27's proof for the schedule the load sweep derives (components/evaluate/load_sweep.py). First the sweep
itself (plain and each K of `--k-values` at each level of `--concurrency`, servers up at once, cells in
`--sweep-repeats` interleaved rounds, vLLM's own load client) gives the schedule and the best fixed K (the K with the
most summed median output tokens/s over the levels). Then `--repeats` rounds, each on fresh servers of the three ways
(plain, the best fixed K, the schedule), up at once when memory allows (else one after the other, the order rotating by
round), every level measured with `vllm bench serve` on the same held-out prompts, the order of the ways alternating by
level and round (`load_sweep.round_order`). Per level: the median output tokens/s of each way over the rounds.
Goals: at every level the schedule within 3% of the better of the other two, and never below plain by more than the
plain runs' own spread (max/min - 1 over the repeats); outputs identical to plain at T = 0 (0 mismatches).
Head: `--head DIR|models:/...` with `--target` (e.g. the demo's fine-tune champion), else the benchmarks' speed head
on the embedded default (`--head-steps`). Writes `k_schedule[-<name>].json` and `.png` (tokens/s by concurrency).
Run: `python bench/k_schedule.py [--quick] [--repeats 3] [--sweep-repeats 3] [--concurrency 1,4,16] [--k-values 3,5]
[--head H --target T --heldout FILE]` (default preset: ~20 min on 2 cores; `--quick`: the tiny preset, two levels).
Not here: batch-1 speedup (bench/speedup_trust.py, bench/vllm_speedup.py).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import common  # noqa: E402  (puts the repository on sys.path)
from common import base_args, goal_line, prepare, print_table, speed_head, start, write_results

from components.evaluate.load_sweep import LoadConfig, load_sweep
from components.evaluate.stage import EvaluateConfig, HeadEval
from eagle.run_config import SpecConfig

WAYS = ("plain", "best_k", "schedule")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def resolve(args, settings) -> tuple[str, str, str, str]:
    """(target dir, head dir, held-out traffic, name) of the head to measure."""
    if args.head:
        from components.targets.servable import servable_head
        from infra.mlflow_store import MlflowStore

        def local(uri: str) -> str:
            return str(MlflowStore.connect(settings).resolve(uri)) if uri.startswith("models:/") else uri

        target, head = local(args.target), local(args.head)
        served = servable_head(head, target, settings.state_dir / "servable")
        name = args.name or args.head.replace("models:/", "").replace("/", "-").replace("@", "-")
        return target, str(served), args.heldout, name
    setup = prepare(args.quick, conversations=args.conversations)
    head, suffix = speed_head(setup, args.head_steps, args.conversations)
    return str(setup.target_dir), str(head.head_dir), str(setup.heldout_traffic), "speedhead" + suffix


def serve_ways(
    plan, ways: dict[int, object], r: int, together: bool, settings, tmp: Path
) -> tuple[list[dict], list[dict]]:
    """Round `r`: fresh servers of `ways` ({k: EngineSpec}, k 0 plain, -1 the schedule) measured at every level,
    all up at once when `together`, else one after the other (rotating by round); returns the samples and the
    rounds' orders it measured (components/evaluate/load_sweep.py `measure_rounds`)."""
    from contextlib import ExitStack

    from components.evaluate.load_sweep import measure_rounds
    from infra.vllm_server import VllmServer

    one = LoadConfig(concurrency=tuple(plan.extra["levels"]), k_values=(1,), requests=len(plan.prompts), repeats=1)
    dataset = plan.extra["dataset"]
    if together:
        with ExitStack() as stack:
            servers = {k: stack.enter_context(VllmServer(spec, settings, log_dir=tmp)) for k, spec in ways.items()}
            return measure_rounds(one, plan, settings, servers, dataset, "ways", first_round=r)
    keys = list(ways)
    samples, rounds = [], []
    for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
        with VllmServer(ways[k], settings, log_dir=tmp) as srv:
            got = measure_rounds(one, plan, settings, {k: srv}, dataset, "ways", first_round=r)
        samples, rounds = samples + got[0], rounds + got[1]
    return samples, rounds


def main(argv: list[str] | None = None) -> dict:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep-repeats", type=int, default=3, help="interleaved rounds of the sweep itself")
    p.add_argument("--concurrency", type=_ints, default=(1, 4, 16))
    p.add_argument("--k-values", type=_ints, default=(3, 5))
    p.add_argument("--requests", type=int, default=16, help="requests per level (the same prompts at every level)")
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--head", default="", help="head directory or models:/... (default: the benchmarks' speed head)")
    p.add_argument("--target", default="", help="the head's target (directory or models:/...), with --head")
    p.add_argument("--heldout", default="", help="held-out traffic, with --head")
    p.add_argument("--head-steps", type=int, default=0)
    p.add_argument("--name", default="", help="suffix of the result file with --head (default: from the head's URI)")
    p.add_argument(
        "--compiled", action="store_true", help="vLLM on the CPU compiled (its default), not eager (evaluate.compiled)"
    )
    args = p.parse_args(argv)
    load_before = start(args)
    from dataclasses import replace

    from components.evaluate.load_sweep import SweepPlan, memory_fit
    from infra.settings import Settings
    from infra.vllm_engine_spec import EngineSpec

    settings = replace(Settings.from_env(), engine_compiled=args.compiled)
    if args.quick:
        args.concurrency, args.k_values, args.requests, args.output_len = (1, 4), (2, 3), 4, 16
        args.sweep_repeats = min(args.sweep_repeats, 2)
    target, head, heldout, name = resolve(args, settings)
    cfg = EvaluateConfig(
        spec=SpecConfig(depth=max(args.k_values), max_new_tokens=args.output_len),
        load=LoadConfig(
            concurrency=args.concurrency,
            k_values=args.k_values,
            requests=args.requests,
            repeats=args.sweep_repeats,
            verify_schedule=False,
        ),
    )
    with tempfile.TemporaryDirectory() as tmp:
        sweep = load_sweep(cfg, HeadEval(target, head, heldout, str(Path(tmp) / "sweep")), settings)
        k_sum = {k: sum(c["output_tokens_per_s"] for c in sweep.cells if c["k"] == k) for k in args.k_values}
        best_k = max(k_sum, key=k_sum.get)
        print(f"k_schedule: schedule {sweep.schedule} (crossover {sweep.crossover}); best fixed K {best_k}", flush=True)
        dataset = Path(tmp) / "sweep" / "prompts.sharegpt.json"
        prompts = [row["conversations"][0]["value"] for row in json.loads(dataset.read_text())]
        max_len = json.loads(Path(sweep.report_file).read_text())["max_model_len"]
        base = EngineSpec(target, None, method=None, max_model_len=max_len)
        top = max(r[2] for r in sweep.schedule)
        ways = {0: base, best_k: replace(base, head_dir=head, method="eagle3", num_speculative_tokens=best_k)}
        ways[-1] = (
            replace(
                base,
                head_dir=head,
                method="eagle3",
                num_speculative_tokens=max(top, 1),
                k_schedule=tuple(tuple(r) for r in sweep.schedule),
            )
            if top > 0
            else base
        )
        changes, why = memory_fit(base, len(ways), target)
        ways = {k: replace(s, **changes) for k, s in ways.items()} if not why else ways
        plan = SweepPlan(
            prompts,
            target,
            head,
            Path(tmp),
            args.output_len,
            0.0,
            max_len,
            extra={"levels": args.concurrency, "dataset": str(dataset)},
        )
        print(
            f"k_schedule: {'the three ways up at once' if not why else 'one way at a time (' + why + ')'}", flush=True
        )
        samples: list[dict] = []
        rounds: list[dict] = []
        for r in range(args.repeats):
            got = serve_ways(plan, ways, r, not why, settings, Path(tmp))
            samples, rounds = samples + got[0], rounds + got[1]
    key = {0: "plain", best_k: "best_k", -1: "schedule"}
    runs = {
        w: [{s["concurrency"]: s for s in samples if key[s["k"]] == w and s["round"] == r} for r in range(args.repeats)]
        for w in WAYS
    }
    return report(
        args,
        name,
        sweep,
        best_k,
        runs,
        load_before,
        {"mode": "all" if not why else "one_at_a_time", "mode_reason": why, "rounds": rounds},
    )


def report(args, name: str, sweep, best_k: int, runs, load_before, how: dict) -> dict:
    rows, goals = [], {}
    mism = 0
    for c in args.concurrency:
        med = {w: statistics.median(run[c]["output_tokens_per_s"] for run in runs[w]) for w in WAYS}
        plain_t = [run[c]["output_tokens_per_s"] for run in runs["plain"]]
        noise = max(plain_t) / min(plain_t) - 1.0
        for w in ("best_k", "schedule"):
            mism += sum(
                t != p for run, prun in zip(runs[w], runs["plain"]) for t, p in zip(run[c]["texts"], prun[c]["texts"])
            )
        rows.append(
            {
                "concurrency": c,
                **{f"{w}_tok_s": med[w] for w in WAYS},
                **{f"{w}_min": min(run[c]["output_tokens_per_s"] for run in runs[w]) for w in WAYS},
                **{f"{w}_max": max(run[c]["output_tokens_per_s"] for run in runs[w]) for w in WAYS},
                "plain_noise": noise,
                "schedule_vs_best": med["schedule"] / max(med["plain"], med["best_k"]),
                "schedule_vs_plain": med["schedule"] / med["plain"],
            }
        )
    print_table(
        rows, ["concurrency", *[f"{w}_tok_s" for w in WAYS], "plain_noise", "schedule_vs_best", "schedule_vs_plain"]
    )
    worst = min(r["schedule_vs_best"] for r in rows)
    goals["schedule_vs_best"] = goal_line(
        "the schedule's tokens/s within 3% of the better of plain and the best fixed K at every level (worst ratio)",
        worst,
        0.97,
        mism,
    )
    below = min(r["schedule_vs_plain"] - (1 - r["plain_noise"]) for r in rows)
    goals["never_below_plain"] = goal_line(
        "the schedule never below plain by more than plain's own spread (worst margin)", below, 0.0, mism
    )
    out = name if not args.quick else "k_schedule"
    per_round = {w: [{c: run[c]["output_tokens_per_s"] for c in args.concurrency} for run in runs[w]] for w in WAYS}
    path = write_results(
        out if out == "k_schedule" else f"k_schedule-{out}",
        args.quick,
        {
            "head": name,
            "schedule": sweep.schedule,
            "crossover": sweep.crossover,
            "best_k": best_k,
            "sweep_mode": sweep.mode,
            "sweep_repeats": sweep.repeats,
            "sweep_cells": [{k: v for k, v in c.items() if k not in ("texts", "texts_by_round")} for c in sweep.cells],
            "sweep_rounds": list(sweep.rounds),
            "levels": rows,
            "repeats": args.repeats,
            "ways_tok_s": per_round,
            **how,
            "goals": goals,
            "mismatches": mism,
        },
        load_before,
    )
    plot(rows, sweep.schedule, best_k, path.with_suffix(".png"))
    return {"rows": rows, "goals": goals, "mismatches": mism}


def plot(rows: list[dict], schedule, best_k: int, path: Path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [r["concurrency"] for r in rows]
    for w, label in (("plain", "plain"), ("best_k", f"fixed K = {best_k}"), ("schedule", f"schedule {schedule}")):
        ys = [r[f"{w}_tok_s"] for r in rows]
        ax.errorbar(
            xs,
            ys,
            yerr=[[y - r[f"{w}_min"] for y, r in zip(ys, rows)], [r[f"{w}_max"] - y for y, r in zip(ys, rows)]],
            marker="o",
            capsize=3,
            label=label,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s (median of repeats, min-max)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1:])
