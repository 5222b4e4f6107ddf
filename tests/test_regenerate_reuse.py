"""components/regenerate/reuse.py: a run links the finished shards of an earlier run with the same answers.

Purpose: the regenerate stage after `link_twins` answers no conversation whose shard is finished in an earlier folder
(same index, same ids) and leaves files equal to a fresh run's; a longer `limit` answers only the new shard; another
`shard_size` links nothing; a shard the run does not ask for is never placed; a linked shard never changes under the
run that made it; `earlier` lists only sibling folders with the same mark. And through the `train-head` flow on the
tiny target: two runs of one target version whose configs differ only past `regenerate` (here `train.steps`)
regenerate once, the second run's regenerate folder linked to the first's, and a `regenerate` setting that changes
the answers (`max_new_tokens`) regenerates again.
Run: `python -m pytest tests/test_regenerate_reuse.py` (seconds; the flow test ~1 min).
Not here: the stage's own resume and its files (tests/test_regenerate.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from components.config.pipeline import PipelineConfig
from components.regenerate.reuse import earlier, mark, source_key
from components.regenerate.stage import RegenerateConfig, link_twins, regenerate

CFG = RegenerateConfig(max_new_tokens=8, batch_size=4, shard_size=4, limit=8, seed=0)


def _traffic(path: Path, n: int = 12) -> str:
    convs = [{"id": f"c{i:02d}", "segment": "t", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(n)]
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return str(path)


class Counting:
    """An answerer that says which question it answered, counting the conversations it was asked."""

    def __init__(self) -> None:
        self.asked = 0

    def __call__(self, batch, max_new_tokens=None):
        self.asked += len(batch)
        return [f"answer to {msgs[-1]['content']}" for msgs in batch]


def _files(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.glob("shard-*"))}


def _run(cfg: RegenerateConfig, traffic: str, out: Path, reuse=()) -> Counting:
    ans = Counting()
    link_twins(cfg, traffic, str(out), [str(r) for r in reuse], progress=lambda s: None)
    regenerate(cfg, "unused", traffic, str(out), answer=ans, progress=lambda s: None)
    return ans


def test_linked_shards_are_not_answered_again_and_equal_a_fresh_run(tmp_path):
    traffic = _traffic(tmp_path / "t.jsonl")
    first = tmp_path / "runs" / "a" / "regenerate"
    assert _run(CFG, traffic, first).asked == 8
    second = tmp_path / "runs" / "b" / "regenerate"
    assert _run(CFG, traffic, second, [first]).asked == 0
    assert _files(second) == _files(first)
    assert (second / "shard-00000.jsonl").stat().st_ino == (first / "shard-00000.jsonl").stat().st_ino  # a link
    fresh = tmp_path / "fresh"
    _run(CFG, traffic, fresh)
    assert _files(fresh) == _files(second)


def test_a_longer_limit_answers_only_the_new_shard_and_a_shorter_one_places_no_extra_shard(tmp_path):
    traffic = _traffic(tmp_path / "t.jsonl")
    first = tmp_path / "a"
    _run(CFG, traffic, first)
    longer = tmp_path / "longer"
    assert _run(RegenerateConfig(**{**CFG.__dict__, "limit": 12}), traffic, longer, [first]).asked == 4
    shorter = tmp_path / "shorter"
    assert _run(RegenerateConfig(**{**CFG.__dict__, "limit": 4}), traffic, shorter, [longer]).asked == 0
    assert sorted(_files(shorter)) == ["shard-00000.json", "shard-00000.jsonl"]


def test_another_shard_size_links_nothing_and_a_rewrite_leaves_the_source_alone(tmp_path):
    traffic = _traffic(tmp_path / "t.jsonl")
    first = tmp_path / "a"
    _run(CFG, traffic, first)
    before = _files(first)
    other = tmp_path / "other"
    assert _run(RegenerateConfig(**{**CFG.__dict__, "shard_size": 8}), traffic, other, [first]).asked == 8
    assert _files(first) == before


def test_earlier_lists_sibling_folders_with_the_same_mark_only(tmp_path):
    runs = tmp_path / "runs"
    for name, key in (("a", "k1"), ("b", "k2"), ("c", "k1")):
        mark(runs / name / "regenerate", key)
    (runs / "d" / "regenerate").mkdir(parents=True)  # unmarked: a run that never finished regenerating
    assert earlier(runs / "c" / "regenerate", "k1", runs) == [str(runs / "a" / "regenerate")]
    assert earlier(runs / "x" / "regenerate", "k3", runs) == []
    assert source_key("w", "t", "s") != source_key("w", "t", "s2")


def test_the_answers_fingerprint_ignores_limit_and_other_sections_but_not_the_answers_settings():
    base = PipelineConfig.tiny()
    same = base.override({"regenerate": {"limit": 3}, "train": {"steps": 7}}, where="test")
    other = base.override({"regenerate": {"max_new_tokens": 9}}, where="test")
    assert same.regenerate_fingerprint() == base.regenerate_fingerprint()
    assert same.fingerprint() != base.fingerprint()
    assert other.regenerate_fingerprint() != base.regenerate_fingerprint()
