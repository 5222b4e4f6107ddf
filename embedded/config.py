"""Configuration of the embedded default: corpus, tokenizer, target shape, training, traffic, evaluation.

Purpose: one frozen dataclass per concern, grouped in `EmbeddedConfig`, with three presets: `tiny()` (tests, builds
in seconds), `default()` (the 2-core demo) and `gpu()` (a bigger target for one accelerator).
`EmbeddedConfig.from_dict` is strict: an unknown key anywhere, a value of the wrong type or out of its bounds is an
`EmbeddedConfigError` (a `BadInput`) naming the key path and the allowed values.
Not here: building anything (see `embedded.build`); run-time switches that do not change the artifacts
(progress bars, the cache root) are arguments of `build_embedded`, not config.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from eagle.errors import BadInput


class EmbeddedConfigError(BadInput):
    """A value of the embedded build's config that cannot work; the message names its key path."""


@dataclass(frozen=True)
class CorpusConfig:
    """Which standard-library files are read, and how they are cut into samples."""

    max_base_files: int | None = None  # None: every eligible non-test module
    max_file_bytes: int | None = None  # skip larger files (tiny preset only)
    finetune_bytes: int = 3_000_000  # budget of test-suite source for the fine-tune domain
    heldout_fraction: float = 0.06  # of files, per domain; held-out files are never trained on
    chunk_lines: int = 60  # raw file chunks are cut at a blank line after this many lines
    min_body_lines: int = 2
    max_body_lines: int = 40

    def __post_init__(self) -> None:
        if not 0 <= self.heldout_fraction <= 1:  # the split keeps at least one file on each side whatever it is
            raise EmbeddedConfigError(
                f"corpus.heldout_fraction must be in [0, 1] (the share of each domain's files "
                f"held out), got {self.heldout_fraction!r}"
            )


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 8192  # includes the 256 byte tokens and the special tokens
    min_frequency: int = 2


