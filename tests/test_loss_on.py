"""`train.loss_on`: which tokens the TTT loss scores, the answers (default) or every token of the sequences.

Purpose: with `all`, the batch's loss mask is every token of each sequence (padding still 0), a superset of the
answers' mask; a run trains on it and its held-out figures score the answers as before; a bad value is refused.
Run: `python -m pytest tests/test_loss_on.py` (seconds: the tiny embedded default, a few regenerated conversations).
Not here: what it buys on the real model (bench/README.md, "Loss on every token").
"""

from __future__ import annotations

import dataclasses

import pytest

from components.train.data import TrainingData, ttt_batch
from components.train.stage import TrainConfig, train
from tests.test_extract_train import _head, offline_dir, regen_dir  # noqa: F401  (the module's fixtures)


def test_loss_on_every_token_scores_the_prompts_too(offline_dir, tmp_path):
    data = TrainingData.open(offline_dir)
    idx = [0, 3, data.n_seqs - 1]
    draft = _head(data)
    answers = ttt_batch(data, idx, draft.draft_ids(), "cpu").loss_mask_BS.bool()
    every = ttt_batch(data, idx, draft.draft_ids(), "cpu", every_token=True).loss_mask_BS.bool()
    lengths = [len(data.sequence(i)[0]) for i in idx]
    assert [int(r.sum()) for r in every] == lengths and bool((every | ~answers).all())
    assert every.sum() > answers.sum()
    cfg = dataclasses.replace(TrainConfig.tiny(), loss_on="all")
    res = train(cfg, str(offline_dir), str(tmp_path / "train"))
    assert res.final_metrics["step"] == cfg.steps and "heldout_tau" in res.final_metrics
    with pytest.raises(ValueError, match="loss_on"):
        dataclasses.replace(TrainConfig.tiny(), loss_on="prompts")
