"""Export and import of a head in the checkpoint format that vLLM and SGLang load unmodified, plus a probe.

Purpose: `export_head(draft, out_dir)` writes
  config.json              LlamaForCausalLMEagle3, one layer, the target's shapes, every norm flag explicit (vLLM
                           0.32's `norm_before_residual`, `norm_before_fc`, and the variant's `fc_norm` and
                           `norm_output`: eagle/config.py), the fused layer ids for both engines (see below),
                           `torch_dtype`, and for the parallel variants `mask_token_id` (the masked slots' token;
                           vLLM's proposer reads it when served with `parallel_drafting: true`);
  model.safetensors        fc, (fc_norm.{0,1,2} for eagle3.1[-parallel],) midlayer.*, norm, lm_head, d2t (int64),
                           t2d (bool), (mask_hidden [1, 3H] for [eagle3.1-]parallel: vLLM loads it by that name
                           into its buffer);
                           no embed_tokens (the engine shares the target's). When the draft vocabulary is the
                           target's (Vd == V) d2t and t2d are left out: the mapping is the identity and vLLM has
                           no parameter to load them into;
  probe/probe.safetensors  fused-input features, token ids, positions and the exported head's step-0 draft logits,
                           so a serving team can check that their loader reproduces the head. It sits in a
                           subdirectory because both engines load every top-level `*.safetensors` as weights;
  eagle_head.json          our own metadata: the full DraftConfig and the caller's lineage (never read by engines).
Fused layer ids: ours are `DraftConfig.aux_layer_ids`, id k = the hidden state entering target decoder layer k,
three distinct ascending ids in 1..N-1. vLLM reads them as they are from the top-level
`eagle_aux_hidden_state_layer_ids`; SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and captures the
input of layer id + 1, so that list holds our ids minus one (`sglang_capture_layers` and `vllm_capture_layers`
restate each engine's reading). SGLang's `fc` is fixed at 3H, hence always three ids.
Dtype: engines run the head in the target's dtype (vLLM always; SGLang's `--dtype auto` reads each model's own
config), so by default the float tensors are written in `DraftConfig.target_dtype` and `torch_dtype` says so; an
explicit `dtype=` overrides. The probe's logits are those of the weights as written.
The directory appears atomically (written aside, then renamed). `load_head(dir, target)` rebuilds the head,
refuses a head made for another target with a message naming the mismatch, reads a probe at either place, and
folds a head whose draft config repeats a layer id into the equivalent three-distinct-id head
(`fold_duplicate_aux`).
Not here: registries, URIs, downloads (see infra/).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load_file, save_file

from eagle.config import DraftConfig
from eagle.draft import Eagle3Draft
from eagle.errors import BadInput

FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
PROBE = "probe/probe.safetensors"
LEGACY_PROBE = "probe.safetensors"
META = "eagle_head.json"
VOCAB_MAP = ("d2t", "t2d")
NUM_AUX = 3


class HeadMismatchError(BadInput):
    """A head was loaded for a target it was not trained for."""


class HeadFileError(BadInput):
    """A head directory whose files are missing or unreadable; the message names the file."""


def engine_config(cfg: DraftConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json both engines read for an EAGLE-3 Llama-style head."""
    ids = list(cfg.aux_layer_ids)
    parallel = {"mask_token_id": cfg.mask_token_id} if cfg.parallel else {}  # parallel drafting's masked slots
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
        "norm_before_fc": False,
        "fc_norm": cfg.fc_norm,  # eagle3.1[-parallel] (eagle/config.py): one RMSNorm per fused state before fc
        "norm_output": cfg.norm_output,  # eagle3.1[-parallel]: the next draft step reads norm(output)
        "attention_bias": False,
        "mlp_bias": False,
        "num_aux_hidden_states": NUM_AUX,
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True},
        "torch_dtype": str(dtype).removeprefix("torch."),
        **parallel,
    }