@dataclass(frozen=True)
class TargetConfig:
    """Shape of the Llama target (a `LlamaConfig` is made from it)."""

    num_layers: int = 6
    hidden_size: int = 256
    intermediate_size: int = 768
    num_heads: int = 4
    num_kv_heads: int = 4
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for key in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EmbeddedConfigError(f"target.{key} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class LMTrainConfig:
    """One training run (the base target, or the fine-tune continuing from it)."""

    steps: int = 800
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    raw_fraction: float = 0.5  # share of training tokens from raw file chunks; the rest are chat samples
    device: str = "cpu"
    bf16_autocast: bool = True
    num_threads: int = 0  # torch CPU threads during the build; 0 keeps torch's default (one per core)


TRAFFIC_KINDS = ("chat", "long")


@dataclass(frozen=True)
class TrafficConfig:
    """What the traffic files written per domain hold, and how many (train and held-out never share a source file).

    `kind` "chat" is the mix of `traffic.py` (complete, explain, continue, followup); "long" is `long_traffic.py`:
    whole modules and classes continued from their first `long_prompt_lines` lines, each answer at least
    `long_min_new_tokens` target tokens and cut to fit the target's context. The kind changes the traffic files
    only: the target and its fine-tune train on the "chat" samples either way."""

    train_conversations: int = 2000
    heldout_conversations: int = 300
    system_prompt_fraction: float = 0.3
    continue_answer_lines: int = 12
    kind: str = "chat"  # "chat" | "long"
    long_prompt_lines: int = 24
    long_min_new_tokens: int = 1000

    def __post_init__(self) -> None:
        if self.kind not in TRAFFIC_KINDS:
            raise EmbeddedConfigError(f"traffic.kind: unknown kind {self.kind!r}; choose one of {list(TRAFFIC_KINDS)}")
        for key in ("train_conversations", "heldout_conversations", "long_prompt_lines", "long_min_new_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EmbeddedConfigError(f"traffic.{key} must be an integer >= 1, got {value!r}")
        if not 0 <= self.system_prompt_fraction <= 1:
            raise EmbeddedConfigError(
                f"traffic.system_prompt_fraction must be in [0, 1], got {self.system_prompt_fraction!r}"
            )


@dataclass(frozen=True)
class EvalConfig:
    eval_windows: int = 48  # held-out windows of seq_len tokens per domain
    continuations: int = 3  # greedy continuations reported per domain
    max_new_tokens: int = 48


@dataclass(frozen=True)
class EmbeddedConfig:
    seed: int = 0
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    train: LMTrainConfig = field(default_factory=LMTrainConfig)
    finetune: LMTrainConfig = field(
        default_factory=lambda: LMTrainConfig(steps=80, batch_size=16, lr=1e-3, warmup_steps=8)
    )
    traffic: TrafficConfig = field(default_factory=TrafficConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        t = self.target
        if t.hidden_size % t.num_heads or t.num_heads % t.num_kv_heads:
            raise EmbeddedConfigError(
                f"target: hidden_size ({t.hidden_size}) must be a multiple of num_heads "
                f"({t.num_heads}), and num_heads a multiple of num_kv_heads ({t.num_kv_heads})"
            )
        for key in ("train", "finetune"):
            if getattr(self, key).seq_len > t.max_position_embeddings:
                raise EmbeddedConfigError(
                    f"{key}.seq_len {getattr(self, key).seq_len} is longer than the target's "
                    f"context (target.max_position_embeddings {t.max_position_embeddings})"
                )
        room = self.target.max_position_embeddings - 2  # at least one prompt token and the end-of-turn token
        if self.traffic.kind == "long" and self.traffic.long_min_new_tokens > room:
            raise EmbeddedConfigError(
                f"traffic.long_min_new_tokens {self.traffic.long_min_new_tokens} does not fit the target's context "
                f"(target.max_position_embeddings {self.target.max_position_embeddings}: at most {room} new tokens "
                "after a prompt); no long sample could be kept: lower it or raise the context"
            )

    @classmethod
    def default(cls) -> "EmbeddedConfig":
        """The 2-core CPU demo: 6 layers, hidden 256, vocab 8k; 800 steps x 8 sequences x 256 tokens of base
        training, and a shorter fine-tune.

        The shape is the cheapest of those that reached the same held-out loss at equal training tokens (same data
        and seed); batch 8 for more steps did better than 16 for half as many, at about the same tokens/s on 2 cores.
        Fewer steps (650) save under a minute of the build but leave the fine-tune's head clearly worse in fresh
        demos (bench/README.md, "The suite under 15 min; a shorter target tried for the demo and not taken").
        """
        return cls()

    @classmethod
    def tiny(cls) -> "EmbeddedConfig":
        """For tests: a handful of small modules, vocab 512, hidden 64; builds in a few seconds."""
        return cls(
            corpus=CorpusConfig(
                max_base_files=12, max_file_bytes=12_000, finetune_bytes=40_000, heldout_fraction=0.25, chunk_lines=30
            ),
            tokenizer=TokenizerConfig(vocab_size=512),
            # head_dim 32: vLLM's CPU attention refuses 16 (it takes 32, 64, 80, ...), and engine tests serve this
            target=TargetConfig(
                num_layers=6,
                hidden_size=64,
                intermediate_size=128,
                num_heads=2,
                num_kv_heads=1,
                max_position_embeddings=512,
            ),
            # one thread: a tiny model gains nothing from two, and loses a lot when other work shares the cores
            train=LMTrainConfig(steps=10, batch_size=4, seq_len=64, lr=3e-3, warmup_steps=2, num_threads=1),
            finetune=LMTrainConfig(steps=5, batch_size=4, seq_len=64, lr=3e-3, warmup_steps=1, num_threads=1),
            traffic=TrafficConfig(train_conversations=24, heldout_conversations=8, continue_answer_lines=4),
            eval=EvalConfig(eval_windows=4, continuations=1, max_new_tokens=8),
        )

    @classmethod
    def gpu(cls) -> "EmbeddedConfig":
        """A bigger target for one accelerator: 12 layers, hidden 768, vocab 16k (about 100M parameters).

        The corpus is small (the chat samples repeat code of the raw chunks), so a model this size memorises it:
        training much longer than these steps lowers the train loss and raises the held-out loss. Keep the
        fine-tune under one pass of its domain.
        """
        return cls(
            corpus=CorpusConfig(finetune_bytes=12_000_000),
            tokenizer=TokenizerConfig(vocab_size=16384),
            target=TargetConfig(
                num_layers=12,
                hidden_size=768,
                intermediate_size=2048,
                num_heads=12,
                num_kv_heads=4,
                max_position_embeddings=4096,
            ),
            train=LMTrainConfig(steps=600, batch_size=32, seq_len=512, lr=1e-3, warmup_steps=50, device="cuda"),
            finetune=LMTrainConfig(steps=100, batch_size=32, seq_len=512, lr=2e-4, warmup_steps=10, device="cuda"),
            traffic=TrafficConfig(train_conversations=8000, heldout_conversations=600),
            eval=EvalConfig(eval_windows=128, continuations=4, max_new_tokens=96),
        )

    @classmethod
    def preset(cls, name: str) -> "EmbeddedConfig":
        presets = {"tiny": cls.tiny, "default": cls.default, "gpu": cls.gpu}
        if name not in presets:
            raise EmbeddedConfigError(f"unknown preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EmbeddedConfig":
        """Strict: every key must be a field; nested sections may be partial (missing keys take defaults)."""
        return _strict(cls, d, "EmbeddedConfig")


def _strict(cls: type, d: Any, where: str) -> Any:
    if not isinstance(d, dict):
        raise EmbeddedConfigError(f"{where}: expected a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise EmbeddedConfigError(f"{where}: unknown keys {unknown}; allowed: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in d.items():
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            value = _strict(kind, value, f"{where}.{name}")
        else:
            _check_scalar(kind, value, f"{where}.{name}")
        kwargs[name] = value
    return cls(**kwargs)


def _check_scalar(kind: Any, value: Any, where: str) -> None:
    allowed = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    if value is None and type(None) in allowed:
        return
    if isinstance(value, bool) and bool not in allowed:
        raise EmbeddedConfigError(f"{where}: expected {kind}, got a bool")
    if float in allowed and isinstance(value, int):
        return
    if not any(t is not type(None) and isinstance(value, t) for t in allowed):
        raise EmbeddedConfigError(f"{where}: expected {kind}, got {type(value).__name__} {value!r}")
