"""The capture dataset writer without vLLM: rows from what went over the wire, rotation, the size cap, atomic files,
a store that cannot be written (capture pauses, nothing raises, it resumes), and a submit that never waits.

Purpose: components/serving/capture.py and components/data/capture_records.py on hand-made `Exchange`s (the bytes vLLM
answers: a whole JSON body or server-sent events); the files are read back with pyarrow and with the traffic loader
(components/data/traffic_io.py), which is how a retrain reads them.
Run: `python -m pytest tests/test_capture.py` (a few seconds).
Not here: the proxy and real vLLM answers (tests/test_serve_proxy.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from components.data.capture_records import exchange_record
from components.data.traffic_io import load_traffic
from components.serving.capture import META_KEY, CaptureConfig, CaptureWriter, read_capture
from infra.serve_proxy import Exchange

META = {"head": "models:/h/2", "target_name": "tgt", "target_version": "3"}


def chat(i: int, stream: bool = False, finish: str | None = "stop", meta=META) -> Exchange:
    req = {
        "model": "tgt",
        "messages": [{"role": "user", "content": f"q{i}"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
        "stop": ["\n\n"],
    }
    if not stream:
        body = {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f"a{i}"}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2},
        }
        resp = json.dumps(body).encode()
    else:
        events = [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "a"}}]},
            {"choices": [{"index": 0, "delta": {"content": f"{i}"}, "finish_reason": finish}]},
        ]
        resp = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return Exchange("/v1/chat/completions", json.dumps(req).encode(), resp, meta, time.time(), 0.01)


def writer(tmp_path: Path, **kw) -> CaptureWriter:
    said: list[str] = []
    w = CaptureWriter(
        tmp_path / "capture", CaptureConfig(**{"flush_s": 30.0, "retry_s": 0.2, "min_free_bytes": 0, **kw}), said.append
    )
    w.said = said  # type: ignore[attr-defined]
    return w


def test_rows_are_what_was_served_and_readable_as_traffic():
    rec = exchange_record(chat(1))
    assert rec["messages"] == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    assert (rec["completion"], rec["finish_reason"], rec["max_new_tokens"], rec["temperature"]) == ("a1", "stop", 8, 0)
    assert json.loads(rec["params"]) == {"stop": ["\n\n"]} and rec["target_version"] == "3"
    assert (rec["prompt_tokens"], rec["completion_tokens"], rec["stream"]) == (5, 2, False)
    streamed = exchange_record(chat(7, stream=True))
    assert streamed["completion"] == "a7" and streamed["stream"] is True and streamed["finish_reason"] == "stop"
    assert exchange_record(chat(2, stream=True, finish=None)) is None  # cut short: no finished completion
    assert exchange_record(chat(2, finish=None)) is None
    done = Exchange(
        "/v1/completions",
        json.dumps({"prompt": "def f(", "max_tokens": 4}).encode(),
        json.dumps({"choices": [{"text": "x):", "finish_reason": "length", "token_ids": [1, 2]}]}).encode(),
        META,
        time.time(),
        0.1,
    )
    rec = exchange_record(done)
    assert (rec["endpoint"], rec["prompt"], rec["messages"], rec["completion_token_ids"]) == (
        "completions",
        "def f(",
        None,
        [1, 2],
    )


def test_rotation_metadata_and_atomic_files(tmp_path):
    root = tmp_path / "capture"
    (root / "tgt").mkdir(parents=True)
    stale = root / "tgt" / ".capture-x.parquet.abc123.tmp"  # what a killed writer leaves
    stale.write_bytes(b"half")
    with writer(tmp_path, rows_per_file=2) as w:
        for i in range(5):
            w.submit(chat(i, stream=i % 2 == 1))
            time.sleep(0.01)  # distinct file times
    files = sorted((root / "tgt").glob("*.parquet"))
    assert [pq.read_metadata(f).num_rows for f in files] == [2, 2, 1] and not stale.exists()
    assert [p.name for p in (root / "tgt").iterdir() if not p.name.endswith(".parquet")] == []
    meta = json.loads(pq.read_schema(files[0]).metadata[META_KEY])
    assert meta["target_name"] == "tgt" and meta["target_version"] == "3" and meta["schema"] == "1"
    assert [r["completion"] for r in read_capture(root)] == [f"a{i}" for i in range(5)]
    convs = load_traffic(files[0]).conversations
    assert [m.role for m in convs[0].messages] == ["user", "assistant"] and convs[0].max_new_tokens == 8
    assert w.stats()["rows_written"] == 5 and w.stats()["files"] == 3


def test_a_new_target_version_starts_a_new_file(tmp_path):
    with writer(tmp_path, rows_per_file=10) as w:
        w.submit(chat(0))
        w.submit(chat(1, meta={**META, "target_version": "4"}))
    versions = [
        json.loads(pq.read_schema(f).metadata[META_KEY])["target_version"]
        for f in sorted((tmp_path / "capture" / "tgt").glob("*.parquet"))
    ]
    assert versions == ["3", "4"]


def test_size_cap_drops_the_oldest_first(tmp_path):
    with writer(tmp_path, rows_per_file=1) as w:
        w.submit(chat(0))
    one = next((tmp_path / "capture" / "tgt").glob("*.parquet")).stat().st_size
    with writer(tmp_path, rows_per_file=1, max_bytes=int(one * 3.5)) as w:
        for i in range(1, 9):
            w.submit(chat(i))
            time.sleep(0.02)
    files = list((tmp_path / "capture" / "tgt").glob("*.parquet"))
    assert len(files) == 3 and sum(f.stat().st_size for f in files) <= one * 3.5
    assert [r["completion"] for r in read_capture(tmp_path / "capture")] == ["a6", "a7", "a8"]  # the newest kept


def test_an_unwritable_store_pauses_capture_and_it_resumes(tmp_path):
    root = tmp_path / "capture"
    root.write_text("a file where the store should be")  # unwritable even for root (tests may run as root)
    w = writer(tmp_path, rows_per_file=1).start()
    try:
        w.submit(chat(0))
        _until(lambda: w.paused)
        assert "capture paused" in w.said[0] and "serving goes on" in w.said[0]
        w.submit(chat(1))  # dropped at once while paused: nothing raises, nothing waits
        assert w.stats()["dropped"] >= 1 and w.stats()["rows_written"] == 0
        root.unlink()
        time.sleep(0.3)  # past retry_s
        w.submit(chat(2))
        _until(lambda: w.stats()["rows_written"] == 1)
        assert not w.paused and any("capture resumed" in s for s in w.said)
    finally:
        w.close()
    assert [r["completion"] for r in read_capture(root)] == ["a2"]


def test_a_full_disk_pauses_capture_and_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    w = writer(tmp_path, rows_per_file=1, min_free_bytes=1 << 62).start()  # no disk has that much free
    w.submit(chat(0))
    _until(lambda: w.paused)
    w.close()
    assert "MiB free" in w.pause_reason and not list(tmp_path.rglob("*.parquet"))

    def half_then_full(table, where, **kw):
        Path(where).write_bytes(b"PAR1 half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "write_table", half_then_full)
    w = writer(tmp_path, rows_per_file=1).start()
    w.submit(chat(1))
    _until(lambda: w.paused)
    w.close()
    left = [p.name for p in (tmp_path / "capture" / "tgt").iterdir()]
    assert left == [] and "No space left" in w.pause_reason


def test_submit_never_waits(tmp_path):
    w = writer(tmp_path, queue_size=1)  # not started: nothing takes from the queue
    t0 = time.perf_counter()
    for i in range(50):
        w.submit(chat(i))
    assert time.perf_counter() - t0 < 0.5 and w.stats()["dropped"] == 49


def test_config_refuses_a_rate_outside_0_1():
    with pytest.raises(ValueError, match="rate"):
        CaptureConfig(rate=0)


def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
