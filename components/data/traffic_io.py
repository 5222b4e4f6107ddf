"""Loaders for user traffic: OpenAI `messages` and ShareGPT `conversations` chats, normalised to one type.

Purpose: `load_traffic(path)` reads chats and returns `Conversation`s (id, messages with roles system/user/assistant,
optional `segment`, `source_file` and `max_new_tokens` metadata). Schemas, one JSON object per line (or table row):
  OpenAI:   {"id": ..., "messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...], ...}
  ShareGPT: {"id": ..., "conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...], ...}
`max_new_tokens` (optional, an integer >= 1) is how many new tokens the sample asks for: the reference answer's
length in the target's tokens, as the embedded default's long traffic writes it. Regeneration
(components/regenerate/stage.py), the evaluation (components/evaluate/stage.py) and the engine evaluation
(components/evaluate/engine.py) generate at most that many tokens for the sample, the stage's global limit otherwise.
Sources: JSON Lines (`.jsonl`, `.json`, `.ndjson`), Parquet (`.parquet`), Arrow IPC file or stream (`.arrow`), or a
directory written by `Dataset.save_to_disk` (a `DatasetDict` one when it has a single split; else pass `DIR/<split>`).
Tables are read a batch of rows at a time (components/data/traffic_sources.py); a null column counts as an absent key.
`format="auto"` decides per row by the key present. Rules: at most one system message, and only first; at least
one user turn; contents are strings; lines are UTF-8 (a leading byte-order mark is allowed: RFC 8259 lets JSON
parsers ignore it), each under 64 MiB and nested at most 64 deep (components/data/safe_read.py); a UTF-16 or UTF-32 file
is refused as a whole. Blank lines are ignored; a line without an id gets `line-<n>`, a table row `row-<n>`.
A bad line or row raises `TrafficFormatError` naming the file, the line or row (1-based) and the reason; with
`skip_bad=True` bad ones are skipped and counted in `TrafficLoad.skipped`. An empty source (or one with nothing
valid) always raises, and so does any other path (one error listing the accepted forms), a path that is not a regular
file (a named pipe, a device, a socket) or one that cannot be read (checked before it is opened).
`traffic_sha256` hashes a file's bytes (a dataset directory: its data files); `conversations_sha256` hashes the
normalised content (independent of schema and source form).
Run: `python -m components.data.traffic_io PATH...` prints counts per segment and the hashes.
Not here: tokenisation, chat templates, regeneration of answers by a target.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

from components.data.atomic import atomic_path, file_sha256
from components.data.safe_read import MAX_LINE_BYTES, encoding_problem, loads_json
from components.data.traffic_sources import SourceError, dataset_data_files, table_records, traffic_kind
from eagle.errors import BadInput

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}
Format = Literal["auto", "openai", "sharegpt"]


class TrafficFormatError(BadInput):
    """Traffic that cannot be read: `path`, `line` (1-based; 0 for the whole source), `reason`, and `unit`: "line"
    for JSON Lines (message `path:line: reason`), "row" for tables and other sources (`path: row n: reason`)."""

    def __init__(self, path: Path | str, line: int, reason: str, unit: str = "line"):
        self.path, self.line, self.reason, self.unit = str(path), line, reason, unit
        where = f"{path}:{line}" if unit == "line" else f"{path}: row {line}" if line else str(path)
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[Message, ...]
    segment: str | None = None
    source_file: str | None = None
    max_new_tokens: int | None = None  # new tokens the sample asks for (its reference answer's length); optional

    @property
    def system(self) -> str | None:
        return self.messages[0].content if self.messages[0].role == "system" else None

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `messages` form (a JSONL line of `write_openai_jsonl`)."""
        d: dict[str, Any] = {"id": self.id}
        if self.segment is not None:
            d["segment"] = self.segment
        if self.source_file is not None:
            d["source_file"] = self.source_file
        if self.max_new_tokens is not None:
            d["max_new_tokens"] = self.max_new_tokens
        d["messages"] = [{"role": m.role, "content": m.content} for m in self.messages]
        return d


@dataclass(frozen=True)
class SkippedLine:
    line: int
    reason: str


@dataclass(frozen=True)
class TrafficLoad:
    path: Path
    conversations: tuple[Conversation, ...]
    skipped: tuple[SkippedLine, ...]

    @property
    def skipped_reasons(self) -> dict[str, int]:
        """How many lines were skipped for each reason (the reason without its per-line details)."""
        return dict(collections.Counter(s.reason.split(":")[0] for s in self.skipped))


