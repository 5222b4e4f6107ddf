"""The regenerated conversations on disk: the shard files the regenerate stage writes and the stages after it read.

Purpose: `shard_paths(out_dir, s)` names shard s's files (`shard-NNNNN.jsonl`, the conversations as OpenAI-style
JSON lines, and `shard-NNNNN.json`, its sidecar of ok and failed ids); `read_regenerated(out_dir)` reads every
conversation of a finished regeneration directory in shard order, any `shard-*.jsonl` included (a retrain on served
traffic adds `shard-captured.jsonl`: components/data/captured_traffic.py).
Run: imported by components/regenerate/stage.py (the writer) and components/extract/stage.py (the reader).
Not here: answering, resume and accounting (components/regenerate/stage.py), the line format's rules
(components/data/traffic_io.py).
"""

from __future__ import annotations

from pathlib import Path

from components.data.traffic_io import Conversation, load_traffic

SHARDS = "shard-*.jsonl"  # every shard's conversations, the captured one included


def shard_paths(out: Path, s: int) -> tuple[Path, Path]:
    """Shard s's conversations and its sidecar."""
    return out / f"shard-{s:05d}.jsonl", out / f"shard-{s:05d}.json"


def read_regenerated(out_dir: str) -> list[Conversation]:
    """Every regenerated conversation of a finished regeneration directory, in shard order."""
    convs: list[Conversation] = []
    for p in sorted(Path(out_dir).glob(SHARDS)):
        if p.stat().st_size:
            convs.extend(load_traffic(p).conversations)
    if not convs:
        raise ValueError(f"{out_dir}: no regenerated conversation (every one failed?); see accounting.json")
    return convs
