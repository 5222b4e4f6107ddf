"""Bad input, one test per row: each is refused with one clear error that names the input and what to do, and
leaves nothing half-written.

Purpose: the rows of HARDENING.md's bad-input table.
- Through the CLI (`flows.cli.main` in this process, exit code and stderr): traffic files (empty, malformed,
  wrong schema, unknown roles, not UTF-8, a directory), the config (unknown key, not JSON), arguments, target
  directories (not a causal LM, too few layers, pickle weights only, a tokenizer of another model, no chat
  template, a malformed model URI), unreachable MLflow and Ray, a malformed setting. All of these are caught
  before the flow starts: exit 2, and the state dir holds no registry and no run directory.
- Through the components: prompts longer than the target's context, a head for another target, corrupted,
  truncated or unreadable feature files, a NaN loss, a full disk while writing a regenerated shard, a feature
  shard or a checkpoint, a head name taken by a non-head model, an unknown registered version.
Run: `python -m pytest tests/test_bad_input.py` (about 30 s on 2 cores, most of it the shared fixtures).
Not here: kills and outages (tests/test_faults.py).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

QUIET = dict(progress=lambda s: None)
USER = {"role": "user", "content": "def f(x):"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _jsonl(path: Path, *rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _leftovers(root: Path) -> list[str]:
    """Temp or partial files anywhere under `root` (what a write cut short would leave)."""
    return [str(p) for p in root.rglob("*") if p.name.endswith(".tmp") or p.name.startswith((".tmp-", ".head."))]


# ---- through the CLI: refused before anything runs ----------------------------------------------------------------


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys, tiny_embedded):
    """`run(*args, env=...) -> (exit code, stderr)`; a good target and traffic by default; nothing may be written."""
    from flows import cli as cli_mod

    home = tmp_path / ".eagle"
    for key in [k for k in os.environ if k.startswith(("MLFLOW_", "EAGLE_", "RAY_ADDRESS"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("EAGLE_HOME", str(home))
    monkeypatch.setattr("infra.prefect_env.apply_prefect_defaults", lambda settings: {})  # no flow runs here

    good = {"--target": str(tiny_embedded.target_dir), "--traffic": str(tiny_embedded.target_traffic.train),
            "--heldout": str(tiny_embedded.target_traffic.heldout), "--preset": "tiny"}

    def run(*args: str, env: dict[str, str] | None = None, **opts: str) -> tuple[int, str]:
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        argv = list(args) or ["train", *[x for k, v in {**good, **{f"--{k}": v for k, v in opts.items()}}.items()
                                         for x in (k, v)]]
        try:
            rc = cli_mod.main(argv)
        except SystemExit as e:  # argparse
            rc = e.code
        err = capsys.readouterr().err
        assert not (home / "mlflow.db").exists() and not (home / "runs").exists(), "something was written"
        return rc, err

    return run


TRAFFIC_ROWS = {
    "empty": ([""], ["empty file", "at least one conversation"]),
    "malformed-json": ([{"messages": [USER]}, '{"messages": [ '], [":2: malformed JSON", "fix or remove line 2"]),
    "wrong-schema": ([{"prompt": "hi", "completion": "there"}], [":1: missing key", "'messages'", "'conversations'"]),
    "unknown-role": ([{"messages": [USER, {"role": "robot", "content": "x"}]}], ["unknown role: 'robot'"]),
    "sharegpt-unknown-role": ([{"conversations": [{"from": "bot", "value": "x"}]}], ["unknown role: 'bot'"]),
    "content-not-text": ([{"messages": [{"role": "user", "content": ["a", "b"]}]}], ["must be a string"]),
    "no-user-turn": ([{"messages": [{"role": "assistant", "content": "x"}]}], ["no user turn"]),
}


@pytest.mark.parametrize("row", sorted(TRAFFIC_ROWS))
def test_bad_traffic(cli, tmp_path, row):
    lines, needles = TRAFFIC_ROWS[row]
    path = _jsonl(tmp_path / f"{row}.jsonl", *lines) if lines != [""] else str(tmp_path / "empty.jsonl")
    Path(path).touch()
    rc, err = cli(traffic=path)
    assert rc == 2 and path in err and "training traffic" in err, err
    for needle in needles:
        assert needle in err, err


def test_bad_heldout_traffic_is_named_as_such(cli, tmp_path):
    rc, err = cli(heldout=_jsonl(tmp_path / "h.jsonl", {"messages": [{"role": "judge", "content": "x"}]}))
    assert rc == 2 and "h.jsonl:1" in err and "held-out traffic" in err and "unknown role" in err, err


def test_traffic_that_is_not_utf8(cli, tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"messages": [USER]}).encode()[:-2] + b"\xe9\xff\"}]}\n")
    rc, err = cli(traffic=str(path))
    assert rc == 2 and str(path) in err and "not UTF-8" in err, err


def test_traffic_that_is_a_directory(cli, tmp_path):
    rc, err = cli(traffic=str(tmp_path))
    assert rc == 2 and f"--traffic {tmp_path}: not a file" in err, err


@pytest.mark.parametrize("content, needle", [
    ('{"train": {"stepz": 3}}', "unknown key train.stepz; known: ["),
    ('{"train": {"steps": 3}', "cannot read the config"),
    ('{"evaluate": {"depth": "deep"}}', "evaluate.depth: 'deep' is not of type int"),
], ids=["unknown-key", "not-json", "wrong-type"])
def test_bad_config(cli, tmp_path, content, needle):
    path = tmp_path / "cfg.json"
    path.write_text(content)
    rc, err = cli(config=str(path))
    assert rc == 2 and str(path) in err and needle in err, err


@pytest.mark.parametrize("args, needle", [
    (["train", "--traffic", "x.jsonl"], "required: --target"),
    (["train", "--target", "d", "--traffic", "t", "--heldout", "h", "--preset", "huge"], "invalid choice: 'huge'"),
    (["watch", "--interval", "0"], "the interval must be > 0 seconds"),
    (["watch", "--interval", "soon"], "'soon' is not a number of seconds"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["train", "--target", "/nonexistent/model", "--traffic", "t", "--heldout", "h"], "--target /nonexistent/model: no such"),
], ids=["missing-target", "bad-preset", "zero-interval", "bad-interval", "unknown-command", "missing-target-dir"])
def test_bad_arguments(cli, args, needle):
    rc, err = cli(*args)
    assert rc == 2 and needle in err, err


def _target_copy(tiny_embedded, tmp_path: Path, edit=None) -> Path:
    d = tmp_path / "target"
    shutil.copytree(tiny_embedded.target_dir, d)
    if edit:
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_target_that_is_not_a_causal_lm(cli, tiny_embedded, tmp_path):
    d = _target_copy(tiny_embedded, tmp_path, lambda c: c.update(architectures=["LlamaForSequenceClassification"]))
    rc, err = cli(target=str(d))
    assert rc == 2 and str(d) in err and "is not a causal LM (need e.g. LlamaForCausalLM)" in err, err


def test_target_with_too_few_layers(cli, tiny_embedded, tmp_path):
    d = _target_copy(tiny_embedded, tmp_path, lambda c: c.update(num_hidden_layers=3))
    rc, err = cli(target=str(d))
    assert rc == 2 and str(d) in err and "3" in err and "layers" in err, err


def test_target_with_pickle_weights_only(cli, tiny_embedded, tmp_path):
    d = _target_copy(tiny_embedded, tmp_path)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    rc, err = cli(target=str(d))
    assert rc == 2 and "no .safetensors weights; only safetensors are loaded (no pickle)" in err, err


def test_tokenizer_of_another_model(cli, tiny_embedded, tmp_path):
    from transformers import AutoTokenizer

    d = _target_copy(tiny_embedded, tmp_path)
    tok = AutoTokenizer.from_pretrained(d, trust_remote_code=False)
    tok.add_tokens([f"<extra_{i}>" for i in range(64)])  # a tokenizer bigger than the model's vocabulary
    tok.save_pretrained(d)
    rc, err = cli(target=str(d))
    assert rc == 2 and "the tokenizer does not belong to this model" in err and str(d) in err, err


def test_target_without_chat_template(cli, tiny_embedded, tmp_path):
    d = _target_copy(tiny_embedded, tmp_path)
    for f in d.glob("chat_template*"):
        f.unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    rc, err = cli(target=str(d))
    assert rc == 2 and "has no chat template; add one" in err, err


def test_malformed_model_uri(cli):
    rc, err = cli(target="models:/only-a-name")
    assert rc == 2 and "'models:/only-a-name' is not a model URI" in err, err


def test_unreachable_tracking_uri(cli):
    rc, err = cli(env={"MLFLOW_TRACKING_URI": "http://someone:s3cret-pw@127.0.0.1:9"})
    assert rc == 2 and "127.0.0.1:9 is unreachable" in err and "MLFLOW_TRACKING_URI" in err, err
    assert "s3cret-pw" not in err and "someone" not in err  # credentials are never shown


def test_tracking_uri_with_credentials_reaches_a_server_that_is_up():
    """The probe leaves `user:password@` out (urllib would read it as part of the host name) and never shows it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from infra.mlflow_health import probe_tracking
    from infra.settings import Settings

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(401 if self.headers.get("Authorization") is None else 200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://someone:s3cret-pw@127.0.0.1:{server.server_address[1]}"
        probe_tracking(Settings.from_env({"MLFLOW_TRACKING_URI": uri}), timeout_s=5)  # a 401 is an answer
    finally:
        server.shutdown()
        server.server_close()


def test_unreachable_ray_address(cli):
    rc, err = cli(preset="default", env={"RAY_ADDRESS": "127.0.0.1:9"})  # the default preset trains on Ray
    assert rc == 2 and "Ray cluster at 127.0.0.1:9 is unreachable" in err and "RAY_ADDRESS" in err, err


def test_malformed_setting(cli):
    rc, err = cli(env={"EAGLE_TRUST_REMOTE_CODE": "maybe"})
    assert rc == 2 and "EAGLE_TRUST_REMOTE_CODE='maybe' is not a boolean" in err, err


# ---- through the components ----------------------------------------------------------------------------------------


def test_prompts_longer_than_the_targets_context(tiny_embedded, tmp_path):
    from components.regenerate import RegenerateConfig, RegenerateError, regenerate

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
    from components.extract import ExtractConfig, extract
    from components.regenerate import RegenerateConfig, regenerate

    root = tmp_path_factory.mktemp("bad-input")
    regenerate(RegenerateConfig(max_new_tokens=8, shard_size=4, limit=8), tiny_embedded.target_dir,
               str(tiny_embedded.target_traffic.train), str(root / "regen"), **QUIET)
    extract(ExtractConfig(max_len=128, dtype="float32", seqs_per_shard=4), tiny_embedded.target_dir,
            str(root / "regen"), str(root / "ext"), **QUIET)
    return root


def test_a_head_for_another_target(tiny_embedded, extracted, tmp_path):
    from transformers import AutoConfig, LlamaForCausalLM

    from components.evaluate import EvaluateConfig, evaluate
    from components.train import TrainConfig, train
    from eagle.export import HeadMismatchError

    head = train(TrainConfig(**{**TrainConfig.tiny().__dict__, "steps": 2}), str(extracted / "ext"),
                 str(tmp_path / "train")).head_dir
    other = _target_copy(tiny_embedded, tmp_path)  # same tokenizer and template, another shape
    cfg = AutoConfig.from_pretrained(other, trust_remote_code=False)
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 32, 64, 8
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(other)
    with pytest.raises(HeadMismatchError) as err:
        evaluate(EvaluateConfig.tiny(), str(other), head, str(tiny_embedded.target_traffic.heldout),
                 str(tmp_path / "eval"), **QUIET)
    msg = str(err.value)
    assert head in msg and "hidden_size: head expects 64, target has 32" in msg and "train a head for this" in msg
    assert not list((tmp_path / "eval").iterdir())


def _ext_copy(extracted: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(extracted / "ext", tmp_path / "ext"))


@pytest.mark.parametrize("damage", ["flip-a-byte", "truncate", "delete", "bad-manifest", "bad-tokens"])
def test_damaged_feature_files(extracted, tmp_path, damage):
    from components.datasets import FeatureStoreError
    from components.train import TrainConfig, train

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

    from components.extract import _sha256
    from components.train import TrainConfig, train

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


def _enospc(*_args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_writing_a_feature_shard(tiny_embedded, extracted, tmp_path, monkeypatch):
    import safetensors.torch

    from components.extract import ExtractConfig, extract

    real = safetensors.torch.save_file

    def full(tensors, filename, metadata=None):
        real(tensors, filename, metadata)
        if "features-00001" in filename:  # half of it reached the disk, then no space
            os.truncate(filename, os.path.getsize(filename) // 2)
            _enospc()

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "ext"
    cfg = ExtractConfig(max_len=128, dtype="float32", seqs_per_shard=4)
    with pytest.raises(OSError) as err:
        extract(cfg, tiny_embedded.target_dir, str(extracted / "regen"), str(out), **QUIET)
    assert err.value.errno == errno.ENOSPC
    assert str(out / "features-00001.safetensors") in str(err.value) and "free space" in str(err.value)
    assert not _leftovers(out) and not (out / "features-00001.safetensors").exists()
    assert [s["file"] for s in json.loads((out / "manifest.json").read_text())["shards"]] == [
        "features-00000.safetensors"]  # the manifest lists only what is whole
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    res = extract(cfg, tiny_embedded.target_dir, str(extracted / "regen"), str(out), **QUIET)  # space freed
    assert json.loads(Path(res.manifest).read_text())["shards"] == \
        json.loads((extracted / "ext" / "manifest.json").read_text())["shards"]


def test_full_disk_writing_a_regenerated_shard(tiny_embedded, tmp_path, monkeypatch):
    from components import atomic
    from components.regenerate import RegenerateConfig, regenerate

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
    from components.train import TrainConfig, latest_checkpoint, train

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
    from components.register import TargetRef, check_head_name, register_target
    from components.targets import weights_sha256
    from infra.mlflow_store import RegistryCollision

    sha = weights_sha256(tiny_embedded.target_dir)
    register_target(mlflow_store, "t-v1-eagle3", tiny_embedded.target_dir, "base", "", sha)  # a target, by mistake
    with pytest.raises(RegistryCollision) as err:
        check_head_name(mlflow_store, TargetRef("t", 1, sha, tiny_embedded.target_dir))
    assert "'t-v1-eagle3' exists with kind='causal-lm-target', not 'eagle3-head'" in str(err.value)
    assert "another --name" in str(err.value)
    assert [v.version for v in mlflow_store.list_versions("t-v1-eagle3")] == [1]


def test_target_name_taken_by_a_head(mlflow_store, tiny_embedded):
    from components.register import register_target
    from components.targets import weights_sha256
    from infra.mlflow_store import RegistryCollision

    mlflow_store.ensure_model("my-head")  # kind=eagle3-head
    with pytest.raises(RegistryCollision, match="'my-head' exists with kind='eagle3-head', not 'causal-lm-target'"):
        register_target(mlflow_store, "my-head", tiny_embedded.target_dir, "user", "",
                        weights_sha256(tiny_embedded.target_dir))
    assert mlflow_store.list_versions("my-head") == []


def test_unknown_registered_version(mlflow_store):
    with pytest.raises(LookupError, match="models:/nope/3: no such registered model version"):
        mlflow_store.resolve("models:/nope/3")
