"""vLLM as the feature extractor: the engine started with `extract_hidden_states`, one request per sequence.

Purpose: `hidden_states_spec(target_dir, layer_ids, storage_dir, max_model_len)` is the `EngineSpec` of a vLLM server
(infra/vllm_server.py: its own venv, loopback, a free port, its log kept, stopped by its process group) that caches
the hidden states at `layer_ids` (id k = the input of decoder layer k; id N = the residual before the final norm)
and writes them per request, through a KV connector, to `storage_dir/<request id>.safetensors`. On a GPU it uses
vLLM's stock `ExampleHiddenStatesConnector`; on the CPU build the project's `CpuHiddenStatesConnector`
(infra/vllm_plugins/, put on the engine's PYTHONPATH). `request_hidden_states(server, ids)` sends one token
sequence (`max_tokens` 1) and returns the file's path from the answer's `kv_transfer_params`;
`load_hidden_states(path, ids)` waits until the engine released the file's `.lock` (it writes after the request
finished), reads `hidden_states` [T, n_ids, H] (the engine's dtype) and checks the engine saw exactly `ids`;
`remove_hidden_states(path)` deletes the file and its lock.
Settings that vLLM 0.32 needs here: `--no-enable-chunked-prefill` (a sequence is one prefill), `max_tokens` 1,
`--speculative-config {"method": "extract_hidden_states", "num_speculative_tokens": 1, "draft_model_config":
{"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}`, `--kv-transfer-config {"kv_connector": ...,
"kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": DIR}}`.
Run: through `components.extract.stage.extract` with `extract.engine: vllm`; tests/test_extract_engine.py.
Not here: turning the hidden states into shards (components/extract/engine.py), any torch beyond reading a file.
"""

from __future__ import annotations

import json
from pathlib import Path

from infra.vllm_engine_spec import EngineSpec
from infra.vllm_server import EngineError, VllmServer

PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_plugins"
CPU_CONNECTOR = ("CpuHiddenStatesConnector", "cpu_hidden_states_connector")  # class, module (in PLUGIN_DIR)
GPU_CONNECTOR = "ExampleHiddenStatesConnector"  # vLLM's own, registered by name


def hidden_states_spec(
    target_dir: str,
    layer_ids: list[int],
    storage_dir: Path,
    max_model_len: int,
    dtype: str,
    context: int | None = None,
    device: str = "auto",
    kv_cache_bytes: int | None = None,
) -> EngineSpec:
    """The engine that writes the hidden states at `layer_ids` of every request under `storage_dir`, running the
    target in `dtype` (state it: vLLM's "auto" runs a float32 target in 16 bits). `context`: the target's
    `max_position_embeddings`; a `max_model_len` one past it (room for the one token a request generates, never an
    input of a feature) is allowed explicitly. `kv_cache_bytes`: on the CPU build, the engine's KV cache
    (`--kv-cache-memory-bytes`) instead of a share of host memory, so that several engines fit one host."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }
    kv = {"kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)}}
    env: list[tuple[str, str]] = []
    memory: tuple[str, ...] = ()
    if context is not None and max_model_len > context:
        env.append(("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1"))
    if EngineSpec(str(target_dir), method=None, device=device).resolved_device() == "cpu":  # type: ignore[arg-type]
        kv.update(kv_connector=CPU_CONNECTOR[0], kv_connector_module_path=CPU_CONNECTOR[1])
        env.append(("PYTHONPATH", str(PLUGIN_DIR)))
        memory = ("--kv-cache-memory-bytes", str(kv_cache_bytes)) if kv_cache_bytes else ()
    else:
        kv["kv_connector"] = GPU_CONNECTOR
    args = (
        "--speculative-config",
        json.dumps(spec),
        "--kv-transfer-config",
        json.dumps(kv),
        "--no-enable-chunked-prefill",
        *memory,
    )
    return EngineSpec(
        str(target_dir),
        method=None,
        dtype=dtype,
        max_model_len=max_model_len,
        device=device,
        extra_args=args,
        env=tuple(env),
    )  # type: ignore[arg-type]


def request_hidden_states(server: VllmServer, ids: list[int], timeout_s: float = 600.0) -> str:
    """Prefill `ids` in the engine; the path of the file its connector writes the hidden states to."""
    r = server._post(
        "/v1/completions",
        {"model": server.spec.served_model_name, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0},
        timeout_s=timeout_s,
    )
    path = (r.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        raise EngineError(
            f"vLLM at {server.base_url} returned no kv_transfer_params.hidden_states_path: is it "
            f"running with the extract_hidden_states method and a hidden-states connector? "
            f"(log: {server.log_path})"
        )
    return str(path)


def load_hidden_states(path: str, ids: list[int]):
    """`hidden_states` [T, n_ids, H] of the file at `path`, once the engine has released its lock; an `EngineError`
    when the file is missing (the engine died before writing it) or holds other tokens than `ids`."""
    import fcntl

    from safetensors.torch import load_file

    try:
        with open(path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # sleeps until the engine's writer releases LOCK_EX
            data = load_file(path, device="cpu")
    except OSError as e:
        raise EngineError(f"vLLM did not write its hidden states ({e}): did the engine die? see its log") from None
    if data["token_ids"].tolist() != list(ids):
        raise EngineError(
            f"{path}: the engine's token ids differ from the {len(ids)} sent; is another client using "
            "this engine's storage directory?"
        )
    return data["hidden_states"]


def remove_hidden_states(path: str) -> None:
    """Delete a request's hidden-state file and its lock (either may be gone already)."""
    for p in (Path(path), Path(path + ".lock")):
        p.unlink(missing_ok=True)
