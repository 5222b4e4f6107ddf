"""Stage 4a, the K a head drafts at batch size 1, chosen by measurement in vLLM before the head is evaluated.

Purpose: `pick_depth(cfg, head, settings) -> DepthPick` (`cfg.pick`: components/evaluate/load_config.py
`DepthPickConfig`). How many tokens a head should draft is not the head's alone: each draft step is a pass of vLLM's
proposer whose fixed cost is the machine's. On 2 Zen 5 cores one more draft step of SmolLM2's head cost ~0.14 of a
target step, so a head served at K 5 ran below plain and the same head at K 2 at ~1.2x; on Zen 4 it cost a few
hundredths and K 5 paid most (bench/README.md "K by measurement"). So the K is measured where it is served: the load
sweep's machinery (components/evaluate/load_sweep.py) serves the target plainly and with the head at each K of
`cfg.pick.choices`, all up at once, at concurrency 1 over the first `cfg.pick.requests` held-out prompts, in
`cfg.pick.repeats` rounds whose order alternates, with vLLM's own load client, every speculative output checked
equal to plain's (a mismatch raises `NotLosslessError`). `choose` takes the K with the most output tokens/s (median
over the rounds; the smaller K on a tie), whether or not it beats plain: the evaluation that follows measures the
head at that K with its interval, and the gate judges it. `applied(cfg, k)` is the evaluation config everything after
the pick runs with: `spec.depth` k, and the load sweep's `k_values` k where they named the old depth alone.
Writes `depth_pick.json` (the choices' cells, plain's, the chosen K) beside the sweep's own report in `head.out_dir`.
Run: flows/evaluate_head.py calls it first where vLLM evaluates the head. Not here: the sweep's rounds and cells
(components/evaluate/load_sweep.py, load_cells.py), the evaluation at the chosen K (engine.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from components.data.atomic import atomic_write_text
from components.evaluate.load_config import LoadConfig
from components.evaluate.stage import EvaluateConfig, HeadEval

REPORT = "depth_pick.json"


@dataclass(frozen=True)
class DepthPick:
    """The chosen K, each choice's and plain's output tokens/s at batch size 1 (medians), where the report is."""

    depth: int
    tokens_per_s: dict[int, float]  # K -> median output tokens/s; K 0 plain
    report_file: str

    def metrics(self) -> dict[str, float]:
        plain = self.tokens_per_s.get(0) or 0.0
        return {"picked_depth": float(self.depth)} | (
            {"picked_depth_speedup": self.tokens_per_s[self.depth] / plain} if plain else {}
        )


def choose(tokens_per_s: dict[int, float]) -> int:
    """The K (> 0) with the most output tokens/s; the smaller K on a tie."""
    ks = [k for k in tokens_per_s if k > 0]
    if not ks:
        raise ValueError(f"no K measured to choose from: {tokens_per_s}")
    return max(ks, key=lambda k: (tokens_per_s[k], -k))


def applied(cfg: EvaluateConfig, k: int) -> EvaluateConfig:
    """`cfg` at the chosen K: `spec.depth` k, and `load.k_values` (k,) where they were (the old depth,)."""
    load = cfg.load
    if load.k_values == (cfg.spec.depth,):
        load = replace(load, k_values=(k,))
    return replace(cfg, spec=replace(cfg.spec, depth=k), load=load)


def pick_depth(cfg: EvaluateConfig, head: HeadEval, settings, progress: Callable[[str], None] = print) -> DepthPick:
    """Measure `cfg.pick.choices` at batch size 1 in vLLM (see the module doc); the report into `head.out_dir`."""
    from components.evaluate.load_sweep import load_sweep

    pick = cfg.pick
    progress(
        f"evaluate: K by measurement in vLLM: plain and K {', '.join(map(str, pick.choices))} at batch size 1, "
        f"{pick.requests} prompts, {pick.repeats} rounds"
    )
    load = LoadConfig(
        concurrency=(1,),
        k_values=pick.choices,
        requests=pick.requests,
        repeats=pick.repeats,
        margin=cfg.load.margin,
        verify_schedule=False,
    )
    res = load_sweep(replace(cfg, load=load), head, settings, progress)
    tput = {c["k"]: float(c["output_tokens_per_s"]) for c in res.cells if c["concurrency"] == 1 and c["k"] >= 0}
    k = choose(tput)
    plain = tput.get(0, 0.0)
    progress(
        f"evaluate: K {k} drafts at batch size 1 ("
        + ", ".join(f"{'plain' if q == 0 else 'K ' + str(q)} {t:.1f}" for q, t in sorted(tput.items()))
        + " output tokens/s"
        + (f"; K {k} {tput[k] / plain:.2f}x plain" if plain else "")
        + ")"
    )
    out = Path(head.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = out / REPORT
    atomic_write_text(
        report,
        json.dumps(
            {
                "choices": list(pick.choices),
                "requests": pick.requests,
                "repeats": pick.repeats,
                "tokens_per_s": {str(q): t for q, t in sorted(tput.items())},
                "depth": k,
                "sweep_report": res.report_file,
            },
            indent=1,
        ),
    )
    return DepthPick(k, tput, str(report))


def read_pick(report_file: str | Path) -> DepthPick:
    """A pick from its report in a run's directory (the tests read it so; the flow's resumed run gets the same from
    its Prefect task's cache)."""
    r = json.loads(Path(report_file).read_text())
    return DepthPick(int(r["depth"]), {int(q): float(t) for q, t in r["tokens_per_s"].items()}, str(report_file))
