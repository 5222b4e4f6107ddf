"""Stages 2 and 3 on the tiny embedded default: feature extraction (offline shards, online) and head training.

Purpose: the offline manifest describes what is on disk (layer ids, dtype, shard hashes); a re-run rewrites no
shard, but one with another dtype rewrites them all; a corrupted shard is refused by name; online mode stores no
features; the TTT batch is the same from stored features and from the target, and so is a training step; training
exports a head the target accepts; held-out tau is logged every `eval_every` steps, the best held-out weights are
exported (`select="last"`: the last), also after a kill and resume, past checkpoint rotation; bad config values are
refused by name; a run killed mid-way resumes from its last checkpoint and ends where an uninterrupted run ends;
under Ray, FailureConfig restarts the failed worker group and the run completes, and the placement groups a run leaves
are removed (a leftover one held every CPU and the next run waited without end).
Run: `python -m pytest tests/test_extract_train.py` (about 20 s; `-m "not slow"` skips the ~40 s Ray test).
Not here: mocks (Ray is a real local Ray, the `ray_local` fixture); chosen layer ids (tests/test_layer_ids.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from components.extract.stage import ExtractConfig, extract
from components.regenerate.stage import RegenerateConfig, regenerate
from components.targets.target import load_target
from components.train.data import FeatureStoreError, TrainingData, heldout_split, ttt_batch
from components.train.loop import holdout_size
from components.train.stage import RayConfig, TrainConfig, TrainSetup, latest_checkpoint, train
from components.train.state import read_best
from eagle.config import default_aux_layer_ids
from eagle.export import load_head, read_head_meta, verify_probe
from eagle.run_config import OptimConfig
from tests.helpers import Crash, CrashAt

QUIET = dict(progress=lambda s: None)


@pytest.fixture(scope="module")
def regen_dir(tiny_embedded, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("stages") / "regen"
    cfg = RegenerateConfig(max_new_tokens=16, temperature=1.0, batch_size=8, shard_size=8, limit=12, seed=0)
    res = regenerate(cfg, tiny_embedded.target_dir, str(tiny_embedded.target_traffic.train), str(out), **QUIET)
    assert res.ok >= 8
    return str(out)


@pytest.fixture(scope="module")
def offline_dir(tiny_embedded, regen_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stages") / "offline"
    extract(
        ExtractConfig(max_len=160, dtype="float32", seqs_per_shard=4, batch_size=3),
        tiny_embedded.target_dir,
        regen_dir,
        str(out),
        **QUIET,
    )
    return out


@pytest.fixture(scope="module")
def online_dir(tiny_embedded, regen_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stages") / "online"
    extract(
        ExtractConfig(mode="online", max_len=160, dtype="float32"),
        tiny_embedded.target_dir,
        regen_dir,
        str(out),
        **QUIET,
    )
    return out


@pytest.fixture(scope="module")
def target(tiny_embedded):
    return load_target(tiny_embedded.target_dir)[0]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _mtimes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(d.glob("features-*.safetensors"))}


# ---- extract ----------------------------------------------------------------------------------------------------


def test_offline_manifest_describes_the_shards(offline_dir, target, tiny_embedded):
    from components.data.atomic import file_sha256 as _sha256
    from components.targets.target import weights_sha256

    m = json.loads((offline_dir / "manifest.json").read_text())
    n = target.config.num_hidden_layers
    assert m["mode"] == "offline" and m["dtype"] == "float32"
    assert m["layer_ids"] == list(default_aux_layer_ids(n)) and len(set(m["layer_ids"])) == 3
    assert m["target"]["weights_sha256"] == weights_sha256(tiny_embedded.target_dir)
    assert len(m["shards"]) == -(-m["n_seqs"] // 4) >= 2
    for s in m["shards"]:
        path = offline_dir / s["file"]
        assert s["sha256"] == _sha256(path) and s["bytes"] == path.stat().st_size
        t = load_file(str(path))
        assert t["aux_hidden_states"].dtype == torch.float32
        assert t["aux_hidden_states"].shape == (s["n_tokens"], 3 * target.config.hidden_size)
        assert t["last_hidden_state"].shape == (s["n_tokens"], target.config.hidden_size)
        assert int(t["offsets"][-1]) == s["n_tokens"] and t["offsets"].numel() == s["n_seqs"] + 1
    assert sum(s["n_seqs"] for s in m["shards"]) == m["n_seqs"]
    assert sum(s["n_tokens"] for s in m["shards"]) == m["n_tokens"]
    assert m["bytes_per_token"] > 4 * 4 * target.config.hidden_size  # 3H + H floats per token, at least
    data = TrainingData.open(offline_dir)
    assert data.n_seqs == m["n_seqs"] and int(data.loss_mask.sum()) == m["n_trained_tokens"] > 0
    assert int(data.token_counts.sum()) == m["n_trained_tokens"]


def test_rerun_rewrites_no_shard_but_a_new_dtype_rewrites_all(offline_dir, tiny_embedded, regen_dir, tmp_path):
    out = _copy(offline_dir, tmp_path / "ext")
    before = _mtimes(out)
    written: list[str] = []
    extract(
        ExtractConfig(max_len=160, dtype="float32", seqs_per_shard=4, batch_size=3),
        tiny_embedded.target_dir,
        regen_dir,
        str(out),
        progress=written.append,
    )
    assert written == [] and _mtimes(out) == before
    assert (
        json.loads((out / "manifest.json").read_text())["shards"]
        == json.loads((offline_dir / "manifest.json").read_text())["shards"]
    )

    extract(
        ExtractConfig(max_len=160, dtype="bfloat16", seqs_per_shard=4, batch_size=3),
        tiny_embedded.target_dir,
        regen_dir,
        str(out),
        progress=written.append,
    )
    assert len(written) == len(before)  # float32 shards are not bfloat16 shards
    assert all(load_file(str(p))["aux_hidden_states"].dtype == torch.bfloat16 for p in out.glob("features-*"))
    TrainingData.open(out)  # and the manifest matches them


def test_corrupted_shard_is_refused_by_name(offline_dir, tmp_path):
    out = _copy(offline_dir, tmp_path / "ext")
    shard = out / "features-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(FeatureStoreError, match="features-00001.safetensors.*sha256"):
        TrainingData.open(out)
    with pytest.raises(FeatureStoreError, match="features-00001.safetensors"):  # training fails fast, in the driver
        train(TrainConfig.tiny(), str(out), str(tmp_path / "train"))
    shard.write_bytes(bytes(raw[: len(raw) // 2]))  # truncated
    with pytest.raises(FeatureStoreError, match="features-00001.safetensors"):
        TrainingData.open(out)
    shard.unlink()
    with pytest.raises(FeatureStoreError, match="features-00001.safetensors.*missing"):
        TrainingData.open(out)


def test_online_mode_writes_no_features(online_dir, offline_dir):
    assert not list(online_dir.glob("features-*"))
    m = json.loads((online_dir / "manifest.json").read_text())
    assert m["mode"] == "online" and m["shards"] == [] and m["bytes_per_token"] == 0.0
    on, off = TrainingData.open(online_dir), TrainingData.open(offline_dir)
    assert torch.equal(on.input_ids, off.input_ids) and torch.equal(on.loss_mask, off.loss_mask)
    with pytest.raises(FeatureStoreError, match="no feature shard"):
        on.features(0)


# ---- offline == online ------------------------------------------------------------------------------------------


def _head(data: TrainingData, seed: int = 0):
    from eagle.train import head_from_tensors

    torch.manual_seed(seed)
    return head_from_tensors(data.target_config(), data.token_counts, data.embed_tokens, data.lm_head, 64)


def test_offline_and_online_batches_and_steps_are_the_same(offline_dir, online_dir, target):
    from eagle.train import OptimConfig, make_optimizer, train_step
    from eagle.ttt import TTTConfig

    off, on = TrainingData.open(offline_dir), TrainingData.open(online_dir)
    idx = [0, 3, off.n_seqs - 1]  # different lengths: padding differs from the extract stage's batches
    draft = _head(off)
    a = ttt_batch(off, idx, draft.draft_ids(), "cpu")
    b = ttt_batch(on, idx, draft.draft_ids(), "cpu", target=target)
    assert torch.equal(a.input_ids_BS, b.input_ids_BS) and torch.equal(a.loss_mask_BS, b.loss_mask_BS)
    m = a.loss_mask_BS.bool()
    assert m.sum() > 10
    torch.testing.assert_close(a.aux_BS3H[m], b.aux_BS3H[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(a.teacher.probs_BTVd[m], b.teacher.probs_BTVd[m], atol=1e-5, rtol=0)
    assert torch.equal(a.teacher.argmax_BT[m], b.teacher.argmax_BT[m])

    ttt = TTTConfig(ttt_steps=3)
    losses = []
    for batch in (a, b):
        head = _head(off)
        opt, sched = make_optimizer(head.trainable_parameters(), OptimConfig.tiny(), 20)
        losses.append(float(train_step(head, head, batch, ttt, opt, sched, 0.5).loss.detach()))
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


# ---- train ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(offline_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("stages") / "train"
    res = train(TrainConfig.tiny(), str(offline_dir), str(out), lineage={"run_key": "k1"})
    return res


def _steps(history_file: str) -> list[int]:
    return [json.loads(x)["step"] for x in Path(history_file).read_text().splitlines()]


def test_train_exports_a_head_the_target_accepts(trained, target):
    cfg = TrainConfig.tiny()
    draft = load_head(trained.head_dir, target)
    assert draft.cfg.draft_vocab_size == cfg.draft_vocab_size and draft.cfg.hidden_size == target.config.hidden_size
    assert verify_probe(draft, trained.head_dir) < 1e-5
    meta = read_head_meta(trained.head_dir)
    assert meta["lineage"]["run_key"] == "k1" and meta["lineage"]["resumed_from_step"] == 0
    assert meta["lineage"]["train_config"]["steps"] == cfg.steps
    assert _steps(trained.history_file) == list(range(cfg.log_every, cfg.steps + 1, cfg.log_every))
    assert trained.resumed_from_step == 0 and trained.final_metrics["step"] == cfg.steps
    assert all(torch.isfinite(torch.tensor(v)) for v in trained.final_metrics.values())


def test_killed_run_resumes_from_its_last_checkpoint(offline_dir, trained, tmp_path):
    cfg = TrainConfig.tiny()  # checkpoints at 5, 10, 12; history every 2 steps
    out = tmp_path / "train"
    with pytest.raises(Crash, match="step 8"):
        train(cfg, str(offline_dir), str(out), lineage={"run_key": "k1"}, sinks=(CrashAt(8),))
    assert latest_checkpoint(out).name == "step-0000005"
    assert _steps(str(out / "history.jsonl")) == [2, 4, 6, 8]  # 6 and 8 are past the checkpoint
    res = train(cfg, str(offline_dir), str(out), lineage={"run_key": "k1"})
    meta = read_head_meta(res.head_dir)
    assert res.resumed_from_step == 5 and meta["lineage"]["resumed_from_step"] == 5
    assert (res.selected_step, res.selection_rule) == (trained.selected_step, trained.selection_rule)
    steps = _steps(res.history_file)
    assert steps == sorted(set(steps)) and steps[-1] == cfg.steps  # no step twice
    assert latest_checkpoint(out).name == f"step-{cfg.steps:07d}"
    # batches, optimiser, scheduler and RNG all resume: the same head as the uninterrupted run
    a, b = (
        load_file(str(Path(res.head_dir) / "model.safetensors")),
        load_file(str(Path(trained.head_dir) / "model.safetensors")),
    )
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)


def _same(head_dir: str, weights: Path) -> bool:
    a, b = load_file(str(Path(head_dir) / "model.safetensors")), load_file(str(weights))
    return set(a) == set(b) and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)


def test_heldout_tau_is_logged_and_the_best_is_exported(trained, offline_dir):
    rows = [json.loads(x) for x in Path(trained.history_file).read_text().splitlines()]
    held = [(r["step"], r["heldout_tau"], r["heldout_loss"]) for r in rows if "heldout_tau" in r]
    assert [s for s, _, _ in held] == [4, 8, 12] and all(1.0 <= t <= 4.0 for _, t, _ in held)  # eval_every 4, K=3
    best_step = max(held, key=lambda x: (x[1], -x[2], -x[0]))[0]  # highest tau, lowest loss, earliest
    lineage = read_head_meta(trained.head_dir)["lineage"]
    assert trained.selected_step == lineage["selected_step"] == trained.best_step == best_step
    assert trained.last_heldout_tau == held[-1][1] and trained.selected_heldout_tau == held[best_step // 4 - 1][1]
    assert f"step {best_step}" in trained.selection_rule == lineage["selection_rule"]
    assert trained.heldout_seqs == holdout_size(TrainConfig.tiny(), TrainingData.open(offline_dir).n_seqs) >= 1
    info, weights = read_best(Path(trained.head_dir).parent)
    assert info["step"] == best_step and _same(trained.head_dir, weights)


@pytest.fixture
def scripted_tau(monkeypatch):
    """Held-out tau 2.0, 3.0, 2.5 for the 1st, 2nd, 3rd weights seen (the same weights, after a resume: the same)."""
    import eagle.train

    taus: dict[bytes, float] = {}

    def fake(draft, batches, ttt, amp=None):
        assert len(list(batches)) == 1  # 1 held-out sequence (a quarter of 7), batch 4
        key = draft.fc.weight.detach().numpy().tobytes()
        taus[key] = taus[key] if key in taus else (2.0, 3.0, 2.5)[len(taus)]
        return {"heldout_loss": 5.0 - taus[key], "heldout_acc_0": 0.5, "heldout_tau": taus[key]}

    monkeypatch.setattr(eagle.train, "heldout_metrics", fake)


def test_best_weights_survive_rotation_and_select_last_exports_the_last(offline_dir, scripted_tau, tmp_path, capsys):
    cfg = dataclasses.replace(TrainConfig.tiny(), checkpoint_every=4, keep_checkpoints=1)
    res = train(cfg, str(offline_dir), str(tmp_path / "best"))
    assert "heldout tau 3.00 loss 2.000" in capsys.readouterr().out
    assert (res.selected_step, res.selected_heldout_tau, res.last_heldout_tau) == (8, 3.0, 2.5)
    assert res.selection_rule == "best held-out tau at step 8 of 12 (3.00 vs last 2.50)"
    ckpt = latest_checkpoint(tmp_path / "best")  # rotation kept only step 12: the best is still there
    assert ckpt.name == "step-0000012" and _same(res.head_dir, ckpt / "best.safetensors")
    assert _same(res.head_dir, read_best(tmp_path / "best")[1]) and not _same(res.head_dir, ckpt / "head.safetensors")
    last = train(dataclasses.replace(cfg, select="last"), str(offline_dir), str(tmp_path / "last"))
    assert (last.selected_step, last.best_step, last.selected_heldout_tau) == (12, 8, 2.5)
    assert last.selection_rule == "last step 12 (held-out tau 2.50; best 3.00 at step 8)"
    assert _same(last.head_dir, ckpt / "head.safetensors")


def test_a_resumed_run_selects_what_an_uninterrupted_one_selects(offline_dir, scripted_tau, tmp_path):
    cfg, out = TrainConfig.tiny(), tmp_path / "train"  # checkpoints at 5, 10, 12; evaluations at 4, 8, 12
    ref = train(cfg, str(offline_dir), str(tmp_path / "ref"))
    with pytest.raises(Crash, match="step 8"):
        train(cfg, str(offline_dir), str(out), sinks=(CrashAt(8),))
    assert read_best(out)[0]["step"] == 8 and latest_checkpoint(out).name == "step-0000005"  # a best past it
    seen: list[int] = []

    class BestAt:  # what out/best holds when step 6 is logged
        def log(self, step, metrics):
            seen.extend([read_best(out)[0]["step"]] if step == 6 else [])

    res = train(cfg, str(offline_dir), str(out), sinks=(BestAt(),))
    assert seen == [4]  # the best of step 8 was dropped with the steps past the checkpoint, then found again
    assert (res.selected_step, res.selection_rule, res.resumed_from_step) == (8, ref.selection_rule, 5)
    assert _same(res.head_dir, Path(ref.head_dir) / "model.safetensors") and read_best(out)[0]["step"] == 8


def test_selection_keeps_the_earliest_best_and_the_holdout_is_seeded():
    from eagle.train import Selection

    sel = Selection()
    assert sel.choose("best_tau", 10) == (10, "last step 10 (no held-out evaluation)")
    for step, tau, loss in [(2, 1.5, 3.0), (4, 2.25, 2.0), (6, 2.25, 2.0), (7, 2.25, 2.5), (8, 1.75, 1.0)]:
        sel = sel.record(step, tau, loss)  # a tie in tau goes to the lower loss, then the earlier step
    assert (sel.best_step, sel.best_tau, sel.last_step, sel.last_tau) == (4, 2.25, 8, 1.75)
    assert sel.choose("best_tau", 8) == (4, "best held-out tau at step 4 of 8 (2.25 vs last 1.75)")
    assert sel.choose("last", 8) == (8, "last step 8 (held-out tau 1.75; best 2.25 at step 4)")
    assert sel.record(9, 2.25, 1.5).best_step == 9 and sel.record(10, 2.5, 1.0).choose("best_tau", 10) == (
        10,
        "best held-out tau at step 10 of 10, the last (2.50)",
    )
    train_ids, held = heldout_split(40, holdout_size(TrainConfig(holdout_seqs=32), 40), seed=3)
    assert len(held) == 10 and sorted(train_ids + held) == list(range(40))  # at most a quarter
    assert (train_ids, held) == heldout_split(40, 10, seed=3) != heldout_split(40, 10, seed=4)
    with pytest.raises(ValueError, match="at least 2 sequences, the features hold 1.*eval_every 0"):
        holdout_size(TrainConfig.tiny(), 1)
    assert holdout_size(TrainConfig(eval_every=0, select="last"), 1) == 0  # nothing held out, nothing refused


def test_warm_start_begins_at_the_given_head_and_learns_faster(offline_dir, trained, target, tmp_path):
    parent = load_file(str(Path(trained.head_dir) / "model.safetensors"))
    frozen = dataclasses.replace(TrainConfig.tiny(), steps=2, optim=OptimConfig(lr=0.0, warmup_steps=2), log_every=1)
    res = train(frozen, str(offline_dir), str(tmp_path / "frozen"), setup=TrainSetup(trained.head_dir))
    child = load_file(str(Path(res.head_dir) / "model.safetensors"))
    assert set(child) == set(parent)
    for k in parent:  # lr 0: the exported head is the head it started from, draft vocabulary included
        torch.testing.assert_close(child[k], parent[k], atol=0, rtol=0, msg=k)
    assert res.warm_start_heldout_tau == pytest.approx(res.last_heldout_tau)  # before any step; lr 0 keeps it
    cfg = dataclasses.replace(TrainConfig.tiny(), steps=2, log_every=1)
    warm = train(cfg, str(offline_dir), str(tmp_path / "warm"), setup=TrainSetup(trained.head_dir))
    cold = train(cfg, str(offline_dir), str(tmp_path / "cold"))
    first = [json.loads(Path(r.history_file).read_text().splitlines()[0])["loss"] for r in (warm, cold)]
    assert first[0] < first[1] and cold.warm_start_heldout_tau is None, first  # same batches: the trained starts lower


def test_variant_eagle3_1_trains_and_warm_starts_across_variants(offline_dir, trained, tmp_path):
    cfg = dataclasses.replace(TrainConfig.tiny(), steps=2, optim=OptimConfig(0.0, warmup_steps=2), variant="eagle3.1")
    res = train(cfg, str(offline_dir), str(tmp_path), setup=TrainSetup(trained.head_dir))
    child, parent = (load_file(str(Path(d) / "model.safetensors")) for d in (res.head_dir, trained.head_dir))
    assert set(child) - set(parent) == {f"fc_norm.{i}.weight" for i in range(3)}
    assert all(torch.equal(child[k], parent.get(k, torch.ones_like(child[k]))) for k in child)  # lr 0: fc_norm at 1
    engine_cfg, back = json.loads((Path(res.head_dir) / "config.json").read_text()), load_head(res.head_dir)
    assert engine_cfg["fc_norm"] and engine_cfg["norm_output"] and back.cfg.variant == "eagle3.1"


def test_warm_start_refuses_a_head_of_another_shape(trained, target):
    import copy

    from components.train.loop import warm_start_head
    from eagle.export import HeadMismatchError

    other = copy.deepcopy(target.config)
    other.hidden_size *= 2
    with pytest.raises(HeadMismatchError, match=r"warm-start head .*\(hidden_size: head expects 64, target has 128\)"):
        warm_start_head(
            trained.head_dir,
            other,
            target.get_input_embeddings().weight,
            default_aux_layer_ids(target.config.num_hidden_layers),
        )


@pytest.mark.slow
def test_ray_failure_config_restarts_and_completes(offline_dir, ray_local, tmp_path):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class CrashOnce:  # a metrics sink (rank 0 logs) that raises once, at `step`: the marker outlives the restart
        marker: str
        step: int

        def log(self, step, metrics):
            if step == self.step and not os.path.exists(self.marker):
                Path(self.marker).write_text("crashed")
                raise RuntimeError(f"crashed at step {step}")

    cfg = dataclasses.replace(
        TrainConfig.tiny(), steps=8, checkpoint_every=3, batch_size=2, ray=RayConfig(num_workers=2, max_failures=1)
    )
    out, marker, ray = tmp_path / "train", tmp_path / "crashed", TrainSetup(storage_dir=str(tmp_path / "ray"))
    res = train(cfg, str(offline_dir), str(out), sinks=(CrashOnce(str(marker), 4),), setup=ray)
    assert marker.is_file()  # the worker group crashed at step 4, and fit() still returned: Ray restarted it
    meta = read_head_meta(res.head_dir)
    assert meta["lineage"]["resumed_from_step"] == 3  # the restarted workers resumed from the checkpoint
    steps = _steps(res.history_file)
    assert steps == sorted(set(steps)) and steps[-1] == cfg.steps
    assert latest_checkpoint(out).name == f"step-{cfg.steps:07d}"


def test_a_runs_leftover_placement_groups_are_removed_and_older_ones_kept(ray_local):
    """A worker group's placement group left behind (2 x 1 CPU, as one was on a test session's local Ray) held every
    CPU, and the next Ray Train run waited for them without end: `groups_released` removes what its block created."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from components.train.ray_train import groups_released

    older = placement_group([{"memory": 1024}])  # holds no CPU
    with groups_released():
        left = placement_group([{"CPU": 1}, {"CPU": 1}])  # the run "forgot" it
        assert left.wait(30)
    table = ray.util.placement_group_table()
    assert table[left.id.hex()]["state"] == "REMOVED" and table[older.id.hex()]["state"] != "REMOVED"
    remove_placement_group(older)
    with groups_released():
        nxt = placement_group([{"CPU": 1}, {"CPU": 1}])
        assert nxt.wait(30)  # both CPUs free for the next run
    assert ray.util.placement_group_table()[nxt.id.hex()]["state"] == "REMOVED"
