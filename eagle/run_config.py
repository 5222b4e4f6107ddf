"""How a head is trained and how it drafts: the configs of the TTT loss, the optimiser and generation.

Purpose: `TTTConfig` (eagle/ttt.py's loss), `OptimConfig` (eagle/train.py's AdamW and schedule) and `SpecConfig`
(eagle/speculative.py's drafting and verification), frozen and checked field by field when built
(eagle/config_checks.py). They import no torch, so a pipeline config that holds them loads without it; the
modules that use them re-export them.
Not here: the head's shapes (eagle/config.py `DraftConfig`), the pipeline's stage configs (components/).
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle.config_checks import FieldError, at_least, finite, one_of

# the ways the target's passes can run (decoder-kernels; see eagle/target_path.py), and "auto" for the fastest
TARGET_PATHS = ("lean-packed", "lean-torch", "hf-packed", "hf-torch")


@dataclass(frozen=True)
class TTTConfig:
    """The TTT loss (eagle/ttt.py): K unrolled steps weighted gamma^k, and the chunk sizes that bound its memory.

    `shallow_steps` / `shallow_fraction`: the first `shallow_fraction` of a run's training steps unroll only
    `shallow_steps` steps (`depth_at`), the rest `ttt_steps`. A step's cost grows with its depth (each unrolled step
    runs the layer, the draft `lm_head` and the loss again), so a shallow step is several times cheaper and the head
    sees several times the tokens early on; the deep phase then teaches it to draft from its own outputs. Held-out
    figures are always taken at `ttt_steps`.
    """

    ttt_steps: int = 7
    gamma: float = 0.8
    attn_chunk: int = 512  # query rows per attention chunk
    loss_chunk: int = 2048  # rows per lm_head/loss chunk
    shallow_steps: int = 1  # the depth of the shallow phase (used only when shallow_fraction > 0)
    shallow_fraction: float = 0.0  # the share of a run's steps, from its start, trained at shallow_steps

    def __post_init__(self) -> None:
        at_least(self, {"ttt_steps": 1, "attn_chunk": 1, "loss_chunk": 1, "shallow_steps": 1})
        finite(self, "gamma", lambda g: 0 < g <= 1, "in (0, 1]")
        finite(self, "shallow_fraction", lambda f: 0 <= f < 1, "in [0, 1)")
        if self.shallow_fraction and self.shallow_steps >= self.ttt_steps:
            raise FieldError(
                self,
                "shallow_steps",
                f"must be below ttt_steps ({self.ttt_steps}) for a shallow phase, got {self.shallow_steps}",
            )

    def depth_at(self, step: int, total_steps: int) -> int:
        """The unrolled depth of training step `step` (0-based) of a run of `total_steps`."""
        return self.shallow_steps if step < round(self.shallow_fraction * total_steps) else self.ttt_steps

    @classmethod
    def tiny(cls) -> "TTTConfig":
        return cls(ttt_steps=3, attn_chunk=8, loss_chunk=16)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and its schedule (`make_optimizer`), and the gradient-norm clip the caller passes to `train_step`.
    The schedule's length is the run's step count, which the caller passes to `make_optimizer`."""

    lr: float = 3e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio at the last step
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5  # max gradient norm

    def __post_init__(self) -> None:
        finite(self, "lr", lambda x: x >= 0, ">= 0")
        at_least(self, {"warmup_steps": 0})
        finite(self, "min_lr_ratio", lambda x: 0 <= x <= 1, "in [0, 1]")
        finite(self, "weight_decay", lambda x: x >= 0, ">= 0")
        finite(self, "grad_clip", lambda x: x > 0, "> 0")
        b = self.betas
        if not (
            isinstance(b, (tuple, list))
            and len(b) == 2
            and all(not isinstance(x, bool) and isinstance(x, (int, float)) and 0 <= x < 1 for x in b)
        ):
            raise FieldError(self, "betas", f"must be two numbers in [0, 1), got {b!r}")
        object.__setattr__(self, "betas", tuple(b))

    @classmethod
    def tiny(cls) -> "OptimConfig":
        return cls(lr=3e-3, warmup_steps=2)


@dataclass(frozen=True)
class SpecConfig:
    """How to generate (eagle/speculative.py). `topk` and `budget` shape trees only; `budget` counts drafted nodes,
    the root excluded. Chains sample their drafts from the head (standard rule). Greedy trees draft the top-k
    (EAGLE-2); sampling trees draw `topk` children per expanded node from the head and verify them by recursive
    rejection, keeping whole sibling groups (`budget // topk` of them; see `eagle.tree.draft_tree_sampled`)."""

    method: str = "chain"  # "chain" | "tree"
    depth: int = 5  # drafted tokens per step (a chain's length, a tree's depth)
    topk: int = 4
    budget: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    max_new_tokens: int = 64
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int = 0
    # chains stop drafting early when the head's top probability for the next draft is below this in every row
    # (its drafts there are mostly rejected; skipping them saves head steps). 0: always draft `depth` tokens.
    min_draft_prob: float = 0.0
    # how the target's passes run (`eagle.target_path`): "auto" times the paths once per target and process and
    # takes the fastest (or the one EAGLE_TARGET_PATH pins); "lean-packed" | "lean-torch" | "hf-packed" | "hf-torch"
    path: str = "auto"

    def __post_init__(self) -> None:
        one_of(self, "method", ("chain", "tree"))
        one_of(self, "path", ("auto",) + TARGET_PATHS)
        at_least(self, {"depth": 1, "topk": 1, "budget": 1, "max_new_tokens": 1, "pad_token_id": -1})
        most = self.topk + (self.depth - 1) * self.topk**2
        if self.method == "tree" and self.budget > most:
            raise FieldError(
                self, "budget", f"must be in 1..topk + (depth-1)*topk^2 = {most} for a tree, got {self.budget}"
            )
        finite(self, "temperature", lambda x: x >= 0, ">= 0")
        finite(self, "top_p", lambda x: 0 < x <= 1, "in (0, 1]")
        finite(self, "min_draft_prob", lambda x: 0 <= x < 1, "in [0, 1)")
        eos = self.eos_token_id
        ids = eos if isinstance(eos, (tuple, list)) else () if eos is None else (eos,)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise FieldError(self, "eos_token_id", f"must be a token id, a list of them or null, got {eos!r}")
        if isinstance(eos, list):
            object.__setattr__(self, "eos_token_id", tuple(eos))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def verify_width(self) -> int:
        """Tokens per verification pass, the root included."""
        return 1 + (self.depth if self.method == "chain" else self.budget)
