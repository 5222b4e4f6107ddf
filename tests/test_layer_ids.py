"""Chosen fused layers, from the config through the feature manifest into the trained head (stages 2 and 3).

Purpose: features extracted at chosen layer ids (1, 2, 4) are the target's inputs of those layers, and the head
trained on them writes those ids for both engines; a warm-start head or a checkpoint of other layer ids is refused,
as are ids the target does not have; the pipeline config takes three distinct ascending ids and refuses others.
Run: `python -m pytest tests/test_layer_ids.py` (about 15 s: tests/test_extract_train.py's fixtures, by name, made
again for this module).
Not here: extraction and training at the default ids (tests/test_extract_train.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from components.extract.stage import ExtractConfig, extract
from components.train.data import TrainingData, ttt_batch
from components.train.stage import TrainConfig, TrainSetup, train
from eagle.export import load_head
from tests.test_extract_train import QUIET, offline_dir, regen_dir, target, trained  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def custom_ids_dir(tiny_embedded, regen_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stages") / "custom-ids"
    extract(
        ExtractConfig(max_len=160, dtype="float32", seqs_per_shard=8, aux_layer_ids=(1, 2, 4)),
        tiny_embedded.target_dir,
        regen_dir,
        str(out),
        **QUIET,
    )
    return out


def test_chosen_layer_ids_reach_the_trained_head(custom_ids_dir, target, tmp_path):
    assert json.loads((custom_ids_dir / "manifest.json").read_text())["layer_ids"] == [1, 2, 4]
    data = TrainingData.open(custom_ids_dir)
    batch = ttt_batch(data, [0], torch.arange(64), "cpu")
    from eagle.features import target_forward

    ids = data.sequence(0)[0][None].long()
    want = target_forward(target, ids, (1, 2, 4)).aux_BT3H
    torch.testing.assert_close(batch.aux_BS3H[:, : ids.shape[1]], want, atol=1e-5, rtol=0)
    res = train(dataclasses.replace(TrainConfig.tiny(), steps=2), str(custom_ids_dir), str(tmp_path / "train"))
    cfg = json.loads((Path(res.head_dir) / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    assert load_head(res.head_dir, target).cfg.aux_layer_ids == (1, 2, 4)


def test_other_layer_ids_are_refused(custom_ids_dir, offline_dir, trained, tiny_embedded, regen_dir, tmp_path):
    from eagle.export import HeadMismatchError

    cfg = dataclasses.replace(TrainConfig.tiny(), steps=2)
    default = list(json.loads((offline_dir / "manifest.json").read_text())["layer_ids"])
    with pytest.raises(
        HeadMismatchError, match=re.escape(f"fuses layers {default}, but the features are of layers [1, 2, 4]")
    ):
        train(cfg, str(custom_ids_dir), str(tmp_path / "warm"), setup=TrainSetup(trained.head_dir))
    out = tmp_path / "resume"
    shutil.copytree(Path(trained.head_dir).parent / "checkpoints", out / "checkpoints")
    with pytest.raises(
        ValueError,
        match=re.escape(f"trained on features of layers {default}, but the features are of layers [1, 2, 4]"),
    ):
        train(cfg, str(custom_ids_dir), str(out))
    with pytest.raises(ValueError, match=r"aux_layer_ids \[1, 2, 6\] .* \(the target has 6 decoder layers\)"):
        extract(
            ExtractConfig(aux_layer_ids=(1, 2, 6)), tiny_embedded.target_dir, regen_dir, str(tmp_path / "x"), **QUIET
        )


def test_pipeline_config_takes_layer_ids_and_refuses_bad_ones(tmp_path):
    from components.config.pipeline import ConfigError, PipelineConfig

    def load(values):
        path = tmp_path / "pipeline.json"
        path.write_text(json.dumps({"extract": {"aux_layer_ids": values}}))
        return PipelineConfig.load(path, preset="tiny")

    assert load([1, 3, 5]).extract.aux_layer_ids == (1, 3, 5)
    for bad in ([1, 1, 3], [0, 2, 4], [3, 2, 1], [1, 2]):
        with pytest.raises(ConfigError, match=r"extract.aux_layer_ids \[.*\] must be three distinct ascending"):
            load(bad)
    for bad in ([1, 2, "3"], [1, 2, 3.5], 3):
        with pytest.raises(ConfigError, match="extract.aux_layer_ids"):
            load(bad)
