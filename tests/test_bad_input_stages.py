"""Bad input met by the stages (the rest of HARDENING.md's bad-input table; the CLI's rows are in test_bad_input.py).

Purpose: one test per row: prompts longer than the target's context, a head for another target, corrupted,
truncated or unreadable feature files, a NaN loss, a history line torn by a kill, a full disk while writing a
regenerated shard, a feature shard or a checkpoint, a head or target name taken by the other kind of model, an
unknown registered version; bad input is not retried (an outage is), also when a Ray Train worker finds it. Each
error names the input and what to do; nothing half-written remains.
A stage's refusal met inside a running flow reaches the terminal as the CLI's one line, without Prefect's failure
log (a filter on its console handler, and the real CLI in a subprocess), and the flow takes back what the run made
when no stage finished (its run directory, the target version it registered).
Run: `python -m pytest tests/test_bad_input_stages.py` (about 45 s once the tiny embedded default is built, plus
the slow Ray and CLI runs, ~25 s and ~40 s).
Not here: kills and outages (tests/test_faults.py).
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


def _jsonl(path: Path, *rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _leftovers(root: Path) -> list[str]:
    """Temp or partial files anywhere under `root` (what a write cut short would leave)."""
    return [str(p) for p in root.rglob("*") if p.name.endswith(".tmp") or p.name.startswith((".tmp-", ".head."))]


def _later_turns_too_long(path: Path) -> str:
    """Three conversations whose first turn fits the tiny target's context and whose second does not."""
    return _jsonl(path, *[{"id": f"long-{i}", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "x = 1\n" * 400}]} for i in range(3)])


def test_prompts_longer_than_the_targets_context(tiny_embedded, tmp_path):
    from components.regenerate.stage import RegenerateConfig, RegenerateError, regenerate

    traffic = _jsonl(tmp_path / "long.jsonl", *[{"id": f"long-{i}", "messages": [
        {"role": "user", "content": "x = 1\n" * 400}]} for i in range(3)])
    out = tmp_path / "regen"
    with pytest.raises(RegenerateError) as err:
        regenerate(RegenerateConfig(max_new_tokens=8, shard_size=2), tiny_embedded.target_dir, traffic, str(out),
                   **QUIET)
    msg = str(err.value)
    assert traffic in msg and "long-0" in msg and "exceeds the target's context" in msg and "Shorten the prompts" in msg
    assert sorted(p.name for p in out.iterdir()) == ["accounting.json"]  # no shard marked done: a re-run retries
    assert json.loads((out / "accounting.json").read_text())["failed"] == 3


@pytest.fixture(scope="module")
def extracted(tiny_embedded, tmp_path_factory) -> Path:
    from components.extract.stage import ExtractConfig, extract
    from components.regenerate.stage import RegenerateConfig, regenerate

    root = tmp_path_factory.mktemp("bad-input")
    regenerate(RegenerateConfig(max_new_tokens=8, shard_size=4, limit=8), tiny_embedded.target_dir,
               str(tiny_embedded.target_traffic.train), str(root / "regen"), **QUIET)
    extract(ExtractConfig(max_len=128, dtype="float32", seqs_per_shard=4), tiny_embedded.target_dir,
            str(root / "regen"), str(root / "ext"), **QUIET)
    return root


def test_a_head_for_another_target(tiny_embedded, extracted, tmp_path):
    from transformers import AutoConfig, LlamaForCausalLM

    from components.evaluate.stage import EvaluateConfig, HeadEval, evaluate
    from components.train.stage import TrainConfig, train
    from eagle.export import HeadMismatchError

    head = train(dataclasses.replace(TrainConfig.tiny(), steps=2), str(extracted / "ext"),
                 str(tmp_path / "train")).head_dir
    other = target_copy(tiny_embedded, tmp_path)  # same tokenizer and template, another shape
    cfg = AutoConfig.from_pretrained(other, trust_remote_code=False)
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 32, 64, 8
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(other)
    with pytest.raises(HeadMismatchError) as err:
        evaluate(EvaluateConfig.tiny(), HeadEval(str(other), head, str(tiny_embedded.target_traffic.heldout),
                                                 str(tmp_path / "eval")), **QUIET)
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
    named, hint = {"flip-a-byte": (shard.name, "delete it and re-run extract"),
                   "truncate": (shard.name, "delete it and re-run extract"),
                   "delete": (shard.name, "re-run extract"),
                   "bad-manifest": ("manifest.json", "delete it and re-run extract"),
                   "bad-tokens": ("tokens/target_heads", "re-run extract")}[damage]
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
        "features-00000.safetensors"]  # the manifest lists only what is whole
    monkeypatch.setattr("components.extract.stage.atomic_write_bytes", real)
    res = extract(cfg, tiny_embedded.target_dir, str(extracted / "regen"), str(out), **QUIET)  # space freed
    assert json.loads(Path(res.manifest).read_text())["shards"] == \
        json.loads((extracted / "ext" / "manifest.json").read_text())["shards"]


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
        regenerate(RegenerateConfig(max_new_tokens=4, shard_size=2, limit=4), tiny_embedded.target_dir,
                   str(tiny_embedded.target_traffic.train), str(out), **QUIET)
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
        register_target(mlflow_store, "my-head", tiny_embedded.target_dir, "user", "",
                        weights_sha256(tiny_embedded.target_dir))
    assert mlflow_store.list_versions("my-head") == []


