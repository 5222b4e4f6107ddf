"""Feature capture from a Hugging Face causal LM: the fused low/mid/high hidden states and the teacher signal.

Purpose: run a target (Llama, Qwen2/Qwen3, Mistral families: anything with `model.layers` and an output
embedding) and keep only what an EAGLE-3 head needs: the hidden states *entering* three decoder layers (by
default 2, N//2, N-3, i.e. HF `hidden_states[2]`, `[N//2]`, `[N-3]`) and the final normed hidden state, from
which the teacher distribution is computed in chunks (`teacher_targets`). Forward pre-hooks capture the three
layer inputs as they pass, so every other layer's hidden state is freed as usual.
CPU kernels for inference: `linear` sends multi-row products through oneDNN with a weight packed once and cached
(MKL's fp32 GEMM is 2-4x slower at 2-64 rows on these CPUs; one row stays on MKL's GEMV); `packed_linears(model)`
routes a whole model's `nn.Linear` layers through it for the duration of a `with` block.
Not here: tokenisation, chat templates, storage of shards.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

_PACKED: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, torch.Tensor]]" = weakref.WeakKeyDictionary()
_MIN_PACKED_WORK = 1 << 20  # rows x weight elements; below it MKL is as fast as oneDNN (in this loop's cache state)


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
    """`F.linear(x, layer.weight, layer.bias)`; without autograd, a CPU input of several rows uses oneDNN."""
    w = layer.weight
    rows = x.numel() // max(x.shape[-1], 1)
    if rows * w.numel() < _MIN_PACKED_WORK or not _packable(x, w):
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
    kwargs: dict[str, Any] = {}
    if past_key_values is not None:  # transformers >= 5.2x names it `cache`, older ones `past_key_values`
        kwargs[_cache_kwarg(base)] = past_key_values
    with capture_layer_inputs(target, layer_ids) as store:
        out = base(input_ids=input_ids_BT, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=use_cache, **kwargs)
    aux = torch.cat([store[i] for i in layer_ids], dim=-1)
    cache = out.get("cache", None) if "cache" in out else out.get("past_key_values", None)
    return TargetStep(aux, out.last_hidden_state, cache)


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
