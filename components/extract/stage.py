"""Stage 2, extract: the target's fused hidden states and teacher signal over the regenerated conversations.

Purpose: `extract(cfg, target_dir, regen_dir, out_dir, context=StageContext()) -> ExtractResult` (`context`:
components/targets/runtime.py, whether the target's code is trusted, the Settings, the run's `TargetRuntime`).
- Always: tokenises every conversation with the target's chat template (assistant-only loss mask) into
  `tokens.safetensors`, counts the trained tokens (`token_counts`, for the draft vocabulary) and saves the
  target's embedding and lm_head, the decoder layer the highest fused state enters and the final norm
  (`target_heads.safetensors`), so training never needs more of the target in
  offline mode.
  Its config goes to `target_config/config.json`, with the dtype the target's own config states (the head is
  exported in it).
- The fused layers are `cfg.aux_layer_ids` (checked against the target's depth), or
  when empty `eagle.config.default_aux_layer_ids` of the target's depth; the manifest's `layer_ids` records them
  and training builds the head with exactly those.
- `cfg.mode == "offline"`: also writes feature shards `features-XXXXX.safetensors` (input_ids int32, loss_mask
  uint8, offsets int64, aux_hidden_states [T, 3H] and last_hidden_state [T, H] in `cfg.dtype`) and a manifest with
  the target's path and weights hash, layer ids, dtype, scale layout, each shard's sha256, tokens hash and size, and
  bytes per token (of the shard files). Shards are written atomically; a re-run keeps every shard whose file hash
  matches the previous manifest and that holds the same sequences, from the same target weights, layers, dtype and
  scale layout.
- `cfg.dtype == "float8_e4m3fn"`: both hidden states are stored as e4m3 with one float32 scale per row (token
  position), `aux_hidden_states_scale` [T] and `last_hidden_state_scale` [T] (`eagle.fp8`: scale = amax(|row|)/448);
  the manifest's `scales` says so (components/extract/feature_shards.py `FP8_SCALES`; null for the other dtypes). About
  half the bytes of bfloat16.
- `cfg.mode == "online"`: stores no features; training computes the same tensors (rounded to the same dtype, fp8
  included: quantised and dequantised per row).
- Distributed: `cfg.num_workers` 0 computes the shards in this process; N >= 1 computes the shards that need
  (re)writing on N Ray actors (infra/actor_pool.py), one shard per task, each a `FeatureWorker` loading the target
  once. A shard travels back as its safetensors bytes (`shard_bytes`, the same function in both paths; bytes, not
  tensors: Ray's pickling of torch tensors cannot carry float8) and this process writes every file and the manifest,
  so they are byte-identical whatever `num_workers` is, and resume is the same.
- in the engine (the run's `TargetRuntime` says so: `extract.engine: vllm`, or `target.runtime: vllm`): the shards'
  hidden states come from a vLLM started for the run (components/extract/engine.py), sent the same token ids; the
  shards, the manifest (its `engine` says which) and resume are the same, and this process never loads the whole
  target (embedding and lm_head are read by tensor name). Shards of the other engine are recomputed, not kept.
Not here: the shard file's layout (components/extract/feature_shards.py), training (components/train/stage.py) and the
dataset readers (components/train/data.py).
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from components.data.atomic import atomic_path, atomic_write_bytes, atomic_write_text, file_sha256, remove_stale_temps
from components.data.chat import tokenize_conversation
from components.data.regenerated import read_regenerated
from components.extract.feature_shards import FP8, pack_shard, scale_layout
from components.targets.runtime import STAGE_ENGINES, StageContext, TargetRuntime
from components.targets.target import declared_dtype, load_target, weights_sha256
from eagle.config_checks import NOT_IDENTITY, FieldError, at_least, one_of

MANIFEST = "manifest.json"
FEATURE_DTYPES = ("bfloat16", "float16", "float32", FP8)


@dataclass(frozen=True)
class ExtractConfig:
    mode: Literal["offline", "online"] = "offline"
    max_len: int = 512
    dtype: str = "bfloat16"
    batch_size: int = 8
    seqs_per_shard: int = 256
    device: str = "cpu"
    aux_layer_ids: tuple[int, ...] = ()  # fused layers (inputs of these target layers); empty: the default rule
    engine: str = "local"  # who runs the target: "local" (here or on Ray actors); "vllm" (an engine started here)
    # where and how fast, not what: the files are the same whatever these are (not part of a run's identity)
    num_workers: int = field(default=0, metadata=NOT_IDENTITY)  # 0: in this process; N: N Ray actors, a shard each
    cpus_per_worker: int = field(default=1, metadata=NOT_IDENTITY)  # of each actor (one GPU each too on CUDA)
    engine_replicas: int = field(default=1, metadata=NOT_IDENTITY)  # engine 'vllm': N > 1 engines, Ray actors

    def __post_init__(self) -> None:
        one_of(self, "mode", ("offline", "online"))
        one_of(self, "dtype", FEATURE_DTYPES)  # of the stored features
        one_of(self, "engine", STAGE_ENGINES)  # who computes the hidden states (components/extract/engine.py: vLLM)
        at_least(
            self,
            {
                "max_len": 2,
                "batch_size": 1,
                "seqs_per_shard": 1,
                "num_workers": 0,
                "cpus_per_worker": 1,
                "engine_replicas": 1,
            },
        )
        ids = tuple(self.aux_layer_ids)
        if ids and not (len(ids) == 3 and all(type(i) is int for i in ids) and 1 <= ids[0] < ids[1] < ids[2]):
            raise FieldError(
                self,
                "aux_layer_ids",
                f"{list(ids)} must be three distinct ascending layer ids >= 1, or "
                "empty for the default rule of the target's depth",
            )
        object.__setattr__(self, "aux_layer_ids", ids)

    def engine_conflict(self, in_engine: bool) -> tuple[str, str] | None:
        """(key, why) when this section cannot run where the runtime puts it (components/targets/runtime.py asks,
        for the whole config at load and again when the stage starts): online features or Ray actors beside the
        engine, or engine replicas without one."""
        if in_engine and self.mode == "online":
            return "engine", (
                "'vllm' needs mode 'offline': online features are computed inside training by this process"
            )
        if in_engine and self.num_workers:
            return "num_workers", (
                f"must be 0 with engine 'vllm' (one engine computes every shard), got {self.num_workers}"
            )
        if not in_engine and self.engine_replicas > 1:
            return "engine_replicas", (
                f"{self.engine_replicas} needs engine 'vllm' (replicas of the engine; local "
                "extraction scales with num_workers)"
            )
        return None


@dataclass(frozen=True)
class ExtractResult:
    out_dir: str
    mode: str
    manifest: str
    n_seqs: int
    n_tokens: int
    n_trained_tokens: int
    bytes_per_token: float


def tokenize_all(tokenizer, regen_dir: str, max_len: int):
    """Token ids and loss masks of every regenerated conversation (sequences with no trained token dropped)."""
    seqs, truncated = [], 0
    for conv in read_regenerated(regen_dir):
        t = tokenize_conversation(tokenizer, conv, max_len)
        truncated += t.truncated
        if sum(t.loss_mask) > 1:
            seqs.append((t.input_ids, t.loss_mask))
    if not seqs:
        raise ValueError(f"{regen_dir}: no conversation has assistant tokens within {max_len} tokens")
    return seqs, truncated


def _save_tokens(out: Path, seqs, vocab_size: int) -> int:
    import torch
    from safetensors.torch import save_file

    ids = torch.tensor([i for s, _ in seqs for i in s], dtype=torch.int32)
    mask = torch.tensor([m for _, ms in seqs for m in ms], dtype=torch.uint8)
    offsets = torch.tensor([0] + [len(s) for s, _ in seqs]).cumsum(0)
    counts = torch.bincount(ids[mask.bool()].long(), minlength=vocab_size)
    with atomic_path(out / "tokens.safetensors") as tmp:
        save_file({"input_ids": ids, "loss_mask": mask, "offsets": offsets, "token_counts": counts}, str(tmp))
    return int(mask.sum())


def _save_target_heads(out: Path, heads: dict) -> None:
    """The embedding, `lm_head` and the rest of `heads` (the target layer); a tied `lm_head` (the embedding itself:
    `tie_word_embeddings`) is stored once, as `embed_tokens`, and read back as both (components/train/data.py
    `TrainingData.open`)."""
    from safetensors.torch import save_file

    embed, lm_head = heads["embed_tokens"], heads["lm_head"]
    tied = lm_head is embed or (lm_head.shape == embed.shape and lm_head.data_ptr() == embed.data_ptr())
    with atomic_path(out / "target_heads.safetensors") as tmp:
        kept = {k: v for k, v in heads.items() if not (tied and k == "lm_head")}
        save_file(kept, str(tmp), metadata={"tied": str(tied).lower()})


def target_layer_tensors(target, target_dir: str, index: int) -> dict:
    """{"layer.<part>": tensor, "norm": tensor}: the decoder layer the highest fused state enters and the final norm
    (eagle/train.py `start_from_target_layer`, `train.head_init: target-layer`), from the loaded target or, when
    the engine extracts, read by tensor name; parts the target does not have (another family's names) are left
    out."""
    from eagle.train import TARGET_LAYER_PARTS

    names = {f"model.layers.{index}.{p}": f"layer.{p}" for p in TARGET_LAYER_PARTS} | {"model.norm.weight": "norm"}
    if target is None:
        from components.targets.target import read_tensors

        found = read_tensors(target_dir, list(names))
    else:
        state = target.state_dict()
        found = {n: state[n] for n in names if n in state}
    return {names[n]: t.detach().float().contiguous().cpu() for n, t in found.items()}


def _open_target(cfg: ExtractConfig, target_dir: str, trust_remote_code: bool, in_engine: bool):
    """(loaded target or None, its config, tokenizer, {"embed_tokens", "lm_head"} float32): `in_engine` (the
    features come from the engine) the target is never loaded here (its embedding and lm_head are read by tensor
    name)."""
    if in_engine:
        from components.extract.engine import target_heads
        from components.targets.target import check_target

        config, tokenizer = check_target(target_dir, trust_remote_code)
        return None, config, tokenizer, target_heads(target_dir, config)
    target, tokenizer = load_target(target_dir, cfg.device, trust_remote_code=trust_remote_code)
    heads = {
        "embed_tokens": target.get_input_embeddings().weight.detach().float().contiguous().cpu(),
        "lm_head": target.get_output_embeddings().weight.detach().float().contiguous().cpu(),
    }
    return target, target.config, tokenizer, heads


class FeatureWorker:
    """A Ray actor's state (infra/actor_pool.py): the config, the fused layer ids and, from its first shard on, the
    loaded target."""

    def __init__(self, cfg: ExtractConfig, target_dir: str, layer_ids: list[int], trust_remote_code: bool):
        self.cfg, self.target_dir, self.layer_ids = cfg, target_dir, layer_ids
        self.trust_remote_code = trust_remote_code
        self.target = None

    def run(self, shard: int, seqs) -> bytes:
        if self.target is None:  # in the first task, so a load error is that task's error, raised as itself
            self.target = load_target(self.target_dir, self.cfg.device, trust_remote_code=self.trust_remote_code)[0]
        return shard_bytes(self.target, self.layer_ids, list(seqs), self.cfg)


def shard_bytes(target, layer_ids, seqs, cfg: ExtractConfig) -> bytes:
    """The safetensors file of the feature shard holding `seqs` (what the driver writes, in- or out-of-process)."""
    return pack_shard(seqs, _local_features(target, layer_ids, seqs, cfg), cfg.dtype)


def _local_features(target, layer_ids, seqs, cfg: ExtractConfig):
    """(aux_hidden_states [T, 3H], last_hidden_state [T, H]) of each sequence, in order, from the loaded target."""
    import torch

    from eagle.features import target_forward

    for b in range(0, len(seqs), cfg.batch_size):
        chunk = seqs[b : b + cfg.batch_size]
        width = max(len(s) for s, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        att = torch.zeros_like(ids)
        for r, (s, _) in enumerate(chunk):
            ids[r, : len(s)] = torch.tensor(s)
            att[r, : len(s)] = 1
        with torch.no_grad():
            step = target_forward(target, ids.to(cfg.device), layer_ids, attention_mask=att.to(cfg.device))
        for r, (s, _) in enumerate(chunk):
            yield step.aux_BT3H[r, : len(s)], step.last_hidden_BTH[r, : len(s)]


def extract(
    cfg: ExtractConfig,
    target_dir: str,
    regen_dir: str,
    out_dir: str,
    progress: Callable[[str], None] = print,
    context: StageContext = StageContext(),
) -> ExtractResult:
    """Extract into `out_dir` (resuming a previous run). `cfg.num_workers` >= 1 computes the shards on Ray; where
    `context.runtime` (components/targets/runtime.py; None: the one `cfg` alone says) extracts in the engine, a vLLM
    started here does (`context.settings`: the infra.settings.Settings that say where Ray runs and where vLLM's venv
    is; None: from the environment)."""
    trust_remote_code, ray_settings = context.trust_remote_code, context.settings
    runtime = context.runtime or TargetRuntime.from_sections(extract=cfg)  # refuses what the engine cannot run
    engine = runtime.engine_of("extract")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)  # left by a run killed mid-write
    target, config, tokenizer, heads = _open_target(cfg, target_dir, trust_remote_code, runtime.extracts_in_engine)
    layer_ids = fused_layer_ids(cfg, config.num_hidden_layers, target_dir)
    seqs, truncated = tokenize_all(tokenizer, regen_dir, cfg.max_len)
    n_trained = _save_tokens(out, seqs, config.vocab_size)
    _save_target_heads(out, {**heads, **target_layer_tensors(target, target_dir, layer_ids[-1])})
    _save_target_config(out, config, target_dir)
    target_sha = weights_sha256(target_dir)  # once: hashing a real target's weights takes a while
    previous = _previous_manifest(out / MANIFEST)
    same_source = (
        previous.get("dtype"),
        previous.get("scales"),
        previous.get("layer_ids"),
        previous.get("target", {}).get("weights_sha256"),
        previous.get("engine", "local"),
    ) == (cfg.dtype, scale_layout(cfg.dtype), layer_ids, target_sha, engine)  # else other features
    known = {s["file"]: (s["sha256"], s.get("tokens_sha256")) for s in previous.get("shards", []) if same_source}
    parts = (
        [seqs[i : i + cfg.seqs_per_shard] for i in range(0, len(seqs), cfg.seqs_per_shard)]
        if cfg.mode == "offline"
        else []
    )
    shards, pending = _kept_shards(out, parts, known)  # shard index -> manifest entry; index -> sequences to write

    def save_manifest() -> dict:
        manifest = _manifest(
            cfg,
            engine,
            target_dir,
            target_sha,
            layer_ids,
            (seqs, n_trained, truncated),
            [shards[k] for k in sorted(shards)],
        )
        atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        return manifest

    def finish(k: int, data: bytes, seconds: float) -> None:
        path = _shard_path(out, k)
        atomic_write_bytes(path, data)
        shards[k] = _shard_entry(path, parts[k], file_sha256(path))
        progress(f"extract: shard {k + 1}/{len(parts)}, {shards[k]['n_tokens']} tokens ({seconds:.2f} s)")
        save_manifest()  # after each shard: a killed run keeps what it finished

    if pending and runtime.extracts_in_engine:
        from components.extract.engine import CaptureTarget, run_in_engine

        run_in_engine(cfg, CaptureTarget(target_dir, config, layer_ids), pending, finish, out, ray_settings, progress)
    elif pending and cfg.num_workers:
        from infra.actor_pool import run_on_ray

        del target  # the workers load their own; on CUDA its memory goes back for the worker on this device
        if str(cfg.device).startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
        run_on_ray(
            cfg,
            FeatureWorker,
            (target_dir, list(layer_ids), trust_remote_code),
            pending,
            finish,
            "extract",
            ray_settings,
            progress,
        )
    else:
        for k, part in pending.items():
            t0 = time.perf_counter()
            finish(k, shard_bytes(target, layer_ids, part, cfg), time.perf_counter() - t0)
    manifest = save_manifest()
    return ExtractResult(
        str(out), cfg.mode, str(out / MANIFEST), len(seqs), manifest["n_tokens"], n_trained, manifest["bytes_per_token"]
    )


def _shard_path(out: Path, k: int) -> Path:
    return out / f"features-{k:05d}.safetensors"


def _tokens_sha256(part) -> str:
    """The hash of the sequences a shard holds."""
    return hashlib.sha256(json.dumps(part).encode()).hexdigest()


def _shard_entry(path: Path, part, sha: str) -> dict:
    return {
        "file": path.name,
        "sha256": sha,
        "tokens_sha256": _tokens_sha256(part),
        "n_seqs": len(part),
        "n_tokens": sum(len(s) for s, _ in part),
        "bytes": path.stat().st_size,
    }


def _kept_shards(out: Path, parts, known: dict) -> tuple[dict[int, dict], dict[int, list]]:
    """(index -> manifest entry of each shard a previous run wrote for these very sequences and features, whose file
    hash matches its manifest; index -> sequences of every other shard, to be written)."""
    kept, pending = {}, {}
    for k, part in enumerate(parts):
        path = _shard_path(out, k)
        sha = file_sha256(path) if path.is_file() else None
        if sha is not None and known.get(path.name) == (sha, _tokens_sha256(part)):
            kept[k] = _shard_entry(path, part, sha)
        else:
            pending[k] = part
    return kept, pending


def fused_layer_ids(cfg: ExtractConfig, n: int, target_dir: str) -> list[int]:
    """`cfg.aux_layer_ids` checked against the target's depth `n`, or the default rule for it."""
    from eagle.config import check_aux_layer_ids, default_aux_layer_ids

    if not cfg.aux_layer_ids:
        return list(default_aux_layer_ids(n))
    try:
        return list(check_aux_layer_ids(cfg.aux_layer_ids, n))
    except ValueError as e:
        raise ValueError(f"extract.aux_layer_ids for {target_dir}: {e}") from None


def _save_target_config(out: Path, config, target_dir: str) -> None:
    """The target's config, stating the dtype of the target's own config.json (a loaded target is in fp32)."""
    config = copy.deepcopy(config)
    config.dtype = declared_dtype(target_dir)
    atomic_write_text(out / "target_config" / "config.json", config.to_json_string())


def _previous_manifest(path: Path) -> dict:
    """The manifest of an earlier run, or {} when there is none or it is unreadable (then every shard is redone)."""
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return previous if isinstance(previous, dict) else {}


def _manifest(
    cfg: ExtractConfig, engine: str, target_dir: str, target_sha: str, layer_ids, counts: tuple[list, int, int], shards
):
    """The manifest; `engine` who computed the features ("local" or the engine's name), `counts` (the tokenised
    sequences, trained tokens, truncated sequences)."""
    seqs, n_trained, truncated = counts
    n_tokens = sum(len(s) for s, _ in seqs)
    total = sum(s["bytes"] for s in shards)
    return {
        "format_version": 1,
        "mode": cfg.mode,
        "engine": engine,
        "target": {"path": str(target_dir), "weights_sha256": target_sha},
        "layer_ids": layer_ids,
        "dtype": cfg.dtype,
        "scales": scale_layout(cfg.dtype),
        "max_len": cfg.max_len,
        "n_seqs": len(seqs),
        "n_tokens": n_tokens,
        "n_trained_tokens": n_trained,
        "n_truncated": truncated,
        "shards": shards,
        "bytes_per_token": total / n_tokens if shards else 0.0,
    }
