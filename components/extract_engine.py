"""Extraction through the serving engine: the feature shards computed by vLLM instead of this process.

Purpose: with `extract.engine: vllm`, `components.extract.extract` tokenises, counts and writes the manifest as for
local extraction, and hands the shards to `run_in_engine(...)`, which starts vLLM (infra/vllm_extract.py:
`extract_hidden_states` at the fused ids plus the last layer id N, a hidden-states KV connector writing one file per
request under `OUT/engine-hidden-states/`), sends each sequence's token ids exactly as local extraction tokenised
them (`max_tokens` 1, `extract.batch_size` requests in flight), and builds the same shard as local extraction
(`components.extract.pack_shard`, the same dtypes, fp8 included):
- aux_hidden_states [T, 3H]: the engine's ids k (inputs of decoder layers k), concatenated in ascending order;
- last_hidden_state [T, H]: the engine's id N (the residual before the final norm) through the target's final
  RMSNorm, its weight read by tensor name from the target's safetensors (`target_final_norm`), which is what local
  extraction stores (the decoder's output); the teacher is computed from it with `lm_head` as for local shards.
The engine's files of a shard are deleted once the shard is written, so they take at most one shard's
`seqs_per_shard x T x 4 x H` values of the engine's dtype on disk; a killed run resumes at the shard it was on
(the resume rule of components/extract.py) and clears the files it left. Our process never loads the whole target:
`target_heads` reads the embedding and `lm_head` by name too (the embedding when the weights are tied).
Measured on the tiny fp32 target (tests/test_extract_engine.py): features equal to local extraction's within 1e-5
relative.
Run: `extract(ExtractConfig(engine="vllm"), ...)`, or `{"extract": {"engine": "vllm"}}` in a pipeline config; needs
vLLM's venv (`make vllm`) or EAGLE_VLLM_PYTHON.
Not here: the vLLM process (infra/), the shard format and resume rule (components/extract.py), several engine
replicas, and targets whose final norm is not an RMSNorm (Gemma's (1 + w), LayerNorm with bias: refused).
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from components.targets import TargetError, declared_dtype, read_tensors

STORAGE = "engine-hidden-states"  # under the extraction's out_dir: the engine's per-request files, one shard's worth
NORM, EMBED, LM_HEAD = "model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class FinalNorm:
    """The target's final RMSNorm: weight_H (float32) and eps."""

    weight_H: Any
    eps: float

    def __call__(self, x_TH):
        import torch

        x = x_TH.float()
        return self.weight_H * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def target_final_norm(target_dir: str, config) -> FinalNorm:
    """The final norm of a Llama / Mistral / Qwen2 / Qwen3-family target, read by tensor name."""
    model_type = str(getattr(config, "model_type", ""))
    found = read_tensors(target_dir, [NORM, NORM.replace(".weight", ".bias")])
    if model_type.startswith("gemma") or len(found) != 1 or NORM not in found:
        raise TargetError(f"{target_dir}: extraction through the engine needs a final RMSNorm `{NORM}` (no bias, "
                          f"Llama/Mistral/Qwen families); this {model_type or 'model'} target has "
                          f"{sorted(found) or 'none'}: use extract.engine 'local'")
    return FinalNorm(found[NORM].float(), float(getattr(config, "rms_norm_eps", 1e-6)))


def target_heads(target_dir: str, config) -> dict:
    """{"embed_tokens", "lm_head"} (float32) by tensor name; `lm_head` is the embedding when the weights are tied."""
    found = read_tensors(target_dir, [EMBED, LM_HEAD])
    if EMBED not in found:
        raise TargetError(f"{target_dir}: its safetensors have no `{EMBED}`; extraction through the engine reads the "
                          "embedding by that name (Llama/Mistral/Qwen families): use extract.engine 'local'")
    if LM_HEAD not in found and not getattr(config, "tie_word_embeddings", False):
        raise TargetError(f"{target_dir}: its safetensors have no `{LM_HEAD}` and config.json does not tie it to the "
                          "embedding (tie_word_embeddings); the weights are incomplete")
    embed = found[EMBED].float().contiguous()
    return {"embed_tokens": embed, "lm_head": found[LM_HEAD].float().contiguous() if LM_HEAD in found else embed}


def engine_features(hidden_TnH, norm: FinalNorm):
    """(aux_hidden_states [T, 3H], last_hidden_state [T, H]) from the engine's [T, 4, H] (three fused ids, then N)."""
    T, n, H = hidden_TnH.shape
    return hidden_TnH[:, :n - 1].reshape(T, (n - 1) * H), norm(hidden_TnH[:, n - 1])


def run_in_engine(cfg, target_dir: str, config, layer_ids: list[int], pending: dict[int, list],
                  finish: Callable[[int, bytes, float], None], out: Path, settings=None,
                  progress: Callable[[str], None] = print) -> None:
    """Compute every pending shard (index -> sequences (input_ids, loss_mask)) in one vLLM started here;
    `finish(shard, bytes, seconds)` writes each. `settings`: infra.settings.Settings (None: from the environment)."""
    from components.extract import pack_shard
    from infra.settings import Settings
    from infra.vllm_extract import hidden_states_spec, load_hidden_states, remove_hidden_states, request_hidden_states
    from infra.vllm_server import VllmServer

    norm = target_final_norm(target_dir, config)
    storage = out / STORAGE
    shutil.rmtree(storage, ignore_errors=True)  # files a killed run left
    storage.mkdir(parents=True)
    n = int(config.num_hidden_layers)
    spec = hidden_states_spec(target_dir, [*layer_ids, n], storage, cfg.max_len + 1, declared_dtype(target_dir),
                              context=getattr(config, "max_position_embeddings", None))
    progress(f"extract (vLLM): starting the engine for layer ids {[*layer_ids, n]} ({len(pending)} shards)")
    with VllmServer(spec, settings or Settings.from_env()) as server, \
            ThreadPoolExecutor(max_workers=cfg.batch_size) as pool:
        for k, part in pending.items():
            t0 = time.perf_counter()
            paths = list(pool.map(lambda s: request_hidden_states(server, s[0]), part))
            hidden = (load_hidden_states(p, s) for p, (s, _) in zip(paths, part))
            data = pack_shard(part, (engine_features(h, norm) for h in hidden), cfg.dtype)
            finish(k, data, time.perf_counter() - t0)
            for p in paths:
                remove_hidden_states(p)
    shutil.rmtree(storage, ignore_errors=True)
