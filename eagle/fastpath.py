"""The speed layer of inference on CPU: oneDNN products over packed weights and a lean decoder for Llama-family targets.

Purpose: the same operations as the plain torch/HF code, in the same order, with less time per call; nothing here
changes what is computed (up to rounding), only how fast.
- `linear(x, layer)`: `F.linear` through oneDNN with the weight packed once and cached, repacked when it changes
  (faster than MKL's fp32 GEMM at the few rows of decoding, and than its GEMV in decoding loops); without autograd
  on CPU only, plain `F.linear` everywhere else. `version(t)` is the in-place update counter the caches key on.
- `packed_linears(model)`: within a `with` block, every plain `nn.Linear` of `model` computes through `linear`
  (the model is patched meanwhile, for every thread).
- `LeanDecoder`: the decoder stack of a Llama/Mistral/Qwen2/Qwen3 target run over its own modules and HF's own
  attention and RoPE functions, without HF's per-call machinery (output capture, mask preparation, keyword
  plumbing): less Python per pass, what counts for small targets on CPU. `LeanDecoder.of(target)` says whether a
  target qualifies; `FAMILIES` lists the families it runs.
How to run: `eagle.draft` computes its products with `linear`; `eagle.speculative` runs the target inside
`packed_linears` and through `LeanDecoder` once it has reproduced HF's forward (`confirm`), on the path that
`eagle.target_path` measured fastest on the machine (`torch_linear` and HF's forward are the other choices).
Not here: what the models compute (`eagle.draft`, `eagle.features`), GPU kernels, torch.compile, CUDA graphs.

Shape legend: B batch, T new positions, L keys visible (past + T), H hidden size, D head dim, h heads.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from eagle.features import decoder_layers

_HOOK_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # targets already warned about their hooks
_PACKED: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, torch.Tensor]]" = weakref.WeakKeyDictionary()
_LEAN_VERDICTS: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()
# oneDNN for every product from this size (rows x weight elements) on. MKL's GEMV/GEMM win in tight loops over hot
# weights, oneDNN in the decoding loops, where the weights come from L3 or memory each step (end to end, plain
# decoding and the speculative cycle run faster through oneDNN than through MKL for the smaller products).
# One kernel per weight also means one copy of it in the caches.
_MIN_PACKED = 1 << 16


def _packable(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == w.dtype
        and w.device.type == "cpu"
        and not torch.is_grad_enabled()
        and (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))
        and torch.backends.mkldnn.is_available()
    )


def version(t: torch.Tensor) -> int:
    """In-place update counter (inference-mode tensors have none: they cannot change outside inference mode)."""
    return 0 if t.is_inference() else t._version


def _packed_weight(layer: nn.Module) -> torch.Tensor:
    """The layer's weight in oneDNN's blocked layout, packed again whenever the weight changes."""
    w = layer.weight
    key = (w.data_ptr(), version(w), w.dtype, tuple(w.shape))
    hit = _PACKED.get(layer)
    if hit is None or hit[0] != key:
        hit = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8))
        _PACKED[layer] = hit
    return hit[1]


def torch_linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """`F.linear(x, layer.weight, layer.bias)` with torch's own kernels (the "torch" kernels of `eagle.target_path`)."""
    return F.linear(x, layer.weight, layer.bias)


def linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """`F.linear(x, layer.weight, layer.bias)`; without autograd on CPU, through oneDNN's packed weight."""
    w = layer.weight
    if x.numel() // max(x.shape[-1], 1) * w.numel() < _MIN_PACKED or not _packable(x, w):
        return F.linear(x, w, layer.bias)
    return torch.ops.mkldnn._linear_pointwise(x, _packed_weight(layer), layer.bias, "none", [None], "")


