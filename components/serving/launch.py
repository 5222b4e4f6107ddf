"""Serving a head on a GPU cluster: the commands that serve it with vLLM or SGLang.

Purpose: `launch_commands(spec, head_dir)`: the vLLM and SGLang command lines for a GPU cluster, with the head's ids
(the head directory as an engine loads it: components/targets/servable.py `servable_head`); for a head made for
parallel drafting (variant "parallel" or "eagle3.1-parallel") vLLM's gets `parallel_drafting: true` and SGLang's is a
comment saying so (this project knows no SGLang setting for it).
Run: `eagle-heads serve --head models:/NAME@champion [--print-only]` (flows/cli.py) prints them.
Not here: starting the engine (infra/vllm_server.py), measuring it (components/evaluate/engine.py), serving behind our
proxy with capture and swaps (`serve --capture`, `--follow-alias`: components/serving/live.py).
"""

from __future__ import annotations

import shlex

from infra.vllm_engine_spec import EngineSpec


def launch_commands(spec: EngineSpec, port: int = 8000) -> dict[str, str]:
    """Equivalent launch commands: vLLM (`vllm serve`) and SGLang (`python -m sglang.launch_server`)."""
    head = str(spec.head_dir)
    if spec.method is None:  # plain decoding (`serve --concurrency` above the crossover): no head in either engine
        gpu = EngineSpec(
            spec.target_dir,
            None,
            method=None,
            dtype="auto",
            max_model_len=spec.max_model_len,
            served_model_name=spec.served_model_name,
            device="cuda",
        )
        sglang = [
            "python",
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(spec.target_dir),
            "--served-model-name",
            spec.served_model_name,
            "--port",
            str(port),
        ]
        return {"vllm": gpu.launch_command(port), "sglang": " ".join(shlex.quote(a) for a in sglang)}
    parallel = spec.drafts_in_parallel()
    gpu = EngineSpec(
        spec.target_dir,
        head,
        method="eagle3",
        num_speculative_tokens=spec.num_speculative_tokens,
        dtype="auto",
        max_model_len=spec.max_model_len,
        served_model_name=spec.served_model_name,
        device="cuda",
        k_schedule=spec.k_schedule,
        parallel_drafting=parallel,
    )
    if parallel:
        return {
            "vllm": gpu.launch_command(port),
            "sglang": "# none: the head drafts in parallel (vLLM's parallel_drafting); serve it with vLLM",
        }
    sglang = [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(spec.target_dir),
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        head,
        "--speculative-num-steps",
        str(spec.num_speculative_tokens),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(spec.num_speculative_tokens + 1),
        "--served-model-name",
        spec.served_model_name,
        "--port",
        str(port),
    ]
    return {"vllm": gpu.launch_command(port), "sglang": " ".join(shlex.quote(a) for a in sglang)}
