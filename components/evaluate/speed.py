"""A speedup figure you can trust: plain and speculative decoding timed side by side, in rounds, until it settles.

Purpose: `measure_speedup(n_prompts, plain, spec, cfg, progress) -> SpeedupEstimate`, used by the local
evaluation (components/evaluate/stage.py) and the engine evaluation (components/evaluate/engine.py) alike.
- `plain(i, r)` and `spec(i, r)` decode prompt i once (round r); this module only times them. Within a round the two
  run block by block (`block` prompts each, 1: prompt by prompt), interleaved, and which of the two goes first
  alternates with the block and the round, so that anything else on the machine lands on both sides alike and a
  side that ends one block begins the next (fewer switches between them: what `settle` waits for).
- A round's ratio is its plain seconds over its speculative seconds summed over every prompt (what a user sees over
  that traffic). Rounds repeat until `min_rounds` are done and the median's interval is within `max_spread`, or
  `max_rounds` or `budget_s` is reached.
- The figure is the **median of the round ratios**; `lo`/`hi` is a distribution-free interval of that median from
  the rounds' order statistics (the widest pair (k, n+1-k) whose coverage is >= 90%; with fewer than 5 rounds no
  such pair exists and lo/hi are the min and max, whose coverage `coverage` states).
- `settle(kind)`, when given, runs before each timed decode ("plain" or "spec"), untimed and outside the budget:
  the engine evaluation waits there for the other vLLM server's idle spin to end (components/evaluate/engine.py).
- `reliable` is False, with `reason` saying why, when fewer than `min_rounds` rounds fit in the budget, the
  interval is wider than `max_spread` (relative half-width, max(hi/median - 1, 1 - lo/median)), or other processes
  used more than `max_other_load` CPU cores on average while it was measured (infra/cpu_load.py: the machine's busy
  time less ours, the servers being measured counting as ours through `own_pgids`; `other_load` records it). A
  neighbour on the cores moves the ratio itself, not only its noise (on 2 cores one busy thread beside the
  evaluation raised the median 6%, one process 10%), so a figure measured beside one is that busy machine's, not
  the head's. An unreliable figure is registered as such, never as a number (components/registry/register.py).
- `warm_up(servers, prompt_ids)`: the engine callers' untimed pass over every prompt on each server first.
Run: the evaluation calls it; `python -m components.evaluate.speed` prints the interval rule's coverages.
Not here: what is decoded, identity checks, acceptance (the callers do that).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from math import comb
from typing import Callable, Iterable

from eagle.config_checks import FieldError, at_least
from infra.cpu_load import OtherLoad

COVERAGE = 0.90  # the wanted coverage of the median's interval
# prompts per side per turn where each switch between the sides waits (a CPU engine pair): 4 switches a round
# instead of one per prompt, each side's block of 4 taking a few seconds, so drift still lands on both alike
SWITCH_BLOCK = 4


@dataclass(frozen=True)
class SpeedupConfig:
    """How long to measure: at least `min_rounds` rounds over the prompts, at most `max_rounds`, stopping early once
    the median's interval is within +-`max_spread`; no new round starts after `budget_s` seconds. A figure measured
    while other processes used more than `max_other_load` CPU cores on average is unreliable (`inf`: never).
    `block`: prompts decoded by one side before the other takes them (0: the caller's choice, `block_for`).
    `switch_pause_s`: seconds a timed vLLM request waits when the one before went to the other server (None: the
    device's own, vLLM's idle spin and a margin on a CPU build, 0 on a GPU, components/evaluate/engine.py
    `SwitchPause`); 0 suits a machine with many cores, where one spinning core does not move the figure."""

    min_rounds: int = 5
    max_rounds: int = 9
    max_spread: float = 0.10
    budget_s: float = 300.0
    max_other_load: float = 0.5
    block: int = 0
    switch_pause_s: float | None = None

    def __post_init__(self) -> None:
        at_least(self, {"min_rounds": 1, "max_rounds": 1, "block": 0})
        if self.switch_pause_s is not None and (
            isinstance(self.switch_pause_s, bool) or not 0.0 <= self.switch_pause_s < float("inf")
        ):
            raise FieldError(
                self,
                "switch_pause_s",
                f"must be a number of seconds >= 0 (null: the device's own), got {self.switch_pause_s}",
            )
        if self.max_rounds < self.min_rounds:
            raise FieldError(self, "max_rounds", f"must be >= min_rounds ({self.min_rounds}), got {self.max_rounds}")
        if not 0.0 < self.max_spread < 1.0:
            raise FieldError(self, "max_spread", f"must be in (0, 1) (a relative half-width), got {self.max_spread}")
        if not 0.0 < self.budget_s < float("inf"):
            raise FieldError(self, "budget_s", f"must be a positive number of seconds, got {self.budget_s}")
        if isinstance(self.max_other_load, bool) or not self.max_other_load >= 0.0:
            raise FieldError(
                self, "max_other_load", f"must be a number of CPU cores >= 0 (inf: no bound), got {self.max_other_load}"
            )

    def block_for(self, switch_costs: bool) -> int:
        """The block size to run: `block` when set, else 1 (prompt by prompt) where switching sides is free and
        `SWITCH_BLOCK` where each switch waits (a CPU engine pair's idle spin, components/evaluate/engine.py)."""
        return self.block or (SWITCH_BLOCK if switch_costs else 1)

    @classmethod
    def tiny(cls) -> "SpeedupConfig":
        """Two rounds, no bound on other load, no pause between vLLM servers: the tests' tiny figures mean nothing
        and must not depend on what else the machine runs (tests/test_speed.py checks the bound and the pause)."""
        return cls(min_rounds=2, max_rounds=2, budget_s=60.0, max_other_load=float("inf"), switch_pause_s=0.0)


@dataclass(frozen=True)
class SpeedupEstimate:
    speedup: float  # median of the round ratios (plain seconds / speculative seconds)
    lo: float
    hi: float
    coverage: float  # of [lo, hi] for the median (distribution-free)
    rounds: int
    reliable: bool
    reason: str  # why it is unreliable ("" when reliable)
    plain_tokens_per_s: float  # round 0's tokens over the median round's seconds
    spec_tokens_per_s: float
    other_load: float | None = None  # mean CPU cores other processes used while it was measured (None: unknown)
    # unreliable only because [lo, hi] is wider than `max_spread`: enough rounds, no other load. Such an interval is
    # honest at its coverage, only wide, so a comparison of intervals may still use it (the shadow test's verdict)
    wide_only: bool = False
    round_ratios: list[float] = field(default_factory=list)
    plain_s: list[list[float]] = field(default_factory=list)  # [round][prompt]
    spec_s: list[list[float]] = field(default_factory=list)

    @property
    def spread(self) -> float:
        """Relative half-width of [lo, hi] around the median."""
        return max(self.hi / self.speedup - 1.0, 1.0 - self.lo / self.speedup) if self.speedup > 0 else float("inf")

    def describe(self) -> str:
        """ "1.52x [1.47, 1.58] over 5 rounds", with "unreliable: <why>" when it is."""
        text = f"{self.speedup:.2f}x [{self.lo:.2f}, {self.hi:.2f}] over {self.rounds} round(s)"
        return text if self.reliable else f"{text}, unreliable: {self.reason}"

    def metrics(self, suffix: str = "") -> dict[str, float]:
        """`speedup<suffix>` (the median), `_lo`, `_hi`, `_reliable` (1/0), `_rounds`, `_other_load` when known (e.g.
        suffix "_vllm")."""
        base = f"speedup{suffix}"
        out = {
            base: self.speedup,
            f"{base}_lo": self.lo,
            f"{base}_hi": self.hi,
            f"{base}_reliable": float(self.reliable),
            f"{base}_rounds": float(self.rounds),
        }
        if self.other_load is not None:
            out[f"{base}_other_load"] = self.other_load
        return out


def median_interval(values: list[float], coverage: float = COVERAGE) -> tuple[float, float, float]:
    """(lo, hi, achieved coverage) of a distribution-free interval for the median of `values`: the order statistics
    (k, n+1-k) with the largest k whose coverage 1 - 2 P(Binomial(n, 1/2) < k) is at least `coverage`; (min, max)
    when no k reaches it."""
    xs, n = sorted(values), len(values)
    if n == 0:
        raise ValueError("no values")

    def cover(k: int) -> float:
        return 1.0 - 2.0 * sum(comb(n, j) for j in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and cover(k + 1) >= coverage:
        k += 1
    return xs[k - 1], xs[n - k], cover(k)


@dataclass(frozen=True)
class Timing:
    """How `measure_speedup` times the decodes, beyond `SpeedupConfig`: `what` names the measurement in its progress
    lines; `clock` times them and the budget (seconds); `own_pgids` are the process groups of the servers being
    measured (their CPU time is ours, not other load); `settle(kind)` runs before each decode, untimed, its time not
    counted in the budget; `block`: prompts per side per turn (None: `cfg.block_for` without a switch cost)."""

    what: str = ""
    clock: Callable[[], float] = time.perf_counter
    own_pgids: Iterable[int] = ()
    settle: Callable[[str], None] | None = None
    block: int | None = None


def warm_up(servers: Iterable, prompt_ids: list[list[int]]) -> None:
    """Each prompt once on each server (4 new tokens), untimed, before the counters are read. A head's server pays a
    cost the first time it sees a prompt (its prefill's kernels for that length) that a plain server does not, so
    a timed first round without this reads the head slower than every later one (bench/README.md)."""
    for s in servers:
        for ids in prompt_ids:
            s.complete(ids, 4)


def measure_speedup(
    n_prompts: int,
    plain: Callable[[int, int], int],
    spec: Callable[[int, int], int],
    cfg: SpeedupConfig,
    progress: Callable[[str], None] | None = None,
    timing: Timing = Timing(),
) -> SpeedupEstimate:
    """Rounds of interleaved plain and speculative decoding over `n_prompts`; each callable returns the tokens it
    produced (for tokens/s), timed as `timing` says. See the module doc."""
    what, clock, settle = timing.what, timing.clock, timing.settle
    block = timing.block or cfg.block_for(switch_costs=False)
    t_start = clock()
    settled = 0.0  # seconds spent in `settle`, left out of the budget
    probe = OtherLoad.start(timing.own_pgids)
    plain_s: list[list[float]] = []
    spec_s: list[list[float]] = []
    tokens_plain = tokens_spec = 0
    est = None
    while len(plain_s) < cfg.max_rounds and (not plain_s or clock() - t_start - settled < cfg.budget_s):
        r = len(plain_s)
        times: dict[str, list[float]] = {"plain": [0.0] * n_prompts, "spec": [0.0] * n_prompts}
        for b, first in enumerate(range(0, n_prompts, block)):
            kinds = ("plain", "spec") if (b + r) % 2 == 0 else ("spec", "plain")
            for kind in kinds:
                fn = plain if kind == "plain" else spec
                for i in range(first, min(first + block, n_prompts)):
                    if settle is not None:
                        t_settle = clock()
                        settle(kind)
                        settled += clock() - t_settle
                    t0 = clock()
                    n_tok = fn(i, r)
                    times[kind][i] = clock() - t0
                    if r == 0:
                        tokens_plain += n_tok if kind == "plain" else 0
                        tokens_spec += n_tok if kind == "spec" else 0
        row_p, row_s = times["plain"], times["spec"]
        plain_s.append(row_p)
        spec_s.append(row_s)
        est = _estimate(plain_s, spec_s, tokens_plain, tokens_spec, cfg, clock() - t_start - settled, probe.cores())
        if progress:
            progress(
                f"speedup{what}: round {r + 1}: {sum(row_p) / max(sum(row_s), 1e-9):.2f}x; so far {est.describe()}"
            )
        if len(plain_s) >= cfg.min_rounds and est.spread <= cfg.max_spread:
            break
    assert est is not None
    return est


def _estimate(
    plain_s,
    spec_s,
    tokens_plain: int,
    tokens_spec: int,
    cfg: SpeedupConfig,
    elapsed: float,
    other_load: float | None = None,
) -> SpeedupEstimate:
    ratios = [sum(p) / max(sum(s), 1e-9) for p, s in zip(plain_s, spec_s)]
    med = statistics.median(ratios)
    lo, hi, cov = median_interval(ratios)
    n = len(ratios)
    spread = max(hi / med - 1.0, 1.0 - lo / med) if med > 0 else float("inf")
    reason = ""
    if n < cfg.min_rounds:
        reason = (
            f"only {n} of {cfg.min_rounds} rounds fitted in the {cfg.budget_s:.0f} s budget"
            if elapsed >= cfg.budget_s or n >= cfg.max_rounds
            else f"{n} of {cfg.min_rounds} rounds so far"
        )
    elif spread > cfg.max_spread:
        reason = (
            f"the rounds disagree: median {med:.2f}x, interval [{lo:.2f}, {hi:.2f}] is +-{spread:.0%} "
            f"(bound +-{cfg.max_spread:.0%}); the machine was probably busy"
        )
    wide_only = bool(reason) and n >= cfg.min_rounds
    if other_load is not None and other_load > cfg.max_other_load:
        wide_only = False
        busy = (
            f"the machine was busy: other processes used {other_load:.2f} CPU cores on average while it was "
            f"measured (bound {cfg.max_other_load:g}, speed.max_other_load); re-run on quiet cores"
        )
        reason = f"{reason}; {busy}" if reason else busy
    return SpeedupEstimate(
        speedup=med,
        lo=lo,
        hi=hi,
        coverage=cov,
        rounds=n,
        reliable=not reason,
        reason=reason,
        plain_tokens_per_s=tokens_plain / max(statistics.median(sum(p) for p in plain_s), 1e-9),
        spec_tokens_per_s=tokens_spec / max(statistics.median(sum(s) for s in spec_s), 1e-9),
        other_load=other_load,
        wide_only=wide_only,
        round_ratios=ratios,
        plain_s=plain_s,
        spec_s=spec_s,
    )


if __name__ == "__main__":
    for n in range(1, 13):
        print(
            f"{n:>2} rounds: interval of the median from order statistics covers "
            f"{median_interval(list(range(n)))[2]:.3f}"
        )
