"""The `long` traffic kind of the embedded default: whole stdlib modules and classes continued from their first lines.

Purpose: build long conversations from a few real stdlib files with a small BPE trained on them (about a second),
and check the prompts (the first lines of the unit), the answers (the real rest, cut at a line end to fit the
context), the lengths (`max_new_tokens` >= 1,000 and prompt + answer within 2,048 positions) and the traffic format
(written, read back, validated). Fast tier: no model is trained here.
Not here: the target's behaviour on long outputs, extraction and training memory (bench/long_outputs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.data.traffic_io import Conversation, TrafficFormatError, load_traffic, write_openai_jsonl
from embedded.config import CorpusConfig, EmbeddedConfig, TokenizerConfig, TrafficConfig
from embedded.corpus import SourceFile, base_files
from embedded.long_traffic import long_conversations
from embedded.tokenizer import render_chat, train_tokenizer
from embedded.traffic import sample_traffic

CONTEXT = 2048
MIN_NEW = 1000


@pytest.fixture(scope="module")
def files() -> list[SourceFile]:
    return base_files(CorpusConfig(max_base_files=6, max_file_bytes=60_000))


@pytest.fixture(scope="module")
def tok(files):
    return train_tokenizer(
        [f.text for f in files], TokenizerConfig(vocab_size=512), progress=False, model_max_length=CONTEXT
    )


@pytest.fixture(scope="module")
def convs(files, tok) -> list[Conversation]:
    return long_conversations(
        files, "stdlib", tok, TrafficConfig(kind="long", long_min_new_tokens=MIN_NEW), CONTEXT, seed=0
    )


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _unit(conv: Conversation, files: list[SourceFile]) -> str:
    """The source the conversation was made from: the whole file, or the class its prompt starts with."""
    text = next(f.text for f in files if f.rel_path == conv.source_file)
    head = conv.messages[-2].content.split("\n\n", 1)[1]
    return text if conv.segment == "long-module" else text[text.index(head) :]


def test_prompts_are_first_lines_and_answers_the_real_rest(convs, files):
    assert {c.segment for c in convs} == {"long-module", "long-class"}
    for c in convs:
        assert [m.role for m in c.messages][-2:] == ["user", "assistant"]
        head, answer = c.messages[-2].content.split("\n\n", 1)[1], c.messages[-1].content
        unit = _unit(c, files)
        assert head == "".join(unit.splitlines(keepends=True)[: TrafficConfig().long_prompt_lines])
        assert unit.startswith(head + answer)  # the real continuation, from the line after the prompt's last
        assert answer.endswith("\n") or head + answer == unit


def test_lengths_fit_the_context_and_ask_for_long_answers(convs, tok, files):
    assert len(convs) >= 4
    for c in convs:
        prompt = render_chat(
            [{"role": m.role, "content": m.content} for m in c.messages[:-1]], add_generation_prompt=True
        )
        answer = c.messages[-1].content
        assert c.max_new_tokens == len(_ids(tok, answer)) >= MIN_NEW
        assert len(_ids(tok, prompt)) + c.max_new_tokens + 1 <= CONTEXT  # + the end-of-turn token
        rest = _unit(c, files)[len(c.messages[-2].content.split("\n\n", 1)[1]) + len(answer) :]
        if rest:  # cut: one more line would not have fitted
            more = answer + rest.splitlines(keepends=True)[0]
            assert len(_ids(tok, prompt)) + len(_ids(tok, more)) + 1 > CONTEXT


def test_written_file_reads_back_with_max_new_tokens(convs, tmp_path: Path):
    held = sample_traffic(convs, 5, seed=0, split="target-heldout")
    assert all(c.max_new_tokens >= MIN_NEW for c in held)
    path = tmp_path / "target-heldout.jsonl"
    write_openai_jsonl(path, held)
    assert all(json.loads(line)["max_new_tokens"] >= MIN_NEW for line in path.read_text().splitlines())
    assert load_traffic(path).conversations == tuple(held)


def test_a_parquet_column_carries_max_new_tokens(convs, tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [c.to_openai() for c in convs[:3]]
    path = tmp_path / "long.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert [c.max_new_tokens for c in load_traffic(path).conversations] == [c.max_new_tokens for c in convs[:3]]


def test_a_files_conversations_do_not_depend_on_the_others(convs, files, tok):
    cfg = TrafficConfig(kind="long", long_min_new_tokens=MIN_NEW)
    big = max(files, key=lambda f: len(f.text))
    alone = long_conversations([big], "stdlib", tok, cfg, CONTEXT, seed=0)
    assert alone and alone == [c for c in convs if c.source_file == big.rel_path]


def test_too_short_a_context_gives_no_sample(files, tok):
    cfg = TrafficConfig(kind="long", long_min_new_tokens=MIN_NEW)
    assert long_conversations(files, "stdlib", tok, cfg, 512, seed=0) == []


@pytest.mark.parametrize("value", [0, -3, "1000", 1000.5, True])
def test_bad_max_new_tokens_names_the_line(tmp_path: Path, value):
    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "max_new_tokens": value}) + "\n")
    with pytest.raises(TrafficFormatError, match=r"bad\.jsonl:2: bad field: 'max_new_tokens'"):
        load_traffic(path)


def test_kind_is_a_setting_and_chat_stays_the_default():
    assert EmbeddedConfig.default().traffic.kind == "chat"
    assert EmbeddedConfig.from_dict({"traffic": {"kind": "long"}}).traffic.kind == "long"
    with pytest.raises(ValueError, match="unknown kind 'longer'"):
        EmbeddedConfig.from_dict({"traffic": {"kind": "longer"}})


def test_the_build_writes_long_traffic_when_the_setting_asks(tmp_path: Path):
    """The tiny preset (512 positions) with `traffic.kind: long`: every traffic file holds long conversations."""
    from embedded.build import build_embedded

    tiny = EmbeddedConfig.tiny().to_dict()
    tiny["traffic"].update(kind="long", long_prompt_lines=8, long_min_new_tokens=150)
    result = build_embedded(EmbeddedConfig.from_dict(tiny), tmp_path, progress=False)
    for files in (result.target_traffic, result.finetune_traffic):
        for path in (files.train, files.heldout):
            convs = load_traffic(path).conversations
            assert convs and all(c.segment.startswith("long-") and c.max_new_tokens >= 150 for c in convs)