def load_traffic(path: Path | str, format: Format = "auto", skip_bad: bool = False) -> TrafficLoad:
    path = Path(path)
    if format not in ("auto", "openai", "sharegpt"):
        raise ValueError(f"unknown traffic format {format!r}; expected auto, openai or sharegpt")
    try:
        kind = traffic_kind(path)
    except SourceError as e:
        raise TrafficFormatError(path, 0, e.reason, "row") from None
    if kind == "jsonl":
        _check_encoding(path)
        unit, records = "line", _jsonl_lines(path)

        def parse(raw: Any, n: int) -> Conversation:
            return parse_line(_decode(raw, n), n, format)
    else:
        unit, records = "row", table_records(path, kind)

        def parse(rec: Any, n: int) -> Conversation:
            return parse_record(rec, n, format, id_prefix="row")

    convs: list[Conversation] = []
    skipped: list[SkippedLine] = []
    seen_any = False
    try:
        with contextlib.closing(records):  # closes the file or memory map also when a bad row stops the read
            for n, payload in records:
                seen_any = True
                try:
                    convs.append(parse(payload, n))
                except _LineError as e:
                    if not skip_bad:
                        raise TrafficFormatError(path, n, str(e), unit) from None
                    skipped.append(SkippedLine(n, str(e)))
    except SourceError as e:
        raise TrafficFormatError(path, e.row, e.reason, unit) from None
    if not seen_any:
        raise TrafficFormatError(
            path, 0, "empty file: no conversations" if unit == "line" else "empty table: no rows", unit
        )
    if not convs:
        raise TrafficFormatError(
            path,
            0,
            f"no valid conversation; all {len(skipped)} {unit}s were bad "
            f"(first: {unit} {skipped[0].line}: {skipped[0].reason})",
            unit,
        )
    return TrafficLoad(path, tuple(convs), tuple(skipped))


def _check_encoding(path: Path) -> None:
    """A JSON Lines file in UTF-16 or UTF-32 is refused as a whole (each of its lines would be a bad line)."""
    with path.open("rb") as fh:
        problem = encoding_problem(fh.read(4))
    if problem:
        raise TrafficFormatError(path, 0, problem)


