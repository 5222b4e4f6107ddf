"""Bad input across all six commands, one table row each: exit 2, one line naming the input, nothing written.

Purpose: issue 28's table (HARDENING.md lists every row by its id): arguments, files (truncated weights, broken JSON,
directories where files belong), registry URIs and names, URLs, settings, and config values (`BAD_CONFIGS`: bad
values of the config sections, each in its own `--config` file); issue 49's files that are not what they seem (other
encodings, deep or huge JSON, named pipes, devices, sockets, link loops, unreadable files:
tests/helpers_bad_input.py) and the programs and folders the project runs or writes (EAGLE_VLLM_PYTHON, EAGLE_HOME's
folders, TMPDIR; a full disk in `test_a_full_disk_is_refused_before_any_work`). The inputs the rows name are made by
the `files` and `homes` fixtures (tests/helpers_bad_input_files.py). Each row runs `flows.cli.main(argv)`
in this process and asserts exit code 2, exactly one `error:` line on stderr that contains the row's needle (the
offending input), no traceback, and no new file under the state dir, within `ROW_LIMIT_S` (a read that blocks fails
the row instead of hanging the suite). Rows share two state dirs: an `empty` one (it does not exist and must not be
created) and a `registry` one (a local MLflow store holding target `t` version 1, which has no alias). If a row's
input passed the preflight, the command is not run: the row fails with exit 99.
`EMBEDDED_ROWS` are the embedded build's config (`python -m embedded --config F`), refused before the
build. HARDENING.md's table lists exactly these rows (`test_hardening_lists_every_row`).
Run: `python -m pytest tests/test_bad_input_table.py` (fast tier, ~30 s once the tiny embedded default is built).
Not here: bad input met inside a stage (tests/test_bad_input_stages.py), kills and outages (tests/test_faults.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers_bad_input import (
    BAD_CONFIGS,
    CONFIG_ON_EVALUATE,
    EMPTY,
    EVAL,
    FILE_ROWS,
    MON,
    REGISTRY,
    ROW_LIMIT_S,
    SERVE,
    TRAIN,
    argv_with as _with,
    time_limit,
)
from tests.helpers_bad_input_files import files, homes  # noqa: F401  (the fixtures)

# id -> (state dir, argv (templated with the paths of `files`), environment, needle the one error line must contain)
ROWS: dict[str, tuple[str, list[str], dict[str, str], str]] = {
    # train: arguments, target directories, registry names and URIs, config values
    "train-no-target": (EMPTY, ["train", "--traffic", "{traffic}", "--heldout", "{heldout}"], {}, "--target"),
    "train-unknown-preset": (EMPTY, _with(TRAIN, preset="huge"), {}, "'huge'"),
    "train-target-missing": (EMPTY, _with(TRAIN, target="/no/such/model"), {}, "/no/such/model: no such file"),
    "train-target-weights-truncated": (EMPTY, _with(TRAIN, target="{t_trunc}"), {}, "model.safetensors: truncated"),
    "train-target-weights-garbage": (EMPTY, _with(TRAIN, target="{t_garbage}"), {}, "not a readable safetensors"),
    "train-target-config-broken": (EMPTY, _with(TRAIN, target="{t_badcfg}"), {}, "config.json: cannot be read"),
    "train-target-no-lm-head": (
        EMPTY,
        _with(TRAIN, target="{t_nohead}"),
        {},
        "no lm_head.weight and config.json does not tie it",
    ),
    "train-target-gguf-truncated": (EMPTY, _with(TRAIN, target="{g_trunc}"), {}, "truncated or corrupt GGUF file"),
    "train-target-gguf-not-gguf": (EMPTY, _with(TRAIN, target="{g_text}"), {}, "not a GGUF file"),
    "train-target-gguf-architecture": (EMPTY, _with(TRAIN, target="{g_arch}"), {}, "architecture 'mamba2'"),
    "train-target-shard-missing": (
        EMPTY,
        _with(TRAIN, target="{t_shard}"),
        {},
        "the index names shard(s) model-00002-of-00002.safetensors that are not there",
    ),
    "train-target-is-a-file": (EMPTY, _with(TRAIN, target="{traffic}"), {}, "not a Hugging Face model directory"),
    "train-name-with-slash": (EMPTY, _with(TRAIN, name="a/b"), {}, "--name 'a/b' is not valid for the MLflow"),
    "train-name-with-colon": (EMPTY, _with(TRAIN, name="a:b"), {}, "--name 'a:b' is not valid"),
    "train-name-empty": (EMPTY, _with(TRAIN, name=""), {}, "--name '' is not valid"),
    "train-folder-name-invalid": (
        EMPTY,
        _with(TRAIN, target="{t_colon}"),
        {},
        "folder name (the default --name) 'x:y'",
    ),
    "train-head-suffix-invalid": (EMPTY, _with(TRAIN, config="{c_suffix}"), {}, "head name"),
    "train-uri-no-version": (EMPTY, _with(TRAIN, target="models:/x"), {}, "'models:/x' is not a model URI"),
    "train-uri-no-name": (EMPTY, _with(TRAIN, target="models:/"), {}, "the model name is missing"),
    "train-uri-empty-alias": (EMPTY, _with(TRAIN, target="models:/x@"), {}, "'models:/x@' is not a model URI"),
    "train-uri-alias-no-name": (EMPTY, _with(TRAIN, target="models:/@champion"), {}, "'models:/@champion'"),
    "train-uri-query": (EMPTY, _with(TRAIN, target="models:/a?x=1"), {}, "'models:/a?x=1' is not a model URI"),
    "train-uri-version-zero": (EMPTY, _with(TRAIN, target="models:/a/0"), {}, "the version '0' is not a whole"),
    "train-uri-version-word": (EMPTY, _with(TRAIN, target="models:/a/latest"), {}, "the version 'latest'"),
    "train-uri-no-registry-yet": (EMPTY, _with(TRAIN, target="models:/nope/3"), {}, "models:/nope/3: no registered"),
    "train-uri-unknown-model": (REGISTRY, _with(TRAIN, target="models:/nope/3"), {}, "no registered model 'nope'"),
    "train-uri-unknown-version": (
        REGISTRY,
        _with(TRAIN, target="models:/t/9"),
        {},
        "models:/t/9: registered model 't' has no version 9 (its versions: 1)",
    ),
    "train-uri-unknown-alias": (REGISTRY, _with(TRAIN, target="models:/t@champion"), {}, "has no alias 'champion'"),
    "train-config-is-a-directory": (EMPTY, _with(TRAIN, config="{dir}"), {}, "--config {dir}: not a file"),
    "train-config-not-an-object": (EMPTY, _with(TRAIN, config="{c_list}"), {}, "must be a JSON object"),
    "train-config-interval-zero": (EMPTY, _with(TRAIN, config="{c_interval0}"), {}, "monitor.interval_s must be"),
    "train-config-endpoint-ftp": (EMPTY, _with(TRAIN, config="{c_ftp}"), {}, "regenerate.endpoint_url 'ftp://"),
    "train-config-endpoint-no-scheme": (EMPTY, _with(TRAIN, config="{c_noscheme}"), {}, "the scheme is missing"),
    "train-config-ttt-steps-zero": (EMPTY, _with(TRAIN, config="{c_ttt0}"), {}, "train.ttt.ttt_steps must be"),
    "train-traffic-missing": (EMPTY, _with(TRAIN, traffic="/no/such.jsonl"), {}, "--traffic /no/such.jsonl"),
    "train-heldout-empty": (EMPTY, _with(TRAIN, heldout="{empty_jsonl}"), {}, "held-out traffic"),
    "train-traffic-bad-line": (EMPTY, _with(TRAIN, traffic="{bad_jsonl}"), {}, "bad.jsonl:1: malformed JSON"),
    "train-traffic-first-turn-too-long": (
        EMPTY,
        _with(TRAIN, traffic="{long_jsonl}"),
        {},
        "long.jsonl:2: the first turn of 'long-0' is a prompt of",
    ),
    "train-traffic-first-turn-too-long-engine": (
        EMPTY,
        [*_with(TRAIN, traffic="{long_jsonl}"), "--set", "regenerate.engine=vllm"],
        {},
        "long.jsonl:2: the first turn of",
    ),
    # settings (the environment), met by every command
    "tracking-uri-unknown-scheme": (EMPTY, TRAIN, {"MLFLOW_TRACKING_URI": "foo://bar"}, "unknown scheme foo://"),
    "tracking-uri-sqlite-dir-missing": (
        EMPTY,
        TRAIN,
        {"MLFLOW_TRACKING_URI": "sqlite:////no/such/dir/x.db"},
        "the directory /no/such/dir does not exist",
    ),
    "tracking-uri-bad-ipv6": (EMPTY, TRAIN, {"MLFLOW_TRACKING_URI": "http://[::1:5000"}, "Invalid IPv6 URL"),
    "tracking-uri-no-host": (EMPTY, TRAIN, {"MLFLOW_TRACKING_URI": "http:///x"}, "MLFLOW_TRACKING_URI='http:///x'"),
    "tracking-uri-unreachable": (
        EMPTY,
        TRAIN,
        {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"},
        "127.0.0.1:9 is unreachable",
    ),
    "eagle-home-is-a-file": ("file", TRAIN, {}, "a file, not a directory"),
    "eagle-home-not-writable": ("/proc/eagle-home", TRAIN, {}, "EAGLE_HOME=/proc/eagle-home: /proc is not writable"),
    "trust-remote-code-malformed": (EMPTY, TRAIN, {"EAGLE_TRUST_REMOTE_CODE": "maybe"}, "'maybe' is not a boolean"),
    "vllm-zygote-malformed": (
        EMPTY,
        TRAIN,
        {"EAGLE_VLLM_ZYGOTE": "sometimes"},
        "EAGLE_VLLM_ZYGOTE='sometimes' is not a boolean",
    ),
    # evaluate
    "evaluate-json-is-a-directory": (EMPTY, _with(EVAL, json="{dir}"), {}, "--json {dir}: a directory"),
    "evaluate-json-dir-missing": (EMPTY, _with(EVAL, json="/no/such/dir/r.json"), {}, "/no/such/dir does not exist"),
    "evaluate-head-meta-truncated": (EMPTY, _with(EVAL, head="{h_meta}"), {}, "eagle_head.json: not readable JSON"),
    "evaluate-head-config-truncated": (EMPTY, _with(EVAL, head="{h_cfg}"), {}, "config.json: not readable JSON"),
    "evaluate-head-weights-truncated": (EMPTY, _with(EVAL, head="{h_trunc}"), {}, "model.safetensors: truncated"),
    "evaluate-head-no-weights": (EMPTY, _with(EVAL, head="{h_noweights}"), {}, "model.safetensors is missing"),
    "evaluate-head-probe-truncated": (EMPTY, _with(EVAL, head="{h_probe}"), {}, "probe.safetensors: truncated"),
    "evaluate-head-is-a-file": (EMPTY, _with(EVAL, head="{traffic}"), {}, "--head {traffic}: not a directory"),
    "evaluate-target-weights-truncated": (EMPTY, _with(EVAL, target="{t_trunc}"), {}, "model.safetensors: truncated"),
    "evaluate-traffic-empty": (EMPTY, _with(EVAL, traffic="{empty_jsonl}"), {}, "empty.jsonl:0: empty file"),
    "evaluate-head-uri-malformed": (EMPTY, _with(EVAL, head="models:/h"), {}, "'models:/h' is not a model URI"),
    "evaluate-head-unknown-model": (
        REGISTRY,
        _with(EVAL, head="models:/nope@champion"),
        {},
        "no registered model 'nope'",
    ),
    "evaluate-depth-zero": (EMPTY, _with(EVAL, depth="0"), {}, "'0': must be >= 1"),
    "evaluate-unknown-method": (EMPTY, _with(EVAL, method="beam"), {}, "'beam'"),
    "evaluate-unknown-engine": (EMPTY, _with(EVAL, engine="tpu"), {}, "'tpu'"),
    # serve
    "serve-k-too-large": (EMPTY, _with(SERVE, k="1000"), {}, "'1000': at most 16 speculative tokens"),
    "serve-k-zero": (EMPTY, _with(SERVE, k="0"), {}, "'0': must be >= 1"),
    "serve-concurrency-zero": (EMPTY, _with(SERVE, concurrency="0"), {}, "'0': must be >= 1"),
    "serve-k-and-concurrency": (
        EMPTY,
        _with(SERVE, k="2", concurrency="8"),
        {},
        "serve: --k pins K, --concurrency picks it from the registered schedule: give one of them",
    ),
    "serve-port-out-of-range": (EMPTY, _with(SERVE, port="70000"), {}, "'70000': a port is 1..65535"),
    "serve-port-taken": (
        EMPTY,
        _with(SERVE, port="{taken_port}"),
        {},
        "--port {taken_port}: 127.0.0.1:{taken_port} is taken",
    ),
    "serve-print-only-truncated-head": (
        EMPTY,
        [*_with(SERVE, head="{h_trunc}"), "--print-only"],
        {},
        "model.safetensors: truncated",
    ),
    "serve-head-uri-empty-alias": (EMPTY, _with(SERVE, head="models:/t@"), {}, "the alias after @ is missing"),
    "serve-head-unknown-version": (REGISTRY, _with(SERVE, head="models:/t/9"), {}, "has no version 9"),
    "serve-head-unknown-alias": (REGISTRY, _with(SERVE, head="models:/t@champion"), {}, "has no alias 'champion'"),
    # monitor: URLs, bounds shared with the config, the target version
    "monitor-url-file": (EMPTY, _with(MON, metrics_url="file:///etc/passwd"), {}, "'file:///etc/passwd': only http"),
    "monitor-url-ftp": (EMPTY, _with(MON, metrics_url="ftp://h/metrics"), {}, "not ftp://"),
    "monitor-url-no-scheme": (EMPTY, _with(MON, metrics_url="127.0.0.1:8000/metrics"), {}, "the scheme is missing"),
    "monitor-url-bad-ipv6": (EMPTY, _with(MON, metrics_url="http://[::1/metrics"), {}, "'http://[::1/metrics': not"),
    "monitor-url-bad-port": (EMPTY, _with(MON, metrics_url="http://h:99999/metrics"), {}, "Port out of range"),
    "monitor-url-no-host": (EMPTY, _with(MON, metrics_url="http:///metrics"), {}, "'http:///metrics': no host"),
    "monitor-interval-zero": (EMPTY, _with(MON, interval="0"), {}, "'0': the interval must be > 0"),
    "monitor-interval-inf": (EMPTY, _with(MON, interval="inf"), {}, "'inf': the interval must be > 0"),
    "monitor-ratio-above-one": (EMPTY, _with(MON, ratio="1.5"), {}, "'1.5': the ratio must be in (0, 1]"),
    "monitor-config-interval-zero": (EMPTY, _with(MON, config="{c_interval0}"), {}, "monitor.interval_s must be"),
    "monitor-config-window-negative": (EMPTY, _with(MON, config="{c_window}"), {}, "monitor.window_s must be"),
    "monitor-target-not-a-version": (EMPTY, _with(MON, target="models:/t"), {}, "'models:/t' is not a model URI"),
    "monitor-target-no-registry-yet": (EMPTY, MON, {}, "models:/t/1: no registered model 't'"),
    "monitor-target-unknown-version": (REGISTRY, _with(MON, target="models:/t/9"), {}, "has no version 9"),
    "monitor-target-unknown-model": (
        REGISTRY,
        _with(MON, target="models:/nope@champion"),
        {},
        "no registered model 'nope'",
    ),
    # watch and demo
    "watch-interval-inf": (EMPTY, ["watch", "--interval", "inf"], {}, "'inf': the interval must be > 0"),
    "watch-interval-nan": (EMPTY, ["watch", "--interval", "nan"], {}, "'nan': the interval must be > 0"),
    "watch-interval-negative": (EMPTY, ["watch", "--interval", "-5"], {}, "'-5': the interval must be > 0"),
    "watch-unknown-dispatch": (EMPTY, ["watch", "--dispatch", "everywhere"], {}, "'everywhere'"),
    "watch-tracking-uri-ftp": (EMPTY, ["watch", "--once"], {"MLFLOW_TRACKING_URI": "ftp://h/x"}, "unknown scheme"),
    "demo-gpu-without-cuda": (EMPTY, ["demo", "--embedded-preset", "gpu"], {}, "--embedded-preset gpu: no CUDA"),
    "demo-unknown-preset": (EMPTY, ["demo", "--preset", "huge"], {}, "'huge'"),
    "unknown-command": (EMPTY, ["frobnicate"], {}, "'frobnicate'"),
    **FILE_ROWS,  # issue 49: files that are not what they seem, programs and folders (tests/helpers_bad_input.py)
}

# the settings in a `--config` file (tests/helpers_bad_input.py `BAD_CONFIGS`): rows `train-config-<id>`, and
# `evaluate-config-<id>` for the ids in CONFIG_ON_EVALUATE
for _id, (_, _needle) in BAD_CONFIGS.items():
    _file = "{bad_config_" + _id.replace("-", "_") + "}"
    ROWS[f"train-config-{_id}"] = (EMPTY, _with(TRAIN, config=_file), {}, _needle)
    if _id in CONFIG_ON_EVALUATE:
        ROWS[f"evaluate-config-{_id}"] = (EMPTY, _with(EVAL, config=_file), {}, _needle)

# `python -m embedded --config <f>` (the embedded build): row id -> (the file's text, needle). Each is
# refused before the build starts: exit 2, one line `embedded: error: <f>: ...`, nothing under the cache root.
EMBEDDED_ROWS: dict[str, tuple[str, str]] = {
    "embedded-traffic-unknown-kind": (
        '{"traffic": {"kind": "longer"}}',
        "traffic.kind: unknown kind 'longer'; choose one of ['chat', 'long']",
    ),
    "embedded-long-prompt-lines-zero": (
        '{"traffic": {"kind": "long", "long_prompt_lines": 0}}',
        "traffic.long_prompt_lines must be an integer >= 1, got 0",
    ),
    "embedded-long-prompt-lines-fraction": (
        '{"traffic": {"long_prompt_lines": 2.5}}',
        "EmbeddedConfig.traffic.long_prompt_lines: expected <class 'int'>",
    ),
    "embedded-long-min-new-tokens-negative": (
        '{"traffic": {"kind": "long", "long_min_new_tokens": -5}}',
        "traffic.long_min_new_tokens must be an integer >= 1, got -5",
    ),
    "embedded-long-min-new-tokens-bool": (
        '{"traffic": {"long_min_new_tokens": true}}',
        "EmbeddedConfig.traffic.long_min_new_tokens: expected <class 'int'>, got a bool",
    ),
    "embedded-long-min-new-tokens-above-context": (
        '{"traffic": {"kind": "long", "long_min_new_tokens": 4000}}',
        "traffic.long_min_new_tokens 4000 does not fit the target's context (target.max_position_embeddings 2048",
    ),
    "embedded-heldout-fraction-above-one": (
        '{"corpus": {"heldout_fraction": 1.5}}',
        "corpus.heldout_fraction must be in [0, 1]",
    ),
    "embedded-train-conversations-zero": (
        '{"traffic": {"train_conversations": 0}}',
        "traffic.train_conversations must be an integer >= 1, got 0",
    ),
    "embedded-system-prompt-fraction-above-one": (
        '{"traffic": {"system_prompt_fraction": 1.5}}',
        "traffic.system_prompt_fraction must be in [0, 1], got 1.5",
    ),
    "embedded-target-kv-heads-zero": (
        '{"target": {"num_kv_heads": 0}}',
        "target.num_kv_heads must be an integer >= 1, got 0",
    ),
    "embedded-target-heads-not-dividing": (
        '{"target": {"num_heads": 3}}',
        "target: hidden_size (256) must be a multiple of num_heads (3)",
    ),
    "embedded-seq-len-above-context": (
        '{"train": {"seq_len": 4096}}',
        "train.seq_len 4096 is longer than the target's context",
    ),
    "embedded-unknown-key": ('{"traffic": {"knd": "long"}}', "EmbeddedConfig.traffic: unknown keys ['knd']"),
    "embedded-config-not-json": ('{"traffic": ', "Expecting value"),
}


def _tree(home: Path) -> list[str]:
    if not home.exists():
        return []
    return sorted(str(p) for p in home.rglob("*")) if home.is_dir() else [f"{home}:{home.stat().st_size}"]


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.timeout(2 * ROW_LIMIT_S, method="thread", func_only=True)  # a read blocked in C, which no signal ends
def test_bad_input_is_refused_in_one_line(row, files, homes, monkeypatch, capsys):
    from flows import cli

    kind, argv, env, needle = ROWS[row]
    if row == "demo-gpu-without-cuda":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    home = homes.get(kind, Path(kind))
    for key in [k for k in os.environ if k.startswith(("MLFLOW_", "EAGLE_", "RAY_ADDRESS"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("EAGLE_HOME", str(home))
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(**files))
    monkeypatch.setattr("infra.prefect_env.apply_prefect_defaults", lambda settings: {})
    monkeypatch.setattr(cli, "_run_command", lambda a, settings, cfg: 99)  # passed the preflight: the row fails
    before = _tree(home)
    try:
        with time_limit(ROW_LIMIT_S):  # a read that blocks (a named pipe) fails the row instead of hanging the suite
            rc = cli.main([a.format(**files) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert rc == 2, f"exit {rc}: {err}"
    assert "Traceback" not in err and len(lines) == 1 and needle.format(**files) in lines[0], err
    assert err.count("\n") == 1 or err.startswith("usage:"), err  # ours: one line; argparse: usage, then one line
    assert _tree(home) == before, "the refusal wrote under the state dir"


@pytest.mark.parametrize("where", ["state-dir", "tmpdir"])
def test_a_full_disk_is_refused_before_any_work(where, files, homes, monkeypatch, capsys):
    """A state dir (here: the folder it will be made in) or TMPDIR on a disk with less than `MIN_FREE_MIB` free:
    one line, exit 2. A full disk cannot be made in a test, so `os.statvfs` reports 10 blocks free for that folder."""
    from flows import cli
    from infra.settings import MIN_FREE_MIB

    home = homes[EMPTY]
    full = home.parent if where == "state-dir" else Path(files["dir"])
    real = os.statvfs

    def statvfs(path):
        st = real(path)
        if Path(path) != full:
            return st
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 10, 10, *tuple(st)[5:]))

    for key in [k for k in os.environ if k.startswith(("MLFLOW_", "EAGLE_", "RAY_ADDRESS"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("EAGLE_HOME", str(home))
    if where == "tmpdir":
        monkeypatch.setenv("TMPDIR", str(full))
    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(cli, "_run_command", lambda a, settings, cfg: 99)
    rc = cli.main([a.format(**files) for a in TRAIN])
    err = capsys.readouterr().err
    what = f"EAGLE_HOME={home}: {full} is full" if where == "state-dir" else f"TMPDIR={full}: full"
    assert rc == 2 and err.count("\n") == 1 and what in err and f"less than the {MIN_FREE_MIB} MiB" in err, err
    assert not home.exists()


@pytest.mark.parametrize("row", list(EMBEDDED_ROWS))
def test_bad_embedded_config_is_refused_in_one_line(row, tmp_path, capsys):
    from embedded.__main__ import main

    text, needle = EMBEDDED_ROWS[row]
    (tmp_path / "cfg.json").write_text(text)
    rc = main(["--config", str(tmp_path / "cfg.json"), "--root", str(tmp_path / "root"), "--quiet"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == "", captured
    assert captured.err.startswith(f"embedded: error: {tmp_path / 'cfg.json'}: ") and needle in captured.err, captured
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured
    assert not (tmp_path / "root").exists(), "the refusal started the build"


def test_hardening_lists_every_row():
    """HARDENING.md's table of refusals (its `row` column) names exactly the rows of this module."""
    import re

    text = (Path(__file__).resolve().parents[1] / "HARDENING.md").read_text()
    section = text.split("| input | error (excerpt) | row |", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"\| `([a-z0-9-]+)` \|\s*$", section, flags=re.M)
    assert len(listed) == len(set(listed)), "a row is listed twice"
    assert set(listed) == set(ROWS) | set(EMBEDDED_ROWS)
