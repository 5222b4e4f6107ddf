"""Captured traffic records: one served request (as the proxy saw it on the wire) turned into one table row.

Purpose: `exchange_record(exchange) -> dict | None` parses a request the proxy sampled (infra/serve_proxy.py
`Exchange`: request body, answer bytes, what the backend serves) into a row of `SCHEMA`; None when it holds no
finished completion (no finish reason: an answer cut short, or a body that is not what vLLM answers). Streamed
answers (server-sent events) are joined chunk by chunk; only choice 0 is kept.
Row (one per request; `messages` is the OpenAI traffic form, so a capture file is training traffic as it is:
components/data/traffic_io.py `load_traffic(file.parquet)` reads it):
    id                 "cap-<uuid4 hex>"
    time               when the request arrived (UTC, ms)
    endpoint           "chat" (/v1/chat/completions) or "completions" (/v1/completions)
    model              the model name the request asked for
    target_name, target_version, head   what served it (the head as named: models:/NAME/VERSION or a directory;
                       "" for plain decoding)
    messages           chat: the request's messages, then {"role": "assistant", "content": completion};
                       null for /v1/completions
    prompt             /v1/completions: the prompt (a string, or token ids as JSON); null for chat
    completion         the text the target produced; finish_reason: "stop", "length", ...
    completion_token_ids  when the answer carried them (`return_token_ids`), else null
    max_new_tokens     the request's max_tokens (or max_completion_tokens); null when it set none
    temperature, top_p, seed   as requested (null: the server's default); stream: whether it was streamed
    params             every other request setting as a JSON object (stop, penalties, ...)
    prompt_tokens, completion_tokens   the answer's usage when reported (a stream reports it only when asked)
    latency_s          seconds from the request's arrival to the answer's last byte, through the proxy
Read side: `capture_files(root)` lists the finished capture files under a capture root (or one target's folder),
oldest first; `file_target(path)` reads the target (name, version) and row count a file's metadata names without
reading its rows; `read_rows(path)` reads its rows as dicts (what a retrain on captured traffic starts from:
components/data/captured_traffic.py).
Run: imported by components/serving/capture.py and components/data/captured_traffic.py.
Not here: writing files (components/serving/capture.py), the proxy (infra/serve_proxy.py), turning rows into training
conversations (components/data/captured_traffic.py).
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from pathlib import Path
from typing import Any

from infra.serve_proxy import Exchange

SCHEMA_VERSION = "1"
FILE_PATTERN = "capture-*.parquet"  # a finished file (components/serving/capture.py writes `.tmp` names until complete)
META_KEY = b"eagle.capture"  # the file metadata naming the schema version and the target of its rows
# request keys that have columns of their own; the rest go to `params`
_OWN_KEYS = {
    "messages",
    "prompt",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stream",
}


def schema():
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema(
        [
            ("id", pa.string()),
            ("time", pa.timestamp("ms", tz="UTC")),
            ("endpoint", pa.string()),
            ("model", pa.string()),
            ("target_name", pa.string()),
            ("target_version", pa.string()),
            ("head", pa.string()),
            ("messages", pa.list_(message)),
            ("prompt", pa.string()),
            ("completion", pa.string()),
            ("finish_reason", pa.string()),
            ("completion_token_ids", pa.list_(pa.int64())),
            ("max_new_tokens", pa.int64()),
            ("temperature", pa.float64()),
            ("top_p", pa.float64()),
            ("seed", pa.int64()),
            ("stream", pa.bool_()),
            ("params", pa.string()),
            ("prompt_tokens", pa.int64()),
            ("completion_tokens", pa.int64()),
            ("latency_s", pa.float64()),
        ]
    )


def exchange_record(ex: Exchange) -> dict[str, Any] | None:
    try:
        req = json.loads(ex.request)
    except ValueError:
        return None
    if not isinstance(req, dict):
        return None
    chat = ex.path.endswith("/chat/completions")
    answer = _streamed(ex.response, chat) if req.get("stream") else _whole(ex.response, chat)
    if answer is None or answer["finish_reason"] is None:
        return None
    messages = None
    if chat:
        if not isinstance(req.get("messages"), list):
            return None
        messages = [_message(m) for m in req["messages"]] + [{"role": "assistant", "content": answer["text"]}]
    prompt = req.get("prompt")
    max_new = req.get("max_tokens", req.get("max_completion_tokens"))
    return {
        "id": f"cap-{uuid.uuid4().hex}",
        "time": dt.datetime.fromtimestamp(ex.started, dt.timezone.utc),
        "endpoint": "chat" if chat else "completions",
        "model": _str(req.get("model")),
        "target_name": ex.meta.get("target_name", ""),
        "target_version": ex.meta.get("target_version", ""),
        "head": ex.meta.get("head", ""),
        "messages": messages,
        "prompt": None if chat else (prompt if isinstance(prompt, str) else json.dumps(prompt)),
        "completion": answer["text"],
        "finish_reason": answer["finish_reason"],
        "completion_token_ids": answer["token_ids"],
        "max_new_tokens": _int(max_new),
        "temperature": _float(req.get("temperature")),
        "top_p": _float(req.get("top_p")),
        "seed": _int(req.get("seed")),
        "stream": bool(req.get("stream")),
        "params": json.dumps({k: v for k, v in req.items() if k not in _OWN_KEYS}, sort_keys=True),
        "prompt_tokens": _int(answer["usage"].get("prompt_tokens")),
        "completion_tokens": _int(answer["usage"].get("completion_tokens")),
        "latency_s": float(ex.seconds),
    }


def _whole(body: bytes, chat: bool) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
        choice = obj["choices"][0]
        text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    ids = choice.get("token_ids")
    return {
        "text": text or "",
        "finish_reason": choice.get("finish_reason"),
        "token_ids": [int(t) for t in ids] if isinstance(ids, list) else None,
        "usage": obj.get("usage") or {},
    }


def _streamed(body: bytes, chat: bool) -> dict[str, Any] | None:
    """Choice 0 of a stream of `data: {...}` events: text deltas joined, the last finish reason, the usage."""
    parts: list[str] = []
    ids: list[int] | None = None
    finish, usage = None, {}
    for line in body.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        try:
            event = json.loads(payload)
        except ValueError:
            return None
        if not isinstance(event, dict):
            return None
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            parts.append(piece or "")
            if isinstance(choice.get("token_ids"), list):
                ids = (ids or []) + [int(t) for t in choice["token_ids"]]
            finish = choice.get("finish_reason") or finish
    return {"text": "".join(parts), "finish_reason": finish, "token_ids": ids, "usage": usage}


def _message(m: Any) -> dict[str, str]:
    """A request message as role and text (a content given as parts keeps its text parts, joined)."""
    if not isinstance(m, dict):
        return {"role": "user", "content": _str(m)}
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return {"role": _str(m.get("role")), "content": _str(content)}


def _str(v: Any) -> str:
    return v if isinstance(v, str) else "" if v is None else json.dumps(v)


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _float(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def capture_files(root: str | Path) -> list[Path]:
    """Every finished capture file under `root` (a capture root `<state>/capture` or one target's folder), oldest
    first by the UTC time in its name (the writer names files `capture-<time>-<n>.parquet`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted([*root.glob(FILE_PATTERN), *root.glob(f"*/{FILE_PATTERN}")], key=lambda p: (p.name, str(p)))


def file_target(path: str | Path) -> tuple[str, str, int]:
    """(target name, target version, rows) that a capture file's metadata names; every row of a file has the same
    target (the writer starts a new file when it changes). ValueError for a file without that metadata."""
    import pyarrow.parquet as pq

    meta = (pq.read_schema(str(path)).metadata or {}).get(META_KEY)
    if meta is None:
        raise ValueError(f"{path}: not a capture file (no {META_KEY.decode()} metadata)")
    m = json.loads(meta)
    return str(m.get("target_name", "")), str(m.get("target_version", "")), int(m.get("rows", 0))


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of one capture file, in the order they were written, as dicts of `schema()`'s columns."""
    import pyarrow.parquet as pq

    return pq.read_table(str(path)).to_pylist()
