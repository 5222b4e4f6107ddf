"""Reading the files a user hands us: regular files only, within size caps, UTF-8 text, JSON of sane depth.

Purpose: one set of rules for every file the pipeline reads from the user (the `--config` JSON, traffic in every
form, held-out files, the JSON of target and head directories), so that a file that is not what it seems is one
`UnreadableFile` line (a `BadInput`: exit 2) naming the file, what is wrong and what to do, in milliseconds:
  kind      `file_problem(path)`: a named pipe (whose read would wait for a writer for ever), a device, a socket, a
            directory, a symbolic link loop or a dangling link, and a file whose first byte cannot be read; decided
            with `os.stat` before anything is opened (the first byte is read only from a regular file).
  size      `read_capped` reads at most `limit` + 1 bytes: a file over the cap is refused without reading the rest
            (JSON files: `MAX_JSON_BYTES`; JSON Lines: each line under `MAX_LINE_BYTES`, components/data/traffic_io.py).
  encoding  `decode_utf8`: UTF-16 or UTF-32 (a byte-order mark, or NUL bytes, which JSON text never holds raw) and
            bytes that are not UTF-8 (Latin-1, cp1252) are refused with "re-save it as UTF-8". A UTF-8 byte-order
            mark: RFC 8259 (section 8.1) lets a JSON parser ignore it, so it is accepted (`bom_ok`) in the files only
            this project parses (the `--config` file, JSON Lines traffic, a saved dataset's state.json); the JSON of
            a model or head directory is read by transformers, vLLM and the head loader too, whose `json.loads`
            refuses it, so there it is refused up front.
  depth     `loads_json` refuses JSON nested deeper than `MAX_DEPTH` levels (Python's parser raises
            RecursionError near 1000; no config, chat or model file nests beyond a handful).
`check_model_files(dir)` applies the kind rule to the files a model or head directory's loaders read, and the JSON
rules to its `*.json` files but syntax, which each file's reader reports in its own terms (`tokenizer.json`, up to
tens of MB and parsed by the Rust tokenizers library with its own depth bound: the kind, size and encoding rules).
Run: imported by the readers (components/config/pipeline.py, components/config/presets.py,
components/data/traffic_io.py, components/data/traffic_sources.py;
flows/preflight.py); nothing runs at import.
Not here: what the JSON must hold (each reader checks its own schema), binary formats' contents (safetensors,
Parquet, Arrow are checked by their readers).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from eagle.errors import BadInput

MAX_JSON_BYTES = 64 << 20  # a whole JSON file; the largest tokenizer.json of a public model is about 35 MB
MAX_LINE_BYTES = 64 << 20  # one JSON Lines record; a 1M-token conversation is about 4 MB
MAX_DEPTH = 64
# what a model or head directory's loaders open: weights, JSON, chat templates, sentencepiece and BPE vocabularies
MODEL_FILES = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt")
# JSON read by the Rust `tokenizers` library (serde_json, which refuses nesting past 128 with an error of its own)
RUST_PARSED = ("tokenizer.json",)
_BOMS = (
    (b"\x00\x00\xfe\xff", "UTF-32 (big-endian)"),
    (b"\xff\xfe\x00\x00", "UTF-32 (little-endian)"),
    (b"\xfe\xff", "UTF-16 (big-endian)"),
    (b"\xff\xfe", "UTF-16 (little-endian)"),
)
UTF8_BOM = b"\xef\xbb\xbf"
RESAVE = "re-save it as UTF-8"


class UnreadableFile(BadInput):
    """A file that is not a regular readable file, too large, not UTF-8, or JSON that is malformed or too deep."""

    def __init__(self, path: Path | str, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"{path}: {reason}")


class MalformedJson(UnreadableFile):
    """JSON text with a syntax error (a truncated or hand-edited file)."""


def _kind(mode: int) -> str | None:
    """What a file that is not a regular one is, and what to pass instead; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISFIFO(mode):
        return (
            "a named pipe (FIFO), not a regular file: reading it would wait for a writer; save what it carries "
            "to a file and pass that"
        )
    if stat.S_ISDIR(mode):
        return "a directory where a file is expected; pass the file itself"
    kind = (
        "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a special file"
    )
    return f"{kind}, not a regular file; pass a file that holds the data"


