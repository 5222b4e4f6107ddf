"""Capture of served traffic: a background writer that turns sampled requests into a rotating Parquet dataset.

Purpose: `CaptureWriter(root, CaptureConfig(...))` takes the proxy's sampled requests (infra/serve_proxy.py
`Exchange`) through `submit()`, which never blocks: it puts them on a bounded queue and drops (and counts) what does
not fit. A writer thread, woken every `POLL_S` (not by each request), parses them (components/data/capture_records.py:
one row each) and writes them to `<root>/<target_name>/capture-<UTC time>-<n>.parquet` (root: `<state>/capture`),
one file per `rows_per_file` rows or per `flush_s` seconds, whichever comes first, and on `close()`. Each file is
written to a temporary name and renamed when complete (components/data/atomic.py), so a reader never sees half a file;
its Parquet metadata
(`eagle.capture`) names the schema version and the target (name and version) of every row in it (a target change
starts a new file). After each file, the oldest `*.parquet` files under `root` are deleted until the total is at most
`max_bytes` (the newest file is always kept).
A store that cannot be written (a full disk: under `min_free_bytes` free, or ENOSPC; a read-only or missing folder)
pauses capture: one warning line through `say`, the rows of that file and the requests of the next `retry_s`
seconds are dropped (counted), then it tries again and says when it resumed. Serving never waits for any of it.
`stats()`: rows written, files, dropped, paused (and why).
Run: `eagle-heads serve --capture` (components/serving/live.py starts it).
Not here: what a row holds (components/data/capture_records.py), training on it (the traffic loaders read the files:
components/data/traffic_io.py).
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import queue
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from components.data.atomic import atomic_path, remove_stale_temps
from components.data.capture_records import FILE_PATTERN as PATTERN, META_KEY, SCHEMA_VERSION, exchange_record, schema


@dataclass(frozen=True)
class CaptureConfig:
    rate: float = 1.0  # share of requests recorded (sampled at random per request)
    max_bytes: int = 1 << 30  # size cap of all capture files under the root; the oldest go first
    rows_per_file: int = 1000
    flush_s: float = 60.0  # a file is closed at the latest this long after its first row
    retry_s: float = 30.0  # a paused capture tries the store again after this long
    min_free_bytes: int = 100 << 20  # less free space than this on the store's disk counts as full
    queue_size: int = 1024  # requests waiting for the writer; more are dropped, never waited for

    def __post_init__(self) -> None:
        if not 0 < self.rate <= 1:
            raise ValueError(f"capture rate {self.rate} must be in (0, 1]")
        if self.rows_per_file < 1 or self.max_bytes < 1 or self.flush_s <= 0 or self.queue_size < 1:
            raise ValueError("rows_per_file, max_bytes, flush_s and queue_size must be positive")


POLL_S = 0.25  # how often the writer takes what the requests queued


class CaptureWriter:
    def __init__(self, root: str | Path, cfg: CaptureConfig, say: Callable[[str], None] = print):
        self.root, self.cfg, self._say = Path(root), cfg, say
        self._queue: queue.Queue = queue.Queue(cfg.queue_size)
        self._rows: list[dict[str, Any]] = []
        self._first_row_at = 0.0
        self._paused_until = 0.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._seq = 0
        self.written = self.files = self.unparsed = 0
        # each counter has one writing thread: requests dropped on the request side, rows dropped by the writer
        self._dropped_requests = self._dropped_rows = 0
        self.pause_reason: str | None = None

    # ---- the request side (the proxy's thread): never blocks --------------------------------------------------
    def submit(self, exchange) -> None:
        if self.pause_reason is not None and time.monotonic() < self._paused_until:
            self._dropped_requests += 1
            return
        try:
            self._queue.put_nowait(exchange)
        except queue.Full:
            self._dropped_requests += 1

    @property
    def dropped(self) -> int:
        return self._dropped_requests + self._dropped_rows

    @property
    def paused(self) -> bool:
        return self.pause_reason is not None

    def stats(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "rate": self.cfg.rate,
            "rows_written": self.written,
            "files": self.files,
            "dropped": self.dropped,
            "unparsed": self.unparsed,
            "paused": self.pause_reason,
        }

    # ---- life cycle ----------------------------------------------------------------------------------------------
    def start(self) -> "CaptureWriter":
        if self.root.is_dir():
            for d in [self.root, *(p for p in self.root.iterdir() if p.is_dir())]:
                remove_stale_temps(d)  # a killed writer's half-written files
        self._thread = threading.Thread(target=self._run, name="capture-writer", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what is queued and buffered, then stop the thread."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        self._thread = None

    def __enter__(self) -> "CaptureWriter":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the writer's thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        # woken by a clock, not by each request: a wake-up per answer takes the GIL from the proxy's loop thread
        # (bench/proxy_overhead.py, 2 cores, concurrency 16: 0.45-0.51x output tokens/s that way, 1.07x this way)
        while True:
            stopping = self._stop.wait(POLL_S)
            while True:
                try:
                    self._take(self._queue.get_nowait())
                except queue.Empty:
                    break
            if stopping or (self._rows and time.monotonic() - self._first_row_at >= self.cfg.flush_s):
                self._flush()
            if stopping:
                return

    def _take(self, exchange) -> None:
        try:
            row = exchange_record(exchange)
        except Exception:  # a body we do not understand is not worth a writer that stops
            row = None
        if row is None:
            self.unparsed += 1
            return
        if self._rows and _target(self._rows[0]) != _target(row):
            self._flush()  # one target version per file
        if not self._rows:
            self._first_row_at = time.monotonic()
        self._rows.append(row)
        if len(self._rows) >= self.cfg.rows_per_file:
            self._flush()

    def _flush(self) -> None:
        rows, self._rows = self._rows, []
        if not rows:
            return
        if self.pause_reason is not None and time.monotonic() < self._paused_until:
            self._dropped_rows += len(rows)
            return
        try:
            path = self._write(rows)
        except OSError as e:
            self._dropped_rows += len(rows)
            self._pause(e)
            return
        if self.pause_reason is not None:
            self._say(f"serve: capture resumed: writing to {path.parent}")
            self.pause_reason = None
        self.written += len(rows)
        self.files += 1
        self._cap(keep=path)

    def _write(self, rows: list[dict[str, Any]]) -> Path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        name, version = _target(rows[0])
        folder = self.root / (re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "_")
        folder.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(folder).free
        if free < self.cfg.min_free_bytes:
            raise OSError(
                errno.ENOSPC,
                f"{free >> 20} MiB free on the disk of {folder} (capture keeps "
                f"{self.cfg.min_free_bytes >> 20} MiB free)",
            )
        self._seq += 1
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        path = folder / f"capture-{stamp}-{self._seq:06d}.parquet"
        meta = {"schema": SCHEMA_VERSION, "target_name": name, "target_version": version, "rows": len(rows)}
        table = pa.Table.from_pylist(rows, schema=schema().with_metadata({META_KEY: json.dumps(meta).encode()}))
        with atomic_path(path) as tmp:
            pq.write_table(table, str(tmp))
        return path

    def _pause(self, err: OSError) -> None:
        self._paused_until = time.monotonic() + self.cfg.retry_s
        reason = f"{err.strerror or err}" + (f": {err.filename}" if getattr(err, "filename", None) else "")
        if self.pause_reason is None:
            self._say(
                f"serve: warning: capture paused, the store {self.root} cannot be written ({reason}); serving "
                f"goes on, captured requests are dropped; retrying every {self.cfg.retry_s:.0f} s"
            )
        self.pause_reason = reason

    def _cap(self, keep: Path) -> None:
        """Delete the oldest capture files under the root until they total at most `max_bytes` (never `keep`)."""
        try:
            files = sorted(((p.stat().st_mtime, p.name, p) for p in self.root.glob(f"*/{PATTERN}")))
            total = sum(p.stat().st_size for _, _, p in files)
            for _, _, p in files:
                if total <= self.cfg.max_bytes:
                    break
                if p == keep:
                    continue
                size = p.stat().st_size
                p.unlink()
                total -= size
        except OSError as e:  # a file gone under us (another serve's cap) or a folder we cannot list
            self._say(f"serve: warning: capture size cap not applied this time ({e})")


def _target(row: dict[str, Any]) -> tuple[str, str]:
    return row["target_name"], row["target_version"]


def read_capture(root: str | Path) -> list[dict[str, Any]]:
    """Every row under `root` (a capture root or one target's folder), oldest file first, as dicts."""
    import pyarrow.parquet as pq

    root = Path(root)
    files = sorted(root.glob(PATTERN)) or sorted(root.glob(f"*/{PATTERN}"), key=lambda p: p.name)
    return [row for p in files for row in pq.read_table(str(p)).to_pylist()]
