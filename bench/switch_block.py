"""Does taking the prompts in blocks move vLLM's speedup figure? Prompt by prompt against blocks, on the same servers.

Purpose: on a CPU build the engine evaluation waits out the other server's idle spin (1.2 s) before each request
that follows one on the other server (components/evaluate_engine.py `SwitchPause`). Prompt by prompt that is half
the requests: ~19 s of waiting a round of 16 prompts, most of a demo head's engine evaluation. In blocks of 4 prompts
per side (components/speed.py `SWITCH_BLOCK`) a round waits 4 times. Every timed request is still either preceded
by the wait or by a request on its own server, as before; what changes is how far apart in time a prompt's two
decodes are (a block of 4 takes a few seconds). This measures whether that moves the figure: one plain and one
speculative vLLM server (the evaluation's pair, the pipeline's `default` evaluation: 16 held-out prompts, depth 5,
96 new tokens), then `--reps` repetitions of `measure_speedup` at each block size in `--blocks` (the order of the
sizes alternating between repetitions), `--rounds` rounds each, all with the evaluation's wait.
Per block size: the median, min and max over repetitions of the figure (each the median of its rounds), the seconds
a round took with the waits, and greedy mismatches between the two servers (every round's outputs, must be 0).
Goal: the block figure's median within +-5% of the prompt-by-prompt median, 0 mismatches.
Run: `python bench/switch_block.py [--quick] [--reps 3] [--rounds 5] [--blocks 1 4]
[--head DIR|models:/... --target DIR|models:/... --heldout FILE]` (default subject: bench/speedup_trust.py's, the
benchmarks' speed head on the embedded default; ~10 min with the defaults on 2 cores; `--quick`: the tiny preset).
Writes `switch_block.json`.
Not here: fresh processes or a loaded machine (bench/speedup_trust.py --engine vllm).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import common  # noqa: F401  (puts the repository on sys.path)
from common import base_args, goal_line, print_table, start, write_results

BAND = 0.05


def main() -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 4])
    p.add_argument("--head-steps", type=int, default=0)
    p.add_argument("--head", default="")
    p.add_argument("--target", default="")
    p.add_argument("--heldout", default="")
    args = p.parse_args()
    if args.reps < 1 or args.rounds < 1 or not args.blocks or min(args.blocks) < 1:
        p.error("--reps, --rounds and every --blocks size must be whole numbers >= 1")
    load = start(args)

    import speedup_trust
    from components.evaluate_engine import (SwitchPause, engine_samples, eval_spec, plain_server)
    from components.speed import measure_speedup
    from infra.settings import Settings
    from infra.vllm_server import VllmServer, running

    args.engine = "vllm"
    target, head_dir, heldout = speedup_trust.subject(args)
    cfg = speedup_trust.eval_config(args.quick)
    settings = Settings.from_env()
    prompts = engine_samples(cfg, target, heldout, settings)
    longest = max(x.max_new_tokens for x in prompts)
    speed_cfg = dataclasses.replace(cfg.speed, min_rounds=args.rounds, max_rounds=args.rounds, budget_s=1e9,
                                    max_other_load=float("inf"))
    rows, mismatches = [], 0
    with running(plain_server(cfg, target, settings, longest),
                 VllmServer(eval_spec(cfg, target, head_dir, max_new_tokens=longest), settings)) as (plain, srv):
        outs: dict[str, dict[tuple[int, int], list[int]]] = {"plain": {}, "spec": {}}

        def decode(server, kind: str, rep_block: tuple[int, int]):
            def fn(i: int, r: int) -> int:
                c = server.complete(prompts[i].ids, prompts[i].max_new_tokens, cfg.spec.temperature, cfg.ignore_eos)
                outs[kind][(i, r, *rep_block)] = c.token_ids
                return len(c.token_ids)
            return fn

        for s in (plain, srv):
            s.complete(prompts[0].ids, 4)  # warm-up
        for rep in range(args.reps):
            for b in (args.blocks if rep % 2 == 0 else list(reversed(args.blocks))):
                pause = SwitchPause.between(plain.spec, last="spec")
                t0 = time.perf_counter()
                est = measure_speedup(len(prompts), decode(plain, "plain", (rep, b)), decode(srv, "spec", (rep, b)),
                                      speed_cfg, settle=pause, block=b)
                wall = time.perf_counter() - t0
                rows.append({"rep": rep, "block": b, "speedup": est.speedup, "lo": est.lo, "hi": est.hi,
                             "round_ratios": est.round_ratios, "s_per_round": wall / est.rounds})
                print(f"  rep {rep + 1} block {b}: {est.describe()}; {wall / est.rounds:.1f} s a round", flush=True)
        mismatches = sum(outs["spec"][k] != outs["plain"][k] for k in outs["plain"])
    summary = {}
    for b in args.blocks:
        xs = [r["speedup"] for r in rows if r["block"] == b]
        summary[b] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
                      "s_per_round": statistics.median(r["s_per_round"] for r in rows if r["block"] == b)}
    print_table([{"block": b, **s} for b, s in summary.items()], ["block", "median", "min", "max", "s_per_round"],
                "speedup in vLLM by block size (each repetition's figure the median of its rounds; s_per_round with "
                "the waits)")
    base, other = args.blocks[0], args.blocks[-1]
    ratio = summary[other]["median"] / summary[base]["median"]
    goals = {"deviation": goal_line(f"block {other}'s median off block {base}'s by (fraction)", abs(ratio - 1.0),
                                    BAND, mismatches, below=True)}
    write_results("switch_block", args.quick, {"subject": {"target": target, "head": head_dir, "heldout": heldout},
                                                "reps": args.reps, "rounds": args.rounds, "blocks": args.blocks,
                                                "runs": rows, "summary": {str(b): s for b, s in summary.items()},
                                                "block_over_base": ratio, "mismatches": mismatches, "goals": goals},
                  load)


if __name__ == "__main__":
    main()