def file_problem(path: Path | str) -> str | None:
    """Why `path` is not a regular file whose bytes can be read (following symbolic links), or None."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop (it never reaches a file); point the link at the file itself"
        if e.errno == errno.ENOENT and os.path.islink(path):
            return f"a symbolic link to {os.readlink(path)}, which does not exist; point it at the file itself"
        if e.errno == errno.ENOENT:
            return "no such file"
        return f"cannot be read ({e.strerror}); make it readable or copy it again"
    kind = _kind(st.st_mode)
    if kind:
        return kind
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        return f"cannot be read ({e.strerror or e}); make it readable (chmod a+r) or copy it again"
    return None


def check_file(path: Path | str) -> None:
    """`UnreadableFile` when `path` is not a regular, readable file (`file_problem`)."""
    problem = file_problem(path)
    if problem:
        raise UnreadableFile(path, problem)


def read_capped(path: Path | str, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (no more than `limit` + 1 are ever read)."""
    check_file(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)  # st_size can lie (procfs says 0), so the cap is on what is read
    except OSError as e:
        raise UnreadableFile(path, f"cannot be read ({e.strerror or e}); copy it again") from None
    if len(raw) > limit:
        raise UnreadableFile(
            path,
            f"larger than {limit >> 20} MiB, the most a file of this kind may be here; "
            "check that this is the right file",
        )
    return raw


def encoding_problem(raw: bytes) -> str | None:
    """Why `raw` (a file's first bytes, or one of its lines) is UTF-16 or UTF-32 rather than UTF-8, or None."""
    for bom, name in _BOMS:
        if raw.startswith(bom):
            return f"not UTF-8 text: it starts with a {name} byte-order mark; {RESAVE}"
    if b"\x00" in raw:
        return f"not UTF-8 text: it holds NUL bytes (UTF-16 or UTF-32 without a byte-order mark?); {RESAVE}"
    return None


def decode_utf8(raw: bytes, path: Path | str, bom_ok: bool = True) -> str:
    """`raw` as UTF-8 text (a leading UTF-8 byte-order mark dropped where `bom_ok`), else `UnreadableFile`."""
    problem = encoding_problem(raw)
    if problem:
        raise UnreadableFile(path, problem)
    if raw.startswith(UTF8_BOM):
        if not bom_ok:
            raise UnreadableFile(
                path,
                "starts with a UTF-8 byte-order mark, which transformers, vLLM and the head "
                "loader refuse in model files; re-save it as UTF-8 without one",
            )
        raw = raw[len(UTF8_BOM) :]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnreadableFile(
            path,
            f"not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {e.start} (Latin-1 or "
            f"another 8-bit encoding?); {RESAVE}",
        ) from None


def json_depth_over(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` nests lists and objects more than `limit` deep (a loop over a stack: no recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def loads_json(text: str, limit: int = MAX_DEPTH) -> Any:
    """`json.loads(text)`; ValueError (JSONDecodeError for bad syntax) when it nests deeper than `limit`."""
    too_deep = ValueError(
        f"JSON nested deeper than {limit} levels; no config, chat or model file needs that many: "
        "check how it was written"
    )
    try:
        value = json.loads(text)
    except RecursionError:
        raise too_deep from None
    if json_depth_over(value, limit):
        raise too_deep
    return value


def read_json(path: Path | str, bom_ok: bool = True, limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON value of a file, every rule of this module applied; malformed JSON is `not readable JSON (...)`."""
    text = decode_utf8(read_capped(path, limit), path, bom_ok)
    try:
        return loads_json(text)
    except json.JSONDecodeError as e:
        raise MalformedJson(path, f"not readable JSON ({e})") from None
    except ValueError as e:
        raise UnreadableFile(path, str(e)) from None


def check_model_files(directory: Path | str, recursive: bool = False) -> None:
    """The files a model or head directory's loaders open (`MODEL_FILES`, below it too with `recursive`) are
    regular and readable, and each `*.json` is UTF-8 JSON within the caps (no byte-order mark: module doc)."""
    d = Path(directory)
    found = {p for pattern in MODEL_FILES for p in (d.rglob(pattern) if recursive else d.glob(pattern))}
    for p in sorted(found):
        if p.name in RUST_PARSED:  # tens of MB, which Python would parse in a second; its reader bounds the depth
            decode_utf8(read_capped(p, MAX_JSON_BYTES), p, bom_ok=False)
        elif p.suffix == ".json":
            with contextlib.suppress(MalformedJson):  # a syntax error: its own reader names it in its own terms
                read_json(p, bom_ok=False)
        else:
            check_file(p)
