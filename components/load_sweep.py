"""Stage 4c, the head under load: throughput by concurrency in vLLM, and the K schedule the engine should run.

Purpose: `load_sweep(cfg, target_dir, head_dir, traffic_path, out_dir, settings) -> SweepResult`.
A production server runs many requests at once, and speculation spends compute a busy server no longer has to
spare, so one K is not right at every load. For the held-out prompts (the evaluation's, chat template applied) it
- serves the target plainly (K = 0) and with the head at each K of `cfg.load.k_values`, each on a fresh vLLM server,
  and at each concurrency of `cfg.load.concurrency` runs vLLM's own load client (infra/vllm_bench.py): output
  tokens/s, TTFT and inter-token latency (median, p99), tau and alpha_k from the counters;
- checks every speculative output equal to the plain output at the same concurrency (T = 0, fp32). Batching can
  change a plain output by itself (floating-point sums in another order); a prompt whose plain output at
  concurrency C differs from its plain output at the lowest level is counted as `batch_variant`, not as a head
  mismatch, and only the other differences raise `NotLosslessError`;
- derives the schedule (`derive_schedule`): at each measured level the K with the most output tokens/s, K = 0 unless
  a K beats plain by more than `cfg.load.margin`; levels between two measured ones take the lower one's K (as vLLM
  fills gaps); the result is vLLM's `num_speculative_tokens_per_batch_size` ranges. `crossover` is the first
  concurrency where the best K is 0 (None: speculation pays at every measured level);
- serves the schedule itself at every level (`cfg.load.verify_schedule`), so its throughput sits beside the fixed
  K's in the table and the plot, and its counters show where it drafted.
Writes `load_sweep.json` (cells, schedule, crossover) and `load_sweep.png` (output tokens/s against concurrency:
plain, each K, the schedule).
Concurrency here is what the client keeps in flight; vLLM's schedule is keyed by the scheduler's batch size, which
equals it in steady state (ramp-up and drain have smaller batches).
Not here: batch-1 latency and speedup (components/engine_eval.py), registering (components/register.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from components.atomic import atomic_write_text
from components.engine_eval import engine_max_len
from components.evaluate import NotLosslessError, held_out_messages
from components.load_config import MAX_BATCH, LoadConfig  # noqa: F401  (LoadConfig re-exported)
from components.plots import plot_load_sweep

@dataclass(frozen=True)
class SweepResult:
    cells: list[dict]  # one per (k, concurrency); k 0 plain, k -1 the schedule
    schedule: list[list[int]]  # [[first batch size, last batch size, K], ...] (vLLM's ranges)
    crossover: int | None  # first concurrency where plain wins (None: speculation pays everywhere measured)
    best_k: dict[int, int]  # concurrency -> best K (0: plain)
    speedup_at: dict[int, float]  # concurrency -> the schedule's (or the best K's) tokens/s over plain's
    batch_variant: int  # plain outputs that changed with the batch alone
    mismatches: int  # speculative outputs that differ from plain where plain itself did not vary
    report_file: str
    plot_file: str

    def metrics(self) -> dict[str, float]:
        m = {f"speedup_at_{c}": v for c, v in self.speedup_at.items()}
        if self.crossover is not None:
            m["crossover"] = float(self.crossover)
        return m

    def tags(self) -> dict[str, str]:
        return {"crossover": str(self.crossover) if self.crossover is not None else "none",
                "k_schedule": json.dumps(self.schedule),
                **{f"speedup_at_{c}": f"{v:.4f}" for c, v in self.speedup_at.items()}}


def derive_schedule(throughput: dict[int, dict[int, float]], margin: float) -> tuple[list[list[int]], dict[int, int]]:
    """From `throughput[K][concurrency]` (K 0: plain), vLLM's ranges and the best K per level (see the module doc)."""
    levels = sorted(throughput[0])
    best: dict[int, int] = {}
    for c in levels:
        plain = throughput[0][c]
        k, tps = max(((k, t[c]) for k, t in throughput.items() if k > 0 and c in t), key=lambda kt: (kt[1], -kt[0]),
                     default=(0, plain))
        best[c] = k if tps > plain * (1.0 + margin) else 0
    ranges: list[list[int]] = []
    for i, c in enumerate(levels):
        first = 1 if i == 0 else c
        last = levels[i + 1] - 1 if i + 1 < len(levels) else MAX_BATCH
        if ranges and ranges[-1][2] == best[c]:
            ranges[-1][1] = last
        else:
            ranges.append([first, last, best[c]])
    return ranges, best


def crossover_of(best: dict[int, int]) -> int | None:
    return next((c for c in sorted(best) if best[c] == 0), None)


