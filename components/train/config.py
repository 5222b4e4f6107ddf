"""The training run's config: its length, data, checkpoints and speed-ups (`TrainConfig`) and its workers (`RayConfig`).

Purpose: the `train` section of a pipeline config, each field checked where it is built (a pipeline config file
with a bad value fails at load, naming the key). What the fields do is in components/train/loop.py (the loop) and
components/train/data.py (batches, the teacher cache); ARCHITECTURE.md's knob index lists them.
Not here: the training loop (components/train/loop.py), the TTT loss's and the optimiser's own sections
(eagle/run_config.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from eagle.config import PARALLEL_VARIANTS, VARIANTS
from eagle.config_checks import NOT_IDENTITY, FieldError, at_least, one_of
from eagle.run_config import OptimConfig, TTTConfig

__all__ = ["RayConfig", "TrainConfig"]


@dataclass(frozen=True)
class RayConfig:
    """Where training runs: Ray Train workers (DDP), their resources, and how often Ray restarts a failed one."""

    num_workers: int = 1  # 0: run in the driver process
    use_gpu: bool = False
    cpus_per_worker: int = 1
    max_failures: int = 2  # worker restarts before the run fails (-1: no limit)

    def __post_init__(self) -> None:
        at_least(self, {"num_workers": 0, "cpus_per_worker": 1, "max_failures": -1})
        if not isinstance(self.use_gpu, bool):
            raise FieldError(self, "use_gpu", f"must be true or false, got {self.use_gpu!r}")


@dataclass(frozen=True)
class TrainConfig:
    """The head's training run: its length, data and checkpoints here; the TTT loss (`ttt`), the optimiser
    (`optim`) and the workers (`ray`) in their own sections (`train.ttt.ttt_steps` in a pipeline config)."""

    steps: int = 400
    batch_size: int = 8
    draft_vocab_size: int = 2048
    seed: int = 0
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    warm_start: bool = True  # a fine-tune's head starts from its base target's champion head when there is one
    warm_start_steps: int = 0  # steps of a warm-started run (0: `steps`)
    eval_every: int = 50  # held-out loss and simulated tau every N steps and at the last (0: none, nothing held out)
    holdout_seqs: int = 32  # sequences set aside for it (at most a quarter of the data, at least one)
    select: Literal["best_tau", "last"] = "best_tau"  # the exported weights: best held-out tau, or the last step's
    # which tokens the loss scores: the answers ("assistant"), or every token ("all": the prompts' positions too,
    # where the teacher is the target's distribution as well; more signal from the same features, no extra compute).
    # The held-out figures score the answers either way.
    loss_on: Literal["assistant", "all"] = "assistant"
    # how a fresh head starts: "random", or "target-layer": as the target's own decoder layer that the highest fused
    # state enters, with the fusion passing that state through (eagle/train.py `start_from_target_layer`)
    head_init: Literal["random", "target-layer"] = "random"
    # the head's architecture (eagle/config.py): eagle3, eagle3.1, parallel (P-EAGLE: drafts K tokens in one pass;
    # TTT's steps 1..K-1 become its masked slots, eagle/ttt.py) or eagle3.1-parallel (both); TTT trains each
    variant: str = "eagle3"
    # two or more variants: train each on the same features (in place of `variant`), evaluate each, register the one
    # with the best served speedup (components/registry/variant_choice.py); empty: off
    variants: tuple[str, ...] = ()
    # bf16 autocast (weights and optimiser stay fp32): "gpu" on a GPU only, "auto" also on a CPU with bf16 matrix
    # units (Intel AMX, AVX512-BF16; elsewhere a CPU's bf16 is slower than fp32), "off" never
    autocast: str = "gpu"
    # batches of like-length sequences (components/train/data.py `batches`): less padding, the same epochs
    bucket_by_length: bool = False
    # each sequence's teacher signal (the target's lm_head over its final hidden states) computed once and kept in
    # memory for the next epochs, up to this many MiB (0: recomputed every step); offline features only
    teacher_cache_mib: int = field(default=0, metadata=NOT_IDENTITY)  # the same batches either way
    ttt: TTTConfig = field(default_factory=TTTConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=20))
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        _check_config(self)

    @classmethod
    def tiny(cls) -> "TrainConfig":
        return cls(
            steps=12,
            batch_size=4,
            draft_vocab_size=128,
            checkpoint_every=5,
            log_every=2,
            warm_start_steps=6,
            eval_every=4,
            holdout_seqs=2,
            ttt=TTTConfig(ttt_steps=3),
            optim=OptimConfig(lr=3e-3, warmup_steps=2),
            ray=RayConfig(num_workers=0),
        )


def _check_config(cfg: TrainConfig) -> None:
    """Refuse out-of-range values, naming the field (a pipeline config file then fails at load)."""
    at_least(
        cfg,
        {
            "steps": 1,
            "batch_size": 1,
            "draft_vocab_size": 1,
            "seed": 0,
            "checkpoint_every": 1,
            "keep_checkpoints": 1,
            "log_every": 1,
            "warm_start_steps": 0,
            "eval_every": 0,
            "holdout_seqs": 0,
            "teacher_cache_mib": 0,
        },
    )
    if not isinstance(cfg.bucket_by_length, bool):
        raise FieldError(cfg, "bucket_by_length", f"must be true or false, got {cfg.bucket_by_length!r}")
    one_of(cfg, "select", ("best_tau", "last"))
    one_of(cfg, "loss_on", ("assistant", "all"))
    one_of(cfg, "head_init", ("random", "target-layer"))
    one_of(cfg, "autocast", ("gpu", "auto", "off"))
    one_of(cfg, "variant", VARIANTS)
    _check_variants(cfg)
    for name, kind in (("ttt", TTTConfig), ("optim", OptimConfig), ("ray", RayConfig)):
        if not isinstance(getattr(cfg, name), kind):
            raise FieldError(cfg, name, f"must be a {kind.__name__}, got {getattr(cfg, name)!r}")
    if (par := [v for v in (cfg.variant, *cfg.variants) if v in PARALLEL_VARIANTS]) and cfg.ttt.ttt_steps < 2:
        raise FieldError(
            cfg,
            "variant",
            f"{par[0]!r} needs ttt.ttt_steps >= 2 (its masked slots are TTT's steps "
            f"1..K-1), got ttt_steps {cfg.ttt.ttt_steps}",
        )
    if par and cfg.ttt.shallow_fraction and cfg.ttt.shallow_steps < 2:
        raise FieldError(
            cfg,
            "variant",
            f"{par[0]!r} needs ttt.shallow_steps >= 2 in a shallow phase (its masked slots are TTT's steps "
            f"1..K-1), got shallow_steps {cfg.ttt.shallow_steps}",
        )
    if cfg.select == "best_tau" and cfg.eval_every == 0:
        raise FieldError(
            cfg, "select", "'best_tau' needs the held-out evaluation: set eval_every >= 1, or select 'last'"
        )
    if cfg.eval_every and cfg.holdout_seqs == 0:
        raise FieldError(
            cfg, "holdout_seqs", "must be >= 1 when eval_every >= 1 (eval_every 0 turns the held-out evaluation off)"
        )


def _check_variants(cfg: TrainConfig) -> None:
    """`variants`: empty, or two or more distinct names of eagle.config.VARIANTS."""
    vs = cfg.variants
    bad = (
        "must be a list of variant names"
        if not isinstance(vs, tuple) or not all(isinstance(v, str) for v in vs)
        else f"names an unknown variant; known: {', '.join(VARIANTS)}"
        if set(vs) - set(VARIANTS)
        else "names a variant twice"
        if len(set(vs)) < len(vs)
        else "must list two or more variants (for one, set train.variant), or none"
        if len(vs) == 1
        else ""
    )
    if bad:
        raise FieldError(cfg, "variants", f"{bad}, got {list(vs) if isinstance(vs, tuple) else vs!r}")
