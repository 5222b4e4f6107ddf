"""Served traffic as training data, without vLLM: captured rows -> training conversations, the target filter and its
skip reasons, the held-out split, the mix ratio, the plan the train-head flow takes, and the `capture` settings.

Purpose: components/data/captured_traffic.py and the read side of components/data/capture_records.py on capture files
written by the real writer (components/serving/capture.py) from hand-made exchanges (the bytes vLLM answers).
Run: `python -m pytest tests/test_capture_retrain.py` (a few seconds).
Not here: the flow end to end with vLLM and the shadow test (tests/test_capture_retrain_engine.py), the verdict rule
(tests/test_shadow.py).
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from components.data.captured_traffic import (
    SHARD,
    CaptureError,
    CapturedTrafficConfig,
    mix_counts,
    new_conversations,
    prepare_capture_plan,
    prompt_key,
    select_captured,
    split_heldout,
)
from components.data.traffic_io import Conversation, Message, load_traffic
from components.serving.capture import CaptureConfig, CaptureWriter
from infra.serve_proxy import Exchange

TARGET = {"head": "models:/t-v3-eagle3/1", "target_name": "t", "target_version": "3"}
_ARRIVALS = itertools.count(int(time.time() * 1000), 5)  # ms apart: rows are ordered by their arrival time (ms)


def exchange(
    q: str, a: str, temperature: float | None = 0.0, meta=TARGET, path="/v1/chat/completions", finish="stop", history=()
) -> Exchange:
    req = {
        "model": "t",
        "messages": [*history, {"role": "user", "content": q}],
        "max_tokens": 16,
        "temperature": temperature,
    }
    if path.endswith("/completions") and "chat" not in path:
        req = {"model": "t", "prompt": q, "max_tokens": 16}
        body = {"choices": [{"text": a, "finish_reason": finish}]}
    else:
        body = {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": a}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 5},
        }
    return Exchange(path, json.dumps(req).encode(), json.dumps(body).encode(), meta, next(_ARRIVALS) / 1000, 0.01)


def capture(root: Path, exchanges: list[Exchange]) -> None:
    with CaptureWriter(root, CaptureConfig(rows_per_file=4, flush_s=30.0, min_free_bytes=0), lambda s: None) as w:
        for ex in exchanges:
            w.submit(ex)


def served(root: Path, n: int = 10) -> None:
    """`n` greedy and sampled chats of target t/3, plus rows that must be skipped."""
    other = {**TARGET, "target_version": "2"}
    capture(
        root,
        [
            *(exchange(f"q{i}", f"a{i}", 0.0 if i % 2 == 0 else 0.8) for i in range(n)),
            exchange("old", "x", meta=other),
            exchange("old2", "y", meta=other),
            exchange("p", "c", path="/v1/completions"),
            exchange("q-empty", ""),
            exchange("q-len", "cut", 0.8, finish="length"),
        ],
    )


def registered(tmp_path: Path, n: int = 20) -> str:
    path = tmp_path / "registered.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"r{i}"}]}) + "\n" for i in range(n)
        )
    )
    return str(path)


def test_captured_rows_become_training_conversations_of_that_target_only(tmp_path):
    served(tmp_path / "cap")
    sel = select_captured(tmp_path / "cap", "t", 3)
    # every usable row of t/3, oldest first, as it was served: the prompt, then the target's answer
    assert [c.messages[-1].content for c in sel.conversations] == [*(f"a{i}" for i in range(10)), "cut"]
    assert sel.conversations[0].messages == (Message("user", "q0"), Message("assistant", "a0"))
    assert {c.segment for c in sel.conversations} == {"captured"}
    assert len(sel.greedy) == 5 and all(
        int(c.messages[-1].content[1:]) % 2 == 0 for c in sel.conversations if c.id in sel.greedy
    )
    assert sel.skipped == {
        "served by t/2, not t/3": 2,
        "a /v1/completions request (no chat messages)": 1,
        "empty completion": 1,
    }
    assert all(Path(f).parent.name == "t" for f in sel.files) and sel.limits[sel.conversations[0].id] == 5
    assert new_conversations(tmp_path / "cap", "t", 3, after_ms=sel.times[sel.conversations[7].id]) == 3
    assert select_captured(tmp_path / "nothing", "t", 3).conversations == []


def _conv(i: int, q: str, a: str = "a") -> Conversation:
    return Conversation(f"c{i}", (Message("user", q), Message("assistant", a)))


def test_the_newest_distinct_prompts_are_held_out_and_never_trained_on():
    convs = [
        _conv(0, "x"),
        _conv(1, "y"),
        _conv(2, "x", "b"),
        _conv(3, "z"),
        _conv(4, "y"),
        _conv(5, "z"),
        _conv(6, "w"),
    ]
    train, held = split_heldout(convs, 2)
    assert [c.id for c in held] == ["c6", "c5"]  # newest first, distinct prompts
    assert [c.id for c in train] == ["c0", "c1", "c2"]  # z and w are held out; c4 repeats c1
    assert not {prompt_key(c) for c in train} & {prompt_key(c) for c in held}
    train, held = split_heldout(convs, 10)
    assert len(held) == 4 and train == []  # only four distinct prompts


@pytest.mark.parametrize(
    "captured, registered, mix, want",
    [
        (10, 100, 0.5, (10, 10)),
        (10, 100, 0.8, (10, 2)),
        (10, 100, 0.2, (10, 40)),
        (10, 4, 0.5, (4, 4)),
        (10, 3, 0.25, (1, 3)),
        (1, 100, 0.9, (1, 1)),
        (3, 1, 0.9, (3, 1)),
    ],
)
def test_the_mix_ratio(captured, registered, mix, want):
    got = mix_counts(captured, registered, mix)
    assert got == want and got[0] <= captured and got[1] <= registered


def test_a_plan_uses_captures_as_served_and_says_what_it_used(tmp_path):
    served(tmp_path / "cap")
    cfg = CapturedTrafficConfig(mix=0.6, heldout=3)
    plan = prepare_capture_plan(cfg, tmp_path / "cap", "t", 3, registered(tmp_path), tmp_path / "plan")
    held = load_traffic(plan.heldout_file).conversations
    train = load_traffic(plan.captured_file).conversations
    assert [c.messages[-1].content for c in held] == ["cut", "a9", "a8"]  # the newest three
    assert (plan.captured, plan.registered, plan.heldout) == (8, 5, 3)  # 8 / (8 + 5) ≈ 0.6
    assert plan.greedy + plan.sampled == 8 and plan.greedy == 4 and held[0].max_new_tokens == 5
    assert plan.skipped["served by t/2, not t/3"] == 2 and all(Path(f).parent.name == "t" for f in plan.files)
    # the train-head flow's hooks: the registered share, the captured shard beside regenerate's, the lineage tags
    from components.config.pipeline import PipelineConfig

    assert plan.applied(PipelineConfig.tiny()).regenerate.limit == 5
    regen = tmp_path / "regen"
    regen.mkdir()
    assert plan.add_to(regen) == 8 and plan.add_to(regen) == 8
    from components.data.regenerated import read_regenerated

    assert [c.id for c in read_regenerated(str(regen))] == [c.id for c in train]
    assert (regen / SHARD).is_file()
    tags = plan.tags()
    assert tags["capture_conversations"] == "8" and tags["capture_heldout"] == "3" and tags["capture_mix"] == "0.6"
    assert "served by t/2, not t/3: 2" in tags["capture_skipped"] and tags["capture_files"].startswith("capture-")
    assert int(tags["capture_until_ms"]) > 0
    # the same captures planned again: the same hash (the run key), whatever folder the plan is in
    again = prepare_capture_plan(cfg, tmp_path / "cap", "t", 3, registered(tmp_path), tmp_path / "plan2")
    assert again.sha256 == plan.sha256
    assert type(plan).read(tmp_path / "plan" / "plan.json") == plan


def test_too_few_captured_conversations_is_one_clear_line(tmp_path):
    capture(tmp_path / "cap", [exchange("q", "a"), exchange("q", "a")])  # one distinct prompt, held out
    with pytest.raises(
        CaptureError,
        match=r"2 usable captured conversations of t/3 \(none skipped\); the newest "
        r"capture.heldout 1 distinct prompts are held out",
    ):
        prepare_capture_plan(
            CapturedTrafficConfig(heldout=1), tmp_path / "cap", "t", 3, registered(tmp_path), tmp_path / "plan"
        )


def test_capture_settings_are_checked_and_out_of_the_runs_identity():
    from components.config.pipeline import ConfigError, PipelineConfig

    cfg = PipelineConfig.tiny()
    assert cfg.override({"capture": {"mix": 0.3}}).fingerprint() == cfg.fingerprint()  # the plan's hash counts
    with pytest.raises(ConfigError, match=r"capture.mix must be a number in \(0, 1\)"):
        cfg.override({"capture": {"mix": 1}})
    with pytest.raises(ConfigError, match=r"capture.heldout must be an integer >= 1, got 0"):
        cfg.override({"capture": {"heldout": 0}})
    with pytest.raises(ConfigError, match=r"unknown key capture.ratio"):
        cfg.override({"capture": {"ratio": 0.5}})


def test_the_read_side_agrees_with_the_writer():
    import components.serving.capture as writer
    import components.data.capture_records as records

    assert (writer.META_KEY, writer.PATTERN) == (records.META_KEY, records.FILE_PATTERN)