def load_sweep(cfg, target_dir: str, head_dir: str, traffic_path: str, out_dir: str, settings,
               progress: Callable[[str], None] = print) -> SweepResult:
    """`cfg` is the EvaluateConfig (its `load`, `spec.max_new_tokens`, `spec.temperature`, `max_prompt_tokens`):
    the first `load.requests` held-out prompts that fit, as texts with the chat template; see the module doc."""
    from transformers import AutoTokenizer

    from components.chat import prompt_ids

    load = cfg.load
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
        raise ValueError(f"{traffic_path}: only {len(prompts)} held-out prompts fit ({cfg.max_prompt_tokens} prompt "
                         f"tokens, {output_len} new, context {max_len}); evaluate.load.requests asks for "
                         f"{load.requests}")
    plan = SweepPlan(prompts, str(target_dir), str(head_dir), Path(out_dir), output_len, cfg.spec.temperature,
                     max_len, progress)
    return run_sweep(load, plan, settings)


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


def run_sweep(cfg: LoadConfig, plan: SweepPlan, settings) -> SweepResult:
    """Every server of the sweep in turn (plain, each K, the schedule), every level on each; see the module doc."""
    from infra.vllm_bench import LoadRequest, bench_serve, write_dataset
    from infra.vllm_server import EngineSpec, VllmServer

    plan.out.mkdir(parents=True, exist_ok=True)
    dataset = str(write_dataset(plan.prompts, plan.out / "prompts.sharegpt.json"))
    base = EngineSpec(plan.target_dir, None, method=None, max_model_len=plan.max_model_len)

    def serve(k: int, schedule: list[list[int]] | None = None) -> list[dict]:
        spec = base if k == 0 else replace(base, head_dir=plan.head_dir, method="eagle3", num_speculative_tokens=k,
                                           k_schedule=tuple(tuple(r) for r in schedule) if schedule else None)
        what = "plain" if k == 0 else ("the schedule" if schedule else f"K = {k}")
        plan.progress(f"load sweep: vLLM with {what} at concurrency {', '.join(map(str, cfg.concurrency))}")
        rows = []
        with VllmServer(spec, settings) as srv:
            for c in cfg.concurrency:
                cell = bench_serve(srv, settings, LoadRequest(dataset, plan.target_dir, c, len(plan.prompts),
                                                              plan.output_len, plan.temperature))
                rows.append({"k": -1 if schedule else k, **asdict(cell)})
                plan.progress(f"load sweep: {what} at {c}: {cell.output_tokens_per_s:.0f} tok/s"
                              + (f", tau {cell.acceptance_length:.2f}" if cell.acceptance_length else ""))
        return rows

    cells = serve(0)
    for k in cfg.k_values:
        cells += serve(k)
    tput: dict[int, dict[int, float]] = {}
    for c in cells:
        tput.setdefault(c["k"], {})[c["concurrency"]] = c["output_tokens_per_s"]
    schedule, best = derive_schedule(tput, cfg.margin)
    top_k = max((r[2] for r in schedule), default=0)
    if cfg.verify_schedule and top_k > 0:
        cells += serve(top_k, schedule)
    return _finish(cfg, plan, cells, schedule, best)


def _finish(cfg: LoadConfig, plan: SweepPlan, cells: list[dict], schedule, best) -> SweepResult:
    plain = {c["concurrency"]: c["texts"] for c in cells if c["k"] == 0}
    low = min(plain)
    variant = {(lvl, i) for lvl, texts in plain.items() for i, t in enumerate(texts) if t != plain[low][i]}
    mismatches = sum(1 for c in cells if c["k"] != 0 for i, t in enumerate(c["texts"])
                     if t != plain[c["concurrency"]][i] and (c["concurrency"], i) not in variant)
    for c in cells:
        c["identical_to_plain"] = sum(t == plain[c["concurrency"]][i] for i, t in enumerate(c["texts"]))
    by = {(c["k"], c["concurrency"]): c["output_tokens_per_s"] for c in cells}
    speedup_at = {lvl: by.get((-1, lvl), by.get((best[lvl], lvl), by[(0, lvl)])) / by[(0, lvl)]
                  for lvl in sorted(plain)}
    res = SweepResult(cells=cells, schedule=schedule, crossover=crossover_of(best), best_k=best,
                      speedup_at=speedup_at, batch_variant=len(variant), mismatches=mismatches,
                      report_file=str(plan.out / "load_sweep.json"), plot_file=str(plan.out / "load_sweep.png"))
    slim = [{k: v for k, v in c.items() if k != "texts"} for c in cells]
    atomic_write_text(plan.out / "load_sweep.json", json.dumps(
        {"config": asdict(cfg), "output_len": plan.output_len, "schedule": schedule, "crossover": res.crossover,
         "best_k": best, "speedup_at": speedup_at, "batch_variant": res.batch_variant, "mismatches": mismatches,
         "cells": slim, **plan.extra}, indent=2) + "\n")
    plot_load_sweep(cells, schedule, res.plot_file)
    if plan.temperature == 0.0 and mismatches:
        raise NotLosslessError(f"under load in vLLM, {mismatches} speculative outputs differ from plain decoding at "
                               f"the same concurrency (not explained by batching); see {res.report_file}")
    plan.progress(f"load sweep: schedule {schedule}, crossover {res.crossover}; {res.batch_variant} plain outputs "
                  f"varied with the batch alone")
    return res
