"""Bad input met by the stages (the rest of HARDENING.md's bad-input table; the CLI's rows are in test_bad_input.py).

Purpose: one test per row: a head for another target, corrupted, truncated or unreadable feature files, a NaN loss,
a history line torn by a kill, a full disk while writing a regenerated shard, a feature shard or a checkpoint, a head
or target name taken by the other kind of model, an unknown registered version; bad input found by a Ray Train worker
is not retried. Each error names the input and what to do; nothing half-written remains.
Run: `python -m pytest tests/test_bad_input_stages.py` (about 45 s once the tiny embedded default is built, plus
the slow Ray run, ~25 s).
Not here: prompts longer than the target's context, from the stage's refusal to the terminal
(tests/test_bad_input_flow.py), kills and outages (tests/test_faults.py).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import Crash, CrashAt, target_copy

QUIET = dict(progress=lambda s: None)


def _leftovers(root: Path) -> list[str]:
    """Temp or partial files anywhere under `root` (what a write cut short would leave)."""
    return [str(p) for p in root.rglob("*") if p.name.endswith(".tmp") or p.name.startswith((".tmp-", ".head."))]


@pytest.fixture(scope="module")
def extracted(tiny_embedded, tmp_path_factory) -> Path:
    from components.extract.stage import ExtractConfig, extract
    from components.regenerate.stage import RegenerateConfig, regenerate

    root = tmp_path_factory.mktemp("bad-input")
    regenerate(
        RegenerateConfig(max_new_tokens=8, shard_size=4, limit=8),
        tiny_embedded.target_dir,
        str(tiny_embedded.target_traffic.train),
        str(root / "regen"),
        **QUIET,
    )
    extract(
        ExtractConfig(max_len=128, dtype="float32", seqs_per_shard=4),
        tiny_embedded.target_dir,
        str(root / "regen"),
        str(root / "ext"),
        **QUIET,
    )
    return root


def test_a_head_for_another_target(tiny_embedded, extracted, tmp_path):
    from transformers import AutoConfig, LlamaForCausalLM

    from components.evaluate.stage import EvaluateConfig, HeadEval, evaluate
    from components.train.stage import TrainConfig, train
    from eagle.export import HeadMismatchError

    head = train(
        dataclasses.replace(TrainConfig.tiny(), steps=2), str(extracted / "ext"), str(tmp_path / "train")
    ).head_dir
    other = target_copy(tiny_embedded, tmp_path)  # same tokenizer and template, another shape
    cfg = AutoConfig.from_pretrained(other, trust_remote_code=False)
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 32, 64, 8
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(other)
    with pytest.raises(HeadMismatchError) as err:
        evaluate(
            EvaluateConfig.tiny(),
            HeadEval(str(other), head, str(tiny_embedded.target_traffic.heldout), str(tmp_path / "eval")),
            **QUIET,
        )
    msg = str(err.value)
    assert head in msg and "hidden_size: head expects 64, target has 32" in msg and "train a head for this" in msg
    assert not list((tmp_path / "eval").iterdir())


def _ext_copy(extracted: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(extracted / "ext", tmp_path / "ext"))


@pytest.mark.parametrize("damage", ["flip-a-byte", "truncate", "delete", "bad-manifest", "bad-tokens"])
def test_damaged_feature_files(extracted, tmp_path, damage):
    from components.train.data import FeatureStoreError
    from components.train.stage import TrainConfig, train

    ext = _ext_copy(extracted, tmp_path)
    shard = ext / "features-00001.safetensors"
    raw = shard.read_bytes()
    named, hint = {
        "flip-a-byte": (shard.name, "delete it and re-run extract"),
        "truncate": (shard.name, "delete it and re-run extract"),
        "delete": (shard.name, "re-run extract"),
        "bad-manifest": ("manifest.json", "delete it and re-run extract"),
        "bad-tokens": ("tokens/target_heads", "re-run extract"),
    }[damage]
    if damage == "flip-a-byte":
        shard.write_bytes(raw[:-5] + bytes([raw[-5] ^ 0xFF]) + raw[-4:])
    elif damage == "truncate":
        shard.write_bytes(raw[: len(raw) // 2])
    elif damage == "delete":
        shard.unlink()
    elif damage == "bad-manifest":
        (ext / "manifest.json").write_text('{"mode": "offline", "shards": [')
    else:
        (ext / "tokens.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(FeatureStoreError) as err:
        train(TrainConfig.tiny(), str(ext), str(tmp_path / "train"))
    assert named in str(err.value) and hint in str(err.value), str(err.value)
    assert not (tmp_path / "train" / "checkpoints").exists() and not (tmp_path / "train" / "head").exists()


def test_a_nan_loss_stops_training_before_any_checkpoint(extracted, tmp_path):
    from safetensors.torch import load_file, save_file

    from components.data.atomic import file_sha256 as _sha256
    from components.train.stage import TrainConfig, train

    ext = _ext_copy(extracted, tmp_path)
    manifest = json.loads((ext / "manifest.json").read_text())
    for s in manifest["shards"]:  # hidden states with NaN, as an fp16 target that overflowed would give
        t = load_file(str(ext / s["file"]))
        t["aux_hidden_states"][:] = float("nan")
        save_file(t, str(ext / s["file"]))
        s["sha256"] = _sha256(ext / s["file"])
    (ext / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FloatingPointError) as err:
        train(TrainConfig.tiny(), str(ext), str(tmp_path / "train"))
    msg = str(err.value)
    assert str(ext) in msg and "step 1" in msg and "non-finite TTT loss" in msg and "lower the learning rate" in msg
    assert not (tmp_path / "train" / "checkpoints").exists() and not (tmp_path / "train" / "head").exists()


def test_a_history_line_torn_by_a_kill_is_dropped_on_resume(extracted, tmp_path):
    from components.train.stage import TrainConfig, train

    out = tmp_path / "train"
    with pytest.raises(Crash, match="step 8"):
        train(TrainConfig.tiny(), str(extracted / "ext"), str(out), sinks=(CrashAt(8),))
    with open(out / "history.jsonl", "a") as f:
        f.write('{"step": 9, "loss": 1.2')  # the process died in the middle of this line
    res = train(TrainConfig.tiny(), str(extracted / "ext"), str(out))
    steps = [json.loads(x)["step"] for x in Path(res.history_file).read_text().splitlines()]
    assert res.resumed_from_step == 5 and steps == [2, 4, 6, 8, 10, 12]


def _enospc(*_args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_writing_a_feature_shard(tiny_embedded, extracted, tmp_path, monkeypatch):
    from components.data import atomic
    from components.extract.stage import ExtractConfig, extract

    real = atomic.atomic_write_bytes

    def full(path, data):  # the shard's bytes go through atomic_write_bytes (in-process and Ray workers alike)
        if "features-00001" not in str(path):
            return real(path, data)
        with atomic.atomic_path(path) as tmp:  # half of it reached the disk, then no space
            Path(tmp).write_bytes(data[: len(data) // 2])
            _enospc()

    monkeypatch.setattr("components.extract.stage.atomic_write_bytes", full)
    out = tmp_path / "ext"
    cfg = ExtractConfig(max_len=128, dtype="float32", seqs_per_shard=4)
    with pytest.raises(OSError) as err:
        extract(cfg, tiny_embedded.target_dir, str(extracted / "regen"), str(out), **QUIET)
    assert err.value.errno == errno.ENOSPC
    assert str(out / "features-00001.safetensors") in str(err.value) and "free space" in str(err.value)
    assert not _leftovers(out) and not (out / "features-00001.safetensors").exists()
    assert [s["file"] for s in json.loads((out / "manifest.json").read_text())["shards"]] == [
        "features-00000.safetensors"
    ]  # the manifest lists only what is whole
    monkeypatch.setattr("components.extract.stage.atomic_write_bytes", real)
    res = extract(cfg, tiny_embedded.target_dir, str(extracted / "regen"), str(out), **QUIET)  # space freed
    assert (
        json.loads(Path(res.manifest).read_text())["shards"]
        == json.loads((extracted / "ext" / "manifest.json").read_text())["shards"]
    )


def test_full_disk_writing_a_regenerated_shard(tiny_embedded, tmp_path, monkeypatch):
    from components.data import atomic
    from components.regenerate.stage import RegenerateConfig, regenerate

    real = os.fsync

    def full(fd):
        if "shard-00001.jsonl" in os.readlink(f"/proc/self/fd/{fd}"):
            _enospc()
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", full)
    out = tmp_path / "regen"
    with pytest.raises(OSError) as err:
        regenerate(
            RegenerateConfig(max_new_tokens=4, shard_size=2, limit=4),
            tiny_embedded.target_dir,
            str(tiny_embedded.target_traffic.train),
            str(out),
            **QUIET,
        )
    assert err.value.errno == errno.ENOSPC and str(out / "shard-00001.jsonl") in str(err.value)
    assert sorted(p.name for p in out.iterdir()) == ["shard-00000.json", "shard-00000.jsonl"]  # nothing else


def test_full_disk_writing_a_checkpoint(extracted, tmp_path, monkeypatch):
    from components.train.stage import TrainConfig, latest_checkpoint, train

    real = torch.save

    def full(obj, f, *args, **kwargs):
        real(obj, f, *args, **kwargs)
        if "step-0000010" in str(f):
            _enospc()

    monkeypatch.setattr(torch, "save", full)
    out = tmp_path / "train"
    with pytest.raises(OSError) as err:
        train(TrainConfig.tiny(), str(extracted / "ext"), str(out))
    assert err.value.errno == errno.ENOSPC and str(out / "checkpoints" / "step-0000010") in str(err.value)
    assert latest_checkpoint(out).name == "step-0000005" and not _leftovers(out) and not (out / "head").exists()
    monkeypatch.setattr(torch, "save", real)
    assert train(TrainConfig.tiny(), str(extracted / "ext"), str(out)).resumed_from_step == 5  # space freed


def test_head_name_taken_by_a_model_that_is_not_a_head(mlflow_store, tiny_embedded):
    from components.registry.register import TargetRef, check_head_name, register_target
    from components.targets.target import weights_sha256
    from infra.mlflow_store import RegistryCollision

    sha = weights_sha256(tiny_embedded.target_dir)
    register_target(mlflow_store, "t-v1-eagle3", tiny_embedded.target_dir, "base", "", sha)  # a target, by mistake
    with pytest.raises(RegistryCollision) as err:
        check_head_name(mlflow_store, TargetRef("t", 1, sha, tiny_embedded.target_dir))
    assert "'t-v1-eagle3' exists with kind='causal-lm-target', not 'eagle3-head'" in str(err.value)
    assert "another --name" in str(err.value)
    assert [v.version for v in mlflow_store.list_versions("t-v1-eagle3")] == [1]


def test_target_name_taken_by_a_head(mlflow_store, tiny_embedded):
    from components.registry.register import register_target
    from components.targets.target import weights_sha256
    from infra.mlflow_store import RegistryCollision

    mlflow_store.ensure_model("my-head")  # kind=eagle3-head
    with pytest.raises(RegistryCollision, match="'my-head' exists with kind='eagle3-head', not 'causal-lm-target'"):
        register_target(
            mlflow_store, "my-head", tiny_embedded.target_dir, "user", "", weights_sha256(tiny_embedded.target_dir)
        )
    assert mlflow_store.list_versions("my-head") == []


def test_unknown_registered_version(mlflow_store):
    """`resolve` says which part of the URI is not in the registry (the CLI's rows: tests/test_bad_input_table.py)."""
    with pytest.raises(LookupError, match="models:/nope/3: no registered model 'nope'"):
        mlflow_store.resolve("models:/nope/3")


# ---- a refusal inside a Ray Train worker --------------------------------------------------------------------------


@pytest.mark.slow  # a Ray Train worker group: ~15 s on a local Ray
def test_a_refusal_inside_a_ray_worker_is_bad_input_and_not_retried(
    tiny_embedded, extracted, ray_local, tmp_path, capfd
):
    """A warm-start head that fuses other layers than the features is found by the worker (`new_head`), not the
    driver: the worker's `HeadMismatchError` reaches the caller as itself (the CLI's one line, exit 2), with the
    worker's message, and Ray does not restart the worker group for it (`max_failures` 2)."""
    from components.extract.stage import ExtractConfig, extract
    from components.train.stage import RayConfig, TrainConfig, TrainSetup, train
    from eagle.export import HeadMismatchError

    cfg = dataclasses.replace(TrainConfig.tiny(), steps=2)
    head = train(cfg, str(extracted / "ext"), str(tmp_path / "head")).head_dir  # fuses the default layers
    other = tmp_path / "ext-1-2-4"
    extract(
        ExtractConfig(max_len=128, dtype="float32", seqs_per_shard=4, aux_layer_ids=(1, 2, 4)),
        tiny_embedded.target_dir,
        str(extracted / "regen"),
        str(other),
        **QUIET,
    )
    ray_cfg = dataclasses.replace(cfg, ray=RayConfig(num_workers=1, cpus_per_worker=1, max_failures=2))
    capfd.readouterr()
    with pytest.raises(HeadMismatchError) as err:
        train(ray_cfg, str(other), str(tmp_path / "train"), setup=TrainSetup(head, str(tmp_path / "ray")))
    out = "".join(capfd.readouterr())
    assert str(err.value).startswith(f"warm-start head {head} fuses layers ") and "[1, 2, 4]" in str(err.value)
    assert type(err.value.__context__).__name__ == "ControllerError"  # ended by the controller at the first error
    assert "Traceback" not in out and "HeadMismatchError" not in out, out  # Ray printed no traceback of it
    assert not (tmp_path / "train" / "checkpoints").exists() and not (tmp_path / "train" / "head").exists()
