"""Stage 4c, the head under load: throughput by concurrency in vLLM, and the K schedule the engine should run.

Purpose: `load_sweep(cfg, head, settings) -> SweepResult` (`head`: components/evaluate/stage.py `HeadEval`).
A production server runs many requests at once, and speculation spends compute a busy server no longer has to
spare, so one K is not right at every load. For the held-out prompts (the evaluation's, chat template applied) it
- serves the target plainly (K = 0) and with the head at each K of `cfg.load.k_values`, all these servers started
  and up at once (each with the memory share of the evaluation's plain/speculative pair,
  components/evaluate/engine.py; where the flow hands that pair on running in an `EnginePool`,
  infra/engine_pool.py, the sweep's servers of the same engines are taken from it, not started again), and
  measures the cells (one server at one concurrency of `cfg.load.concurrency`) with vLLM's own load client
  (infra/vllm_bench.py) in rounds, each request stopping at its end-of-sequence token as the evaluation's do
  (`evaluate.ignore_eos`: both run every request to its limit; timed past EOS, a head drafts text no production
  request asks for, and the sweep's figure falls well below the evaluation's on the same servers: bench/README.md,
  "Figures moved from code comments"): in each round every level, and at each level every server, the order
  alternating (plain, K... at one level, the reverse at the next and in the next round), `cfg.load.repeats`
  rounds. A machine whose load drifts then touches every cell alike. When all servers do not fit in memory (by
  `memory_fit`'s estimate, or one of them fails to start beside the others), plain stays up and the K servers
  come beside it one at a time, plain's rounds pooled over the pairs (`mode` "pairs" in the report, with the
  reason). Per cell: output tokens/s, TTFT and inter-token latency (median, p99), each the median over rounds,
  with the tokens/s spread (min, max) and every round's figure; tau and alpha_k from the counters summed over rounds;
- takes concurrency 1 from the engine evaluation when it timed the very servers of the sweep (plain and its head at
  the sweep's only K, handed on running) greedily (`evaluation_cells`: each round's tokens over its seconds, one
  request at a time, the other server's idle spin waited out): the same measurement again would cost a minute a head
  on 2 cores. Such cells say `"source": "evaluation"` (no TTFT or ITL: the evaluation does not stream), the others
  `"sweep"`; the served schedule's cell at 1 is then the cell of the K it drafts there;
- checks every speculative output equal to the plain output at the same concurrency (T = 0, fp32). Batching can
  change a plain output by itself (floating-point sums in another order); a prompt whose plain output at
  concurrency C differs from its plain output at the lowest level, or between rounds, is counted as `batch_variant`,
  not as a head mismatch, and only the other differences raise `NotLosslessError` (`judge`). When concurrency 1
  came from the evaluation (token ids, no texts) and a difference is found, plain is run once at concurrency 1
  (phase "baseline" in `rounds`) so that batching alone is told from the head before anything is raised;
- derives the schedule (`derive_schedule`) from the medians: at each measured level a K beats plain only when its
  median exceeds plain's by more than `cfg.load.margin` AND its spread lies wholly above plain's (its slowest round
  faster than plain's fastest); the best of those K, else K = 0. Levels between two measured ones take the lower
  one's K (as vLLM fills gaps); the result is vLLM's `num_speculative_tokens_per_batch_size` ranges. `crossover` is
  the first concurrency where the best K is 0 (None: speculation pays at every measured level);
- serves the schedule itself beside plain (`cfg.load.verify_schedule`), interleaved the same way, so its throughput
  sits beside the fixed K's in the table and the plot, and its counters show where it drafted.
Writes `load_sweep.json` (cells with their spreads, the order of every round, the mode, schedule, crossover) and
`load_sweep.png` (output tokens/s against concurrency with the spread as error bars: plain, each K, the schedule).
Concurrency here is what the client keeps in flight; vLLM's schedule is keyed by the scheduler's batch size, which
equals it in steady state (ramp-up and drain have smaller batches).
The cells, the judgement and the schedule from the samples: components/evaluate/load_cells.py.
Not here: batch-1 latency and speedup (components/evaluate/engine.py), registering (components/registry/register.py).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from components.data.atomic import atomic_write_text
from components.evaluate.engine import PAIR_MEMORY_SHARE, engine_max_len, refuse_sampled
from components.evaluate.load_cells import SweepResult, cells_of, crossover_of, derive_schedule, evaluation_cells, judge
from components.evaluate.load_config import LoadConfig  # noqa: F401  (LoadConfig re-exported)
from components.evaluate.plots import plot_load_sweep
from components.evaluate.stage import HeadEval, NotLosslessError, held_out_messages

SCHEDULE = -1  # the `k` of the served schedule's cells
FRONTEND_BYTES = 2**30  # host memory of one server besides its engine's share (the API process, the client's load)


def round_order(keys: list[int], round_i: int, level_i: int) -> list[int]:
    """The servers' order in round `round_i` at the `level_i`-th level: as given when the two add up to an even
    number, reversed otherwise (so every server goes first and last equally often)."""
    return list(keys) if (round_i + level_i) % 2 == 0 else list(reversed(keys))


def load_sweep(
    cfg, head: HeadEval, settings, progress: Callable[[str], None] = print, engines=None, evaluation: str | None = None
) -> SweepResult:
    """`cfg` is the EvaluateConfig (its `load`, `spec.max_new_tokens`, `spec.temperature`, `max_prompt_tokens`,
    `ignore_eos`): the first `load.requests` prompts of `head.heldout` that fit, as texts with the chat template, the
    report in `head.out_dir` (the head alone: no baseline, no curves); see the module doc. `engines`: see `run_sweep`;
    `evaluation`: the `engine_evaluation.json` of `engines`' servers, its rounds as concurrency 1 (evaluation_cells)."""
    from transformers import AutoTokenizer

    from components.data.chat import prompt_ids

    refuse_sampled(cfg, settings)  # a CPU build's sampled verification is wrong
    load, target_dir, traffic_path = cfg.load, head.target_dir, head.heldout
    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=settings.trust_remote_code)
    output_len = load.output_len or cfg.spec.max_new_tokens
    max_len = engine_max_len(target_dir, cfg)
    prompts = []
    for _, msgs in held_out_messages(traffic_path):
        n = len(prompt_ids(tokenizer, msgs))
        if 4 <= n <= cfg.max_prompt_tokens and n + output_len <= max_len:
            prompts.append(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
        if len(prompts) >= load.requests:
            break
    if len(prompts) < load.requests:
        raise ValueError(
            f"{traffic_path}: only {len(prompts)} held-out prompts fit ({cfg.max_prompt_tokens} prompt "
            f"tokens, {output_len} new, context {max_len}); evaluate.load.requests asks for "
            f"{load.requests}"
        )
    plan = SweepPlan(
        prompts,
        str(target_dir),
        str(head.head_dir),
        Path(head.out_dir),
        output_len,
        cfg.spec.temperature,
        max_len,
        progress,
        ignore_eos=cfg.ignore_eos,
    )
    batch1 = (
        evaluation_cells(evaluation, load.k_values[0])
        if evaluation and len(load.k_values) == 1 and 1 in load.concurrency and cfg.spec.temperature == 0.0
        else None
    )
    return run_sweep(load, plan, settings, engines, batch1)


@dataclass(frozen=True)
class SweepPlan:
    """What one sweep needs besides its config: prompts as texts, where the target and head are, who speaks."""

    prompts: list[str]
    target_dir: str
    head_dir: str
    out: Path
    output_len: int
    temperature: float
    max_model_len: int
    progress: Callable[[str], None] = print
    extra: dict = field(default_factory=dict)
    ignore_eos: bool = False  # every request runs to `output_len` (else it stops at its end-of-sequence token)


def memory_fit(spec, n: int, target_dir: str) -> tuple[dict, str]:
    """How `n` servers of `spec`'s kind share memory: (EngineSpec changes for each, "" when they fit at once, else
    why not). CPU: each its KV cache (infra/vllm_memory.py; else the pair's share of host memory), twice the target's
    weights (the target's and the head's vocabulary layers) and `FRONTEND_BYTES`, all within what is available now.
    GPU: the pair's total share split `n` ways, each at least twice the target's weights."""
    from infra.vllm_memory import cpu_kv_cache_bytes, host_memory

    device = spec.resolved_device()
    total, available = host_memory(device)
    weights = sum(f.stat().st_size for f in Path(target_dir).glob("*.safetensors"))
    if device == "cpu":
        share = PAIR_MEMORY_SHARE["cpu"]
        kv = cpu_kv_cache_bytes(target_dir, spec.head_dir, spec.dtype, spec.max_model_len, share)
        need = n * ((kv + 2 * weights if kv else share * total) + FRONTEND_BYTES)
        why = (
            ""
            if total and need <= available
            else (f"{n} servers need ~{need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available")
        )
        return {"cpu_memory_share": share}, why
    share = round(2 * PAIR_MEMORY_SHARE["cuda"] / n, 3)
    why = (
        ""
        if total and share * total >= 2 * weights and available >= 2 * PAIR_MEMORY_SHARE["cuda"] * total
        else (
            f"{n} servers at {share:.2f} of {total / 2**30:.0f} GiB each leave too little beside "
            f"{weights / 2**30:.1f} GiB of weights ({available / 2**30:.0f} GiB free)"
        )
    )
    return {"extra_args": ("--gpu-memory-utilization", str(share))}, why


def run_sweep(
    cfg: LoadConfig, plan: SweepPlan, settings, engines=None, batch1: list[dict] | None = None
) -> SweepResult:
    """Plain and every K up at once (else plain beside one K at a time), cells in alternating rounds; then the
    schedule beside plain; see the module doc. `engines`: an `infra.engine_pool.EnginePool` whose parked servers
    (the vLLM evaluation's plain and speculative pair) stand in for the sweep's servers of the same engines; the
    parked ones it does not take are stopped before it starts any. `batch1`: `evaluation_cells` of those servers,
    taken for concurrency 1 when plain and every K were handed on (else concurrency 1 is measured)."""
    from infra.vllm_bench import write_dataset
    from infra.vllm_engine_spec import EngineSpec
    from infra.vllm_server import PER_REQUEST_METRICS, VllmServer

    plan.out.mkdir(parents=True, exist_ok=True)
    dataset = str(write_dataset(plan.prompts, plan.out / "prompts.sharegpt.json"))
    base = EngineSpec(plan.target_dir, None, method=None, max_model_len=plan.max_model_len)
    changes, why = memory_fit(base, 1 + len(cfg.k_values), plan.target_dir)
    pair_changes, _ = memory_fit(base, 2, plan.target_dir)
    mode = "pairs" if why else "all"

    def spec_of(k: int, schedule=None, pair: bool = False) -> EngineSpec:
        spec = (
            base
            if k == 0
            else replace(
                base,
                head_dir=plan.head_dir,
                method="eagle3",
                num_speculative_tokens=k,
                k_schedule=tuple(tuple(r) for r in schedule) if schedule else None,
                extra_args=PER_REQUEST_METRICS,
            )
        )  # as the evaluation's: one engine
        fit = pair_changes if pair else changes
        return replace(
            spec,
            **{k_: v for k_, v in fit.items() if k_ != "extra_args"},
            extra_args=(*spec.extra_args, *fit.get("extra_args", ())),
        )

    plan.progress(
        f"load sweep: plain and K {', '.join(map(str, cfg.k_values))} "
        + ("up at once" if mode == "all" else f"in pairs with plain ({why})")
        + f", {cfg.repeats} rounds at concurrency {', '.join(map(str, cfg.concurrency))}"
    )
    with ExitStack() as stack:
        plain = VllmServer(spec_of(0, pair=mode == "pairs"), settings)
        handed: dict = {}  # K -> a server the evaluation left running (its plain under 0)
        if engines is not None:  # the parked servers that are this phase's; the others stopped (memory)
            ks = cfg.k_values if mode == "all" else ()
            took = engines.take_each([plain, *(VllmServer(spec_of(k), settings) for k in ks)])
            handed = {k: t for k, t in zip((0, *ks), took) if t is not None}
            if handed:
                plan.progress(
                    "load sweep: "
                    + ", ".join("plain" if k == 0 else f"K {k}" for k in handed)
                    + " handed on by the evaluation, running already"
                )
        from_eval = batch1 is not None and mode == "all" and {0, *cfg.k_values} <= set(handed)
        plain = handed.pop(0, plain)
        stack.callback(plain.stop)
        if plain.proc is None:
            plain.launch()  # from this thread, so that it lives as long as the sweep; it starts beside the K servers
            if plain.compiles:  # but a compiled one first: compiling starts go one at a time (vllm_server.start_groups)
                plain.wait_ready()
        measured = replace(cfg, concurrency=tuple(c for c in cfg.concurrency if c != 1)) if from_eval else cfg
        if from_eval:
            plan.progress(
                "load sweep: concurrency 1 from the evaluation of these servers ("
                + ", ".join(
                    f"{'plain' if c['k'] == 0 else 'K ' + str(c['k'])} {c['output_tokens_per_s']:.0f} tok/s"
                    for c in batch1
                )
                + f", {batch1[0]['repeats']} rounds)"
            )
        mode, why, samples, rounds = _sweep_phase(
            measured, plan, settings, {0: plain, **handed}, spec_of, (mode, why), dataset
        )
        cells = (list(batch1) if from_eval else []) + cells_of([s for s in samples if s["phase"] == "sweep"])
        tput = {c["k"]: {} for c in cells}
        spread = {c["k"]: {} for c in cells}
        for c in cells:
            tput[c["k"]][c["concurrency"]] = c["output_tokens_per_s"]
            spread[c["k"]][c["concurrency"]] = (c["output_tokens_per_s_min"], c["output_tokens_per_s_max"])
        schedule, best = derive_schedule(tput, cfg.margin, spread)
        top_k = max((r[2] for r in schedule), default=0)
        if cfg.verify_schedule and top_k > 0:
            plan.progress(f"load sweep: the schedule {schedule} beside plain")
            with VllmServer(spec_of(top_k, schedule, pair=True), settings) as srv:
                got = measure_rounds(measured, plan, settings, {0: plain, SCHEDULE: srv}, dataset, "schedule")
            samples, rounds = samples + got[0], rounds + got[1]
            phase = cells_of([s for s in samples if s["phase"] == "schedule"])
            if from_eval:  # at batch size 1 the schedule drafts best[1] tokens: that server's cell is the schedule's
                at1 = next(c for c in batch1 if c["k"] == best[1])
                phase += [
                    next(c for c in batch1 if c["k"] == 0),
                    {**at1, "k": SCHEDULE, "source": f"evaluation (the schedule drafts K {best[1]} there)"},
                ]
            plain_then = {c["concurrency"]: c["output_tokens_per_s"] for c in phase if c["k"] == 0}
            cells += [{**c, "plain_tokens_per_s": plain_then[c["concurrency"]]} for c in phase if c["k"] == SCHEDULE]
        if from_eval and plan.temperature == 0.0 and judge(samples)[1]:
            # the evaluation keeps token ids, not the client's texts: without plain's texts at batch 1, a plain output
            # that batching alone changed at the lowest level measured here would read as the head's mismatch
            plan.progress(
                "load sweep: speculative outputs differ from plain's under load; plain at concurrency 1 "
                "once, as the batching baseline"
            )
            got = measure_rounds(
                replace(measured, concurrency=(1,), repeats=1), plan, settings, {0: plain}, dataset, "baseline"
            )
            samples, rounds = samples + got[0], rounds + got[1]
    return _finish(cfg, plan, cells, samples, schedule, best, {"mode": mode, "mode_reason": why, "rounds": rounds})


def _sweep_phase(
    cfg: LoadConfig, plan: SweepPlan, settings, up: dict, spec_of, how: tuple[str, str], dataset: str
) -> tuple[str, str, list[dict], list[dict]]:
    """The sweep's cells beside the running plain server (`up[0]`): in mode "all" every K server up at once (those
    in `up`, K -> server, running already; falling back to pairs when one does not start beside the others), else
    each K beside plain in turn; returns the mode it ran in, why not "all", the samples and the rounds' orders."""
    from infra.engine_pool import stopping
    from infra.vllm_server import EngineError, VllmServer, running

    mode, why = how
    plain, handed = up[0], {k: s for k, s in up.items() if k != 0}
    if mode == "all":
        started = False
        fresh = [k for k in cfg.k_values if k not in handed]
        try:
            with (
                running(*(VllmServer(spec_of(k), settings) for k in fresh)) as started_up,
                stopping(*handed.values()),
            ):  # started at once
                plain.wait_ready()
                by_k = {**dict(zip(fresh, started_up)), **handed}
                servers = {0: plain, **{k: by_k[k] for k in cfg.k_values}}
                started = True
                return (mode, why, *measure_rounds(cfg, plan, settings, servers, dataset, "sweep"))
        except EngineError as e:
            if started:  # a failure while measuring is not about fitting
                raise
            why = f"a server did not start beside the others: {str(e)[:200]}"
            plan.progress(f"load sweep: {why}; plain beside one K at a time")
    plain.wait_ready()
    samples, rounds = [], []
    for k in cfg.k_values:
        with VllmServer(spec_of(k, pair=True), settings) as srv:
            got = measure_rounds(cfg, plan, settings, {0: plain, k: srv}, dataset, "sweep")
        samples, rounds = samples + got[0], rounds + got[1]
    return "pairs", why, samples, rounds


def measure_rounds(
    cfg: LoadConfig, plan: SweepPlan, settings, servers: dict, dataset: str, phase: str, first_round: int = 0
) -> tuple[list[dict], list[dict]]:
    """Every server (`{k: running VllmServer}`) at every level, `cfg.repeats` rounds (numbered from `first_round`) in
    `round_order`, by one client process; returns (one sample per cell measured, each level's order) for the caller
    to add to what it measured before."""
    from infra.vllm_bench import LoadRequest, bench_serve_many

    jobs, rounds = [], []
    for r in range(first_round, first_round + cfg.repeats):
        for i, c in enumerate(cfg.concurrency):
            order = round_order(list(servers), r, i)
            rounds.append({"phase": phase, "round": r, "concurrency": c, "order": order})
            jobs += [
                (
                    k,
                    r,
                    LoadRequest(
                        dataset,
                        plan.target_dir,
                        c,
                        len(plan.prompts),
                        plan.output_len,
                        plan.temperature,
                        ignore_eos=plan.ignore_eos,
                    ),
                )
                for k in order
            ]

    def done(i: int, cell) -> None:
        k, r, _ = jobs[i]
        what = "plain" if k == 0 else ("the schedule" if k == SCHEDULE else f"K = {k}")
        plan.progress(
            f"load sweep: round {r + 1} {what} at {cell.concurrency}: "
            f"{cell.output_tokens_per_s:.0f} tok/s"
            + (f", tau {cell.acceptance_length:.2f}" if cell.acceptance_length else "")
        )

    if not jobs:
        return [], rounds
    cells = bench_serve_many([(servers[k], req) for k, _, req in jobs], settings, on_cell=done)
    return [{"phase": phase, "round": r, "k": k, **asdict(cell)} for (k, r, _), cell in zip(jobs, cells)], rounds


def _finish(
    cfg: LoadConfig, plan: SweepPlan, cells: list[dict], samples: list[dict], schedule, best, how: dict
) -> SweepResult:
    variant, mismatched = judge(samples)
    plain = {c["concurrency"]: c["texts"] for c in cells if c["k"] == 0 and c["source"] == "sweep"}
    for c in cells:
        if c["source"] != "sweep":  # the evaluation's: its own identity count
            continue
        c["identical_to_plain"] = sum(
            all(t[i] == plain[c["concurrency"]][i] for t in c["texts_by_round"])
            for i in range(len(plain[c["concurrency"]]))
        )
    by = {(c["k"], c["concurrency"]): c for c in cells}
    speedup_at = {}
    for lvl in sorted({c["concurrency"] for c in cells if c["k"] == 0}):
        sched = by.get((SCHEDULE, lvl))
        speedup_at[lvl] = (
            sched["output_tokens_per_s"] / sched["plain_tokens_per_s"]
            if sched
            else by[(best[lvl], lvl)]["output_tokens_per_s"] / by[(0, lvl)]["output_tokens_per_s"]
        )
    res = SweepResult(
        cells=cells,
        schedule=schedule,
        crossover=crossover_of(best),
        best_k=best,
        speedup_at=speedup_at,
        batch_variant=len(variant),
        mismatches=len(mismatched),
        report_file=str(plan.out / "load_sweep.json"),
        plot_file=str(plan.out / "load_sweep.png"),
        mode=how["mode"],
        repeats=cfg.repeats,
        rounds=tuple(how["rounds"]),
    )
    slim = [{k: v for k, v in c.items() if k not in ("texts", "texts_by_round")} for c in cells]
    atomic_write_text(
        plan.out / "load_sweep.json",
        json.dumps(
            {
                "config": asdict(cfg),
                "output_len": plan.output_len,
                "max_model_len": plan.max_model_len,
                "mode": how["mode"],
                "mode_reason": how["mode_reason"],
                "repeats": cfg.repeats,
                "schedule": schedule,
                "crossover": res.crossover,
                "best_k": best,
                "speedup_at": speedup_at,
                "batch_variant": res.batch_variant,
                "mismatches": res.mismatches,
                "cells": slim,
                "rounds": how["rounds"],
                **plan.extra,
            },
            indent=2,
        )
        + "\n",
    )
    plot_load_sweep(cells, schedule, res.plot_file)
    if plan.temperature == 0.0 and res.mismatches:
        raise NotLosslessError(
            f"under load in vLLM, {res.mismatches} speculative outputs differ from plain decoding "
            f"at the same concurrency (not explained by batching); see {res.report_file}"
        )
    plan.progress(
        f"load sweep: schedule {schedule}, crossover {res.crossover}; {res.batch_variant} plain outputs "
        f"varied with the batch alone"
    )
    return res
