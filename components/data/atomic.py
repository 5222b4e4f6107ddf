"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Purpose: `atomic_write_text` / `atomic_write_bytes` write to a temp file beside the target, fsync, then rename
(`file_sha256` hashes a file the same streamed way everywhere);
`atomic_path(path)` gives such a temp path to writers that want a file name (safetensors, `torch.save`,
matplotlib). On any failure (a full disk, a crash inside the writer) the temp file is removed and an `OSError`
names the target path. `remove_stale_temps(dir)` deletes the temp files a killed process left behind (call it
at the start of a stage that owns the directory: a `kill -9` runs no cleanup).
Not here: directory-level atomicity (eagle/export.py renames whole directories; components/train/state.py its
checkpoints).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_TEMP = re.compile(r"^\..+\.[A-Za-z0-9_]{6,}\.tmp$")  # `.<name>.<random>.tmp`, as made by atomic_path


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temp path beside `path` for the block to write; renamed to `path` (after fsync) when the block ends."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; the file gets what open() would have given it
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and str(path) not in str(err):
            raise OSError(
                err.errno,
                f"cannot write {path}: {err.strerror or err}; nothing was left half-written: "
                "free space (or fix the permissions) and re-run",
            ) from err
        raise


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1], 8) for x in f if x.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        return 0o022


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def remove_stale_temps(directory: str | Path, extra: tuple[str, ...] = ()) -> list[Path]:
    """Delete temp files of `atomic_path` (and entries matching the glob patterns `extra`) in `directory`."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    gone = [p for p in directory.iterdir() if _TEMP.match(p.name)]
    gone += [p for pattern in extra for p in directory.glob(pattern)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
    return gone


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