def test_unknown_registered_version(mlflow_store):
    """`resolve` says which part of the URI is not in the registry (the CLI's rows: tests/test_bad_input_table.py)."""
    with pytest.raises(LookupError, match="models:/nope/3: no registered model 'nope'"):
        mlflow_store.resolve("models:/nope/3")


@pytest.mark.parametrize("error, attempts", [("bad input", 1), ("outage", 3)])
def test_bad_input_is_not_retried_but_an_outage_is(prefect_harness, monkeypatch, error, attempts):
    from prefect import flow

    from components.regenerate.stage import RegenerateConfig, RegenerateError
    from flows import tasks

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RegenerateError("every prompt is too long") if error == "bad input" else ConnectionError("endpoint down")

    monkeypatch.setattr(tasks, "regenerate", failing)

    @flow
    def one_stage():
        return tasks.regenerate_task.with_options(retry_delay_seconds=0)(RegenerateConfig(), "t", "x.jsonl", "out")

    with pytest.raises((RegenerateError, ConnectionError)):
        one_stage()
    assert len(calls) == attempts


# ---- a stage's refusal met inside a running flow: the CLI's one line, not Prefect's failure log ------------------


def test_prefects_log_of_a_bad_input_failure_is_hidden_and_other_failures_stay(prefect_harness):
    """Real flows, real Prefect records, through a handler on the root logger (where Prefect's console handler is)
    with `hide_bad_input_failures` installed: a task that fails on bad input leaves no failure record, a task that
    fails otherwise keeps Prefect's task and flow failure logs with the traceback."""
    import io
    import logging

    from prefect import flow, task

    from components.regenerate.stage import RegenerateError
    from infra.prefect_env import hide_bad_input_failures

    @task
    def refuse():
        raise RegenerateError("/x/traffic.jsonl: none of 3 conversations could be regenerated")

    @task
    def crash():
        raise RuntimeError("a bug")

    @flow
    def one_stage(fail):
        return fail()

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logging.getLogger().addHandler(handler)
    level = logging.getLogger("prefect").level
    logging.getLogger("prefect").setLevel(logging.INFO)  # a CLI run in this process may have quieted it
    try:
        hide_bad_input_failures()
        hide_bad_input_failures()  # twice adds nothing
        assert sum(type(f).__name__ == "_HideBadInputFailures" for f in handler.filters) == 1
        with pytest.raises(RegenerateError):
            one_stage(refuse)
        refused, _ = out.getvalue(), out.truncate(0)
        with pytest.raises(RuntimeError):
            one_stage(crash)
        crashed = out.getvalue()
    finally:
        logging.getLogger().removeHandler(handler)
        logging.getLogger("prefect").setLevel(level)
    assert "Beginning flow run" in refused  # the run's other lines still show
    assert "RegenerateError" not in refused and "Traceback" not in refused and "Failed" not in refused, refused
    assert "Task run encountered an exception RuntimeError: a bug" in crashed and "Traceback" in crashed
    assert "Flow run encountered an exception: RuntimeError: a bug" in crashed


@pytest.mark.slow  # a Prefect start and a target load in a child process: ~40 s quiet, ~100 s on loaded cores
def test_a_stages_refusal_through_the_cli_is_one_line(tiny_embedded, tmp_path):
    """The real CLI in a subprocess: second turns longer than the target's context pass the preflight (it renders
    first turns only), reach the regenerate task and are refused there: exit 2 and the CLI's one line, with no
    Prefect failure log or traceback above it and nothing after it; the run directory and the target version the
    run registered are gone."""
    import subprocess
    import sys

    traffic = _later_turns_too_long(tmp_path / "long.jsonl")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "EAGLE_", "RAY_"))}
    env.update(EAGLE_HOME=str(tmp_path / "home"), OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "train", "--preset", "tiny", "--target",
                           str(tiny_embedded.target_dir), "--traffic", traffic, "--heldout",
                           str(tiny_embedded.target_traffic.heldout)], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=600)
    out = proc.stdout + proc.stderr
    errors = [x for x in out.splitlines() if "error" in x.lower() or "exception" in x.lower()]
    assert proc.returncode == 2, out
    assert len(errors) == 1 and errors[0].startswith(f"eagle-heads: error: {traffic}: none of 3 conversations"), out
    assert "turn 2: prompt of" in errors[0] and "exceeds the target's context" in errors[0], out
    assert proc.stderr.rstrip().endswith(errors[0]), out
    for noise in ("Traceback", "Finished in state", "Encountered exception", "| ERROR", "Stopping temporary server"):
        assert noise not in out, out
    home = tmp_path / "home"
    assert not list((home / "runs").glob("*")) and not list((home / "mlartifacts").rglob("*.safetensors"))


