"""Configuration of an EAGLE-3 draft head.

Purpose: one frozen dataclass, `DraftConfig`, that fixes every shape of a head and the target it belongs to:
the target's shapes and depth, the draft vocabulary size, the fused layer ids `aux_layer_ids` (three distinct
ascending ids in 1..N-1; id k is the hidden state entering target decoder layer k) and the target's dtype
`target_dtype` (the dtype engines run the head in, hence the dtype it is exported in), and the head's `variant`:
- "eagle3": EAGLE-3 as published: `fc` reads the raw concat of the three fused states; the next drafting step (and
  the next TTT step) reads the layer's un-normalised output; `lm_head` reads `norm(output)`.
- "eagle3.1": EAGLE-3.1 (arXiv 2605.09992, against attention drift on long outputs): two changes, both loaded by
  vLLM 0.32 from the head's config.json (model_executor/models/llama_eagle3.py):
  `fc_norm: true`, one RMSNorm per fused state before `fc` (weights `fc_norm.{0,1,2}.weight`; vLLM's
  `combine_hidden_states` chunks the 3H concat and norms each chunk), and `norm_output: true`, the next step reads
  the post-norm state `norm(output)` (vLLM's `LlamaModel.forward` returns it as the hidden state it carries).
  `lm_head` is unchanged (it reads `norm(output)` either way).
- "parallel": P-EAGLE parallel drafting on the eagle3 layout: all K drafts of a step come from one head pass in
  which K-1 masked slots follow the last committed entry. vLLM 0.32 serves it with `parallel_drafting: true` in
  the speculative config (v1/spec_decode/llm_base_proposer.py); each masked slot reads the token `mask_token_id`
  (the first of the keys vLLM looks up in the head's config.json) and, as its hidden state, `fc(mask_hidden)`,
  where `mask_hidden` [1, 3H] is a learned fused feature (tensor `mask_hidden`; vLLM's buffer of shape
  [1, fc_input_size], projected once by `combine_hidden_states`). `mask_token_id` defaults to 0 here;
  `from_target` takes the target's pad token (else its first EOS, else 0).
- "eagle3.1-parallel": both at once, as vLLM 0.32 composes them (config.json `fc_norm` and `norm_output` true,
  `mask_token_id`, tensors `fc_norm.{0,1,2}` and `mask_hidden`; served with `parallel_drafting: true`). In vLLM's
  forward (paths under vllm/):
  - the masked slots' hidden state is fc(fc_norm(mask_hidden)): at load the proposer projects the flat
    `mask_hidden` [3H] through `combine_hidden_states` (v1/spec_decode/llm_base_proposer.py:1401-1412), which norms
    each of its three H-chunks with its own `fc_norm` before `fc` (model_executor/models/llama_eagle3.py:397-417),
    the same path as the target's fused features of the committed entries (llm_base_proposer.py:550); ours:
    `Eagle3Draft.masked_slots` = `fuse(mask_hidden)`;
  - `norm_output` changes nothing served: the layer returns (norm(output), aux_output) with aux_output =
    norm(output) under `norm_output` (llama_eagle3.py:283-288), but only the first goes anywhere with parallel
    drafting: it feeds `compute_logits` for all K drafts (llm_base_proposer.py:605-615; 628-636 return after that
    one pass), and aux_output is read only by the autoregressive loop that parallel drafting skips; the next
    round's committed entries read the target's features again. Ours alike: TTT's masked steps read nothing of
    step k-1 (eagle/ttt.py), drafting takes all K picks from the one pass (eagle/drafters.py `commit_head`).
  The name takes "-", not "+": variant names go into MLflow metric and tag keys (`<variant>/loss`,
  `variant_<v>_tau`), which allow only letters, digits, "_", "-", ".", " ", ":" and "/".
vLLM's third key, `norm_before_fc` (one RMSNorm over the 3H concat, weight `input_norm.weight`), belongs to
no variant and is exported as false.
Build it from a Hugging Face target config with `DraftConfig.from_target(...)`, or `DraftConfig.tiny()` in tests.
`default_aux_layer_ids(N)` is the rule for a target of N layers; `check_aux_layer_ids(ids, N)` validates others.
Not here: training hyper-parameters (see `eagle.ttt.TTTConfig`) or anything about orchestration.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

TARGET_DTYPES = ("float32", "bfloat16", "float16")
VARIANTS = ("eagle3", "eagle3.1", "parallel", "eagle3.1-parallel")  # see the module doc; simplest first
NORMED_VARIANTS = ("eagle3.1", "eagle3.1-parallel")  # EAGLE-3.1's `fc_norm` and `norm_output`
PARALLEL_VARIANTS = ("parallel", "eagle3.1-parallel")  # parallel drafting: `mask_hidden`, `mask_token_id`


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Layers whose *input* hidden states are fused (EAGLE-3's low, middle, high) for a target of N layers.

    Rule: (2, N//2, N-3) when those are strictly ascending (N >= 7), else (1, N//2, N-1), so that
    small targets get three distinct ids too: N=4 -> (1, 2, 3), 5 -> (1, 2, 4), 6 -> (1, 3, 5), 7 -> (2, 3, 4),
    8 -> (2, 4, 5). Engines fuse exactly three distinct states; repeated ids make vLLM capture fewer.
    """
    if num_layers < 4:
        raise ValueError(f"an EAGLE-3 head needs a target with at least 4 decoder layers, got {num_layers}")
    ids = (2, num_layers // 2, num_layers - 3)
    return ids if ids[0] < ids[1] < ids[2] else (1, num_layers // 2, num_layers - 1)


def check_aux_layer_ids(ids: Any, num_layers: int) -> tuple[int, int, int]:
    """`ids` as a tuple, if they are three distinct ascending ints within 1..num_layers-1; else a ValueError."""
    ids = tuple(ids)
    ok = len(ids) == 3 and not any(isinstance(i, bool) for i in ids)
    try:
        ids = tuple(operator.index(i) for i in ids)
    except TypeError:
        ok = False
    if not (ok and 1 <= ids[0] < ids[1] < ids[2] <= num_layers - 1):
        raise ValueError(
            f"aux_layer_ids {list(ids)} are not three distinct ascending layer ids within "
            f"1..{num_layers - 1} (the target has {num_layers} decoder layers)"
        )
    return ids  # type: ignore[return-value]


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
    target_dtype: str = "float32"
    variant: str = "eagle3"
    mask_token_id: int | None = None  # the token of parallel drafting's masked slots (PARALLEL_VARIANTS only)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.parallel and self.mask_token_id is None:
            object.__setattr__(self, "mask_token_id", 0)
        m = self.mask_token_id
        if m is not None and not self.parallel:
            raise ValueError(f"mask_token_id is for the parallel variants only, got {m} for {self.variant!r}")
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < self.vocab_size):
            raise ValueError(f"mask_token_id must be a token id in 0..{self.vocab_size - 1}, got {m!r}")
        if not self.aux_layer_ids:
            object.__setattr__(self, "aux_layer_ids", default_aux_layer_ids(self.target_num_layers))
        object.__setattr__(self, "aux_layer_ids", check_aux_layer_ids(self.aux_layer_ids, self.target_num_layers))
        if self.target_dtype not in TARGET_DTYPES:
            raise ValueError(f"target_dtype must be one of {TARGET_DTYPES}, got {self.target_dtype!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")
        if self.hidden_act != "silu":
            raise ValueError(f"only silu MLPs are supported, got {self.hidden_act!r}")
        if self.rope_scaling and self.rope_scaling.get("rope_type", "default") not in ("default", "llama3", "linear"):
            raise ValueError(f"unsupported rope scaling {self.rope_scaling!r}")

    @property
    def fc_norm(self) -> bool:
        """One RMSNorm per fused state before `fc` (vLLM's `fc_norm`)."""
        return self.variant in NORMED_VARIANTS

    @property
    def norm_output(self) -> bool:
        """The next drafting step reads `norm(output)`, not the raw output (vLLM's `norm_output`)."""
        return self.variant in NORMED_VARIANTS

    @property
    def parallel(self) -> bool:
        """All K drafts of a step in one pass, masked slots after the last committed entry (vLLM's
        `parallel_drafting`); the head has a learned `mask_hidden`."""
        return self.variant in PARALLEL_VARIANTS

    @classmethod
    def tiny(cls, vocab_size: int = 256, draft_vocab_size: int = 128) -> "DraftConfig":
        return cls(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_num_layers=6,
            max_position_embeddings=512,
        )

    @classmethod
    def from_target(
        cls, target_config: Any, draft_vocab_size: int, aux_layer_ids: Sequence[int] = (), variant: str = "eagle3"
    ) -> "DraftConfig":
        """Shapes and dtype from a HF `PretrainedConfig` of the Llama, Qwen2/3 or Mistral families; fused layer
        ids `aux_layer_ids` (empty: `default_aux_layer_ids` of the target's depth); the head's `variant`."""
        c = target_config
        for name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size"):
            if getattr(c, name, None) is None:
                raise ValueError(f"target config ({type(c).__name__}) has no {name}: not a decoder-only causal LM")
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        rope = _rope_of(c)
        mask = default_mask_token_id(c) if variant in PARALLEL_VARIANTS else None
        return cls(
            hidden_size=c.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size,
            draft_vocab_size=min(draft_vocab_size, c.vocab_size),
            target_num_layers=c.num_hidden_layers,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=rope[0],
            rope_scaling=rope[1],
            max_position_embeddings=int(getattr(c, "max_position_embeddings", 2048)),
            hidden_act=getattr(c, "hidden_act", "silu"),
            aux_layer_ids=tuple(aux_layer_ids),
            target_model_type=getattr(c, "model_type", "llama"),
            target_dtype=dtype_name(c),
            variant=variant,
            mask_token_id=mask,
        )

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


def default_mask_token_id(c: Any) -> int:
    """The masked slots' token for a target config: its pad token, else its (first) EOS, else 0."""
    for name in ("pad_token_id", "eos_token_id"):
        v = getattr(c, name, None)
        v = v[0] if isinstance(v, (list, tuple)) and v else v
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < c.vocab_size:
            return v
    return 0


def dtype_name(target_config: Any) -> str:
    """The dtype a HF config declares (`dtype`, or the older `torch_dtype`), as a name like "bfloat16"."""
    d = getattr(target_config, "dtype", None) or vars(target_config).get("torch_dtype")
    return str(d).removeprefix("torch.") if d else "float32"


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
