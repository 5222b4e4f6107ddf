"""Regenerated answers shared between the runs of one target version, so that no run answers a shard twice.

Purpose: a retrain on captured traffic (flows/retrain_capture.py) regenerates the same first registered
conversations as the run that trained the champion: the same target, traffic file and settings, so the same
answers. `source_key(weights_sha256, traffic_sha256, settings_fingerprint)` names what decides a regenerate folder's
answers; `mark(out_dir, key)` records it there (`source.json`, once its regeneration finished); `earlier(out_dir, key,
runs_dir)` lists the sibling runs' folders with the same key. Before the stage runs, components/regenerate/stage.py
`link_twins` hard-links (`link_shard`; a copy across filesystems) each shard not finished yet whose twin is finished in
one of them: the same index and the same conversation ids in its sidecar, so a shard cut differently (another
`shard_size` or `limit`) is answered again and no shard the run does not ask for is placed. The stage then skips the
linked shards as it skips its own finished ones, and starts no vLLM when nothing is left to answer. Shards are never
written in place (temp file and rename), so a link never changes under the run that made it.
Run: flows/train_head.py before the regenerate stage; tests/test_regenerate_reuse.py.
Not here: the stage and its resume (components/regenerate/stage.py), what `settings_fingerprint` covers
(components/config/pipeline.py `PipelineConfig.regenerate_fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from components.data.atomic import atomic_write_text

MARK = "source.json"


def source_key(weights_sha256: str, traffic_sha256: str, settings_fingerprint: str) -> str:
    return hashlib.sha256(f"{weights_sha256}|{traffic_sha256}|{settings_fingerprint}".encode()).hexdigest()


def mark(out_dir: str | Path, key: str) -> None:
    """Records in `out_dir` what its answers were made from (once; a folder's key never changes)."""
    path = Path(out_dir) / MARK
    if not path.is_file():
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"source_key": key}) + "\n")


def _key_of(folder: Path) -> str | None:
    try:
        return json.loads((folder / MARK).read_text()).get("source_key")
    except (OSError, ValueError, AttributeError):
        return None


def _place(src: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".link.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # another filesystem, or links not allowed: a copy
        shutil.copyfile(src, tmp)
    os.replace(tmp, dest)


def earlier(out_dir: str | Path, key: str, runs_dir: str | Path) -> list[str]:
    """The sibling regenerate folders (`runs_dir/*/regenerate`, `out_dir` itself left out) marked with `key`."""
    out = Path(out_dir).resolve()
    return [str(f) for f in sorted(Path(runs_dir).glob("*/regenerate")) if f.resolve() != out and _key_of(f) == key]


def link_shard(data: Path, meta: Path, out: Path) -> None:
    """A finished shard of another folder placed in `out` under the same names: the data, then the sidecar that
    marks it done."""
    _place(data, out / data.name)
    _place(meta, out / meta.name)
