"""Loading a target: any Hugging Face causal LM directory (Llama, Qwen2/Qwen3, Mistral families).

Purpose: `load_target(path, device)` returns (model, tokenizer) in eval mode, weights through safetensors only,
`trust_remote_code` off unless the caller turns it on, and a clear error for a directory that is not a causal LM
with enough layers for an EAGLE-3 head, or whose tokenizer does not fit the model or has no chat template;
`check_target(path)` makes the same checks without loading the weights (flows check their inputs up front), and
refuses what a real checkpoint can carry that the pipeline does not support yet: a family outside `PROVEN_FAMILIES`
(`check_family`), a config.json dtype the engine does not run, and quantized weights (`check_dtypes`: every
tensor's dtype, from the safetensors headers).
`weights_sha256` hashes the weight files for lineage; `declared_dtype` is the dtype the target's config.json
states (targets are loaded in float32 here, which rewrites the loaded config's dtype; engines use the stated one);
`target_context` its context length, the longest `max_model_len` an engine serving it accepts.
`read_tensors(path, names)` reads single tensors by name from the target's safetensors (through
`model.safetensors.index.json` when sharded) without loading the model, for a target an engine runs.
Not here: registry URIs (infra/ resolves `models:/...` to a local directory first).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from eagle.config import default_aux_layer_ids
from eagle.errors import BadInput


class TargetError(BadInput):
    """A target directory that cannot serve as an EAGLE-3 target."""


# model_type -> architecture of the families the pipeline is proven on: tests/test_families.py runs each through
# regenerate, extract, train, export and our verification, and through vLLM's EAGLE-3 (each has its aux hidden state
# hook in vLLM 0.32: SupportsEagle3 in models/llama.py (Mistral too), qwen2.py, qwen3.py, qwen3_moe.py); the
# embedded default and SmolLM2 are Llama. Another family may load and still draft wrongly (its own norms, attention,
# tied layouts): it joins this table with its row in tests/test_families.py.
PROVEN_FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# the dtypes a target runs in: vLLM's `--dtype` choices (the config's dtype is passed as the engine's --dtype, and
# a head is exported in it) and the float tensors its CPU build runs (platforms/cpu.py `supported_dtypes`);
# integer or 8-bit float tensors are a quantized checkpoint (GPTQ/AWQ packs int32, fp8 scales), not supported yet
ENGINE_DTYPES = ("float32", "bfloat16", "float16")
TENSOR_DTYPES = ("F32", "BF16", "F16")  # the same three, as safetensors headers name them


def check_family(model_type: str, architectures: list[str], where: str) -> None:
    """`TargetError` naming `where` unless `model_type` is a proven family (and, when given, some architecture is
    that family's own: vLLM picks its model class by the architecture, transformers by the model_type)."""
    proven = ", ".join(PROVEN_FAMILIES)
    if model_type in PROVEN_FAMILIES and (not architectures or set(architectures) & set(PROVEN_FAMILIES.values())):
        return
    archs = f" (architectures {architectures})" if architectures else ""
    raise TargetError(
        f"{where}: model_type {model_type!r}{archs} is not a family this pipeline is proven on "
        f"({proven}: tests/test_families.py runs each through training and vLLM's EAGLE-3); use a "
        "target of one of them, or prove the family there first and add it to PROVEN_FAMILIES "
        "(components/targets/target.py)"
    )


def check_target(path: str | Path, trust_remote_code: bool = False):
    """(config, tokenizer) of a target directory, checked without loading its weights; `TargetError` says why not."""
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise TargetError(
            f"{path}: not a Hugging Face model directory (no config.json); pass the directory that "
            "holds config.json, the tokenizer and *.safetensors"
        )
    if not list(path.glob("*.safetensors")):
        raise TargetError(
            f"{path}: no .safetensors weights; only safetensors are loaded (no pickle): convert the "
            "checkpoint with `save_pretrained(..., safe_serialization=True)`"
        )
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # malformed JSON, unknown model_type, remote code refused
        raise TargetError(
            f"{path}/config.json: cannot be read as a transformers config ({e}); for a model that "
            "ships its own code set EAGLE_TRUST_REMOTE_CODE=1 if you trust it"
        ) from None
    archs = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise TargetError(f"{path}: architectures {archs} is not a causal LM (need e.g. LlamaForCausalLM)")
    check_family(str(getattr(config, "model_type", "")), list(archs), f"{path}/config.json")
    _check_config_dtype(path, config)
    try:
        default_aux_layer_ids(int(getattr(config, "num_hidden_layers", 0)))
    except ValueError as e:
        raise TargetError(f"{path}: {e}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise TargetError(
            f"{path}: cannot load its tokenizer ({e}); save the target's tokenizer beside it "
            "(tokenizer.save_pretrained)"
        ) from None
    if len(tokenizer) > config.vocab_size:
        raise TargetError(
            f"{path}: tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
            f"{config.vocab_size}: the tokenizer does not belong to this model"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError(
            f"{path}: the tokenizer has no chat template; add one (tokenizer.chat_template, saved "
            "in tokenizer_config.json or chat_template.jinja)"
        )
    _check_output_layer(path, config)
    check_dtypes(path)
    return config, tokenizer


def _check_config_dtype(path: Path, config) -> None:
    from eagle.config import dtype_name

    dtype = dtype_name(config)
    if dtype not in ENGINE_DTYPES:
        raise TargetError(
            f"{path}/config.json: dtype {dtype!r} is not one the engine runs a target in "
            f"({', '.join(ENGINE_DTYPES)}: vLLM's --dtype, and the head is exported in it); save the "
            "target in bfloat16 or float32 (model.to(torch.bfloat16).save_pretrained(...))"
        )


def _header(f: Path) -> dict:
    """The safetensors header of `f` (the tensors' names, dtypes, shapes, offsets): no tensor is read."""
    try:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(min(n, 100 << 20)))
        return {k: v for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, AttributeError) as e:
        raise TargetError(f"{f}: not a readable safetensors file ({str(e)[:200]}); copy it again") from None


def check_dtypes(path: str | Path) -> None:
    """Every tensor of the target's safetensors (each shard, by its header) is float32, bfloat16 or float16: an
    integer or 8-bit tensor is a quantized checkpoint, which neither vLLM's `--dtype` nor our float32 load runs."""
    for f in sorted(Path(path).glob("*.safetensors")):
        odd = {
            k: v.get("dtype")
            for k, v in _header(f).items()
            if isinstance(v, dict) and v.get("dtype") not in TENSOR_DTYPES
        }
        if odd:
            name, dtype = next(iter(sorted(odd.items())))
            raise TargetError(
                f"{f}: tensor {name} is stored as {dtype} ({len(odd)} tensor(s) not float32, bfloat16 "
                "or float16): a quantized checkpoint (GPTQ, AWQ, int8, fp8), which the pipeline does "
                "not run yet; give the unquantized checkpoint (bfloat16 or float32 safetensors)"
            )


def weight_names(path: str | Path) -> set[str]:
    """The tensor names in the target's safetensors, from the index when sharded (each shard it names must exist)
    or from each file's header: no tensor is read."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise TargetError(f"{index}: not a readable safetensors index ({e})") from None
        missing = sorted({f for f in weight_map.values() if not (path / str(f)).is_file()})
        if missing:
            raise TargetError(
                f"{path}: the index names shard(s) {', '.join(missing[:3])} that are not there; "
                "copy every shard of the checkpoint"
            )
        return set(weight_map)
    names: set[str] = set()
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                names.update(st.keys())
        except Exception as e:  # safetensors raises several types for a truncated or foreign file
            raise TargetError(f"{f}: not a readable safetensors file ({str(e)[:200]}); copy it again") from None
    return names


def _check_output_layer(path: Path, config) -> None:
    """A head needs the target's output layer: `lm_head.weight`, or the embedding when the weights are tied."""
    names = weight_names(path)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if "lm_head.weight" in names or (tied and any(n.endswith("embed_tokens.weight") for n in names)):
        return
    raise TargetError(
        f"{path}: the weights hold no lm_head.weight"
        + (
            " and no embed_tokens.weight to tie it to"
            if tied
            else " and config.json does not tie it to the embedding (tie_word_embeddings is false)"
        )
        + "; the checkpoint is incomplete"
    )


def load_target(path: str | Path, device: str = "cpu", trust_remote_code: bool = False, dtype: Any = None):
    import torch
    from transformers import AutoModelForCausalLM

    config, tokenizer = check_target(path, trust_remote_code)  # before the (slow) weights
    try:
        model = AutoModelForCausalLM.from_pretrained(
            Path(path), dtype=dtype or torch.float32, use_safetensors=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, RuntimeError) as e:  # truncated file, shapes that do not fit config.json
        raise TargetError(
            f"{path}: cannot load its weights ({str(e)[:400]}); check that the *.safetensors files "
            "are complete and belong to config.json"
        ) from None
    return model.to(device).eval(), tokenizer


def declared_dtype(path: str | Path) -> str:
    """The dtype the target's config.json states (`dtype`, or the older `torch_dtype`); "float32" if none."""
    raw = json.loads((Path(path) / "config.json").read_text())
    return str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")


def target_context(target_dir: str | Path) -> int:
    """The target's context length (`max_position_embeddings`): vLLM refuses a longer max_model_len."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))


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


def read_tensors(path: str | Path, names: list[str]) -> dict:
    """{name: tensor} for each of `names` found in the target's safetensors (absent names are left out), read one
    tensor at a time: the rest of the weights are never loaded."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {n: path / weight_map[n] for n in names if n in weight_map}
    else:
        files = {}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                files.update({n: f for n in names if n in st.keys() and n not in files})
    out = {}
    for name, f in files.items():
        with safe_open(str(f), "pt") as st:
            out[name] = st.get_tensor(name)
    return out
