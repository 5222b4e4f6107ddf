"""Feature capture from a Hugging Face causal LM: the fused low/mid/high hidden states and the teacher signal.

Purpose: run a target (Llama, Qwen2/Qwen3, Mistral families: anything with `model.layers` and an output
embedding) and keep only what an EAGLE-3 head needs: the hidden states *entering* three decoder layers (by
default 2, N//2, N-3, i.e. HF `hidden_states[2]`, `[N//2]`, `[N-3]`) and the final normed hidden state, from
which the teacher distribution is computed in chunks (`teacher_targets`). Forward pre-hooks capture the three
layer inputs as they pass (`capture_layer_inputs`), so every other layer's hidden state is freed as usual.
How to run: `step = target_forward(target, ids_BT, layer_ids)`, then
`teacher_targets(step.last_hidden_BTH, lm_head_VH, draft_ids_Vd)`; used by extraction, online training and decoding.
Not here: tokenisation, chat templates, storage of shards; the fast inference kernels and the lean decoder
(`eagle.fastpath`).

Shape legend: B batch, T positions, H hidden size, V target vocabulary, Vd draft vocabulary, N = B*T rows, n the rows
of one chunk.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The target's list of decoder layers; a clear error when the model is not a decoder-only LM."""
    base = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or target.get_output_embeddings() is None:
        raise ValueError(
            f"{type(target).__name__} is not a decoder-only causal LM with `model.layers` and an "
            "output embedding; EAGLE-3 heads need one (Llama, Qwen2/3, Mistral families)"
        )
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


def target_forward(
    target: nn.Module,
    input_ids_BT: torch.Tensor,
    layer_ids: Sequence[int],
    *,
    past_key_values: Any = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    use_cache: bool = False,
) -> TargetStep:
    """Run the target's decoder (no lm_head) and capture the three layer inputs."""
    base = target.get_decoder()
    cache_name = _cache_kwarg(base)  # transformers >= 5.2x names it `cache` (the old name is deprecated there)
    kwargs: dict[str, Any] = {} if past_key_values is None else {cache_name: past_key_values}
    with capture_layer_inputs(target, layer_ids) as store:
        out = base(
            input_ids=input_ids_BT,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **kwargs,
        )
    aux_BT3H = torch.cat([store[i] for i in layer_ids], dim=-1)
    return TargetStep(aux_BT3H, out.last_hidden_state, out.get(cache_name, None))


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
def teacher_targets(
    last_hidden_BTH: torch.Tensor, lm_head_VH: torch.Tensor, draft_ids_Vd: torch.Tensor, chunk: int = 1024
) -> Teacher:
    """Teacher signal from the target's final hidden state; full-vocab logits exist for `chunk` rows at a time."""
    B, T, H = last_hidden_BTH.shape
    flat_NH = last_hidden_BTH.reshape(B * T, H)
    t2d_V = torch.zeros(lm_head_VH.shape[0], dtype=torch.bool, device=flat_NH.device)
    t2d_V[draft_ids_Vd] = True
    probs, in_vocab, argmax = [], [], []
    w_VH = lm_head_VH.to(flat_NH.device)
    for s in range(0, B * T, chunk):
        logits_nV = (flat_NH[s : s + chunk].to(w_VH.dtype) @ w_VH.T).float()
        top_n = logits_nV.argmax(-1)
        argmax.append(top_n)
        in_vocab.append(t2d_V[top_n])
        probs.append(torch.softmax(logits_nV[:, draft_ids_Vd], dim=-1))
    return Teacher(torch.cat(probs).view(B, T, -1), torch.cat(in_vocab).view(B, T), torch.cat(argmax).view(B, T))
