"""Acceptance at long output positions, by head variant, in our loop and in vLLM (issue 25, item 5).

Run: `python bench/long_variants.py [--quick] [--variants eagle3 eagle3.1] [--target base|long] [--runs 3]
[--prompts 4] [--steps N] [--depth 5] [--setup-only]`
Target (`--target`): `base` is the embedded default's target as built, decoded with `ignore_eos` (every prompt runs
to its sample's length past the end-of-turn token: the base target was trained on 256-token windows and ends its
answers after ~50-100 tokens, so past that the positions are out of its distribution; labelled `base+ignore_eos`);
`long` first continues that target's training on 2,048-token windows (`embedded.lm_train`: raw train
files and the long train conversations, `--long-steps` steps of `--long-batch`, cached under
`.eagle/bench/long-target-*/`; its time and held-out loss by position before and after are in the result) and
decodes it with `ignore_eos` too, so every bucket is filled. `--quick` uses the tiny engine target (head_dim 32,
context 512) and shorter samples.
Traffic: the `long` kind (embedded/long_traffic.py) of the build's base domain, made for the target's
context: held-out prompts with their per-sample `max_new_tokens` (1,093-1,894 tokens on the default). Heads: one
per variant (any of eagle.config.VARIANTS), the same features, steps, batch and seed (`common.train_or_reuse_head`,
cached); the features are extracted from the long train conversations' reference answers (the real rest of each
module or class, up to the context), not regenerated: the base target's own answers stop within ~100 tokens, and
the teacher is the target's distribution at every position either way.
Measured, greedy, chain of depth `--depth`, on the same `--prompts` held-out prompts, each to its own length:
  ours   `components.evaluate.stage.evaluate` per head (ignore_eos, edges 0/128/512/2048, one speed round): tau emitted
         and tau/alpha_1 by output-position bucket, outputs checked identical to plain greedy decoding;
  vLLM   `--runs` rounds, each on fresh servers (plain and one per variant, started at once, side by side with a
         small memory share each), one request at a time, each prompt sent to every server in turn (the order
         rotating), with the samples' limits and `ignore_eos`: tau from the counters, tau/alpha_1 by bucket from
         the per-request metrics (raw, as the engine counts), speedup = plain seconds / head seconds per round (the
         median over rounds reported with min and max), mismatches = head outputs that differ from plain vLLM's.
Goals (met only with 0 mismatches, ours and vLLM's): the best variant (highest median vLLM speedup) keeps its last
bucket's tau (vLLM) >= 0.9x its first; its vLLM speedup >= 1.2x EAGLE-3's.
Writes long_variants*.json + .png (bench/results/, or .eagle/bench/results-quick/ with --quick).
Its sizes, the long traffic and target, the heads' features: bench/long_variants_setup.py.
Not measured here: memory (bench/long_outputs.py), batches > 1, T > 0, trees, the parallel variant unless listed.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)

from common import (
    Setup,
    base_args,
    goal_line,
    print_table,
    pyplot,
    results_dir,
    start,
    train_or_reuse_head,
    write_results,
)
from long_variants_setup import SIZES, Sizes, prepare_long

EDGES = (0, 128, 512, 2048)
MEMORY_SHARE = 0.06  # of host memory, per vLLM server (three side by side; the tiny targets need far less)


def head_config(setup: Setup, sizes: Sizes, variant: str, steps: int):
    base = setup.preset.train
    return dataclasses.replace(
        base,
        steps=steps,
        batch_size=sizes.batch,
        variant=variant,
        eval_every=0,
        select="last",
        ttt=dataclasses.replace(base.ttt, ttt_steps=min(7, base.ttt.ttt_steps)),
    )


def ours(setup: Setup, heads: dict[str, Path], n_prompts: int, depth: int) -> dict[str, dict]:
    """`components.evaluate.stage.evaluate` of each head (ignore_eos, one speed round): tau, buckets, identity."""
    from components.evaluate.speed import SpeedupConfig
    from components.evaluate.stage import EvaluateConfig, HeadEval, evaluate
    from eagle.run_config import SpecConfig

    cfg = EvaluateConfig(
        spec=SpecConfig(depth=depth, max_new_tokens=64),
        limit=n_prompts,
        max_prompt_tokens=1024,
        ignore_eos=True,
        position_edges=EDGES,
        speed=SpeedupConfig(min_rounds=1, max_rounds=1, budget_s=3600.0),
    )
    out = {}
    for v, head in heads.items():
        common._say(f"bench: our loop, {v}")
        res = evaluate(
            cfg,
            HeadEval(str(setup.target_dir), str(head), str(setup.heldout_traffic), str(setup.work / "eval" / v)),
            progress=lambda s: None,
        )
        samples = json.loads(Path(res.report_file).read_text())["samples"]
        out[v] = {
            "tau": res.tau,
            "by_position": res.by_position,
            "identical": res.identical,
            "speedup_ours": res.speedup,
            "outputs": [s["output_ids"] for s in samples],
            "limits": [s["max_new_tokens"] for s in samples],
        }
    return out


def engine_spec(setup: Setup, method: str, head: Path | None, depth: int):
    """vLLM for `method` ("plain" or a variant with its head): fp32, eager, the target's context, per-request
    metrics, a small memory share (the servers of a round run side by side)."""
    from components.targets.target import target_context
    from eagle.config import PARALLEL_VARIANTS
    from infra.vllm_engine_spec import EngineSpec
    from infra.vllm_server import PER_REQUEST_METRICS

    spec = EngineSpec(
        str(setup.target_dir),
        str(head) if head else None,
        method="eagle3" if head else None,
        num_speculative_tokens=depth,
        max_model_len=target_context(setup.target_dir),
        extra_args=PER_REQUEST_METRICS if head else (),
        cpu_memory_share=MEMORY_SHARE,
        served_model_name=method,
    )
    if method in PARALLEL_VARIANTS:
        spec = dataclasses.replace(spec, parallel_drafting=True)  # EngineSpec's field for P-EAGLE (issue 25 item 3)
    return spec


def engine_round(setup: Setup, heads: dict[str, Path], order: list[str], prompts, depth: int, settings) -> dict:
    """One round on fresh servers, every method's up at once (started in parallel), each prompt sent to each
    server in turn (one request at a time, the order rotating by prompt; on a CPU build each request first waits out
    the previous server's idle spin, untimed), to its limit with ignore_eos: per method
    outputs, seconds, tokens, and for heads the counters' tau and the buckets of the per-request metrics."""
    from components.evaluate.engine import SwitchPause
    from eagle.stats import acceptance_by_position, raw_steps
    from infra.vllm_server import VllmServer, running

    servers = {m: VllmServer(engine_spec(setup, m, heads.get(m), depth), settings) for m in order}
    # a request after one on another server waits out that server's 1 s idle spin (bench/README.md, "An idle vLLM
    # server spins a core")
    pause = SwitchPause.between(servers[order[0]].spec, last=order[-1])
    rows = {m: {"outputs": [], "steps": [], "seconds": 0.0} for m in order}
    with running(*servers.values()):
        for srv in servers.values():
            srv.complete(prompts[0].ids, 4)  # warm-up, before the counters
        before = {m: servers[m].spec_counters() for m in order if m in heads}
        for i, p in enumerate(prompts):
            for m in order[i % len(order) :] + order[: i % len(order)]:
                pause(m)
                t0 = time.perf_counter()
                c = servers[m].complete(p.ids, p.max_new_tokens, 0.0, ignore_eos=True)
                rows[m]["seconds"] += time.perf_counter() - t0
                rows[m]["outputs"].append(c.token_ids)
                rows[m]["steps"].append(c.accepted_per_step)
        for m in before:
            steps = rows[m]["steps"]
            rows[m]["tau"] = (servers[m].spec_counters() - before[m]).tau
            rows[m]["by_position"] = (
                acceptance_by_position([raw_steps(s) for s in steps], EDGES)
                if all(s is not None for s in steps)
                else []
            )
    for r in rows.values():
        r["tokens"] = sum(map(len, r["outputs"]))
        r.pop("steps")
    return rows


def vllm_rounds(setup: Setup, heads: dict[str, Path], prompts, depth: int, runs: int) -> list[dict]:
    from infra.settings import Settings

    settings, methods, out = Settings.from_env(), ["plain", *heads], []
    for r in range(runs):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        out.append(engine_round(setup, heads, order, prompts, depth, settings))
        rd = out[-1]
        common._say(
            f"bench: vLLM round {r + 1}/{runs} done: "
            + ", ".join(
                f"{m} {rd['plain']['seconds'] / rd[m]['seconds']:.2f}x plain, tau {rd[m]['tau']:.2f}" for m in heads
            )
        )
    return out


def first_last(bp: list[dict]) -> tuple[float | None, float | None]:
    """tau of the first and of the last non-empty output-position bucket."""
    filled = [b["tau"] for b in bp if b["steps"]]
    return (filled[0], filled[-1]) if filled else (None, None)


def rows_of(heads, mine, rounds) -> list[dict]:
    rows = []
    for v in heads:
        x = [r["plain"]["seconds"] / r[v]["seconds"] * r[v]["tokens"] / r["plain"]["tokens"] for r in rounds]
        bad = sum(a != b for r in rounds for a, b in zip(r["plain"]["outputs"], r[v]["outputs"]))
        row = {
            "variant": v,
            "tau ours": mine[v]["tau"],
            "tau vLLM": rounds[0][v]["tau"],
            "x vLLM plain": statistics.median(x),
            "min": min(x),
            "max": max(x),
            "mismatch vLLM": bad,
            "mismatch ours": 0 if mine[v]["identical"] else 1,
            "x ours (1 round)": mine[v]["speedup_ours"],
        }
        for name, bp in (("ours", mine[v]["by_position"]), ("vLLM", rounds[0][v]["by_position"])):
            for b in bp:
                row[f"tau {name} {b['lo']}-{b['hi']}"] = b["tau"]
        rows.append(row)
    return rows


def goals(rows: list[dict], rounds: list[dict], mine: dict) -> dict:
    bad = sum(r["mismatch vLLM"] + r["mismatch ours"] for r in rows)
    best = max(rows, key=lambda r: r["x vLLM plain"])
    first, last = first_last(rounds[0][best["variant"]]["by_position"])
    flat = last / first if first and last is not None else None
    e3 = next((r for r in rows if r["variant"] == "eagle3"), None)
    gain = best["x vLLM plain"] / e3["x vLLM plain"] if e3 else None
    b = best["variant"]
    return {
        "best_variant": b,
        "flat": goal_line(f"{b}: last-bucket tau / first-bucket tau (vLLM) >= 0.9", flat, 0.9, bad),
        "vs_eagle3": goal_line(f"{b}: vLLM speedup / EAGLE-3's >= 1.2", gain, 1.2, bad),
    }


def plot(rows: list[dict], mine: dict, rounds: list[dict], title: str, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for v in mine:
        for name, bp, style in (("ours", mine[v]["by_position"], "-o"), ("vLLM", rounds[0][v]["by_position"], "--s")):
            pts = [((b["lo"] + b["hi"]) / 2, b["tau"]) for b in bp if b["steps"]]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{v} ({name})")
    ax.set_xscale("log")
    ax.set_xlabel("output position (bucket middle)")
    ax.set_ylabel("tau")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    from eagle.config import VARIANTS

    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=["eagle3", "eagle3.1"], choices=VARIANTS)
    p.add_argument(
        "--target",
        choices=("base", "long"),
        default="base",
        help="base: the built target with ignore_eos; long: continued on 2,048-token windows first",
    )
    p.add_argument("--long-steps", type=int, default=150, help="steps of the long-context training (--target long)")
    p.add_argument("--long-batch", type=int, default=2, help="windows per step of the long-context training")
    p.add_argument("--runs", type=int, default=0, help="rounds of fresh vLLM servers (0: 3, quick 1)")
    p.add_argument("--prompts", type=int, default=0, help="held-out prompts (0: 4, quick 2)")
    p.add_argument("--steps", type=int, default=0, help="head training steps (0: 150, quick 8)")
    p.add_argument("--depth", type=int, default=0, help="chain depth / speculative tokens (0: 5, quick 3)")
    p.add_argument(
        "--setup-only",
        action="store_true",
        help="prepare target, traffic, features and the heads (cached), then stop: e.g. one process per "
        "variant at once, then the measuring run finds them all",
    )
    args = p.parse_args(argv)
    load = start(args)
    sizes = SIZES["quick" if args.quick else "default"]
    runs, n_prompts = args.runs or sizes.runs, args.prompts or sizes.prompts
    steps, depth = args.steps or sizes.steps, args.depth or sizes.depth
    t0, phases = time.perf_counter(), {}

    def phase(name: str) -> None:
        phases[name] = round(time.perf_counter() - t0 - sum(phases.values()), 1)
        common._say(f"bench: {name} done ({phases[name]} s)")

    setup, label, long_report = prepare_long(args, sizes)
    phase("target, traffic, features")
    heads, train_s = {}, {}
    for v in args.variants:
        h = train_or_reuse_head(setup, f"long-{v}", head_config(setup, sizes, v, steps))
        heads[v], train_s[v] = h.head_dir, h.seconds
    phase("heads")
    if args.setup_only:
        print(json.dumps({"target": label, "heads": {v: str(h) for v, h in heads.items()}, "train_s": train_s}))
        return
    mine = ours(setup, heads, n_prompts, depth)
    phase("our loop")
    from components.evaluate.engine import engine_samples
    from components.evaluate.stage import EvaluateConfig
    from infra.settings import Settings

    prompts = engine_samples(
        EvaluateConfig(limit=n_prompts, max_prompt_tokens=1024),
        str(setup.target_dir),
        str(setup.heldout_traffic),
        Settings.from_env(),
    )
    rounds = vllm_rounds(setup, heads, prompts, depth, runs)
    phase("vLLM")
    rows = rows_of(heads, mine, rounds)
    for r, v in zip(rows, heads):
        r["train_s"] = train_s[v]
    title = (
        f"{label}: {len(prompts)} held-out long prompts ({min(x.max_new_tokens for x in prompts)}-"
        f"{max(x.max_new_tokens for x in prompts)} new tokens), chain K={depth}, heads of {steps} steps, "
        f"{runs} vLLM round(s)"
    )
    cols = [
        "variant",
        "tau ours",
        "tau vLLM",
        "x vLLM plain",
        "min",
        "max",
        "mismatch vLLM",
        "mismatch ours",
        "x ours (1 round)",
        "train_s",
    ] + [f"tau {n} {a}-{b}" for n in ("ours", "vLLM") for a, b in zip(EDGES, EDGES[1:])]
    print_table(rows, cols, title)
    ours_vs_vllm = sum(a != b for v in heads for a, b in zip(mine[v]["outputs"], rounds[0]["plain"]["outputs"]))
    print(f"our outputs vs vLLM plain (information: fp32 kernels differ): {ours_vs_vllm} differ")
    g = goals(rows, rounds, mine)
    name = "long_variants" + ("-long" if args.target == "long" else "") + (f"-runs{runs}" if runs != sizes.runs else "")
    png = results_dir(args.quick) / f"{name}.png"
    plot(rows, mine, rounds, title, png)
    payload = {
        "args": vars(args),
        "target": label,
        "target_dir": str(setup.target_dir),
        "long_target": long_report,
        "edges": EDGES,
        "depth": depth,
        "runs": runs,
        "head_steps": steps,
        "n_prompts": len(prompts),
        "limits": [x.max_new_tokens for x in prompts],
        "rows": rows,
        "goals": g,
        "ours_vs_vllm_plain_differ": ours_vs_vllm,
        "seconds": round(time.perf_counter() - t0, 1),
        "phase_seconds": phases,
        "per_round": [{m: {k: x for k, x in r.items() if k != "outputs"} for m, r in rd.items()} for rd in rounds],
        "plot": str(png),
    }
    print(write_results(name, args.quick, payload, load))


if __name__ == "__main__":
    main()
