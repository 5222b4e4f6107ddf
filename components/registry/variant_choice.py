"""Which head variant to register when a run trains several (`train.variants`): the choice by measured speedup.

Purpose: `choose_variant({variant: metrics}) -> VariantChoice`, pure. `metrics` are what the evaluation stages report
for each variant's head (`EvaluateResult.metrics()` merged with `EngineEvalResult.metrics()`, as the flow registers
them). The rule:
- The figure is the served speedup: vLLM's `speedup_vllm` when every variant has one (the engine evaluation ran),
  else ours (`speedup`); a variant without a finite figure of that kind leaves the choice to the simplest.
- Each figure comes with the median's interval (`_lo`, `_hi`) and whether it is reliable (`_reliable`;
  components/evaluate/speed.py). Variant A beats B when A's interval lies wholly above B's (A.lo > B.hi) and A is
  reliable or B is not: an unreliable figure never beats a reliable one. Overlapping intervals are a tie.
- The chosen variant is the simplest (the order of eagle.config.VARIANTS: eagle3, eagle3.1, parallel, then
  eagle3.1-parallel, which has both changes) that no other beats; with two, the more complex wins only when its
  interval lies above the simpler's. The beats relation implies interval order, which has no cycles, so some
  variant is always unbeaten.
`variant_tags(metrics, choice)` are the registry tags that keep every variant's figures on the chosen version
(`variant_<v>_tau`, `variant_<v>_speedup_vllm`, with `_lo`/`_hi`/`_rounds`, ...) and the reason (`variant_choice`).
`VariantSink` prefixes one variant's training metrics (`<variant>/loss`) in the run's metrics sink.
Run: flows/train_head.py calls it after training and evaluating each listed variant on the same features.
Not here: training or measuring (components/train/stage.py, components/evaluate/stage.py,
components/evaluate/engine.py); the promotion gate, which judges the chosen head alone, as for a run of one variant
(components/registry/register.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from components.registry.register import speedup_tags
from eagle.config import VARIANTS

LABELS = {"speedup_vllm": "vLLM speedup", "speedup": "speedup (this project's decoder)"}


@dataclass(frozen=True)
class Speedup:
    """One variant's speedup figure: the median, its interval, and whether it is reliable."""

    value: float
    lo: float
    hi: float
    reliable: bool

    @classmethod
    def of(cls, metrics: Mapping[str, float], key: str) -> Speedup | None:
        """The figure `key` ("speedup" or "speedup_vllm") of `metrics`; None when absent or not finite. A figure
        without an interval is its own interval."""
        value = metrics.get(key)
        if value is None or not math.isfinite(value):
            return None
        lo, hi = metrics.get(f"{key}_lo", value), metrics.get(f"{key}_hi", value)
        return cls(float(value), float(lo), float(hi), bool(metrics.get(f"{key}_reliable", 1.0)))

    def beats(self, other: Speedup) -> bool:
        """This interval lies above `other`'s, and this figure is reliable or `other`'s is not."""
        return self.lo > other.hi and (self.reliable or not other.reliable)

    def describe(self) -> str:
        text = f"{self.value:.2f}x [{self.lo:.2f}, {self.hi:.2f}]"
        return text if self.reliable else f"{text} unreliable"


@dataclass(frozen=True)
class VariantChoice:
    variant: str
    key: str  # the figure that decided: "speedup_vllm", "speedup", or "" (none measured for every variant)
    reason: str  # in words, with every variant's figure


def served_key(metrics: Mapping[str, Mapping[str, float]]) -> str:
    """ "speedup_vllm" when every variant has a finite vLLM figure, else "speedup" when every one has ours, else ""."""
    for key in ("speedup_vllm", "speedup"):
        if all(Speedup.of(m, key) is not None for m in metrics.values()):
            return key
    return ""


def choose_variant(metrics: Mapping[str, Mapping[str, float]]) -> VariantChoice:
    """The variant to register of those in `metrics` (variant -> its evaluation metrics), by the module's rule."""
    unknown = [v for v in metrics if v not in VARIANTS]
    if unknown or not metrics:
        raise ValueError(f"variants to choose from must be some of {VARIANTS}, got {list(metrics)}")
    order = sorted(metrics, key=VARIANTS.index)  # simplest first
    key = served_key(metrics)
    if not key:
        return VariantChoice(order[0], "", f"{order[0]}, the simplest: no speedup measured for every variant")
    figs = {v: s for v in order if (s := Speedup.of(metrics[v], key)) is not None}  # all, by `served_key`
    beaten_by = {v: [w for w in order if figs[w].beats(figs[v])] for v in order}
    chosen = next(v for v in order if not beaten_by[v])
    why = []
    for v in order:
        if beaten_by[v]:
            why.append(f"{v} is beaten by {', '.join(beaten_by[v])} (interval above)")
        elif v != chosen:
            a, b = figs[v], figs[chosen]
            why.append(
                f"{v} lies above but is unreliable and {chosen} is not"
                if a.lo > b.hi
                else f"{v} lies below"
                if b.lo > a.hi
                else f"{v} ties (intervals overlap), and ties go to the simpler"
            )
    figures = ", ".join(f"{v} {figs[v].describe()}" for v in order)
    return VariantChoice(chosen, key, f"{chosen} by {LABELS[key]} ({figures}): {'; '.join(why)}")


def variant_tags(metrics: Mapping[str, Mapping[str, float]], choice: VariantChoice) -> dict[str, str]:
    """Tags for the chosen head's version: `variant` (the chosen), `variants` (all, simplest first),
    `variant_choice` (the reason), and each variant's τ and speedups as `variant_<v>_<tag>`, formatted as the
    version's own (components/registry/register.py `speedup_tags`: "unreliable" with `_median` when it is)."""
    order = sorted(metrics, key=VARIANTS.index)
    tags = {"variant": choice.variant, "variants": " ".join(order), "variant_choice": choice.reason}
    for v in order:
        m = metrics[v]
        for k in ("tau", "tau_vllm"):
            if k in m and math.isfinite(m[k]):
                tags[f"variant_{v}_{k}"] = f"{float(m[k]):.4f}"
        for k in ("speedup", "speedup_vllm"):
            if Speedup.of(m, k) is not None:
                tags.update({f"variant_{v}_{t}": x for t, x in speedup_tags(dict(m), k).items()})
    return tags


@dataclass(frozen=True)
class VariantSink:
    """A metrics sink that sends one variant's training metrics to `inner` as `<variant>/<name>`; picklable when
    `inner` is (it travels to Ray workers)."""

    inner: Any
    variant: str

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.inner.log(step, {f"{self.variant}/{k}": v for k, v in metrics.items()})