def _jsonl_lines(path: Path) -> Iterator[tuple[int, bytes | None]]:
    """(1-based line number, bytes) of each non-blank line; None for a line over `MAX_LINE_BYTES`, which is
    skipped a block at a time (never held whole)."""
    with path.open("rb") as fh:  # bytes: a line that is not UTF-8 is one bad line, not a crash of the whole read
        for lineno, raw_bytes in enumerate(iter(lambda: fh.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw_bytes) > MAX_LINE_BYTES and not raw_bytes.endswith(b"\n"):
                while (rest := fh.readline(1 << 20)) and not rest.endswith(b"\n"):
                    pass
                yield lineno, None
            elif raw_bytes.strip():
                yield lineno, raw_bytes


class _LineError(Exception):
    pass


def _decode(raw: bytes | None, lineno: int) -> str:
    if raw is None:
        raise _LineError(
            f"line too long: over {MAX_LINE_BYTES >> 20} MiB (one conversation per line; a line this long is not one)"
        )
    if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark, as some editors write
        raw = raw[3:]
    if b"\x00" in raw:  # valid UTF-8, but never in JSON text: UTF-16 without a byte-order mark
        raise _LineError("not UTF-8 text: NUL bytes (UTF-16 without a byte-order mark?); re-save the file as UTF-8")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _LineError(
            f"not UTF-8 text: byte 0x{raw[e.start]:02x} at column {e.start + 1} (Latin-1 or another "
            "8-bit encoding?); re-save the file as UTF-8"
        ) from None


def parse_line(raw: str, lineno: int, format: Format = "auto") -> Conversation:
    try:
        obj = loads_json(raw)
    except json.JSONDecodeError as e:
        raise _LineError(f"malformed JSON: {e.msg} at column {e.colno}") from None
    except ValueError as e:  # nested too deep
        raise _LineError(str(e)) from None
    return parse_record(obj, lineno, format)


def parse_record(obj: Any, n: int, format: Format = "auto", id_prefix: str = "line") -> Conversation:
    """One chat (a JSON line's object or a table row's dict); without an id it is `<id_prefix>-<n>`."""
    if not isinstance(obj, dict):
        raise _LineError(f"not a JSON object: got {type(obj).__name__}")
    kind = format
    if kind == "auto":
        kind = "openai" if "messages" in obj else "sharegpt" if "conversations" in obj else "auto"
        if kind == "auto":
            raise _LineError("missing key: neither 'messages' (OpenAI) nor 'conversations' (ShareGPT)")
    messages = _openai_messages(obj) if kind == "openai" else _sharegpt_messages(obj)
    _check_turns(messages)
    meta = {k: obj.get(k) for k in ("id", "segment", "source_file")}
    for k, v in meta.items():
        if v is not None and not isinstance(v, (str, int)):
            raise _LineError(f"bad field: {k!r} must be a string, got {type(v).__name__}")
    return Conversation(
        id=str(meta["id"]) if meta["id"] is not None else f"{id_prefix}-{n}",
        messages=tuple(messages),
        segment=_opt_str(meta["segment"]),
        source_file=_opt_str(meta["source_file"]),
        max_new_tokens=_max_new_tokens(obj),
    )


def _max_new_tokens(obj: dict[str, Any]) -> int | None:
    v = obj.get("max_new_tokens")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _LineError(f"bad field: 'max_new_tokens' must be an integer >= 1, got {v!r}")
    return v


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


def _turns(obj: dict[str, Any], key: str) -> list[Any]:
    turns = obj.get(key)
    if not isinstance(turns, list):
        raise _LineError(f"missing key: {key!r} must be a list, got {type(turns).__name__}")
    if not turns:
        raise _LineError(f"no user turn: {key!r} is empty")
    return turns


def _openai_messages(obj: dict[str, Any]) -> list[Message]:
    out = []
    for i, m in enumerate(_turns(obj, "messages")):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise _LineError(f"bad message: message {i} needs 'role' and 'content'")
        if m["role"] not in ROLES:
            raise _LineError(f"unknown role: {m['role']!r} in message {i}; expected one of {list(ROLES)}")
        out.append(Message(m["role"], _content(m["content"], i)))
    return out


def _sharegpt_messages(obj: dict[str, Any]) -> list[Message]:
    out = []
    for i, m in enumerate(_turns(obj, "conversations")):
        if not isinstance(m, dict) or "from" not in m or "value" not in m:
            raise _LineError(f"bad message: turn {i} needs 'from' and 'value'")
        if m["from"] not in SHAREGPT_ROLES:
            raise _LineError(f"unknown role: {m['from']!r} in turn {i}; expected one of {list(SHAREGPT_ROLES)}")
        out.append(Message(SHAREGPT_ROLES[m["from"]], _content(m["value"], i)))
    return out


def _content(value: Any, i: int) -> str:
    if not isinstance(value, str):
        raise _LineError(f"bad message: content of message {i} must be a string, got {type(value).__name__}")
    return value


def _check_turns(messages: list[Message]) -> None:
    systems = [i for i, m in enumerate(messages) if m.role == "system"]
    if systems and systems != [0]:
        raise _LineError(
            f"misplaced system message: at position {systems[-1]}; only one leading system prompt is supported"
        )
    if not any(m.role == "user" for m in messages):
        raise _LineError("no user turn: the conversation has only " + ", ".join(sorted({m.role for m in messages})))


# Bump when `write_openai_jsonl` writes different bytes for the same conversations: the embedded default's build
# hash covers this number instead of this module's source (tests/test_traffic_io.py pins the output bytes).
WRITER_VERSION = 1


def write_openai_jsonl(path: Path | str, conversations: Iterable[Conversation]) -> str:
    """Write one OpenAI-format line per conversation (UTF-8, keys in a fixed order); return the file's sha256."""
    path = Path(path)
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as fh:  # a crash leaves no half file
        for c in conversations:
            fh.write(json.dumps(c.to_openai(), ensure_ascii=False) + "\n")
    return traffic_sha256(path)


def traffic_sha256(path: Path | str) -> str:
    """sha256 of the exact traffic used: a file's bytes; for a saved-dataset directory, of the lines
    `<sha256 of a data file>  <its path relative to the directory>` in sorted order, over the data files its
    state.json lists (not state.json itself, whose fingerprint differs between saves of identical rows)."""
    path = Path(path)
    if not path.is_dir():
        return file_sha256(path)
    try:
        files = dataset_data_files(path)
    except SourceError as e:
        raise TrafficFormatError(path, 0, e.reason, "row") from None
    rel = sorted((f.relative_to(path).as_posix(), f) for f in files)
    return hashlib.sha256("".join(f"{file_sha256(f)}  {name}\n" for name, f in rel).encode()).hexdigest()


def conversations_sha256(conversations: Iterable[Conversation]) -> str:
    """sha256 of the normalised conversations: equal for the same chats in OpenAI or ShareGPT form."""
    h = hashlib.sha256()
    for c in conversations:
        h.update(json.dumps(c.to_openai(), ensure_ascii=False, sort_keys=True).encode() + b"\n")
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    paths = argv if argv is not None else sys.argv[1:]
    if not paths:
        print(
            "usage: python -m components.data.traffic_io PATH... (.jsonl, .parquet, .arrow or a save_to_disk "
            "directory)",
            file=sys.stderr,
        )
        return 2
    for p in paths:
        try:
            load = load_traffic(p, skip_bad=True)
        except (TrafficFormatError, OSError) as e:  # one line, no traceback: the file and why
            print(f"traffic_io: error: {e}", file=sys.stderr)
            return 2
        segments = collections.Counter(c.segment or "-" for c in load.conversations)
        print(
            json.dumps(
                {
                    "path": str(p),
                    "conversations": len(load.conversations),
                    "segments": dict(segments),
                    "skipped": load.skipped_reasons,
                    "sha256": traffic_sha256(p),
                    "content_sha256": conversations_sha256(load.conversations),
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
