"""Traffic loaders: OpenAI and ShareGPT JSONL, every error with its line number, skip_bad counting, hashing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.data.traffic_io import (
    Conversation,
    Message,
    TrafficFormatError,
    conversations_sha256,
    load_traffic,
    traffic_sha256,
    write_openai_jsonl,
)

OPENAI = [
    {
        "id": "a",
        "segment": "complete",
        "source_file": "json/decoder.py",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": 'def f(x):\n    """Double x."""'},
            {"role": "assistant", "content": "    return 2 * x\n"},
            {"role": "user", "content": "And triple?"},
            {"role": "assistant", "content": "    return 3 * x\n"},
        ],
    },
    {"id": "b", "messages": [{"role": "user", "content": "continue: import os"}]},
]
SHAREGPT = [
    {
        "id": "a",
        "segment": "complete",
        "source_file": "json/decoder.py",
        "conversations": [
            {"from": "system", "value": "You are terse."},
            {"from": "human", "value": 'def f(x):\n    """Double x."""'},
            {"from": "gpt", "value": "    return 2 * x\n"},
            {"from": "human", "value": "And triple?"},
            {"from": "gpt", "value": "    return 3 * x\n"},
        ],
    },
    {"id": "b", "conversations": [{"from": "human", "value": "continue: import os"}]},
]


def _write(tmp_path: Path, lines: list, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_openai_and_sharegpt_normalise_to_the_same_conversations(tmp_path):
    a = load_traffic(_write(tmp_path, OPENAI, "a.jsonl")).conversations
    b = load_traffic(_write(tmp_path, SHAREGPT, "b.jsonl"), format="sharegpt").conversations
    assert a == b
    assert a[0].system == "You are terse." and a[1].system is None
    assert [m.role for m in a[0].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert a[0].segment == "complete" and a[0].source_file == "json/decoder.py"
    assert conversations_sha256(a) == conversations_sha256(b)


def test_round_trip_through_the_writer(tmp_path):
    convs = load_traffic(_write(tmp_path, OPENAI)).conversations
    out = tmp_path / "out.jsonl"
    sha = write_openai_jsonl(out, convs)
    assert sha == traffic_sha256(out)
    assert load_traffic(out).conversations == convs


def test_missing_id_gets_the_line_number_and_blank_lines_are_ignored(tmp_path):
    path = _write(tmp_path, ["", {"messages": [{"role": "user", "content": "hi"}]}])
    (conv,) = load_traffic(path).conversations
    assert conv == Conversation("line-2", (Message("user", "hi"),))


BAD_LINES = [
    ("{not json", "malformed JSON"),
    ("[1, 2]", "not a JSON object"),
    ({"id": "x"}, "missing key"),
    ({"messages": "hello"}, "missing key"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "unknown role"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, "unknown role"),
    ({"messages": [{"role": "user"}]}, "bad message"),
    ({"messages": [{"role": "user", "content": 3}]}, "bad message"),
    ({"messages": [{"role": "assistant", "content": "only me"}]}, "no user turn"),
    ({"messages": []}, "no user turn"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}, "misplaced system"),
]


@pytest.mark.parametrize("bad, reason", BAD_LINES)
def test_each_bad_line_names_file_line_and_reason(tmp_path, bad, reason):
    path = _write(tmp_path, [OPENAI[1], "", bad])
    with pytest.raises(TrafficFormatError) as e:
        load_traffic(path)
    assert e.value.line == 3 and e.value.path == str(path)
    assert e.value.reason.startswith(reason)
    assert f"{path}:3: {reason}" in str(e.value)


def test_empty_file_is_an_error(tmp_path):
    for content in ("", "\n\n"):
        path = tmp_path / "empty.jsonl"
        path.write_text(content)
        with pytest.raises(TrafficFormatError, match="empty file") as e:
            load_traffic(path, skip_bad=True)
        assert e.value.line == 0


def test_skip_bad_counts_skipped_lines_by_reason(tmp_path):
    path = _write(
        tmp_path,
        [
            OPENAI[0],
            "{oops",
            {"messages": [{"role": "tool", "content": "x"}]},
            OPENAI[1],
            {"messages": [{"role": "robot", "content": "x"}]},
        ],
    )
    load = load_traffic(path, skip_bad=True)
    assert [c.id for c in load.conversations] == ["a", "b"]
    assert [s.line for s in load.skipped] == [2, 3, 5]
    assert load.skipped_reasons == {"malformed JSON": 1, "unknown role": 2}


def test_skip_bad_with_nothing_valid_is_an_error(tmp_path):
    with pytest.raises(TrafficFormatError, match="no valid conversation"):
        load_traffic(_write(tmp_path, ["{oops", "[]"]), skip_bad=True)


def test_explicit_format_rejects_the_other_form(tmp_path):
    with pytest.raises(TrafficFormatError, match="missing key"):
        load_traffic(_write(tmp_path, SHAREGPT), format="openai")


def test_file_hash_changes_with_content_but_content_hash_ignores_format(tmp_path):
    a, b = _write(tmp_path, OPENAI, "a.jsonl"), _write(tmp_path, SHAREGPT, "b.jsonl")
    assert traffic_sha256(a) != traffic_sha256(b)
    assert len(traffic_sha256(a)) == 64


def test_a_line_that_is_not_utf8_is_a_named_error_or_a_skipped_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    bad = json.dumps({"id": "c", "messages": [{"role": "user", "content": "caf\u00e9"}]}, ensure_ascii=False)
    path.write_bytes((json.dumps(OPENAI[0]) + "\n").encode() + bad.encode("latin-1") + b"\n")
    with pytest.raises(TrafficFormatError, match=r"latin1.jsonl:2: not UTF-8 text: byte 0xe9 at column \d+") as e:
        load_traffic(path)
    assert e.value.line == 2
    load = load_traffic(path, skip_bad=True)
    assert [c.id for c in load.conversations] == ["a"] and load.skipped_reasons == {"not UTF-8 text": 1}


def test_a_leading_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(x) + "\n" for x in OPENAI).encode())
    assert [c.id for c in load_traffic(path).conversations] == ["a", "b"]


def test_writer_output_is_pinned_to_its_version(tmp_path):
    """The embedded build hash covers WRITER_VERSION, not the writer's source: if this fails, the writer now writes
    other bytes; bump `traffic_io.WRITER_VERSION` (cached embedded builds must be rebuilt) and update the hash."""
    from components.data.traffic_io import WRITER_VERSION

    convs = load_traffic(_write(tmp_path, OPENAI)).conversations
    sha = write_openai_jsonl(tmp_path / "out.jsonl", convs)
    assert (WRITER_VERSION, sha) == (1, PINNED_WRITER_SHA256)


PINNED_WRITER_SHA256 = "6abd2831ac7397fb8e4face690d0842007ab7e1282d98ae3f654a53ad341a496"
