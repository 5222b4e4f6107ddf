"""How much memory the vLLM engines the pipeline starts draw on, and how big a KV cache a CPU engine needs.

Purpose: `host_memory(device)` gives (total, available) bytes of host memory (CPU build) or of the first GPU, so
that the load sweep knows how many servers fit at once. `cpu_kv_cache_bytes(...)` sizes a CPU engine's KV cache
from the target's own shape: vLLM's CPU build otherwise reserves its `--gpu-memory-utilization` share of host memory
for the cache (2-5 GiB on a 24 GB machine for a 30 MB target), and zeroing it costs every start seconds of wall
time and of CPU (bench/README.md, "Figures moved from code comments").
The size is the cache of `KV_SEQS` sequences of `max_model_len` tokens each, target and head layers together, at
most the share: enough for the concurrency the pipeline asks of an engine (16 in the load sweep by default; vLLM
queues requests past what its cache holds, it never fails them).
Not here: the GPU build's memory (`--gpu-memory-utilization` there, unchanged); starting engines
(infra/vllm_server.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

KV_SEQS = 64  # full-length sequences a CPU engine's KV cache holds at once
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def host_memory(device: str) -> tuple[int, int]:
    """(total, available) bytes the engines draw on: host memory (/proc/meminfo) for the CPU build, else the first
    GPU's (nvidia-smi); (0, 0) when it cannot be read."""
    if device == "cpu":
        try:
            info = dict(ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines() if ":" in ln)
            return int(info["MemTotal"].split()[0]) * 1024, int(info["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return 0, 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.splitlines()[0]
        total, free = (int(x) * 2**20 for x in out.split(","))
        return total, free
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        return 0, 0


def kv_bytes_per_token(config: dict, dtype: str) -> int | None:
    """K and V of one token in every layer of a transformers config (`text_config` when nested); None when the
    config does not say its layers, heads and width."""
    c = config.get("text_config") or config
    try:
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
        return 2 * int(c["num_hidden_layers"]) * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def cpu_kv_cache_bytes(
    target_dir: str, head_dir: str | None, dtype: str, max_model_len: int, share: float
) -> int | None:
    """The KV cache a CPU engine of this target (and head) needs for `KV_SEQS` sequences of `max_model_len` tokens,
    at most `share` of host memory; None (vLLM's share then) when a config cannot be read."""

    def config(d: str | None) -> dict | None:
        try:
            return json.loads((Path(d) / "config.json").read_text()) if d else None
        except (OSError, ValueError):
            return None

    target, head = config(target_dir), config(head_dir)
    per_token = kv_bytes_per_token(target, dtype) if target else None
    if per_token is None or (head_dir and head is None):
        return None
    if head is not None:  # the head's layers hold their own cache beside the target's (its shape, else the target's)
        per_token += kv_bytes_per_token({**(target.get("text_config") or target), **head}, dtype) or 0
    need = per_token * max_model_len * KV_SEQS
    total = host_memory("cpu")[0]
    return min(need, int(share * total)) if total else need
