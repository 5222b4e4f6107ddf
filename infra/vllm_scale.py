"""vLLM's scale settings: how the engine spreads a target over devices and nodes, passed through as they are.

Purpose: `EngineScale(tensor_parallel_size, pipeline_parallel_size, data_parallel_size, distributed_executor_backend)`
gives the flags (`args()`) that `infra.vllm_engine_spec.EngineSpec.server_args` appends to every
vLLM command line; the train flow puts the config's `target` values in `Settings.engine_scale`, so that each vLLM a
run starts (regeneration, extraction, evaluation, load sweep) gets them. With `distributed_executor_backend: ray`
vLLM places its workers on the Ray cluster the engine's environment names (RAY_ADDRESS, inherited).
Commands (a user's cluster): `vllm serve TARGET --tensor-parallel-size 8` (one node, 8 GPUs);
`--tensor-parallel-size 8 --pipeline-parallel-size 2 --distributed-executor-backend ray` (two nodes of a Ray cluster,
`ray start --head` on one, `ray start --address HEAD:6379` on the other, the engine started on the head).
Not here: starting vLLM (infra/vllm_server.py); the values' checks (the config's `target` section,
components/config/pipeline.py; vLLM refuses sizes the devices do not have at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass

EXECUTOR_BACKENDS = (None, "mp", "ray", "uni", "external_launcher")  # vLLM 0.32's --distributed-executor-backend


@dataclass(frozen=True)
class EngineScale:
    """How vLLM spreads the target over devices and nodes: its own settings, passed through as they are
    (`--tensor-parallel-size`, `--pipeline-parallel-size`, `--data-parallel-size`,
    `--distributed-executor-backend`; "ray" runs the engine's workers on the Ray cluster of RAY_ADDRESS)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # vLLM's choice when None: "mp" on one node, "ray" past it

    def args(self) -> list[str]:
        """The flags that differ from vLLM's defaults (none for one device)."""
        sizes = (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
            ("--data-parallel-size", self.data_parallel_size),
        )
        out = [a for flag, n in sizes if n != 1 for a in (flag, str(n))]
        if self.distributed_executor_backend:
            out += ["--distributed-executor-backend", self.distributed_executor_backend]
        return out
