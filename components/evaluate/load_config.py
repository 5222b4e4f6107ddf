"""The load sweep's settings (`evaluate.load`), apart from the sweep so that the evaluation's config can hold them
without importing the sweep (components/evaluate/load_sweep.py imports the evaluation).

Purpose: `LoadConfig` (concurrency levels, K values, requests per level, rounds of the interleaved cells, the margin a
K must beat plain by) and
`MAX_BATCH`, the batch size the last range of a schedule reaches. Run: imported by components/evaluate/stage.py.
Not here: the sweep itself (components/evaluate/load_sweep.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle.config_checks import FieldError, at_least

MAX_BATCH = 1024  # the last range of a schedule reaches this batch size (vLLM caps it at its max_num_seqs)


MAX_K = 16  # the heads here draft at most this many tokens


def check_ascending(owner: object, name: str, values: tuple[int, ...], top: int | None = None) -> None:
    """`values` whole numbers >= 1, ascending without repeats, each <= `top` when given (K: `MAX_K`)."""
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
        raise FieldError(owner, name, f"must be whole numbers >= 1, got {list(values)}")
    if list(values) != sorted(set(values)):
        raise FieldError(owner, name, f"must be ascending without repeats, got {list(values)}")
    if top is not None and any(v > top for v in values):
        raise FieldError(owner, name, f"must be <= {top} (the heads here draft at most {top}), got {list(values)}")


@dataclass(frozen=True)
class LoadConfig:
    """The sweep (`evaluate.load` in a pipeline config): empty `concurrency` means no sweep."""

    concurrency: tuple[int, ...] = ()
    k_values: tuple[int, ...] = (3, 5)
    requests: int = 16  # requests per level: the same held-out prompts at every level (>= the top concurrency)
    output_len: int = 0  # new tokens per request (0: the evaluation's max_new_tokens)
    margin: float = 0.03  # a K must beat plain's output tokens/s by more than this share to be scheduled
    repeats: int = 3  # rounds of every cell (its figure the median: 3 is the fewest that outvote one outlier)
    verify_schedule: bool = True

    def __post_init__(self) -> None:
        at_least(self, {"requests": 1, "output_len": 0, "repeats": 1})
        check_ascending(self, "concurrency", self.concurrency)
        check_ascending(self, "k_values", self.k_values, MAX_K)
        if self.concurrency and not self.k_values:
            raise FieldError(self, "k_values", "must name at least one K when concurrency levels are given")
        if self.concurrency and self.requests < self.concurrency[-1]:
            raise FieldError(
                self,
                "requests",
                f"must be >= the top concurrency {self.concurrency[-1]} (else that "
                f"level never runs full), got {self.requests}",
            )
        if not 0.0 <= self.margin < 1.0:
            raise FieldError(self, "margin", f"must be in [0, 1), got {self.margin}")

    @property
    def enabled(self) -> bool:
        return bool(self.concurrency)


@dataclass(frozen=True)
class DepthPickConfig:
    """The K the head drafts at batch size 1, chosen by measurement (`evaluate.pick` in a pipeline config; empty
    `choices`: no pick, `evaluate.spec.depth` as set). vLLM's per-draft-step cost is a machine's, not the head's: on
    2 Zen 5 cores one extra draft step cost ~0.14 of a target step (a head at K 5 ran at 0.96x plain, the same head at
    K 2 at 1.21x), on Zen 4 a few hundredths, where K 5 paid most (bench/README.md "K by measurement"). Where vLLM
    evaluates the head (components/evaluate/depth_pick.py), plain and the head at each K of `choices` are served at
    once, one request at a time over the first `requests` held-out prompts, in `repeats` alternating rounds; the K
    with the most output tokens/s (median over the rounds; the smaller K on a tie) becomes `evaluate.spec.depth` for
    everything measured after it (ours, vLLM's evaluation, the load sweep) and for what is registered and served."""

    choices: tuple[int, ...] = ()
    requests: int = 4
    repeats: int = 2

    def __post_init__(self) -> None:
        at_least(self, {"requests": 1, "repeats": 1})
        check_ascending(self, "choices", self.choices, MAX_K)
        if len(self.choices) == 1:
            raise FieldError(
                self, "choices", f"must name at least two K to choose from (or none), got {list(self.choices)}"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.choices)
