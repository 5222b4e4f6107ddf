"""Traffic from tables: Parquet, Arrow (IPC stream and file) and `datasets` save_to_disk directories load like JSONL.

Each test writes a few rows in tmp_path with pyarrow or `datasets` (no network, well under a second each after the
first import of `datasets`). Run: `python -m pytest -q tests/test_traffic_datasets.py`.
Not here: the per-row rules themselves (tests/test_traffic_io.py covers them on JSONL; tables use the same parser).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.data import traffic_sources
from components.data.traffic_io import (
    TrafficFormatError,
    conversations_sha256,
    load_traffic,
    traffic_sha256,
    write_openai_jsonl,
)

ROOT = Path(__file__).resolve().parents[1]
ROWS = [
    {
        "id": "a",
        "segment": "complete",
        "source_file": "json/decoder.py",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": 'def f(x):\n    """Double x."""'},
            {"role": "assistant", "content": "    return 2 * x\n"},
            {"role": "user", "content": "And triple? caf\u00e9"},
            {"role": "assistant", "content": "    return 3 * x\n"},
        ],
    },
    {"id": "b", "segment": None, "source_file": None, "messages": [{"role": "user", "content": "continue: import os"}]},
    {
        "id": "c",
        "segment": "chat",
        "source_file": None,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    },
]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}
BAD_ROW = {"id": "x", "segment": None, "source_file": None, "messages": [{"role": "tool", "content": "ls"}]}


def _sharegpt(rows: list[dict]) -> list[dict]:
    return [
        {
            "id": r["id"],
            "segment": r["segment"],
            "source_file": r["source_file"],
            "conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in r["messages"]],
        }
        for r in rows
    ]


def _parquet(path: Path, rows: list[dict], **kw) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, **kw)
    return path


def _saved(path: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def _ipc_file(path: Path, rows: list[dict]) -> Path:
    table = pa.Table.from_pylist(rows)
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    return path


def _forms(tmp_path: Path, rows: list[dict]) -> dict[str, Path]:
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in rows))
    saved = _saved(tmp_path / "saved", rows)
    return {
        "jsonl": jsonl,
        "parquet": _parquet(tmp_path / "t.parquet", rows),
        "arrow-stream (a save_to_disk shard)": saved / "data-00000-of-00001.arrow",
        "arrow-file": _ipc_file(tmp_path / "t.arrow", rows),
        "save_to_disk": saved,
    }


def test_every_form_loads_the_same_conversations(tmp_path):
    forms = _forms(tmp_path, ROWS)
    loads = {name: load_traffic(p).conversations for name, p in forms.items()}
    expected = loads["jsonl"]
    assert [c.id for c in expected] == ["a", "b", "c"] and expected[0].system == "You are terse."
    assert expected[1].segment is None and expected[2].segment == "chat"
    for name, convs in loads.items():
        assert convs == expected, name
        assert conversations_sha256(convs) == conversations_sha256(expected), name
    assert len({traffic_sha256(p) for p in forms.values()}) == len(forms)  # each names its own bytes


def test_sharegpt_schema_in_parquet(tmp_path):
    openai = load_traffic(_parquet(tmp_path / "o.parquet", ROWS)).conversations
    path = _parquet(tmp_path / "s.parquet", _sharegpt(ROWS))
    assert load_traffic(path).conversations == openai == load_traffic(path, format="sharegpt").conversations
    with pytest.raises(TrafficFormatError, match="row 1: missing key") as e:
        load_traffic(path, format="openai")
    assert e.value.line == 1


def test_a_bad_row_names_the_file_and_row_and_skip_bad_counts_it(tmp_path):
    path = _parquet(tmp_path / "bad.parquet", [ROWS[0], ROWS[1], BAD_ROW, ROWS[2]])
    with pytest.raises(TrafficFormatError) as e:
        load_traffic(path)
    assert (e.value.path, e.value.line, e.value.unit) == (str(path), 3, "row")
    assert str(e.value).startswith(f"{path}: row 3: unknown role: 'tool'")
    load = load_traffic(path, skip_bad=True)
    assert [c.id for c in load.conversations] == ["a", "b", "c"]
    assert [s.line for s in load.skipped] == [3] and load.skipped_reasons == {"unknown role": 1}


def test_row_numbers_run_across_batches_and_row_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(traffic_sources, "BATCH_ROWS", 2)
    rows = [dict(ROWS[1], id=f"r{i}") for i in range(7)]
    rows[5] = BAD_ROW
    path = _parquet(tmp_path / "groups.parquet", rows, row_group_size=3)
    assert pq.ParquetFile(path).num_row_groups == 3
    load = load_traffic(path, skip_bad=True)
    assert [c.id for c in load.conversations] == ["r0", "r1", "r2", "r3", "r4", "r6"]
    assert [s.line for s in load.skipped] == [6]
    with pytest.raises(TrafficFormatError, match="row 6: unknown role"):
        load_traffic(_saved(tmp_path / "saved", rows))


def test_nulls_are_absent_keys_and_a_row_without_id_is_numbered(tmp_path):
    mixed = [
        {"id": None, "messages": ROWS[2]["messages"], "conversations": None},
        {"id": 7, "messages": None, "conversations": _sharegpt(ROWS)[1]["conversations"]},
    ]
    convs = load_traffic(_parquet(tmp_path / "mixed.parquet", mixed)).conversations
    assert [c.id for c in convs] == ["row-1", "7"]
    assert [m.content for m in convs[1].messages] == ["continue: import os"]


def test_all_rows_bad_or_no_rows_is_an_error(tmp_path):
    with pytest.raises(TrafficFormatError, match="no valid conversation; all 1 rows were bad") as e:
        load_traffic(_parquet(tmp_path / "bad.parquet", [BAD_ROW]), skip_bad=True)
    assert e.value.line == 0
    empty = pa.Table.from_pylist(ROWS).slice(0, 0)
    pq.write_table(empty, tmp_path / "empty.parquet")
    with pytest.raises(TrafficFormatError, match="empty table: no rows"):
        load_traffic(tmp_path / "empty.parquet", skip_bad=True)


def test_dataset_dict_directory_needs_one_split(tmp_path):
    import datasets

    one = tmp_path / "one"
    datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS)).save_to_disk(str(one))
    assert load_traffic(one).conversations == load_traffic(_parquet(tmp_path / "t.parquet", ROWS)).conversations
    two = tmp_path / "two"
    datasets.DatasetDict(
        train=datasets.Dataset.from_list(ROWS), test=datasets.Dataset.from_list(ROWS[:1])
    ).save_to_disk(str(two))
    for call in (load_traffic, traffic_sha256):
        with pytest.raises(TrafficFormatError, match=r"splits \['train', 'test'\]: pass one split's directory"):
            call(two)
    assert [c.id for c in load_traffic(two / "test").conversations] == ["a"]


def test_unsupported_file_or_directory_lists_the_accepted_forms(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("id,messages\n")
    plain = tmp_path / "plain"
    plain.mkdir()
    for path, reason in ((csv, "unsupported traffic file type '.csv'"), (plain, "a directory that is not a saved")):
        with pytest.raises(TrafficFormatError) as e:
            load_traffic(path)
        assert e.value.line == 0 and e.value.reason.startswith(reason) and "Parquet (.parquet)" in e.value.reason
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(TrafficFormatError, match="not a readable Parquet file"):
        load_traffic(junk)
    with pytest.raises(TrafficFormatError, match=r"no 'messages' \(OpenAI\) or 'conversations' \(ShareGPT\) column"):
        load_traffic(_parquet(tmp_path / "other.parquet", [{"id": "a", "text": "hi"}]))
    with pytest.raises(FileNotFoundError):
        load_traffic(tmp_path / "missing.parquet")


def test_directory_hash_covers_the_data_files_only(tmp_path):
    import datasets

    a = _saved(tmp_path / "a", ROWS)
    b = tmp_path / "b"
    datasets.Dataset.from_list(ROWS).map(lambda r: r).save_to_disk(str(b))  # same rows, another fingerprint
    assert (
        json.loads((a / "state.json").read_text())["_fingerprint"]
        != json.loads((b / "state.json").read_text())["_fingerprint"]
    )
    assert traffic_sha256(a) == traffic_sha256(b)
    datasets.load_from_disk(str(a)).map(lambda r: {"n": 1})  # writes a cache-*.arrow file into the directory
    assert any(p.name.startswith("cache-") for p in a.iterdir()) and traffic_sha256(a) == traffic_sha256(b)
    assert traffic_sha256(_saved(tmp_path / "c", ROWS[:2])) != traffic_sha256(a)
    jsonl = tmp_path / "t.jsonl"
    assert write_openai_jsonl(jsonl, load_traffic(a).conversations) == traffic_sha256(jsonl)


def test_the_command_line_prints_counts_for_parquet(tmp_path):
    path = _parquet(tmp_path / "t.parquet", [ROWS[0], BAD_ROW, ROWS[1], ROWS[2]])
    out = subprocess.run(
        [sys.executable, "-m", "components.data.traffic_io", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    report = json.loads(out)
    assert report["conversations"] == 3 and report["skipped"] == {"unknown role": 1}
    assert report["segments"] == {"complete": 1, "-": 1, "chat": 1}
    assert report["sha256"] == traffic_sha256(path)
    assert report["content_sha256"] == conversations_sha256(load_traffic(path, skip_bad=True).conversations)