@contextmanager
def packed_linears(model: nn.Module) -> Iterator[None]:
    """Within the block, every plain `nn.Linear` of `model` computes through `linear` (same results up to rounding)."""
    patched = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in m.__dict__]
    for m in patched:
        m.forward = functools.partial(linear, layer=m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


class LeanDecoder:
    """`model.model(...)` for the Llama family, layer by layer over the model's own modules, with a caller's cache
    (`update(k, v)` per layer) and additive 4-D mask; captures the inputs of `layer_ids` on the way.
    `LeanDecoder.of(target)` is None for anything else (other families, attention other than "sdpa", modules with
    forward hooks) and for a model whose HF forward it failed to reproduce once (`confirm`); `trusted` once it has
    reproduced it."""

    FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
    LINEARS = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
    NORMS = ("input_layernorm", "post_attention_layernorm")

    def __init__(self, target: nn.Module):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.target = weakref.ref(target)
        self.base, self.layers = target.get_decoder(), decoder_layers(target)
        self.attention = sdpa_attention_forward
        self.rope = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.trusted = _LEAN_VERDICTS.get(target, False)
        self.linear = linear  # the products' kernels: `linear` (oneDNN, packed) or `torch_linear`

    def confirm(self, hf: Sequence[torch.Tensor | None], lean: Sequence[torch.Tensor | None]) -> bool:
        """Trust this decoder for its model iff its outputs match HF's forward on the same pass."""
        ok = all(
            (a is None and b is None)
            or (
                a is not None
                and b is not None
                and a.shape == b.shape
                and bool((a.float() - b.float()).abs().max() <= 1e-3 * a.float().abs().max() + 1e-6)
            )
            for a, b in zip(hf, lean)
        )
        if not ok:
            warnings.warn("eagle: the lean decoder does not reproduce this target's HF forward; using HF's")
        _LEAN_VERDICTS[self.target()] = self.trusted = ok
        return ok

    @classmethod
    def of(cls, target: nn.Module) -> "LeanDecoder | None":
        c = target.config
        if any(m._forward_hooks or m._forward_pre_hooks for m in target.modules()):
            if target not in _HOOK_WARNED:  # someone watches or alters the forward: leave it to HF, say so once
                _HOOK_WARNED.add(target)
                warnings.warn(
                    f"eagle: {type(target).__name__} has forward hooks, so decoding runs through HF's "
                    "forward instead of the lean decoder (slower); remove them to get the lean path"
                )
            return None
        if (
            _LEAN_VERDICTS.get(target) is False
            or c.model_type not in cls.FAMILIES
            or getattr(c, "_attn_implementation", None) != "sdpa"
            or getattr(c, "pretraining_tp", 1) != 1
            or getattr(c, "hidden_act", "silu") != "silu"
        ):
            return None
        try:
            layers = decoder_layers(target)
            ok = all(type(layer.get_submodule(n)) is nn.Linear for layer in layers for n in cls.LINEARS) and all(
                type(layer.get_submodule(n)).__name__.endswith("RMSNorm") for layer in layers for n in cls.NORMS
            )
        except AttributeError:
            return None
        return cls(target) if ok else None

    def __call__(
        self,
        ids_BT: torch.Tensor,
        pos_BT: torch.Tensor,
        mask_B1TL: torch.Tensor,
        cache_layers: Sequence[Any],
        layer_ids: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final normed hidden [B, T, H], inputs of `layer_ids` concatenated [B, T, 3H] or None)."""
        h_BTH = self.base.embed_tokens(ids_BT)
        cos_sin = self.base.rotary_emb(h_BTH, pos_BT)
        seen: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in layer_ids:
                seen[i] = h_BTH
            h_BTH = self._layer(layer, h_BTH, cos_sin, mask_B1TL, cache_layers[i])
        aux_BT3H = torch.cat([seen[i] for i in layer_ids], dim=-1) if layer_ids else None
        return _norm(self.base.norm, h_BTH), aux_BT3H

    def _layer(
        self, layer: nn.Module, h_BTH: torch.Tensor, cos_sin, mask_B1TL: torch.Tensor, cache_layer: Any
    ) -> torch.Tensor:
        a, m = layer.self_attn, layer.mlp
        x_BTH = _norm(layer.input_layernorm, h_BTH)
        heads = (*x_BTH.shape[:-1], -1, a.head_dim)
        lin = self.linear
        q_BThD, k_BThD, v_BThD = (lin(x_BTH, p).view(heads) for p in (a.q_proj, a.k_proj, a.v_proj))
        if hasattr(a, "q_norm"):  # Qwen3
            q_BThD, k_BThD = a.q_norm(q_BThD), a.k_norm(k_BThD)
        q_BhTD, k_BhTD = self.rope(q_BThD.transpose(1, 2), k_BThD.transpose(1, 2), *cos_sin)
        k_BhLD, v_BhLD = cache_layer.update(k_BhTD, v_BThD.transpose(1, 2))
        out_BThD, _ = self.attention(a, q_BhTD, k_BhLD, v_BhLD, mask_B1TL, dropout=0.0, scaling=a.scaling)
        h_BTH = h_BTH + lin(out_BThD.reshape(*x_BTH.shape[:-1], -1).contiguous(), a.o_proj)
        y_BTH = _norm(layer.post_attention_layernorm, h_BTH)
        return h_BTH + lin(F.silu(lin(y_BTH, m.gate_proj)) * lin(y_BTH, m.up_proj), m.down_proj)


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm module; in fp32 as one kernel (the same bits as its upcast-normalise-scale formula)."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32 and hasattr(norm, "variance_epsilon"):
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm(x)
