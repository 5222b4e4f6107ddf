"""The load sweep's figures: cells from its rounds, the lossless judgement, the K schedule they decide, the result.

Purpose: `cells_of(samples)` makes one cell per (K, concurrency) from the load client's samples (medians over rounds,
the tokens/s spread, the speculative counters summed), `evaluation_cells(report, k)` the cells at concurrency 1 from
the engine evaluation's own rounds; `judge(samples)` tells plain outputs that batching alone changed from a head's
mismatches; `derive_schedule` makes vLLM's `num_speculative_tokens_per_batch_size` ranges from the cells' medians
and spreads, `crossover_of` the first level where plain wins; `SweepResult` is what the sweep returns.
Run: imported by components/evaluate/load_sweep.py; pure functions of figures, no engine (tests/test_load_cells.py).
Not here: the servers and the rounds that measure the samples (components/evaluate/load_sweep.py).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from components.evaluate.load_config import MAX_BATCH


@dataclass(frozen=True)
class SweepResult:
    cells: list[dict]  # one per (k, concurrency); k 0 plain, k -1 the schedule; figures are medians over rounds
    schedule: list[list[int]]  # [[first batch size, last batch size, K], ...] (vLLM's ranges)
    crossover: int | None  # first concurrency where plain wins (None: speculation pays everywhere measured)
    best_k: dict[int, int]  # concurrency -> best K (0: plain)
    speedup_at: dict[int, float]  # concurrency -> the schedule's (or the best K's) tokens/s over plain's
    batch_variant: int  # plain outputs that changed with the batch alone
    mismatches: int  # speculative outputs that differ from plain where plain itself did not vary
    report_file: str
    plot_file: str
    mode: str = "all"  # "all": every server of the sweep up at once; "pairs": plain beside one K at a time
    repeats: int = 1
    rounds: tuple = ()  # {"phase", "round", "concurrency", "order": [k, ...]} in the order measured

    def metrics(self) -> dict[str, float]:
        m = {f"speedup_at_{c}": v for c, v in self.speedup_at.items()}
        if self.crossover is not None:
            m["crossover"] = float(self.crossover)
        return m

    def tags(self) -> dict[str, str]:
        return {
            "crossover": str(self.crossover) if self.crossover is not None else "none",
            "k_schedule": json.dumps(self.schedule),
            **{f"speedup_at_{c}": f"{v:.4f}" for c, v in self.speedup_at.items()},
        }


def derive_schedule(
    throughput: dict[int, dict[int, float]],
    margin: float,
    spread: dict[int, dict[int, tuple[float, float]]] | None = None,
) -> tuple[list[list[int]], dict[int, int]]:
    """From `throughput[K][concurrency]` (K 0: plain; medians over rounds) and their `spread[K][concurrency]`
    (min, max over rounds; None: single figures), vLLM's ranges and the best K per level. A K beats plain at a level
    only when its median exceeds plain's by more than `margin` AND its spread does not overlap plain's (its min above
    plain's max); the best K is the fastest of those (the smaller on a tie), else 0."""
    levels = sorted(throughput[0])
    best: dict[int, int] = {}
    for c in levels:
        plain = throughput[0][c]
        plain_hi = spread[0][c][1] if spread else plain
        wins = [
            (k, t[c])
            for k, t in throughput.items()
            if k > 0 and c in t and t[c] > plain * (1.0 + margin) and (spread is None or spread[k][c][0] > plain_hi)
        ]
        best[c] = max(wins, key=lambda kt: (kt[1], -kt[0]))[0] if wins else 0
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


def evaluation_cells(report_file: str | Path, k: int) -> list[dict] | None:
    """Concurrency 1 as the engine evaluation timed it (components/evaluate/engine.py, `engine_evaluation.json`):
    a cell for plain (K 0) and one for the head at K `k`, shaped as `cells_of` makes them, each round's output
    tokens/s that side's tokens over its seconds in the round (greedy: every round decodes the same tokens), the
    head's counters those of the evaluation; None when the evaluation drafted another K than `k`."""
    report = json.loads(Path(report_file).read_text())
    if report["config"]["spec"]["depth"] != k:
        return None
    res, speed, samples = report["result"], report["speed"], report["samples"]
    cells = []
    for kk, key in ((0, "plain"), (k, "spec")):
        tokens = sum(len(s[key]) for s in samples)
        tps = [tokens / sum(secs) for secs in speed[f"{key}_s"]]
        drafts = res["drafts"] if kk else None
        cells.append(
            {
                "k": kk,
                "concurrency": 1,
                "requests": len(samples),
                **_rounds_tps(tps),
                **{m: None for m in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")},
                "duration_s": statistics.median(sum(secs) for secs in speed[f"{key}_s"]),
                "drafts": drafts,
                "accepted": sum(res["accepted_per_pos"]) if kk else None,
                "acceptance_length": res["tau"] if kk else None,
                "per_position": [a / drafts for a in res["accepted_per_pos"]] if kk and drafts else None,
                "identical_to_plain": sum(s["identical_to_plain"] for s in samples),
                "source": "evaluation",
            }
        )
    return cells


def _rounds_tps(tps: list[float]) -> dict:
    """A cell's tokens/s fields from its rounds' figures: the median, the spread and every round, and how many."""
    return {
        "repeats": len(tps),
        "output_tokens_per_s": statistics.median(tps),
        "output_tokens_per_s_min": min(tps),
        "output_tokens_per_s_max": max(tps),
        "output_tokens_per_s_rounds": tps,
    }


def cells_of(samples: list[dict]) -> list[dict]:
    """One cell per (k, concurrency) of `samples`: latencies and tokens/s the medians over rounds, tokens/s also
    min, max and per round; the speculative counters summed; `texts` of each round in `texts_by_round`."""
    keys = sorted({(s["k"], s["concurrency"]) for s in samples}, key=lambda kc: (kc[0] < 0, kc))
    cells = []
    for k, c in keys:
        rows = [s for s in samples if (s["k"], s["concurrency"]) == (k, c)]
        cell = {
            "k": k,
            "concurrency": c,
            "requests": rows[0]["requests"],
            **_rounds_tps([s["output_tokens_per_s"] for s in rows]),
            **{
                m: statistics.median(s[m] for s in rows)
                for m in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "duration_s")
            },
        }
        drafts = [s for s in rows if s["drafts"]]
        n = sum(s["drafts"] for s in drafts)
        acc = sum(s["accepted"] for s in drafts)
        per_pos = (
            [
                sum(s["per_position"][j] * s["drafts"] for s in drafts) / n
                for j in range(min(len(s["per_position"] or []) for s in drafts))
            ]
            if drafts
            else None
        )
        cell.update(
            drafts=n if drafts else None,
            accepted=acc if drafts else None,
            acceptance_length=1.0 + acc / n if drafts else None,
            per_position=per_pos,
            texts=rows[0]["texts"],
            texts_by_round=[s["texts"] for s in rows],
            source="sweep",
        )
        cells.append(cell)
    return cells


def judge(samples: list[dict]) -> tuple[set, set]:
    """(batch-variant (concurrency, prompt) keys, mismatched (k, concurrency, prompt) keys) of the measured samples.
    The baseline is each prompt's plain output at the lowest concurrency where plain was measured by the load
    client (any phase: a "baseline" one included); a plain output that differs from it, or between rounds, is batch
    variance; a speculative output that is none of the plain outputs at its concurrency, where plain did not vary, a
    mismatch."""
    plain_seen: dict[tuple[int, int], set[str]] = {}  # (concurrency, prompt) -> every plain output there
    for s in samples:
        if s["k"] == 0:
            for i, t in enumerate(s["texts"]):
                plain_seen.setdefault((s["concurrency"], i), set()).add(t)
    low = min((s["concurrency"] for s in samples if s["k"] == 0), default=None)
    base = next((s["texts"] for s in samples if s["k"] == 0 and s["concurrency"] == low), [])
    variant = {key for key, seen in plain_seen.items() if seen != {base[key[1]]}}
    mismatched = {
        (s["k"], s["concurrency"], i)
        for s in samples
        if s["k"] != 0
        for i, t in enumerate(s["texts"])
        if t not in plain_seen[(s["concurrency"], i)] and (s["concurrency"], i) not in variant
    }
    return variant, mismatched
