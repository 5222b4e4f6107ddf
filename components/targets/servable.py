"""The head as an engine loads it beside its target: a directory vLLM and SGLang take unmodified.

Purpose: `servable_head(head_dir, target_dir, cache_dir) -> Path`: `head_dir` itself when an engine can load it
unmodified (`is_servable`: its config.json states three distinct fused layer ids, and `model.safetensors` is the only
top-level `*.safetensors`); otherwise (a head exported before that format: probe beside the weights, no ids in
config.json, maybe a repeated layer id) a re-export under `cache_dir`, folded losslessly by `eagle.export.load_head`,
made once per head (keyed by the weights' hash).
Run: every stage that hands a head to an engine: the engine evaluation and the shadow test
(components/evaluate/engine.py, components/evaluate/shadow.py) and `eagle-heads serve` (flows/command_serve.py).
Not here: the engine's command lines (components/serving/launch.py), starting it (infra/vllm_server.py), writing a
head (eagle/export.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from components.data.atomic import file_sha256

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


def servable_head(
    head_dir: str | Path, target_dir: str | Path, cache_dir: str | Path, trust_remote_code: bool = False
) -> Path:
    """A directory vLLM and SGLang load unmodified holding the same head (see the module docstring)."""
    head_dir = Path(head_dir)
    if is_servable(head_dir):
        return head_dir
    out = Path(cache_dir) / file_sha256(head_dir / WEIGHTS)[:16]
    if is_servable(out):
        return out
    from components.targets.target import load_target
    from eagle.export import export_head, load_head, read_head_meta

    target = load_target(str(target_dir), "cpu", trust_remote_code=trust_remote_code)[0]
    draft = load_head(head_dir, target)
    lineage = {**read_head_meta(head_dir).get("lineage", {}), "converted_from": str(head_dir)}
    return export_head(draft, out, lineage=lineage)
