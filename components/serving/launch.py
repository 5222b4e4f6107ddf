"""Serving a head: the directory an engine loads as is, and the commands that serve it with vLLM or SGLang.

Purpose:
- `servable_head(head_dir, target_dir, cache_dir) -> Path`: `head_dir` itself when an engine can load it unmodified
  (its config.json states three distinct fused layer ids, and `model.safetensors` is the only top-level
  `*.safetensors`); otherwise (a head exported before that format: probe beside the weights, no ids in config.json,
  maybe a repeated layer id) a re-export under `cache_dir`, folded losslessly by `eagle.export.load_head`, made once
  per head (keyed by the weights' hash).
- `launch_commands(spec, head_dir)`: the vLLM and SGLang command lines for a GPU cluster, with the head's ids; for a
  head made for parallel drafting (variant "parallel" or "eagle3.1-parallel") vLLM's gets `parallel_drafting: true`
  and SGLang's is a comment saying so (this project knows no SGLang setting for it).
Run: `eagle-heads serve --head models:/NAME@champion [--print-only]` (flows/cli.py) uses both.
Not here: starting the engine (infra/vllm_server.py), measuring it (components/evaluate_engine.py), serving behind our
proxy with capture and swaps (`serve --capture`, `--follow-alias`: components/serve_live.py).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from components.atomic import file_sha256
from infra.vllm_server import EngineSpec

WEIGHTS = "model.safetensors"


def is_servable(head_dir: str | Path) -> bool:
    d = Path(head_dir)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return False
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or []
    distinct = len(ids) == 3 and list(ids) == sorted(set(ids))
    return distinct and sorted(p.name for p in d.glob("*.safetensors")) == [WEIGHTS]


def servable_head(head_dir: str | Path, target_dir: str | Path, cache_dir: str | Path,
                  trust_remote_code: bool = False) -> Path:
    """A directory vLLM and SGLang load unmodified holding the same head (see the module docstring)."""
    head_dir = Path(head_dir)
    if is_servable(head_dir):
        return head_dir
    out = Path(cache_dir) / file_sha256(head_dir / WEIGHTS)[:16]
    if is_servable(out):
        return out
    from components.targets import load_target
    from eagle.export import export_head, load_head, read_head_meta

    target = load_target(str(target_dir), "cpu", trust_remote_code=trust_remote_code)[0]
    draft = load_head(head_dir, target)
    lineage = {**read_head_meta(head_dir).get("lineage", {}), "converted_from": str(head_dir)}
    return export_head(draft, out, lineage=lineage)


def launch_commands(spec: EngineSpec, port: int = 8000) -> dict[str, str]:
    """Equivalent launch commands: vLLM (`vllm serve`) and SGLang (`python -m sglang.launch_server`)."""
    head = str(spec.head_dir)
    if spec.method is None:  # plain decoding (`serve --concurrency` above the crossover): no head in either engine
        gpu = EngineSpec(spec.target_dir, None, method=None, dtype="auto", max_model_len=spec.max_model_len,
                         served_model_name=spec.served_model_name, device="cuda")
        sglang = ["python", "-m", "sglang.launch_server", "--model-path", str(spec.target_dir),
                  "--served-model-name", spec.served_model_name, "--port", str(port)]
        return {"vllm": gpu.launch_command(port), "sglang": " ".join(shlex.quote(a) for a in sglang)}
    parallel = spec.drafts_in_parallel()
    gpu = EngineSpec(spec.target_dir, head, method="eagle3", num_speculative_tokens=spec.num_speculative_tokens,
                     dtype="auto", max_model_len=spec.max_model_len, served_model_name=spec.served_model_name,
                     device="cuda", k_schedule=spec.k_schedule, parallel_drafting=parallel)
    if parallel:
        return {"vllm": gpu.launch_command(port),
                "sglang": "# none: the head drafts in parallel (vLLM's parallel_drafting); serve it with vLLM"}
    sglang = ["python", "-m", "sglang.launch_server", "--model-path", str(spec.target_dir),
              "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head,
              "--speculative-num-steps", str(spec.num_speculative_tokens), "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", str(spec.num_speculative_tokens + 1),
              "--served-model-name", spec.served_model_name, "--port", str(port)]
    return {"vllm": gpu.launch_command(port), "sglang": " ".join(shlex.quote(a) for a in sglang)}
