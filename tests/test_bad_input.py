"""Bad input, one test per row: each is refused with one clear error that names the input and what to do, and
leaves nothing half-written.

Purpose: the CLI rows of HARDENING.md's bad-input table, through `flows.cli.main` in this process (exit code and
stderr): traffic files (empty, malformed, wrong schema, unknown roles, not UTF-8, a directory), the config
(unknown key, not JSON, wrong type), arguments, target directories (not a causal LM, too few layers, pickle
weights only, a tokenizer of another model, no chat template), unreachable MLflow and Ray. All are caught before
a flow starts: exit 2, and the state dir holds no registry and no run directory. The stages' rows are in
tests/test_bad_input_stages.py; the second pass's rows across all commands (URIs, registry names, damaged weights
and heads, URLs, settings, config bounds) are tests/test_bad_input_table.py.
Run: `python -m pytest tests/test_bad_input.py` (about 15 s once the tiny embedded default is built).
Not here: kills and outages (tests/test_faults.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import target_copy

QUIET = dict(progress=lambda s: None)
USER = {"role": "user", "content": "def f(x):"}


def _jsonl(path: Path, *rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


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

    good = {
        "--target": str(tiny_embedded.target_dir),
        "--traffic": str(tiny_embedded.target_traffic.train),
        "--heldout": str(tiny_embedded.target_traffic.heldout),
        "--preset": "tiny",
    }

    def run(*args: str, env: dict[str, str] | None = None, **opts: str) -> tuple[int, str]:
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        argv = list(args) or [
            "train",
            *[x for k, v in {**good, **{f"--{k}": v for k, v in opts.items()}}.items() for x in (k, v)],
        ]
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
    path.write_bytes(json.dumps({"messages": [USER]}).encode()[:-2] + b'\xe9\xff"}]}\n')
    rc, err = cli(traffic=str(path))
    assert rc == 2 and str(path) in err and "not UTF-8" in err, err


def test_traffic_that_is_a_directory_but_not_a_saved_dataset(cli, tmp_path):
    rc, err = cli(traffic=str(tmp_path))
    assert rc == 2 and f"{tmp_path}: a directory that is not a saved dataset" in err and "Parquet" in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "content, needle",
    [
        ('{"train": {"stepz": 3}}', "unknown key train.stepz; known: ["),
        ('{"train": {"steps": 3}', "cannot read the config"),
        ('{"evaluate": {"spec": {"depth": "deep"}}}', "evaluate.spec.depth: 'deep' is not of type int"),
    ],
    ids=["unknown-key", "not-json", "wrong-type"],
)
def test_bad_config(cli, tmp_path, content, needle):
    path = tmp_path / "cfg.json"
    path.write_text(content)
    rc, err = cli(config=str(path))
    assert rc == 2 and str(path) in err and needle in err, err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train", "--traffic", "x.jsonl"], "required: --target"),
        (["train", "--target", "d", "--traffic", "t", "--heldout", "h", "--preset", "huge"], "invalid choice: 'huge'"),
        (["watch", "--interval", "0"], "the interval must be > 0 seconds"),
        (["watch", "--interval", "soon"], "'soon' is not a number of seconds"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (
            ["train", "--target", "/nonexistent/model", "--traffic", "t", "--heldout", "h"],
            "--target /nonexistent/model: no such",
        ),
    ],
    ids=["missing-target", "bad-preset", "zero-interval", "bad-interval", "unknown-command", "missing-target-dir"],
)
def test_bad_arguments(cli, args, needle):
    rc, err = cli(*args)
    assert rc == 2 and needle in err, err


def test_target_that_is_not_a_causal_lm(cli, tiny_embedded, tmp_path):
    d = target_copy(tiny_embedded, tmp_path, lambda c: c.update(architectures=["LlamaForSequenceClassification"]))
    rc, err = cli(target=str(d))
    assert rc == 2 and str(d) in err and "is not a causal LM (need e.g. LlamaForCausalLM)" in err, err


def test_target_with_too_few_layers(cli, tiny_embedded, tmp_path):
    d = target_copy(tiny_embedded, tmp_path, lambda c: c.update(num_hidden_layers=3))
    rc, err = cli(target=str(d))
    assert rc == 2 and str(d) in err and "3" in err and "layers" in err, err


def test_target_with_pickle_weights_only(cli, tiny_embedded, tmp_path):
    d = target_copy(tiny_embedded, tmp_path)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    rc, err = cli(target=str(d))
    assert rc == 2 and "no .safetensors weights; only safetensors are loaded (no pickle)" in err, err


def test_tokenizer_of_another_model(cli, tiny_embedded, tmp_path):
    from transformers import AutoTokenizer

    d = target_copy(tiny_embedded, tmp_path)
    tok = AutoTokenizer.from_pretrained(d, trust_remote_code=False)
    tok.add_tokens([f"<extra_{i}>" for i in range(64)])  # a tokenizer bigger than the model's vocabulary
    tok.save_pretrained(d)
    rc, err = cli(target=str(d))
    assert rc == 2 and "the tokenizer does not belong to this model" in err and str(d) in err, err


def test_target_without_chat_template(cli, tiny_embedded, tmp_path):
    d = target_copy(tiny_embedded, tmp_path)
    for f in d.glob("chat_template*"):
        f.unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    rc, err = cli(target=str(d))
    assert rc == 2 and "has no chat template; add one" in err, err


def test_unreachable_tracking_uri(cli):
    rc, err = cli(env={"MLFLOW_TRACKING_URI": "http://someone:s3cret-pw@127.0.0.1:9"})
    assert rc == 2 and "127.0.0.1:9 is unreachable" in err and "MLFLOW_TRACKING_URI" in err, err
    assert "s3cret-pw" not in err and "someone" not in err  # credentials are never shown


def test_tracking_uri_with_credentials_reaches_a_server_that_is_up(capsys, caplog):
    """The probe leaves `user:password@` out (urllib would read it as part of the host name) and never shows it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from infra.mlflow_health import probe_tracking
    from infra.settings import Settings

    seen = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append((self.path, str(self.headers)))
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
    assert [path for path, _ in seen] == ["/health"]  # the probe reached the server, at the health path
    assert not any("s3cret-pw" in headers or "someone" in headers for _, headers in seen)  # not sent in the clear
    shown = capsys.readouterr()
    assert not any("s3cret-pw" in text for text in (shown.out, shown.err, caplog.text))  # and never shown


def test_unreachable_ray_address(cli):
    rc, err = cli(preset="default", env={"RAY_ADDRESS": "127.0.0.1:9"})  # the default preset trains on Ray
    assert rc == 2 and "Ray cluster at 127.0.0.1:9 is unreachable" in err and "RAY_ADDRESS" in err, err
