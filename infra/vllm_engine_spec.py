"""What a vLLM server serves and the command line that serves it: `EngineSpec`.

Purpose: `EngineSpec(target_dir, head_dir, method, ...)` names the target, the head and the speculative method
("eagle3", "ngram" or None for plain decoding), K and its per-batch-size schedule, dtype, context, device and scale;
`speculative_config()` is the `--speculative-config` vLLM takes (`parallel_drafting` for a head made for it:
`head_drafts_in_parallel`), `server_args(port)` the arguments of vLLM's OpenAI server (on the CPU build
`--gpu-memory-utilization` as a share of host memory and a KV cache sized to the target, infra/vllm_memory.py) and
`launch_command()` the `vllm serve` line a user runs on a GPU cluster. `host_device()` is the device "auto" means
here; `local_path(...)` a model directory made absolute for the engine.
Run: through infra/vllm_server.py `VllmServer(spec, settings)`, components/serving/launch.py (printed commands).
Not here: starting and talking to the server (infra/vllm_server.py), vLLM's scale flags (infra/vllm_scale.py).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from infra.settings import BIND_HOST
from infra.vllm_memory import cpu_kv_cache_bytes
from infra.vllm_scale import EngineScale


def host_device() -> str:
    """The device vLLM runs on here when a spec says "auto": 'cuda' with an NVIDIA driver, else 'cpu'."""
    return "cuda" if Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia").exists() else "cpu"


@dataclass(frozen=True)
class EngineSpec:
    """What to serve. `method`: "eagle3" (with `head_dir`), "ngram" (prompt lookup), or None (plain decoding)."""

    target_dir: str
    head_dir: str | None = None
    method: Literal["eagle3", "ngram"] | None = "eagle3"
    num_speculative_tokens: int = 5
    dtype: str = "float32"  # identity checks need fp32: bf16 outputs depend on the batch shape even without a head
    max_model_len: int = 512
    served_model_name: str = "target"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cpu_memory_share: float = 0.25  # vLLM's CPU build reads --gpu-memory-utilization as a share of host memory
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    # vLLM's `num_speculative_tokens_per_batch_size`: (first batch size, last batch size, K) ranges, K 0 = no drafts
    # there; each K is capped at `num_speculative_tokens` (measured: components/evaluate/load_sweep.py derives it)
    k_schedule: tuple[tuple[int, int, int], ...] | None = None
    env: tuple[tuple[str, str], ...] = ()  # more environment of the engine (e.g. PYTHONPATH of a connector plugin)
    scale: EngineScale | None = None  # None: the run's (`Settings.engine_scale`, set by the flow), else one device
    # vLLM's `parallel_drafting` (P-EAGLE: all K drafts in one head pass); None: on when the head is made for it
    parallel_drafting: bool | None = None
    # on the CPU: compiled (vLLM's default, torch.compile with inductor; a start compiles ~50 s the first time on a
    # machine, ~12 s from inductor's cache after; it decoded 12-16% faster on 2 Zen 5 cores) or eager
    # (`--enforce-eager`, starts in seconds). None: the run's (`Settings.engine_compiled`, set by the evaluation).
    compiled: bool | None = None

    def __post_init__(self) -> None:
        if self.method == "eagle3" and not self.head_dir:
            raise ValueError("method eagle3 needs head_dir (an exported head directory)")
        if self.method not in ("eagle3", "ngram", None):
            raise ValueError(f"unknown speculative method {self.method!r}; use eagle3, ngram or None")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")

    def speculative_config(self) -> dict[str, Any] | None:
        if self.method is None:
            return None
        if self.method == "ngram":
            return {
                "method": "ngram",
                "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 1,
            }
        spec: dict[str, Any] = {
            "method": "eagle3",
            "model": local_path(self.head_dir),
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.drafts_in_parallel():
            spec["parallel_drafting"] = True
        if self.k_schedule:
            spec["num_speculative_tokens_per_batch_size"] = [list(r) for r in self.k_schedule]
        return spec

    def drafts_in_parallel(self) -> bool:
        """Whether vLLM drafts with the head in parallel: `parallel_drafting`, or when None what the head says."""
        if self.parallel_drafting is not None:
            return self.parallel_drafting
        return self.method == "eagle3" and head_drafts_in_parallel(self.head_dir)

    def resolved_device(self) -> str:
        return self.device if self.device != "auto" else host_device()

    @property
    def compiles(self) -> bool:
        """Whether its start compiles: compiled on the CPU (a GPU's vLLM is never given `--enforce-eager` here)."""
        return bool(self.compiled) and self.resolved_device() == "cpu"

    def server_args(self, port: int, host: str | None = BIND_HOST) -> list[str]:
        """Arguments of vLLM's OpenAI server; `host=None` leaves the interface to vLLM (printed commands only)."""
        args = [
            "--model",
            local_path(self.target_dir),
            "--served-model-name",
            self.served_model_name,
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--port",
            str(port),
        ]
        args += ["--host", host] if host is not None else []
        if self.resolved_device() == "cpu":  # the KV cache the pipeline's requests need, at most the share
            kv = cpu_kv_cache_bytes(
                self.target_dir, self.head_dir, self.dtype, self.max_model_len, self.cpu_memory_share
            )
            args += ["--gpu-memory-utilization", str(self.cpu_memory_share)]
            args += [] if self.compiled else ["--enforce-eager"]
            args += ["--kv-cache-memory-bytes", str(kv)] if kv else []
        spec = self.speculative_config()
        if spec is not None:
            args += ["--speculative-config", json.dumps(spec)]
        return args + (self.scale.args() if self.scale else []) + list(self.extra_args)

    def launch_command(self, port: int = 8000) -> str:
        """The shell command a user runs on their cluster (`vllm serve` takes the model as its first argument and
        the same flags; the interface to listen on is theirs to add with --host)."""
        args = self.server_args(port, host=None)[2:]
        return "vllm serve " + " ".join(shlex.quote(a) for a in [local_path(self.target_dir), *args])


def local_path(model: str | Path | None) -> str:
    """A model or head given as a directory that exists here, made absolute (the engine runs in another working
    directory, where a relative path would be read as a hub id); anything else as given."""
    return str(Path(model).resolve()) if model and Path(model).exists() else str(model)


def head_drafts_in_parallel(head_dir: str | Path | None) -> bool:
    """Whether a head directory is made for parallel drafting: its config.json names the masked slots' token
    (`mask_token_id`, the key vLLM's proposer reads first; eagle/export.py writes it for the "parallel"
    variant)."""
    if not head_dir:
        return False
    try:
        cfg = json.loads((Path(head_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and cfg.get("mask_token_id") is not None
