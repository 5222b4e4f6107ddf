"""Warm vLLM's model-info cache once, in one process, so that no engine start pays for it (run by `make vllm`).

Purpose: when vLLM resolves a model architecture it has not seen on this machine, it inspects the model class in a
fresh Python subprocess that imports vLLM and torch (`_run_in_subprocess` in vLLM 0.32's
`model_executor/models/registry.py`, "to avoid initializing CUDA"), then caches the answer under
`~/.cache/vllm/modelinfos` (keyed by the model file's hash). Those imports are half or more of a first engine
start on a small machine (bench/README.md, "Figures moved from code comments"), and the demo's first pair of
servers starts both at once, each missing the same cache. This script fills the cache for the architectures this project
serves (its embedded Llama target, the families the tests build, EAGLE-3 heads, the hidden-states extractor) in
one process, with vLLM's own inspection and cache code: one import of vLLM for all of them.
It runs in vLLM's own venv (only the standard library and vLLM). Any failure is one line and exit 0: the cache is
an optimisation, vLLM fills it itself otherwise.
Run: `.venv-vllm/bin/python infra/vllm_warm.py [ARCH ...]` (no ARCH: the project's list, `ARCHITECTURES`).
Not here: starting engines (infra/vllm_server.py).
"""

from __future__ import annotations

import sys
import time

# the targets' families (embedded default, tests/test_families.py), the heads (EAGLE-3 and its parallel variant
# share a class), the engine's hidden-states extraction (components/extract/engine.py)
ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Eagle3LlamaForCausalLM",
    "ExtractHiddenStatesModel",
)


def warm(architectures: tuple[str, ...] | list[str]) -> list[str]:
    """Inspect each architecture in this process (vLLM's cache written as vLLM writes it); returns one line each."""
    from vllm.model_executor.models import registry

    in_process = lambda fn: fn()  # noqa: E731  (vLLM's subprocess only guards CUDA, which a warm-up never touches)
    registry._run_in_subprocess = in_process
    lines = []
    for arch in architectures:
        model = registry.ModelRegistry.models.get(arch)
        if model is None:
            lines.append(f"{arch}: not in this vLLM, skipped")
            continue
        t0 = time.perf_counter()
        model.inspect_model_cls()
        lines.append(f"{arch}: cached ({time.perf_counter() - t0:.1f} s)")
    return lines


def main(argv: list[str]) -> int:
    t0 = time.perf_counter()
    try:
        lines = warm(argv or list(ARCHITECTURES))
    except Exception as e:  # an optimisation only: vLLM inspects at engine start what is not cached
        print(f"vllm model-info cache not warmed ({type(e).__name__}: {e}); engines will fill it at their first start")
        return 0
    print(f"vllm model-info cache warmed in {time.perf_counter() - t0:.0f} s: " + "; ".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
