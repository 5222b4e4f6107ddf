"""A shallow TTT phase (`train.ttt.shallow_fraction`, `shallow_steps`): the first part of a run unrolls fewer steps.

Purpose: `TTTConfig.depth_at` gives each training step's depth; a run with a shallow phase logs that depth per row,
trains the shallow steps at it and the rest at `ttt_steps`, always measures the held-out figures at `ttt_steps`, and
resumed from a checkpoint inside the shallow phase exports the head an unbroken run exports; bad values are refused
with the field's name.
Run: `python -m pytest tests/test_ttt_schedule.py` (seconds: the tiny embedded default, a few regenerated
conversations).
Not here: what it buys on the real model (bench/ttt_schedule.py, bench/README.md).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from components.train.stage import TrainConfig, train
from eagle.ttt import TTTConfig
from tests.test_extract_train import offline_dir, regen_dir  # noqa: F401  (the module's fixtures)


def test_depth_at_follows_the_fraction_of_the_run():
    cfg = TTTConfig(ttt_steps=5, shallow_steps=1, shallow_fraction=0.5)
    assert [cfg.depth_at(s, 10) for s in range(10)] == [1] * 5 + [5] * 5
    assert {TTTConfig(ttt_steps=5).depth_at(s, 10) for s in range(10)} == {5}  # off by default


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(ttt_steps=3, shallow_steps=3, shallow_fraction=0.5), "shallow_steps"),
        (dict(ttt_steps=3, shallow_steps=0), "shallow_steps"),
        (dict(ttt_steps=3, shallow_fraction=1.0), "shallow_fraction"),
        (dict(ttt_steps=3, shallow_fraction=-0.1), "shallow_fraction"),
    ],
)
def test_bad_schedules_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TTTConfig(**kwargs)


def test_a_parallel_head_needs_two_steps_in_its_shallow_phase():
    ttt = TTTConfig(ttt_steps=3, shallow_steps=1, shallow_fraction=0.5)
    with pytest.raises(ValueError, match="shallow_steps >= 2"):
        dataclasses.replace(TrainConfig.tiny(), variant="parallel", ttt=ttt)


def _rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]


def test_a_shallow_phase_trains_at_its_depth_then_at_ttt_steps_and_resumes_exactly(offline_dir, tmp_path):
    ttt = dataclasses.replace(TrainConfig.tiny().ttt, shallow_steps=1, shallow_fraction=0.5)
    cfg = dataclasses.replace(TrainConfig.tiny(), ttt=ttt, checkpoint_every=4, keep_checkpoints=3, select="last")
    whole = tmp_path / "whole"
    res = train(cfg, str(offline_dir), str(whole))
    rows = _rows(whole)
    shallow, deep = [r for r in rows if r["step"] <= 6], [r for r in rows if r["step"] > 6]
    assert shallow and deep and {r["ttt_depth"] for r in shallow} == {1} and {r["ttt_depth"] for r in deep} == {3}
    assert all("acc_1" not in r for r in shallow) and all("acc_2" in r for r in deep)
    # the held-out figures are taken at the serving depth, in the shallow phase too
    held = [r for r in rows if "heldout_tau" in r]
    assert held[0]["step"] == 4 and all(r["heldout_tau"] >= 1.0 for r in held)
    assert res.final_metrics["step"] == cfg.steps

    resumed = tmp_path / "resumed"  # the same run stopped at the step-4 checkpoint (inside the shallow phase)
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "head")
    for ck in (resumed / "checkpoints").iterdir():
        if ck.name != "step-0000004":
            shutil.rmtree(ck)
    train(cfg, str(offline_dir), str(resumed))
    a, b = load_file(str(whole / "head" / "model.safetensors")), load_file(str(resumed / "head" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
