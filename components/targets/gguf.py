"""GGUF targets: a llama.cpp `.gguf` file converted once to an fp32 safetensors Hugging Face directory.

Purpose: `materialize_target(target, state_dir)` is what a command that takes a target calls first: a path ending in
`.gguf` is checked (`check_gguf`, a few seconds, before any work) and converted (`convert_gguf`), and the converted
directory is returned in its place; any other target comes back unchanged. The conversion dequantizes the weights
through transformers' own GGUF loader, saves them as fp32 safetensors with the tokenizer (its chat template
included), and is cached under `<state_dir>/gguf/<sha256[:16]>/`, keyed by the file's bytes: a second run finds it.
The directory appears whole or not at all (written beside it, then renamed; a lock serialises two conversions of
the same file), and `gguf.json`, written last inside it, names the source file, its hash and its quantization;
`gguf_lineage(target_dir)` reads those back as lineage tags.
Run: `python -m components.targets.gguf FILE.gguf [STATE_DIR]` checks and converts one file, printing the directory.
Not here: the checks every HF target gets (components/targets/target.py `check_target` runs on the converted directory),
running quantized weights (the target is fp32 from here on: the head learns the dequantized model, which is what
the GGUF's own quantization approximates), architectures transformers cannot read from GGUF.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from components.data.atomic import atomic_write_text, file_sha256
from components.targets.target import TargetError

MAGIC = b"GGUF"
MARKER = "gguf.json"  # written last: a cached directory without it is not one
PIP_HINT = "pip install gguf accelerate"
# llama.cpp's names for architectures whose transformers config key is spelled otherwise
# (transformers/modeling_gguf_pytorch_utils.py `load_gguf_checkpoint`)
_LLAMA_CPP_NAMES = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss", "minimax_m2": "minimax-m2"}
# keys of transformers' table that are no architecture, or not a causal LM (encoder-decoders)
_NOT_CAUSAL_LM = {"general", "tokenizer", "t5", "umt5", "t5encoder"}
_SECONDS_PER_GB = 300  # conversion time on 2 CPU cores, measured on a 98 MB Q4_1 file (SmolLM2-135M)


class GgufError(TargetError):
    """A `.gguf` target that cannot be read or converted; the message names the file."""


@dataclass(frozen=True)
class GgufInfo:
    path: Path
    architecture: str  # general.architecture, llama.cpp's name (e.g. "llama", "qwen2")
    quantization: str  # from general.file_type (e.g. "Q4_1", "F16"), else the weights' most common tensor type
    name: str  # general.name, else the file's stem
    size: int  # bytes


def supported_architectures() -> set[str]:
    """The GGUF architectures (llama.cpp's names) that the installed transformers loads as a causal LM."""
    archs: set[str] = set()
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING  # the legacy loader's table

        archs |= {_LLAMA_CPP_NAMES.get(a, a) for a in GGUF_CONFIG_MAPPING}
    except ImportError:
        pass
    try:  # the newer loader (transformers 5): architectures it rebuilds a config for
        from transformers.integrations.gguf.gguf_config_mapping import GGUF_CONFIG_ARCHS

        archs |= set(GGUF_CONFIG_ARCHS)
    except ImportError:
        pass
    return archs - _NOT_CAUSAL_LM


def check_gguf(path: str | Path) -> GgufInfo:
    """What `path` holds, read from its header only; `GgufError` (one line) when it is no GGUF this can convert."""
    path = Path(path)
    _check_file(path)
    reader = _reader(path)
    architecture = _field(reader, "general.architecture")
    if not isinstance(architecture, str) or not architecture:
        raise GgufError(f"{path}: the GGUF header names no general.architecture; the file is incomplete")
    supported = supported_architectures()
    if architecture not in supported:
        import transformers

        raise GgufError(
            f"{path}: architecture {architecture!r} is not one transformers {transformers.__version__} "
            f"loads from GGUF as a causal LM; supported: {', '.join(sorted(supported))}"
        )
    if not _field(reader, "tokenizer.chat_template"):
        raise GgufError(
            f"{path}: the GGUF carries no chat template (tokenizer.chat_template), and a target needs "
            "one; use a GGUF of the chat (instruct) model, or a HF directory with its template"
        )
    name = _field(reader, "general.name")
    return GgufInfo(
        path=path,
        architecture=architecture,
        quantization=_quantization(reader),
        name=name if isinstance(name, str) and name else path.stem,
        size=path.stat().st_size,
    )


def _check_file(path: Path) -> None:
    if not path.exists():
        raise GgufError(f"{path}: no such file")
    if not path.is_file():
        raise GgufError(f"{path}: not a regular file; pass the .gguf file itself")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise GgufError(f"{path}: cannot be read ({e.strerror or e})") from None
    if head != MAGIC:
        raise GgufError(
            f"{path}: not a GGUF file (it starts with {head!r}, not {MAGIC!r}); pass a llama.cpp "
            ".gguf file or a Hugging Face model directory"
        )


def _reader(path: Path):
    try:
        import gguf
    except ImportError:
        raise GgufError(f"{path}: reading a GGUF target needs the gguf and accelerate packages: {PIP_HINT}") from None
    if importlib.util.find_spec("accelerate") is None:  # transformers loads a GGUF only through accelerate
        raise GgufError(f"{path}: loading a GGUF target needs the accelerate package: {PIP_HINT}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors... for a cut-off file
        detail = " ".join(str(e).split())[:160]
        raise GgufError(
            f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {detail}); copy it again"
        ) from None


def _field(reader, key: str):
    field = reader.get_field(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:  # a value of a type this gguf version cannot decode
        return None


def _quantization(reader) -> str:
    """general.file_type's name (MOSTLY_Q4_1 -> Q4_1, ALL_F32 -> F32); else the most common type among the weight
    matrices (a file that states no type, or GUESSED)."""
    import gguf

    file_type = _field(reader, "general.file_type")
    try:
        kind = gguf.LlamaFileType(int(file_type)).name
    except (TypeError, ValueError):
        kind = "GUESSED"
    if kind != "GUESSED":
        return kind.removeprefix("MOSTLY_").removeprefix("ALL_")
    counts: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) >= 2:
            kind = gguf.GGMLQuantizationType(t.tensor_type).name
            counts[kind] = counts.get(kind, 0) + 1
    return max(counts, key=counts.get) if counts else "unknown"


def _cache_dir(path: Path, state_dir: str | Path) -> tuple[str, Path]:
    """(the file's sha256, the directory its conversion is cached in)."""
    st = path.stat()
    sha = _sha256_of(str(path.resolve()), st.st_size, st.st_mtime_ns)
    return sha, Path(state_dir) / "gguf" / sha[:16]


@functools.lru_cache(maxsize=8)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    """The file's sha256, once per process while its size and mtime stay (the preflight, the flow's check and the
    conversion each ask; a multi-GB GGUF takes seconds to hash)."""
    return file_sha256(path)


def converted_dir(path: str | Path, state_dir: str | Path) -> Path | None:
    """The cached conversion of the GGUF file `path` when there is a complete one, else None (nothing converted)."""
    final = _cache_dir(Path(path), state_dir)[1]
    return final if (final / MARKER).is_file() else None


def default_target_name(target: str | Path) -> str:
    """The registry name a target gets without `--name`: a GGUF file's name without `.gguf`, a directory's name."""
    p = Path(target).resolve()
    return p.name[: -len(".gguf")] if is_gguf_target(p) else p.name


def convert_gguf(path: str | Path, state_dir: str | Path, progress: Callable[[str], None] = print) -> Path:
    """The fp32 safetensors HF directory of the GGUF file `path`, converted once and cached under
    `<state_dir>/gguf/<sha256[:16]>/`; a complete cached one (it has `gguf.json`) is returned as it is."""
    info = check_gguf(path)
    sha, final = _cache_dir(info.path, state_dir)
    root = final.parent
    if (final / MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".{final.name}.lock"):
        if (final / MARKER).is_file():  # another process converted it while this one waited
            return final
        for stale in root.glob(f".{final.name}.*.tmp"):  # left by a killed conversion (the lock holder owns them)
            shutil.rmtree(stale, ignore_errors=True)
        eta = max(10, round(info.size / 1e9 * _SECONDS_PER_GB, -1))
        progress(
            f"converting {info.path.name} ({info.quantization}) to fp32 safetensors under {final}; once, ~{eta:.0f} s"
        )
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
        try:
            tmp.chmod(0o755)  # mkdtemp makes 0700; the cache is read by whoever runs the target
            _write_hf_dir(info, tmp)
            tags = {
                "gguf_file": info.path.name,
                "gguf_sha256": sha,
                "gguf_quantization": info.quantization,
                "architecture": info.architecture,
                "gguf_name": info.name,
            }
            atomic_write_text(tmp / MARKER, json.dumps(tags, indent=1) + "\n")
            if final.exists():  # a directory without the marker: not ours to trust
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive `flock` on `path` for the block; the kernel drops it if the process dies."""
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _write_hf_dir(info: GgufInfo, out: Path) -> None:
    """Dequantize `info.path` with transformers and save model (fp32 safetensors) and tokenizer into `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = info.path.parent, info.path.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, dtype=torch.float32, trust_remote_code=False
        )  # a GGUF ships no code
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, trust_remote_code=False)
    except ImportError as e:
        raise GgufError(
            f"{info.path}: loading a GGUF target needs more packages ({_one_line(e)}): {PIP_HINT}"
        ) from None
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, NotImplementedError) as e:
        raise GgufError(
            f"{info.path}: transformers cannot load it ({_one_line(e)}); the file may be a variant "
            "of its architecture that transformers does not read"
        ) from None
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the loaded model is marked GGUF-quantized: save_pretrained refuses
        del config.quantization_config
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the GGUF keeps them in the tokenizer's metadata
        if getattr(config, key, None) is None and getattr(tokenizer, key, None) is not None:
            setattr(config, key, getattr(tokenizer, key))
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    del loaded
    fresh.generation_config.bos_token_id = config.bos_token_id
    fresh.generation_config.eos_token_id = config.eos_token_id
    fresh.generation_config.pad_token_id = config.pad_token_id
    fresh.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def gguf_lineage(target_dir: str | Path) -> dict[str, str]:
    """The tags of a directory `convert_gguf` made (source file, its sha256, quantization, architecture); {} for
    any other directory."""
    marker = Path(target_dir) / MARKER
    try:
        raw = json.loads(marker.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def is_gguf_target(target: str | Path) -> bool:
    return str(target).lower().endswith(".gguf")


def materialize_target(target: str, state_dir: str | Path, progress: Callable[[str], None] = print) -> str:
    """`target` as a path that loads like any HF directory: a `.gguf` file becomes its converted directory."""
    if not is_gguf_target(target):
        return target
    return str(convert_gguf(target, state_dir, progress=progress))


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(
            "usage: python -m components.targets.gguf FILE.gguf [STATE_DIR]  (default state dir: .eagle)",
            file=sys.stderr,
        )
        return 2
    try:
        print(convert_gguf(argv[0], argv[1] if len(argv) > 1 else ".eagle"))
    except GgufError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
