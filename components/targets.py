"""Loading a target: any Hugging Face causal LM directory (Llama, Qwen2/Qwen3, Mistral families).

Purpose: `load_target(path, device)` returns (model, tokenizer) in eval mode, weights through safetensors only,
`trust_remote_code` off unless the caller turns it on, and a clear error for a directory that is not a causal LM
with enough layers for an EAGLE-3 head, or whose tokenizer does not fit the model. `weights_sha256` hashes the
weight files for lineage.
Not here: registry URIs (infra/ resolves `models:/...` to a local directory first).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from eagle.config import default_aux_layer_ids


class TargetError(ValueError):
    """A target directory that cannot serve as an EAGLE-3 target."""


def load_target(path: str | Path, device: str = "cpu", trust_remote_code: bool = False, dtype: Any = None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise TargetError(f"{path}: not a Hugging Face model directory (no config.json)")
    if not list(path.glob("*.safetensors")):
        raise TargetError(f"{path}: no .safetensors weights; only safetensors are loaded (no pickle)")
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    archs = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise TargetError(f"{path}: architectures {archs} is not a causal LM (need e.g. LlamaForCausalLM)")
    try:
        default_aux_layer_ids(int(getattr(config, "num_hidden_layers", 0)))
    except ValueError as e:
        raise TargetError(f"{path}: {e}") from None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, use_safetensors=True,
                                                 trust_remote_code=trust_remote_code).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if len(tokenizer) > config.vocab_size:
        raise TargetError(f"{path}: tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
                          f"{config.vocab_size}: the tokenizer does not belong to this model")
    return model, tokenizer


def weights_sha256(path: str | Path) -> str:
    """sha256 over the target's safetensors files (sorted by name), streamed."""
    h = hashlib.sha256()
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise TargetError(f"{path}: no .safetensors weights to hash")
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
