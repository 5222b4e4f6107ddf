"""Feature capture from a Hugging Face causal LM: the fused low/mid/high hidden states and the teacher signal.

Purpose: run a target (Llama, Qwen2/Qwen3, Mistral families: anything with `model.layers` and an output
embedding) and keep only what an EAGLE-3 head needs: the hidden states *entering* three decoder layers (by
default 2, N//2, N-3, i.e. HF `hidden_states[2]`, `[N//2]`, `[N-3]`) and the final normed hidden state, from
which the teacher distribution is computed in chunks (`teacher_targets`). Forward pre-hooks capture the three
layer inputs as they pass, so every other layer's hidden state is freed as usual.
CPU kernels for inference: `linear` sends products through oneDNN with a weight packed once and cached (faster than
MKL's fp32 GEMM at the few rows of decoding, and than its GEMV in decoding loops); `packed_linears(model)`
routes a whole model's `nn.Linear` layers through it for the duration of a `with` block (the model is patched
meanwhile, for every thread). `LeanDecoder` runs the
decoder stack of a Llama/Mistral/Qwen2/Qwen3 model over its own modules and HF's own attention and RoPE functions,
without HF's per-call machinery (output capture, mask preparation, keyword plumbing): the same operations in the same
order, with less Python per pass (what counts for small targets on CPU).
Not here: tokenisation, chat templates, storage of shards.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

_HOOK_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # targets already warned about their hooks
_PACKED: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, torch.Tensor]]" = weakref.WeakKeyDictionary()
# oneDNN for every product from this size (rows x weight elements) on. MKL's GEMV/GEMM win in tight loops over hot
# weights, oneDNN in the decoding loops, where the weights come from L3 or memory each step (end to end, plain
# decoding and the speculative cycle run faster through oneDNN than through MKL for the smaller products).
# One kernel per weight also means one copy of it in the caches.
_MIN_PACKED = 1 << 16


def _packable(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == w.dtype and w.device.type == "cpu" and not torch.is_grad_enabled()
            and (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))
            and torch.backends.mkldnn.is_available())


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


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The target's list of decoder layers; a clear error when the model is not a decoder-only LM."""
    base = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or target.get_output_embeddings() is None:
        raise ValueError(f"{type(target).__name__} is not a decoder-only causal LM with `model.layers` and an "
                         "output embedding; EAGLE-3 heads need one (Llama, Qwen2/3, Mistral families)")
    return layers


