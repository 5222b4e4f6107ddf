"""Tabular traffic sources: Parquet, Arrow IPC and `datasets` save_to_disk directories, read batch by batch.

Purpose: `traffic_kind(path)` names the form of a traffic path ("jsonl", "parquet", "arrow" or "dataset") or raises
`SourceError` listing the accepted forms, or saying why a path is no regular file that can be read (a named pipe, a
device, a socket, a link loop: components/data/safe_read.py, decided before anything opens it); `table_records(path,
kind)` yields (row number, record) for the tabular forms, one batch of rows at a time (Parquet row groups,
memory-mapped Arrow record batches), reading only the columns the traffic schemas use; `dataset_data_files(path)`
lists the files that hold a saved dataset's rows (what its hash covers), each a regular file that can be read.
Forms: `.jsonl`/`.json`/`.ndjson` (JSON Lines, read by components/data/traffic_io.py); `.parquet`; `.arrow`, either the
IPC stream format (what `datasets` writes: save_to_disk shards, cache files) or the IPC file format
(`pyarrow.ipc.new_file`); a directory written by `Dataset.save_to_disk`, or by `DatasetDict.save_to_disk` when it
holds exactly one split (otherwise pass the split's subdirectory, e.g. `DIR/train`).
Rules: a record is the row as a dict, as its JSON line would be, except that a null column or null struct field is
an absent key (a table cannot tell the two apart). Rows are numbered from 1 in storage order (a directory: row n is
`load_from_disk(DIR)[n - 1]`).
Not here: the per-row rules and the errors naming file and row (components/data/traffic_io.py).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Iterator

from components.data.safe_read import UnreadableFile, file_problem, read_json

ACCEPTED = (
    "JSON Lines (.jsonl, .json, .ndjson), Parquet (.parquet), Arrow IPC file or stream (.arrow), or a "
    "directory written by datasets' save_to_disk"
)
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
# the only columns a row is parsed from
COLUMNS = ("id", "segment", "source_file", "max_new_tokens", "messages", "conversations")
BATCH_ROWS = 1024  # rows turned into Python objects at a time


class SourceError(Exception):
    """A traffic source that cannot be read as a whole (`row` 0) or from row `row` on."""

    def __init__(self, reason: str, row: int = 0):
        self.reason, self.row = reason, row
        super().__init__(reason)


def traffic_kind(path: Path) -> str:
    if not path.exists() and not path.is_symlink():  # a link loop or a dangling link: file_problem says which
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return "dataset"
        raise SourceError(
            "a directory that is not a saved dataset (no state.json or dataset_dict.json, as "
            f"Dataset.save_to_disk writes); accepted: {ACCEPTED}"
        )
    problem = file_problem(path)  # before any open: a named pipe would block it for ever
    if problem:
        raise SourceError(problem)
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in (".parquet", ".arrow"):
        return suffix[1:]
    raise SourceError(f"unsupported traffic file type {suffix or '(no extension)'!r}; accepted: {ACCEPTED}")


def table_records(path: Path, kind: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based row number, record) of every row of a Parquet file, Arrow file or saved dataset directory."""
    import pyarrow as pa

    batches = {"parquet": _parquet_batches, "arrow": _arrow_batches, "dataset": _dataset_batches}[kind]
    n = 0
    try:
        for batch in batches(path):
            for rec in batch.to_pylist():
                n += 1
                yield n, _drop_nulls(rec)
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"unreadable {kind} data after row {n}: {type(e).__name__}: {e}", n + 1) from None


def dataset_split_dir(path: Path) -> Path:
    """The `Dataset` directory to read: `path` itself, or the only split of a DatasetDict directory."""
    if (path / "state.json").is_file():
        return path
    splits = _read_json(path / "dataset_dict.json").get("splits")
    if not isinstance(splits, list) or not splits:
        raise SourceError(f"{path / 'dataset_dict.json'} lists no splits")
    if len(splits) != 1:
        raise SourceError(f"a DatasetDict with splits {splits}: pass one split's directory, e.g. {path / splits[0]}")
    return path / splits[0]


def dataset_data_files(path: Path) -> list[Path]:
    """The Arrow files holding the rows of a saved dataset (its one split), in row order, as its state.json lists
    them: not state.json or dataset_info.json, nor cache files that `.map` may have written beside them."""
    split = dataset_split_dir(path)
    entries = _read_json(split / "state.json").get("_data_files")
    if not isinstance(entries, list) or not entries:
        raise SourceError(f"{split / 'state.json'} lists no data files")
    files = [split / e["filename"] for e in entries if isinstance(e, dict) and isinstance(e.get("filename"), str)]
    if len(files) != len(entries):
        raise SourceError(f"{split / 'state.json'} has a data file entry without a filename")
    missing = [str(f) for f in files if not os.path.lexists(f)]
    if missing:
        raise SourceError(f"data files listed in {split / 'state.json'} are missing: {missing}")
    for f in files:
        problem = file_problem(f)
        if problem:
            raise SourceError(f"data file {f} listed in {split / 'state.json'}: {problem}")
    return files


def _read_json(path: Path) -> dict[str, Any]:
    try:
        obj = read_json(path)
    except UnreadableFile as e:
        raise SourceError(f"{path}: {e.reason}") from None
    if not isinstance(obj, dict):
        raise SourceError(f"{path.name} is not a JSON object")
    return obj


def _columns(names: list[str]) -> list[str]:
    if "messages" not in names and "conversations" not in names:
        raise SourceError(f"no 'messages' (OpenAI) or 'conversations' (ShareGPT) column; columns: {names}")
    return [c for c in COLUMNS if c in names]


def _parquet_batches(path: Path) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path), memory_map=True)
    except pa.ArrowException as e:
        raise SourceError(f"not a readable Parquet file ({type(e).__name__}: {e})") from None
    with pf:
        yield from pf.iter_batches(batch_size=BATCH_ROWS, columns=_columns(pf.schema_arrow.names))


def _arrow_batches(path: Path) -> Iterator[Any]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as src:
        is_file_format = src.read(6) == b"ARROW1"  # the IPC file format's magic; a stream starts with a message
        src.seek(0)
        try:
            reader = pa.ipc.open_file(src) if is_file_format else pa.ipc.open_stream(src)
        except pa.ArrowException as e:
            raise SourceError(f"not a readable Arrow IPC file or stream ({type(e).__name__}: {e})") from None
        cols = _columns(reader.schema.names)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) if is_file_format else reader
        for batch in batches:
            for start in range(0, batch.num_rows, BATCH_ROWS):
                yield batch.slice(start, BATCH_ROWS).select(cols)


def _dataset_batches(path: Path) -> Iterator[Any]:
    split = dataset_split_dir(path)
    dataset_data_files(path)  # each a regular file that can be read, before datasets maps them
    import datasets

    try:
        ds = datasets.load_from_disk(str(split))  # memory-mapped, nothing is copied
    except Exception as e:  # datasets raises several types for a directory it cannot read
        raise SourceError(f"not a readable saved dataset ({type(e).__name__}: {e})") from None
    cols = _columns(ds.column_names)
    for table in ds.with_format("arrow").iter(batch_size=BATCH_ROWS):
        yield table.select(cols)


def _drop_nulls(rec: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in rec.items():
        if v is None:
            continue
        if isinstance(v, list):
            v = [{mk: mv for mk, mv in m.items() if mv is not None} if isinstance(m, dict) else m for m in v]
        out[k] = v
    return out
