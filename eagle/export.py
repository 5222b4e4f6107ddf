"""Export and import of a head in the checkpoint format that vLLM and SGLang load, plus a verification probe.

Purpose: `export_head(draft, out_dir)` writes
  config.json        LlamaForCausalLMEagle3, one layer, the target's shapes, every norm flag explicit;
  model.safetensors  fc, midlayer.*, norm, lm_head, d2t (int64), t2d (bool); no embed_tokens (the engine
                     shares the target's);
  probe.safetensors  fused-input features, token ids, positions and this implementation's step-0 draft logits,
                     so a serving team can check that their loader reproduces the head;
  eagle_head.json    our own metadata: the full DraftConfig and the caller's lineage (never read by engines).
The directory appears atomically (written aside, then renamed). `load_head(dir, target)` rebuilds the head and
refuses a head made for another target with a message naming the mismatch.
Not here: registries, URIs, downloads (see infra/).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle.config import DraftConfig
from eagle.draft import Eagle3Draft

FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
PROBE = "probe.safetensors"
META = "eagle_head.json"


class HeadMismatchError(ValueError):
    """A head was loaded for a target it was not trained for."""


def engine_config(cfg: DraftConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json both engines read for an EAGLE-3 Llama-style head."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def head_state_dict(draft: Eagle3Draft, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Exported tensors: everything but the (target-owned) embedding; float weights cast to `dtype` if given."""
    out = {}
    for name, t in draft.state_dict().items():
        if name.startswith("embed_tokens"):
            continue
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.contiguous().cpu()
    return out


def make_probe(draft: Eagle3Draft, n_tokens: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded features and tokens, and the head's step-0 logits on them (fp32)."""
    cfg = draft.cfg
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, n_tokens, 3 * cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (1, n_tokens), generator=g)
    pos = torch.arange(n_tokens)[None]
    p = next(draft.parameters())
    with torch.no_grad():
        _, logits = draft(ids.to(p.device), draft.fuse(aux.to(p.device, p.dtype)), pos.to(p.device))
    return {"aux_hidden_states": aux, "input_ids": ids, "position_ids": pos, "draft_logits": logits.float().cpu()}


def export_head(draft: Eagle3Draft, out_dir: str | Path, lineage: dict[str, Any] | None = None,
                dtype: torch.dtype | None = None) -> Path:
    """Write the head to `out_dir` (replaced atomically if it exists) and return the path."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = head_state_dict(draft, dtype)
    used = dtype or draft.lm_head.weight.dtype
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        save_file(make_probe(draft), str(tmp / PROBE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(engine_config(draft.cfg, used), indent=2) + "\n")
        meta = {"format_version": FORMAT_VERSION, "draft_config": draft.cfg.to_dict(), "lineage": lineage or {}}
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_head_meta(head_dir: str | Path) -> dict[str, Any]:
    path = Path(head_dir) / META
    if not path.is_file():
        raise FileNotFoundError(f"{head_dir} is not an exported EAGLE-3 head: {META} is missing")
    meta = json.loads(path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported head format version {meta.get('format_version')!r}")
    return meta


def check_target(cfg: DraftConfig, target_config: Any, where: str = "head") -> None:
    """Refuse a head whose shapes do not belong to this target."""
    checks = [("hidden_size", cfg.hidden_size, getattr(target_config, "hidden_size", None)),
              ("vocab_size", cfg.vocab_size, getattr(target_config, "vocab_size", None)),
              ("num_hidden_layers", cfg.target_num_layers, getattr(target_config, "num_hidden_layers", None))]
    bad = [f"{n}: head expects {a}, target has {b}" for n, a, b in checks if a != b]
    if bad:
        raise HeadMismatchError(f"{where} was trained for another target ({'; '.join(bad)}); "
                                "train a head for this target or pass the target it was trained for")


def load_head(head_dir: str | Path, target: torch.nn.Module | None = None,
              device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Eagle3Draft:
    """Rebuild an exported head. With `target`, check it matches and install the target's embedding."""
    head_dir = Path(head_dir)
    cfg = DraftConfig.from_dict(read_head_meta(head_dir)["draft_config"])
    if target is not None:
        check_target(cfg, target.config, where=str(head_dir))
    tensors = load_file(str(head_dir / WEIGHTS))
    draft = Eagle3Draft(cfg)
    expected = set(head_state_dict(draft))
    if set(tensors) != expected:
        raise ValueError(f"{head_dir / WEIGHTS}: tensors {sorted(set(tensors) ^ expected)} missing or unexpected")
    if dtype is not None:
        draft = draft.to(dtype)
    draft.load_state_dict(tensors, strict=False)
    if target is not None:
        draft.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.detach())
    return draft.to(device)


def verify_probe(draft: Eagle3Draft, head_dir: str | Path) -> float:
    """Max abs difference between this head's step-0 logits and the probe's (0.0 for a faithful loader)."""
    probe = load_file(str(Path(head_dir) / PROBE))
    p = next(draft.parameters())
    with torch.no_grad():
        _, logits = draft(probe["input_ids"].to(p.device), draft.fuse(probe["aux_hidden_states"].to(p.device, p.dtype)),
                          probe["position_ids"].to(p.device))
    return float((logits.float().cpu() - probe["draft_logits"]).abs().max())