# ---- a refusal inside a Ray Train worker --------------------------------------------------------------------------


@pytest.mark.slow  # a Ray Train worker group: ~15 s on a local Ray
def test_a_refusal_inside_a_ray_worker_is_bad_input_and_not_retried(tiny_embedded, extracted, ray_local, tmp_path,
                                                                     capfd):
    """A warm-start head that fuses other layers than the features is found by the worker (`new_head`), not the
    driver: the worker's `HeadMismatchError` reaches the caller as itself (the CLI's one line, exit 2), with the
    worker's message, and Ray does not restart the worker group for it (`max_failures` 2)."""
    from components.extract.stage import ExtractConfig, extract
    from components.train.stage import RayConfig, TrainConfig, TrainSetup, train
    from eagle.export import HeadMismatchError

    cfg = dataclasses.replace(TrainConfig.tiny(), steps=2)
    head = train(cfg, str(extracted / "ext"), str(tmp_path / "head")).head_dir  # fuses the default layers
    other = tmp_path / "ext-1-2-4"
    extract(ExtractConfig(max_len=128, dtype="float32", seqs_per_shard=4, aux_layer_ids=(1, 2, 4)),
            tiny_embedded.target_dir, str(extracted / "regen"), str(other), **QUIET)
    ray_cfg = dataclasses.replace(cfg, ray=RayConfig(num_workers=1, cpus_per_worker=1, max_failures=2))
    capfd.readouterr()
    with pytest.raises(HeadMismatchError) as err:
        train(ray_cfg, str(other), str(tmp_path / "train"), setup=TrainSetup(head, str(tmp_path / "ray")))
    out = "".join(capfd.readouterr())
    assert str(err.value).startswith(f"warm-start head {head} fuses layers ") and "[1, 2, 4]" in str(err.value)
    assert type(err.value.__context__).__name__ == "ControllerError"  # ended by the controller at the first error
    assert "Traceback" not in out and "HeadMismatchError" not in out, out  # Ray printed no traceback of it
    assert not (tmp_path / "train" / "checkpoints").exists() and not (tmp_path / "train" / "head").exists()


# ---- a refusal after the run started: nothing of it is left --------------------------------------------------------


def test_a_refusal_after_the_run_started_takes_back_what_the_run_made(prefect_harness, tiny_embedded, tmp_path,
                                                                      monkeypatch):
    """The train flow in this process: every second turn is too long (the preflight passes), the regenerate stage
    refuses after the run registered the target and made its run directory; both are removed. A second refused run
    on a target an earlier run registered removes its own run directory and keeps that version."""
    from components.regenerate.stage import RegenerateError
    from components.registry.register import register_target
    from components.targets.target import weights_sha256
    from flows.train_head import train_head
    from infra.mlflow_store import MlflowStore
    from infra.settings import Settings

    home = tmp_path / "home"
    for key in [k for k in os.environ if k.startswith(("MLFLOW_", "EAGLE_", "RAY_ADDRESS"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("EAGLE_HOME", str(home))
    traffic = _later_turns_too_long(tmp_path / "long.jsonl")
    target, heldout, name = str(tiny_embedded.target_dir), str(tiny_embedded.target_traffic.heldout), "t"
    with pytest.raises(RegenerateError, match="turn 2: prompt of .* exceeds the target's context"):
        train_head(target, traffic, heldout, "tiny", target_name=name)
    store = MlflowStore.connect(Settings.from_env())
    assert not list((home / "runs").glob("*")), list((home / "runs").rglob("*"))
    assert store.list_models() == [] and not list((home / "mlartifacts").rglob("*.safetensors"))

    earlier = register_target(store, name, target, role="user", base_model="", weights_sha256=weights_sha256(target))
    with pytest.raises(RegenerateError):
        train_head(target, traffic, heldout, "tiny", target_name=name)
    assert [v.version for v in store.list_versions(name)] == [earlier.version]  # an earlier run's: kept
    assert list((home / "mlartifacts").rglob("*.safetensors"))  # with its copy of the target
    assert not list((home / "runs").glob("*"))