def vllm_capture_layers(config: dict[str, Any], target_num_layers: int) -> list[int]:
    """The target layers whose inputs vLLM fuses for a head with this config.json (its lookup order)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    n = target_num_layers
    return list(ids) if ids else sorted({2, n // 2, n - 3})


def sglang_capture_layers(config: dict[str, Any], target_num_layers: int) -> list[int]:
    """The target layers whose inputs SGLang fuses for a head with this config.json (it counts one lower)."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    n = target_num_layers
    return [v + 1 for v in ids] if ids is not None else [2, n // 2, n - 3]


def head_state_dict(draft: Eagle3Draft, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Exported tensors: everything but the (target-owned) embedding, and d2t/t2d only when Vd < V; float
    weights cast to `dtype` if given."""
    identity_vocab = draft.cfg.draft_vocab_size == draft.cfg.vocab_size
    out = {}
    for name, t in draft.state_dict().items():
        if name.startswith("embed_tokens") or (identity_vocab and name in VOCAB_MAP):
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
    aux = torch.randn(1, n_tokens, NUM_AUX * cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (1, n_tokens), generator=g)
    pos = torch.arange(n_tokens)[None]
    p = next(draft.parameters())
    with torch.no_grad():
        _, logits = draft(ids.to(p.device), draft.fuse(aux.to(p.device, p.dtype)), pos.to(p.device))
    return {"aux_hidden_states": aux, "input_ids": ids, "position_ids": pos, "draft_logits": logits.float().cpu()}


@contextmanager
def _holding(draft: Eagle3Draft, tensors: dict[str, torch.Tensor]) -> Iterator[Eagle3Draft]:
    """`draft` with `tensors` (the weights as written, maybe rounded) loaded; its own weights restored after."""
    saved = {n: t.detach().clone() for n, t in draft.state_dict().items() if n in tensors}
    draft.load_state_dict(tensors, strict=False)
    try:
        yield draft
    finally:
        draft.load_state_dict(saved, strict=False)


def export_head(
    draft: Eagle3Draft, out_dir: str | Path, lineage: dict[str, Any] | None = None, dtype: torch.dtype | None = None
) -> Path:
    """Write the head to `out_dir` (replaced atomically if it exists) and return the path.

    Float tensors are written in `dtype`, by default the target's (`draft.cfg.target_dtype`)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    used = dtype or getattr(torch, draft.cfg.target_dtype)
    tensors = head_state_dict(draft, used)
    with _holding(draft, tensors):
        probe = make_probe(draft)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / PROBE).parent.mkdir()
        save_file(probe, str(tmp / PROBE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(engine_config(draft.cfg, used), indent=2) + "\n")
        meta = {"format_version": FORMAT_VERSION, "draft_config": draft.cfg.to_dict(), "lineage": lineage or {}}
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def read_head_meta(head_dir: str | Path) -> dict[str, Any]:
    """The head's `eagle_head.json`; `HeadFileError` naming the file when it is missing, unreadable or not ours."""
    path = Path(head_dir) / META
    if not path.is_file():
        raise HeadFileError(f"{head_dir} is not an exported EAGLE-3 head: {META} is missing")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadFileError(f"{path}: not readable JSON ({e}); the head is damaged: export it again") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        got = meta.get("format_version") if isinstance(meta, dict) else type(meta).__name__
        raise HeadFileError(f"{path}: unsupported head format version {got!r}")
    return meta


def check_head_fits(cfg: DraftConfig, target_config: Any, where: str = "head") -> None:
    """Refuse a head whose shapes do not belong to this target."""
    checks = [
        ("hidden_size", cfg.hidden_size, getattr(target_config, "hidden_size", None)),
        ("vocab_size", cfg.vocab_size, getattr(target_config, "vocab_size", None)),
        ("num_hidden_layers", cfg.target_num_layers, getattr(target_config, "num_hidden_layers", None)),
    ]
    bad = [f"{n}: head expects {a}, target has {b}" for n, a, b in checks if a != b]
    if bad:
        raise HeadMismatchError(
            f"{where} was trained for another target ({'; '.join(bad)}); "
            "train a head for this target or pass the target it was trained for"
        )


def fold_duplicate_aux(
    draft_config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The same head with three distinct ascending layer ids, when its draft config repeats or misorders ids.

    `fc` is linear in the concatenated features, so the column blocks of a repeated id are summed into one block;
    each missing id is filled with the smallest unused id in 1..N-1 and a zero block; the ids are sorted and the
    blocks permuted with them. The result computes the same function and keeps `fc` at 3H columns."""
    ids = [int(i) for i in draft_config.get("aux_layer_ids") or ()]
    if not ids or (len(ids) == NUM_AUX and all(a < b for a, b in zip(ids, ids[1:]))):
        return draft_config, tensors
    H, n = int(draft_config["hidden_size"]), int(draft_config["target_num_layers"])
    fc_HX = tensors["fc.weight"]
    if fc_HX.shape[1] != len(ids) * H:
        raise ValueError(f"fc.weight {tuple(fc_HX.shape)} does not fit aux_layer_ids {ids} of hidden size {H}")
    blocks: dict[int, torch.Tensor] = {}
    for j, i in enumerate(ids):
        blocks[i] = blocks.get(i, 0) + fc_HX[:, j * H : (j + 1) * H].float()
    for i in range(1, n):
        if len(blocks) >= NUM_AUX:
            break
        blocks.setdefault(i, torch.zeros(fc_HX.shape[0], H))
    new_ids = sorted(blocks)
    fc = torch.cat([blocks[i] for i in new_ids], dim=1).to(fc_HX.dtype)
    return {**draft_config, "aux_layer_ids": new_ids}, {**tensors, "fc.weight": fc.contiguous()}


def load_head(
    head_dir: str | Path,
    target: torch.nn.Module | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> Eagle3Draft:
    """Rebuild an exported head. With `target`, check it matches and install the target's embedding."""
    head_dir = Path(head_dir)
    meta = read_head_meta(head_dir)
    tensors = load_file(str(head_dir / WEIGHTS))
    config, tensors = fold_duplicate_aux(meta["draft_config"], tensors)
    cfg = DraftConfig.from_dict(config)
    if target is not None:
        check_head_fits(cfg, target.config, where=str(head_dir))
    draft = Eagle3Draft(cfg)  # its vocabulary map starts as the identity, which Vd == V heads may leave out
    expected = set(head_state_dict(draft))
    optional = set(VOCAB_MAP) if cfg.draft_vocab_size == cfg.vocab_size else set()
    if set(tensors) - optional != expected:
        raise ValueError(
            f"{head_dir / WEIGHTS}: tensors {sorted((set(tensors) - optional) ^ expected)} missing or unexpected"
        )
    if dtype is not None:
        draft = draft.to(dtype)
    draft.load_state_dict(tensors, strict=False)
    if target is not None:
        draft.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.detach())
    return draft.to(device)


def verify_probe(draft: Eagle3Draft, head_dir: str | Path) -> float:
    """Max abs difference between this head's step-0 logits and the probe's (0.0 for a faithful loader)."""
    path = Path(head_dir) / PROBE
    probe = load_file(str(path if path.is_file() else Path(head_dir) / LEGACY_PROBE))
    p = next(draft.parameters())
    with torch.no_grad():
        _, logits = draft(
            probe["input_ids"].to(p.device),
            draft.fuse(probe["aux_hidden_states"].to(p.device, p.dtype)),
            probe["position_ids"].to(p.device),
        )
    return float((logits.float().cpu() - probe["draft_logits"]).abs().max())
