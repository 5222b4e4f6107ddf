"""A CPU engine's KV cache is sized to the target (and head) the pipeline serves, at most the memory share.

Purpose: infra/vllm_memory.py reads the target's and the head's config.json and asks vLLM's CPU build for
`KV_SEQS` full-length sequences' cache (`--kv-cache-memory-bytes`) instead of its whole `--gpu-memory-utilization`
share of host memory; these tests check the arithmetic against the configs' shapes, the cap, the fall-back to the
share when a config cannot be read, and that only a CPU engine's command line carries the flag. Every engine test
of the suite then starts vLLM with that cache (what it accepts and serves with).
Run: `python -m pytest tests/test_vllm_memory.py` (about a second).
Not here: the start-up time it saves (infra/vllm_memory.py's docstring, measured), the GPU build's memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.vllm_memory import KV_SEQS, cpu_kv_cache_bytes, host_memory, kv_bytes_per_token
from infra.vllm_engine_spec import EngineSpec

LLAMA = {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}
HEAD = {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32}


def _dir(tmp_path: Path, name: str, config: dict) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def test_bytes_per_token_follow_the_configs_shape():
    assert kv_bytes_per_token(LLAMA, "float32") == 2 * 6 * 2 * 64 * 4  # head_dim = hidden / heads
    assert kv_bytes_per_token(LLAMA, "bfloat16") == 2 * 6 * 2 * 64 * 2
    assert kv_bytes_per_token({**LLAMA, "num_key_value_heads": None}, "float32") == 2 * 6 * 4 * 64 * 4  # MHA
    assert kv_bytes_per_token({"text_config": {**LLAMA, "head_dim": 128}}, "float16") == 2 * 6 * 2 * 128 * 2
    assert kv_bytes_per_token({"hidden_size": 256}, "float32") is None


def test_target_and_head_caches_for_kv_seqs_full_sequences_at_most_the_share(tmp_path: Path):
    target, head = _dir(tmp_path, "target", LLAMA), _dir(tmp_path, "head", HEAD)
    per_token = 2 * 6 * 2 * 64 * 4 + 2 * 1 * 4 * 32 * 4
    assert cpu_kv_cache_bytes(target, head, "float32", 512, 1.0) == per_token * 512 * KV_SEQS
    assert cpu_kv_cache_bytes(target, None, "float32", 512, 1.0) == 2 * 6 * 2 * 64 * 4 * 512 * KV_SEQS
    total = host_memory("cpu")[0]
    assert total > 0 and cpu_kv_cache_bytes(target, head, "float32", 512, 1e-6) == int(1e-6 * total)
    # a config that cannot be read: vLLM's share, as before
    assert cpu_kv_cache_bytes(str(tmp_path / "missing"), None, "float32", 512, 0.25) is None
    assert cpu_kv_cache_bytes(target, str(tmp_path / "missing"), "float32", 512, 0.25) is None


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_only_a_cpu_engine_is_given_the_cache_size(tmp_path: Path, device: str):
    target, head = _dir(tmp_path, "target", LLAMA), _dir(tmp_path, "head", HEAD)
    args = EngineSpec(target, head, max_model_len=256, device=device).server_args(8000)
    if device == "cuda":
        assert "--kv-cache-memory-bytes" not in args and "--gpu-memory-utilization" not in args
        return
    size = int(args[args.index("--kv-cache-memory-bytes") + 1])
    assert size == cpu_kv_cache_bytes(target, head, "float32", 256, 0.25) > 0
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.25"
