"""What makes a training step cheaper without changing what it learns: batches of like length, a kept teacher.

Purpose: `batches(..., lengths)` (train.bucket_by_length) still trains every sequence once an epoch, resumes
exactly, and pads far less than the random order; `TeacherCache` (train.teacher_cache_mib) gives the batch the
uncached path gives (the same probabilities, argmax and in-vocabulary flags on every real position), computes each
sequence once, keeps nothing past its budget and starts over for another draft vocabulary; a run with both trains.
Run: `python -m pytest tests/test_train_throughput.py` (seconds: the tiny embedded default's features).
Not here: what they buy on the real model (bench/train_step.py; bench/README.md, "The demo on the real model").
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from components.train.data import TeacherCache, TrainingData, batches, ttt_batch
from components.train.stage import TrainConfig, train
from tests.test_extract_train import _head, offline_dir, regen_dir  # noqa: F401  (the module's fixtures)


def _take(gen, n):
    return [pos for _step, pos in itertools.islice(gen, n)]


def test_bucketed_batches_cover_each_epoch_resume_exactly_and_pad_less():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(20, 400, (203,), generator=g).tolist()
    per_epoch = 203 // 8
    plain = _take(batches(203, 8, 0), per_epoch)
    bucketed = _take(batches(203, 8, 0, lengths=lengths), 3 * per_epoch)
    for epoch in range(3):  # each epoch: the same sequences the random order trains, once each
        got = [i for pos in bucketed[epoch * per_epoch : (epoch + 1) * per_epoch] for i in pos]
        assert len(got) == len(set(got)) == per_epoch * 8
    assert sorted(i for pos in bucketed[:per_epoch] for i in pos) == sorted(i for pos in plain for i in pos)
    assert (
        _take(batches(203, 8, 0, start_step=per_epoch + 5, lengths=lengths), 7)
        == bucketed[per_epoch + 5 : per_epoch + 12]
    )  # a resumed run continues exactly

    def padding(b):
        return sum(len(pos) * max(lengths[i] for i in pos) - sum(lengths[i] for i in pos) for pos in b)

    assert padding(bucketed[:per_epoch]) < 0.3 * padding(plain)
    assert _take(batches(203, 8, 0, lengths=lengths), 4) == bucketed[:4]  # seeded
    assert _take(batches(203, 8, 1, lengths=lengths), 4) != bucketed[:4]
    two = [_take(batches(203, 4, 0, rank=r, world=2, lengths=lengths), 5) for r in (0, 1)]
    assert all(set(a).isdisjoint(b) for a, b in zip(*two))  # two ranks share a step, not a sequence


def test_teacher_cache_gives_the_uncached_batch_and_computes_each_sequence_once(offline_dir):
    data = TrainingData.open(offline_dir)
    draft = _head(data)
    vocab = draft.draft_ids()
    cache = TeacherCache(1 << 30)
    for idx in ([0, 3, data.n_seqs - 1], [3, 1], [0, 3, data.n_seqs - 1]):
        want = ttt_batch(data, idx, vocab, "cpu")
        got = ttt_batch(data, idx, vocab, "cpu", teacher_cache=cache)
        real = torch.zeros_like(want.loss_mask_BS, dtype=torch.bool)
        for r, i in enumerate(idx):
            real[r, : len(data.sequence(i)[0])] = True
        assert torch.equal(got.input_ids_BS, want.input_ids_BS) and torch.equal(got.aux_BS3H, want.aux_BS3H)
        assert torch.equal(got.loss_mask_BS, want.loss_mask_BS)
        torch.testing.assert_close(got.teacher.probs_BTVd[real], want.teacher.probs_BTVd[real], rtol=1e-5, atol=1e-6)
        assert torch.equal(got.teacher.argmax_BT[real], want.teacher.argmax_BT[real])
        assert torch.equal(got.teacher.in_vocab_BT[real], want.teacher.in_vocab_BT[real])
        assert not got.teacher.in_vocab_BT[~real].any()  # padding: out of the loss whatever its mask says
    assert (cache.misses, cache.hits) == (4, 4)  # sequences 0, 3, last, 1 once; then only hits
    small = TeacherCache(1)  # nothing fits: computed every time, still right
    torch.testing.assert_close(
        ttt_batch(data, [2], vocab, "cpu", teacher_cache=small).teacher.probs_BTVd,
        ttt_batch(data, [2], vocab, "cpu").teacher.probs_BTVd,
        rtol=1e-5,
        atol=1e-6,
    )
    assert small.bytes == 0 and ttt_batch(data, [2], vocab, "cpu", teacher_cache=small) and small.misses == 2
    ttt_batch(data, [0], vocab[:-1], "cpu", teacher_cache=cache)  # another draft vocabulary: starts over
    assert cache.misses == 5 and cache.bytes > 0


def test_a_run_with_both_trains_and_bad_values_are_refused(offline_dir, tmp_path):
    cfg = dataclasses.replace(TrainConfig.tiny(), bucket_by_length=True, teacher_cache_mib=64)
    res = train(cfg, str(offline_dir), str(tmp_path / "train"))
    assert res.final_metrics["step"] == cfg.steps and res.final_metrics["seq_tokens_per_s"] > 0
    assert "heldout_tau" in res.final_metrics
    with pytest.raises(ValueError, match="teacher_cache_mib"):
        dataclasses.replace(TrainConfig.tiny(), teacher_cache_mib=-1)
    with pytest.raises(ValueError, match="bucket_by_length"):
        dataclasses.replace(TrainConfig.tiny(), bucket_by_length="yes")
