"""Configuration of an EAGLE-3 draft head.

Purpose: one frozen dataclass, `DraftConfig`, that fixes every shape of a head and the target it belongs to.
Build it from a Hugging Face target config with `DraftConfig.from_target(...)`, or `DraftConfig.tiny()` in tests.
Not here: training hyper-parameters (see `eagle.ttt.TTTConfig`) or anything about orchestration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Layers whose *input* hidden states are fused: 2, N//2, N-3 (EAGLE-3's low, middle, high)."""
    if num_layers < 4:
        raise ValueError(f"an EAGLE-3 head needs a target with at least 4 decoder layers, got {num_layers}")
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_num_layers: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    aux_layer_ids: tuple[int, int, int] = field(default=())  # type: ignore[assignment]
    target_model_type: str = "llama"

    def __post_init__(self) -> None:
        if not self.aux_layer_ids:
            object.__setattr__(self, "aux_layer_ids", default_aux_layer_ids(self.target_num_layers))
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")
        if self.hidden_act != "silu":
            raise ValueError(f"only silu MLPs are supported, got {self.hidden_act!r}")
        if self.rope_scaling and self.rope_scaling.get("rope_type", "default") not in ("default", "llama3", "linear"):
            raise ValueError(f"unsupported rope scaling {self.rope_scaling!r}")

    @classmethod
    def tiny(cls, vocab_size: int = 256, draft_vocab_size: int = 128) -> "DraftConfig":
        return cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=vocab_size, draft_vocab_size=draft_vocab_size,
                   target_num_layers=6, max_position_embeddings=512)

    @classmethod
    def from_target(cls, target_config: Any, draft_vocab_size: int) -> "DraftConfig":
        """Shapes from a HF `PretrainedConfig` of the Llama, Qwen2/3 or Mistral families."""
        c = target_config
        for name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size"):
            if getattr(c, name, None) is None:
                raise ValueError(f"target config ({type(c).__name__}) has no {name}: not a decoder-only causal LM")
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        rope = _rope_of(c)
        return cls(hidden_size=c.hidden_size, num_attention_heads=heads,
                   num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                   draft_vocab_size=min(draft_vocab_size, c.vocab_size), target_num_layers=c.num_hidden_layers,
                   rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)), rope_theta=rope[0], rope_scaling=rope[1],
                   max_position_embeddings=int(getattr(c, "max_position_embeddings", 2048)),
                   hidden_act=getattr(c, "hidden_act", "silu"), target_model_type=getattr(c, "model_type", "llama"))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DraftConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown DraftConfig keys: {sorted(unknown)}")
        return cls(**{**d, "aux_layer_ids": tuple(d.get("aux_layer_ids", ()))})


def _rope_of(c: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the transformers-5 `rope_parameters` or the older `rope_theta`/`rope_scaling`."""
    params = getattr(c, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0) or 10000.0))
        kind = params.get("rope_type", "default")
        scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
        return theta, scaling
    scaling = getattr(c, "rope_scaling", None) or None
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(getattr(c, "rope_theta", 10000.0) or 10000.0), scaling
