"""What one cycle of bench/serving_loop.py runs on: its sizes, its target and the traffic files of a segment.

Purpose: `QUICK` and `DEFAULT` (the `Sizes` of a `--quick` and of a default cycle: the pipeline preset and the config
over it, request and traffic sizes, timings, the capture threshold); `isolated_env(state)` and `write_config(sizes,
path)` (the children's environment and config, shared with bench/rollback_live.py); `build(quick)` (the target: the
tiny toy trained long enough that its answers depend on the prompt, or the real SmolLM2, with its registry name);
`segments_file(...)` (the conversations of a traffic file in some segments, written once: the champion's code-only
traffic of `--shift explain`, the segments in `CODE`).
Run: imported by bench/serving_loop.py and bench/rollback_live.py.
Not here: the cycle itself (bench/serving_loop.py), its live parts (bench/serving_loop_live.py).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import common

from serving_loop_live import Sizes

CODE = {"complete", "continue", "followup"}  # the segments that are not `explain`


QUICK = Sizes(
    "tiny",
    {
        "regenerate": {"max_new_tokens": 32, "limit": 32},
        "train": {"steps": 120, "checkpoint_every": 120, "warm_start_steps": 60, "eval_every": 20},
        "evaluate": {"spec": {"depth": 3, "max_new_tokens": 32}, "limit": 4},
        "capture": {"heldout": 4, "trigger_new": 24, "mix": 0.5},
        "monitor": {"rollback": {"window_s": 10.0, "min_drafts": 30}},
    },
    32,
    200,
    2,
    0.3,
    1.5,
    3.0,
    15.0,
    60.0,
    24,
    60.0,
    64,
)
# While the retrain runs, a client waits 20 s between requests: the retrain starts vLLM engines of its own (regenerate,
# extract, the shadow test) beside the serving one, and on 2 cores a real target's engine did not come up in 600 s
# beside live traffic at a 2 s pause (2026-12-07, docs/operations.md).
DEFAULT = Sizes(
    "default", {"capture": {"heldout": 8, "trigger_new": 96}}, 64, 400, 2, 0.5, 20.0, 10.0, 60.0, 300.0, 96, 300.0, 32
)


def isolated_env(state: Path) -> dict:
    """The children's environment: their own registry and Prefect in the state dir `state`, never the user's (their
    tracking URI and Prefect API left out)."""
    from infra.settings import env_with

    return {
        k: v
        for k, v in env_with({"EAGLE_HOME": str(state), "PYTHONPATH": str(common.ROOT)}).items()
        if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")
    }


def write_config(sizes: Sizes, path: Path):
    """The sizes' pipeline config written to `path` (the children read it) and loaded over their preset."""
    from components.config.pipeline import PipelineConfig

    path.write_text(json.dumps(sizes.config, indent=1) + "\n")
    return PipelineConfig.load(str(path), sizes.preset)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build(quick: bool):
    """The target: the tiny toy trained long enough that its answers depend on the prompt, or the real SmolLM2."""
    if not quick:
        from embedded.real import build_real

        return build_real(root=common.EMBEDDED_ROOT, progress=_say), "smollm2-135m"
    from embedded.build import build_embedded
    from embedded.config import EmbeddedConfig

    c = EmbeddedConfig.tiny()
    c = dataclasses.replace(
        c,
        train=dataclasses.replace(c.train, steps=800),
        corpus=dataclasses.replace(c.corpus, max_base_files=40, finetune_bytes=120_000),
        traffic=dataclasses.replace(c.traffic, train_conversations=240, heldout_conversations=16),
    )
    root = common.CACHE / "embedded"
    return common.find_embedded(c, root) or build_embedded(c, root, progress=False), "loop-llama"


def segments_file(src: Path, segments: set[str], dest: Path) -> Path:
    """The conversations of `src` (JSONL) in `segments`, written to `dest` once."""
    if not dest.is_file():
        dest.write_text(
            "".join(
                ln
                for ln in src.read_text().splitlines(keepends=True)
                if ln.strip() and json.loads(ln).get("segment") in segments
            )
        )
    return dest