@contextmanager
def capture_layer_inputs(target: nn.Module, layer_ids: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Within the context, every forward of `target` stores the input hidden state of each listed layer."""
    layers = decoder_layers(target)
    store: dict[int, torch.Tensor] = {}
    handles = []
    for i in layer_ids:
        if not 0 <= i < len(layers):
            raise ValueError(f"layer id {i} out of range for a target with {len(layers)} layers")

        def hook(_mod, args, kwargs, i=i):
            store[i] = args[0] if args else kwargs["hidden_states"]

        handles.append(layers[i].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


@dataclass
class TargetStep:
    """One target forward: fused-input features, final normed hidden state and the KV cache after it."""

    aux_BT3H: torch.Tensor
    last_hidden_BTH: torch.Tensor
    past_key_values: Any


def target_forward(target: nn.Module, input_ids_BT: torch.Tensor, layer_ids: Sequence[int], *,
                   past_key_values: Any = None, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, use_cache: bool = False) -> TargetStep:
    """Run the target's decoder (no lm_head) and capture the three layer inputs."""
    base = target.get_decoder()
    cache_name = _cache_kwarg(base)  # transformers >= 5.2x names it `cache` (the old name is deprecated there)
    kwargs: dict[str, Any] = {} if past_key_values is None else {cache_name: past_key_values}
    with capture_layer_inputs(target, layer_ids) as store:
        out = base(input_ids=input_ids_BT, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=use_cache, **kwargs)
    aux = torch.cat([store[i] for i in layer_ids], dim=-1)
    return TargetStep(aux, out.last_hidden_state, out.get(cache_name, None))


def _cache_kwarg(base: nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@dataclass
class Teacher:
    """The target's next-token signal at every position, restricted to the draft vocabulary.

    probs_BTVd: softmax of the target's logits over the draft-vocab ids (renormalised there);
    in_vocab_BT: whether the target's full-vocabulary argmax lies in the draft vocabulary;
    argmax_BT: the target's full-vocabulary argmax (target ids).
    """

    probs_BTVd: torch.Tensor
    in_vocab_BT: torch.Tensor
    argmax_BT: torch.Tensor


@torch.no_grad()
def teacher_targets(last_hidden_BTH: torch.Tensor, lm_head_VH: torch.Tensor, draft_ids: torch.Tensor,
                    chunk: int = 1024) -> Teacher:
    """Teacher signal from the target's final hidden state; full-vocab logits exist for `chunk` rows at a time."""
    B, T, H = last_hidden_BTH.shape
    flat = last_hidden_BTH.reshape(B * T, H)
    t2d = torch.zeros(lm_head_VH.shape[0], dtype=torch.bool, device=flat.device)
    t2d[draft_ids] = True
    probs, in_vocab, argmax = [], [], []
    w = lm_head_VH.to(flat.device)
    for s in range(0, B * T, chunk):
        logits = (flat[s:s + chunk].to(w.dtype) @ w.T).float()
        top = logits.argmax(-1)
        argmax.append(top)
        in_vocab.append(t2d[top])
        probs.append(torch.softmax(logits[:, draft_ids], dim=-1))
    return Teacher(torch.cat(probs).view(B, T, -1), torch.cat(in_vocab).view(B, T), torch.cat(argmax).view(B, T))


_LEAN_VERDICTS: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


class LeanDecoder:
    """`model.model(...)` for the Llama family, layer by layer over the model's own modules, with a caller's cache
    (`update(k, v)` per layer) and additive 4-D mask; captures the inputs of `layer_ids` on the way.
    `LeanDecoder.of(target)` is None for anything else (other families, attention other than "sdpa", modules with
    forward hooks) and for a model whose HF forward it failed to reproduce once (`confirm`); `trusted` once it has
    reproduced it."""

    FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

    def __init__(self, target: nn.Module):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.target = weakref.ref(target)
        self.base, self.layers = target.get_decoder(), decoder_layers(target)
        self.attention = sdpa_attention_forward
        self.rope = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.trusted = _LEAN_VERDICTS.get(target, False)

    def confirm(self, hf: Sequence[torch.Tensor | None], lean: Sequence[torch.Tensor | None]) -> bool:
        """Trust this decoder for its model iff its outputs match HF's forward on the same pass."""
        ok = all((a is None and b is None) or (a is not None and b is not None and a.shape == b.shape and bool(
            (a.float() - b.float()).abs().max() <= 1e-3 * a.float().abs().max() + 1e-6)) for a, b in zip(hf, lean))
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
                warnings.warn(f"eagle: {type(target).__name__} has forward hooks, so decoding runs through HF's "
                              "forward instead of the lean decoder (slower); remove them to get the lean path")
            return None
        if _LEAN_VERDICTS.get(target) is False or c.model_type not in cls.FAMILIES or getattr(c, "_attn_implementation", None) != "sdpa" \
                or getattr(c, "pretraining_tp", 1) != 1 or getattr(c, "hidden_act", "silu") != "silu":
            return None
        linears = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.up_proj", "mlp.down_proj")
        norms = ("input_layernorm", "post_attention_layernorm")
        try:
            ok = all(type(layer.get_submodule(n)) is nn.Linear for layer in decoder_layers(target) for n in linears) \
                and all(type(layer.get_submodule(n)).__name__.endswith("RMSNorm")
                        for layer in decoder_layers(target) for n in norms)
        except AttributeError:
            return None
        return cls(target) if ok else None

    def __call__(self, ids_BT: torch.Tensor, pos_BT: torch.Tensor, mask: torch.Tensor, cache_layers: Sequence[Any],
                 layer_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final normed hidden [B, T, H], inputs of `layer_ids` concatenated [B, T, 3H] or None)."""
        h = self.base.embed_tokens(ids_BT)
        cos_sin = self.base.rotary_emb(h, pos_BT)
        seen: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in layer_ids:
                seen[i] = h
            h = self._layer(layer, h, cos_sin, mask, cache_layers[i])
        return _norm(self.base.norm, h), (torch.cat([seen[i] for i in layer_ids], dim=-1) if layer_ids else None)

    def _layer(self, layer: nn.Module, h: torch.Tensor, cos_sin, mask: torch.Tensor, cache_layer: Any) -> torch.Tensor:
        a, m = layer.self_attn, layer.mlp
        x = _norm(layer.input_layernorm, h)
        shape = (*x.shape[:-1], -1, a.head_dim)
        q, k, v = (linear(x, p).view(shape) for p in (a.q_proj, a.k_proj, a.v_proj))
        if hasattr(a, "q_norm"):  # Qwen3
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), *cos_sin)
        k, v = cache_layer.update(k, v.transpose(1, 2))
        out, _ = self.attention(a, q, k, v, mask, dropout=0.0, scaling=a.scaling)
        h = h + linear(out.reshape(*x.shape[:-1], -1).contiguous(), a.o_proj)
        y = _norm(layer.post_attention_layernorm, h)
        return h + linear(F.silu(linear(y, m.gate_proj)) * linear(y, m.up_proj), m.down_proj)


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm module; in fp32 as one kernel (the same bits as its upcast-normalise-scale formula)."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32 and hasattr(norm, "variance_epsilon"):
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm(x)
