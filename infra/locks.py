"""Per-target locks so that at most one pipeline run per target runs at a time on this machine.

Purpose: `target_lock(settings, key, timeout_s)` holds an exclusive `fcntl` lock on `<state>/locks/<key>.lock`
for the block; a second run for the same target waits, then fails with a clear error after `timeout_s`. The
kernel drops the lock when the process dies (kill -9 included), so no stale lock survives a crash.
Not here: cross-machine exclusion (use a Prefect concurrency limit on the deployment's tag for that).
"""

from __future__ import annotations

import fcntl
import re
import time
from contextlib import contextmanager
from typing import Iterator

from infra.settings import Settings


class TargetBusy(RuntimeError):
    """Another run holds the lock for this target."""


@contextmanager
def target_lock(settings: Settings, key: str, timeout_s: float = 3600.0, poll_s: float = 0.5) -> Iterator[None]:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", key)
    path = settings.state_dir / "locks" / f"{safe}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TargetBusy(f"another run for {key!r} still holds {path} after {timeout_s:.0f} s") from None
                time.sleep(poll_s)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
