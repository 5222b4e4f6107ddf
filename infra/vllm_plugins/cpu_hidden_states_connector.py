"""vLLM plugin: the hidden-states KV connector for vLLM's CPU build (loaded by the engine, not by this project).

Purpose: vLLM's `extract_hidden_states` speculative method caches the hidden states of the listed layer ids, and
its stock `ExampleHiddenStatesConnector` writes them per request to `<shared_storage_path>/<request id>.safetensors`
(`hidden_states` [tokens, n_ids, H] in the engine's dtype, `token_ids` [tokens]), returning the path in the
request's `kv_transfer_params["hidden_states_path"]`. The stock connector copies through CUDA streams, events and
pinned memory, which fails on the CPU build (`pin_memory=True requires a CUDA or other accelerator backend`).
`CpuHiddenStatesConnector` overrides only `_submit_async_write`: it indexes the cache and writes the file
synchronously in the engine's step, then releases the `.lock` companion; its completion objects are always done.
Everything else (file names, lock files, `load_hidden_states`' wait on the lock) is the stock connector's.
Run: by the engine, with `--kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector",
"kv_connector_module_path": "cpu_hidden_states_connector", "kv_role": "kv_producer", ...}'` and this directory on
the engine's PYTHONPATH (infra/vllm_extract.py does both).
Not here: anything of this project; this module imports only vLLM, torch and safetensors (it runs in vLLM's venv).
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """A completion object whose copy is always finished (the write below is synchronous)."""

    @staticmethod
    def query() -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous copy and write (no CUDA stream, event or pinned memory)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a reader waiting in load_hidden_states goes on
        self._req_copy_events[pending.req_id] = _Done()
