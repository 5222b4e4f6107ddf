"""The bad-input table's argv templates, and the files and folders that are not what they seem.

Purpose: pieces of tests/test_bad_input_table.py, kept here so that the table module stays small: `TRAIN`, `EVAL`,
`SERVE`, `MON` (argv templates over the paths of its `files` fixture) and `argv_with`; issue 49's rows (`FILE_ROWS`:
other encodings, deep or huge JSON, named pipes, devices, sockets, link loops, unreadable files, the vLLM python,
EAGLE_HOME's folders, TMPDIR; `MODEL_ROWS`: real checkpoints the pipeline does not support yet, a family it is not
proven on, no chat template, a context shorter than the settings ask for, quantized weights; `SERVE_ROWS`: serve's
rollback flags) with what makes their inputs (`odd_files`, `TARGET_DAMAGE`, `HEAD_DAMAGE`, `odd_homes`); `time_limit`,
which fails a row whose read blocks
instead of hanging the suite.
Run: imported by tests/test_bad_input_table.py; nothing runs at import.
Not here: the table's other rows and its test functions (tests/test_bad_input_table.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
from pathlib import Path

EMPTY, REGISTRY = "empty", "registry"
ROW_LIMIT_S = 30  # each row's refusal takes well under a second; a loaded 2-core machine gets slack
TRAIN = ["train", "--target", "{target}", "--traffic", "{traffic}", "--heldout", "{heldout}", "--preset", "tiny"]
EVAL = ["evaluate", "--head", "{head}", "--target", "{target}", "--traffic", "{heldout}", "--preset", "tiny"]
SERVE = ["serve", "--head", "{head}", "--target", "{target}"]
MON = ["monitor", "--metrics-url", "http://127.0.0.1:9/metrics", "--target", "models:/t/1", "--preset", "tiny"]


def argv_with(base: list[str], **opts: str) -> list[str]:
    """`base` with `--key value` replaced or added for each of `opts` (underscores become dashes)."""
    out = list(base)
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


_with = argv_with  # short, for the rows

# settings in a `--config` file, as the table's BAD_CONFIGS (row `train-config-<id>`): id -> (sections, needle)
CONFIG_ROWS: dict[str, tuple[dict, str]] = {
    "train-bucket-not-bool": ({"train": {"bucket_by_length": "yes"}},
                              "train.bucket_by_length: 'yes' is not of type bool"),
    "train-teacher-cache-negative": ({"train": {"teacher_cache_mib": -1}}, "train.teacher_cache_mib must be"),
    "capture-mix-one": ({"capture": {"mix": 1}}, "capture.mix must be a number in (0, 1)"),
    "capture-heldout-zero": ({"capture": {"heldout": 0}}, "capture.heldout must be an integer >= 1, got 0"),
    "capture-trigger-not-int": ({"capture": {"trigger_new": 2.5}}, "capture.trigger_new: 2.5 is not of type int"),
    "capture-unknown-key": ({"capture": {"ratio": 0.5}}, "unknown key capture.ratio"),
}

# serve's rollback flags (components/serving/monitor.py `RollbackConfig`, flows/commands.py), as the table's ROWS
SERVE_ROWS: dict[str, tuple[str, list[str], dict[str, str], str]] = {
    "serve-rollback-window-zero": (EMPTY, _with(SERVE, rollback_window="0"), {},
                                   "argument --rollback-window: '0': the interval must be > 0 seconds"),
    "serve-rollback-floor-below-one": (EMPTY, _with(SERVE, rollback_floor="0.5"), {},
                                       "monitor.rollback.floor_tau must be a finite number >= 1"),
}

# real checkpoints the pipeline does not support yet (components/targets/target.py `check_target`,
# flows/preflight_context.py `check_context`): id -> (state dir, argv, environment, needle), as the table's ROWS
MODEL_ROWS: dict[str, tuple[str, list[str], dict[str, str], str]] = {
    "train-target-family-unproven": (EMPTY, _with(TRAIN, target="{t_phi3}"), {}, "config.json: model_type 'phi3' "
                                     "(architectures ['Phi3ForCausalLM']) is not a family this pipeline is proven on "
                                     "(llama, mistral, qwen2, qwen3, qwen3_moe"),
    "train-target-no-chat-template": (EMPTY, _with(TRAIN, target="{t_nochat}"), {}, "{t_nochat}: the tokenizer has "
                                      "no chat template; add one"),
    "train-target-context-below-extract-max-len": (EMPTY, _with(TRAIN, target="{t_short}"), {}, "{t_short}/config."
                                                   "json: max_position_embeddings 128 is shorter than extract.max_len "
                                                   "192"),
    "train-evaluate-new-tokens-fill-context": (EMPTY, [*TRAIN, "--set", "evaluate.spec.max_new_tokens=512"], {},
                                               "max_position_embeddings 512 leaves no room for a prompt beside "
                                               "evaluate.spec.max_new_tokens 512"),
    "evaluate-heldout-prompt-beyond-context": (EMPTY, _with(EVAL, target="{t_short}", traffic="{heldlong_jsonl}"), {},
                                               "heldlong.jsonl: 1 of the 1 held-out prompts the evaluation takes"),
    "train-target-dtype-float8": (EMPTY, _with(TRAIN, target="{t_fp8}"), {}, "config.json: dtype 'float8_e4m3fn' is "
                                  "not one the engine runs a target in (float32, bfloat16, float16"),
    "train-target-weights-int32": (EMPTY, _with(TRAIN, target="{t_int32}"), {}, "model.safetensors: tensor "
                                   "model.layers.0.mlp.down_proj.weight is stored as I32"),
}

# id -> (state dir, argv, environment, needle), as the table's ROWS
FILE_ROWS: dict[str, tuple[str, list[str], dict[str, str], str]] = {
    # files that are not what they seem (components/data/safe_read.py): encodings, structure, kinds of file, permissions
    "train-config-utf16": (EMPTY, _with(TRAIN, config="{c_utf16}"), {}, "c_utf16.json: cannot read the config: not "
                           "UTF-8 text: it starts with a UTF-16 (little-endian) byte-order mark; re-save it as UTF-8"),
    "train-config-latin1": (EMPTY, _with(TRAIN, config="{c_latin1}"), {}, "c_latin1.json: cannot read the config: "
                            "not UTF-8 text: byte 0xe9 at offset"),
    "train-config-utf8-bom-is-read": (EMPTY, _with(TRAIN, config="{c_bom}"), {}, "c_bom.json: train.ttt.ttt_steps "
                                      "must be"),  # the mark is skipped: the value behind it is what is refused
    "train-config-nested-too-deep": (EMPTY, _with(TRAIN, config="{c_deep}"), {}, "c_deep.json: cannot read the "
                                     "config: JSON nested deeper than 64 levels"),
    "train-config-a-million-keys": (EMPTY, _with(TRAIN, config="{c_keys}"), {}, "c_keys.json: unknown section 'k0'"),
    "train-config-unreadable": (EMPTY, _with(TRAIN, config="{c_unreadable}"), {}, "c_unreadable.json: cannot read "
                                "the config: cannot be read ("),
    "train-config-is-a-fifo": (EMPTY, _with(TRAIN, config="{c_fifo}"), {}, "--config {c_fifo}: not a file"),
    "train-set-value-nested-too-deep": (EMPTY, [*TRAIN, "--set", "train.steps=" + "[" * 5000 + "]" * 5000], {},
                                        "train.steps: JSON nested deeper than 64 levels"),
    "train-traffic-is-a-fifo": (EMPTY, _with(TRAIN, traffic="{fifo_jsonl}"), {}, "fifo.jsonl: a named pipe (FIFO), "
                                "not a regular file: reading it would wait for a writer"),
    "train-heldout-is-a-fifo": (EMPTY, _with(TRAIN, heldout="{fifo_parquet}"), {}, "fifo.parquet: a named pipe "
                                "(FIFO), not a regular file"),
    "train-traffic-is-a-device": (EMPTY, _with(TRAIN, traffic="{zero_jsonl}"), {}, "zero.jsonl: a device, not a "
                                  "regular file"),
    "train-traffic-is-a-socket": (EMPTY, _with(TRAIN, traffic="{sock_jsonl}"), {}, "sock.jsonl: a socket, not a "
                                  "regular file"),
    "train-traffic-unreadable": (EMPTY, _with(TRAIN, traffic="{unreadable_jsonl}"), {}, "unreadable.jsonl: cannot "
                                 "be read ("),
    "train-traffic-utf16": (EMPTY, _with(TRAIN, traffic="{u16_jsonl}"), {}, "u16.jsonl:0: not UTF-8 text: it starts "
                            "with a UTF-16 (little-endian) byte-order mark; re-save it as UTF-8"),
    "train-traffic-utf16-no-bom": (EMPTY, _with(TRAIN, traffic="{u16nobom_jsonl}"), {}, "u16nobom.jsonl:0: not "
                                   "UTF-8 text: it holds NUL bytes"),
    "train-traffic-nested-too-deep": (EMPTY, _with(TRAIN, traffic="{deep_jsonl}"), {}, "deep.jsonl:1: JSON nested "
                                      "deeper than 64 levels"),
    "train-traffic-line-too-long": (EMPTY, _with(TRAIN, traffic="{huge_jsonl}"), {}, "huge.jsonl:1: line too long: "
                                    "over 64 MiB"),
    "train-traffic-dataset-state-utf16": (EMPTY, _with(TRAIN, traffic="{ds_u16}"), {}, "state.json: not UTF-8 text: "
                                          "it starts with a UTF-16"),
    "train-traffic-dataset-data-file-fifo": (EMPTY, _with(TRAIN, traffic="{ds_fifo}"), {}, "data-00000-of-00001.arrow "
                                             "listed in {ds_fifo}/state.json: a named pipe (FIFO)"),
    "evaluate-traffic-is-a-fifo": (EMPTY, _with(EVAL, traffic="{fifo_jsonl}"), {}, "fifo.jsonl: a named pipe"),
    "train-traffic-link-loop": (EMPTY, _with(TRAIN, traffic="{loop_jsonl}"), {}, "loop.jsonl: a symbolic link loop "
                                "or a link to nothing; point the link at the file itself"),
    "train-target-config-utf16": (EMPTY, _with(TRAIN, target="{t_u16}"), {}, "config.json: not UTF-8 text: it "
                                  "starts with a UTF-16 (little-endian) byte-order mark"),
    "train-target-config-utf8-bom": (EMPTY, _with(TRAIN, target="{t_bom}"), {}, "config.json: starts with a UTF-8 "
                                     "byte-order mark, which transformers, vLLM and the head loader refuse"),
    "train-target-config-nested-too-deep": (EMPTY, _with(TRAIN, target="{t_deep}"), {}, "config.json: JSON nested "
                                            "deeper than 64 levels"),
    "train-target-tokenizer-latin1": (EMPTY, _with(TRAIN, target="{t_toklatin1}"), {}, "tokenizer.json: not UTF-8 "
                                      "text: byte 0xe9"),
    "train-target-tokenizer-config-fifo": (EMPTY, _with(TRAIN, target="{t_fifo}"), {}, "tokenizer_config.json: a "
                                           "named pipe (FIFO)"),
    "evaluate-head-config-utf16": (EMPTY, _with(EVAL, head="{h_u16}"), {}, "config.json: not UTF-8 text: it starts "
                                   "with a UTF-16"),
    "evaluate-head-meta-nested-too-deep": (EMPTY, _with(EVAL, head="{h_deep}"), {}, "eagle_head.json: JSON nested "
                                           "deeper than 64 levels"),
    "evaluate-head-weights-fifo": (EMPTY, _with(EVAL, head="{h_fifo}"), {}, "model.safetensors: a named pipe (FIFO)"),
    "evaluate-head-config-link-loop": (EMPTY, _with(EVAL, head="{h_loop}"), {}, "config.json: a symbolic link loop"),
    "serve-head-meta-utf8-bom": (EMPTY, [*_with(SERVE, head="{h_bom}"), "--print-only"], {}, "eagle_head.json: starts "
                                 "with a UTF-8 byte-order mark"),
    # programs and directories the project runs or writes (infra/settings.py `Settings.check`)
    "vllm-python-missing": (EMPTY, TRAIN, {"EAGLE_VLLM_PYTHON": "/no/such/python"}, "EAGLE_VLLM_PYTHON=/no/such/python:"
                            " no such file"),
    "vllm-python-not-executable": (EMPTY, TRAIN, {"EAGLE_VLLM_PYTHON": "{noexec}"}, "EAGLE_VLLM_PYTHON={noexec}: not "
                                   "executable, mode 644"),
    "vllm-python-is-a-directory": (EMPTY, TRAIN, {"EAGLE_VLLM_PYTHON": "{dir}"}, "a directory, not a program"),
    "eagle-home-parent-is-a-file": ("parent-file", TRAIN, {}, "/a-file is a file, not a directory"),
    "eagle-home-folder-is-a-file": ("folder-file", TRAIN, {}, "its folder runs/ is a file, not a directory"),
    "eagle-home-folder-not-writable": ("folder-ro", TRAIN, {}, "its folder mlartifacts/ is not writable"),
    "tmpdir-missing": (EMPTY, TRAIN, {"TMPDIR": "/no/such/tmp"}, "TMPDIR=/no/such/tmp: no such directory"),
    "tmpdir-is-a-file": (EMPTY, TRAIN, {"TMPDIR": "{traffic}"}, "TMPDIR={traffic}: a file, not a directory"),
    "tmpdir-not-writable": (EMPTY, TRAIN, {"TMPDIR": "/proc"}, "TMPDIR=/proc: not writable"),
    **MODEL_ROWS,
    **SERVE_ROWS,
}


def _resave(path: Path, encoding: str) -> None:
    path.write_bytes(path.read_text(encoding="utf-8").encode(encoding))


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _unreadable(path: Path) -> None:
    """A file whose first read fails: mode 000, or for root (whom 000 does not stop) a link to /proc/self/mem, which
    stat calls a regular file and whose read at offset 0 fails with EIO."""
    path.unlink(missing_ok=True)
    if os.geteuid() == 0:
        path.symlink_to("/proc/self/mem")
    else:
        path.write_text("{}")
        path.chmod(0)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _key(name: str) -> str:
    """The `files` key of a file: c_deep.json -> c_deep, u16.jsonl -> u16_jsonl."""
    return name.removesuffix(".json").replace(".", "_")


def odd_files(root: Path) -> dict[str, str]:
    """Files that are not what they seem: other encodings, deep or huge JSON, pipes, devices, sockets, unreadable."""
    p: dict[str, str] = {}
    texts = {"c_utf16.json": ('{"train": {"steps": 3}}', "utf-16"),
             "c_latin1.json": ('{"register": {"experiment_suffix": "-caf\u00e9"}}', "latin-1"),
             "c_bom.json": ('\ufeff{"train": {"ttt": {"ttt_steps": 0}}}', "utf-8"),
             "c_deep.json": ('{"train": ' + _deep(10000) + "}", "utf-8"),  # past Python's own recursion limit
             "c_keys.json": (json.dumps({f"k{i}": 0 for i in range(1_000_000)}), "utf-8"),
             "u16.jsonl": (json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n", "utf-16"),
             "u16nobom.jsonl": (json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n", "utf-16-le"),
             "deep.jsonl": (json.dumps({"messages": "@"}).replace('"@"', _deep(100)) + "\n", "utf-8"),
             "noexec": ("#!/bin/sh\n", "utf-8"),  # a held-out first turn of ~200 tokens: within 384, past 128
             "heldlong.jsonl": (json.dumps({"id": "long-prompt", "messages": [{"role": "user", "content": "x = 1\n"
                                                                               * 40}]}) + "\n", "utf-8")}
    for name, (text, encoding) in texts.items():
        (root / name).write_bytes(text.encode(encoding))
        p[_key(name)] = str(root / name)
    (root / "noexec").chmod(0o644)
    with open(root / "huge.jsonl", "wb") as f:  # one line of over 64 MiB, mostly a hole: no disk is used
        f.write(b'{"messages": "')
        f.truncate((64 << 20) + 1024)
    for name in ("c_unreadable.json", "unreadable.jsonl"):
        _unreadable(root / name)
    for name in ("c_fifo.json", "fifo.jsonl", "fifo.parquet"):
        _fifo(root / name)
    (root / "zero.jsonl").symlink_to("/dev/zero")
    (root / "loop.jsonl").symlink_to(root / "loop.jsonl")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(root / "sock.jsonl"))
    data = "data-00000-of-00001.arrow"  # a saved dataset's state.json and the one data file it lists
    for name, damage in {"ds_u16": lambda d: _resave(d / "state.json", "utf-16"),
                         "ds_fifo": lambda d: _fifo(d / data)}.items():
        (root / name).mkdir()
        (root / name / "state.json").write_text(json.dumps({"_data_files": [{"filename": data}]}))
        damage(root / name)
        p[name] = str(root / name)
    for name in ("c_unreadable.json", "c_fifo.json", "fifo.jsonl", "fifo.parquet", "zero.jsonl", "sock.jsonl",
                 "unreadable.jsonl", "huge.jsonl", "loop.jsonl"):
        p[_key(name)] = str(root / name)
    return p


def _head_link_loop(d: Path) -> None:
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(d / "config.json")


def _edit_config(d: Path, **values) -> None:
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **values}))


def _int32_tensor(d: Path, name: str = "model.layers.0.mlp.down_proj.weight") -> None:
    """One F32 tensor of the weights relabelled I32 in the header (4 bytes each: the offsets stay valid), as a
    GPTQ or AWQ checkpoint packs its weights."""
    f = d / "model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header[name]["dtype"] = "I32"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


TARGET_DAMAGE = {"t_phi3": lambda d: _edit_config(d, model_type="phi3", architectures=["Phi3ForCausalLM"]),
                 "t_nochat": lambda d: (d / "chat_template.jinja").unlink(),
                 "t_short": lambda d: _edit_config(d, max_position_embeddings=128),
                 "t_fp8": lambda d: _edit_config(d, dtype="float8_e4m3fn"),
                 "t_int32": _int32_tensor,
                 "t_u16": lambda d: _resave(d / "config.json", "utf-16"),
                 "t_bom": lambda d: _resave(d / "config.json", "utf-8-sig"),
                 "t_deep": lambda d: (d / "config.json").write_text(_deep(100)),
                 "t_toklatin1": lambda d: (d / "tokenizer.json").write_bytes(b'{"x": "caf\xe9"}'),
                 "t_fifo": lambda d: _fifo(d / "tokenizer_config.json")}
HEAD_DAMAGE = {"h_u16": lambda d: _resave(d / "config.json", "utf-16"),
               "h_bom": lambda d: _resave(d / "eagle_head.json", "utf-8-sig"),
               "h_deep": lambda d: (d / "eagle_head.json").write_text(_deep(100)),
               "h_fifo": lambda d: _fifo(d / "model.safetensors"),
               "h_loop": _head_link_loop}


def odd_homes(root: Path) -> dict[str, Path]:
    """State dirs `parent-file` (in a folder that is a file), `folder-file` (its `runs` a file), `folder-ro` (its
    `mlartifacts` a link to /proc, which no one can write, root included)."""
    (root / "a-file").write_text("not a directory\n")
    for kind in ("folder-file", "folder-ro"):
        (root / kind).mkdir()
    (root / "folder-file" / "runs").write_text("not a directory\n")
    (root / "folder-ro" / "mlartifacts").symlink_to("/proc")
    return {"parent-file": root / "a-file" / "home", **{kind: root / kind for kind in ("folder-file", "folder-ro")}}


class RowTimedOut(BaseException):
    """Not an Exception: the CLI's catch-all must not turn it into an exit code."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise `RowTimedOut` in this (the main) thread after `seconds`. The signal is sent to this thread itself: one
    sent to the process may land in another of its threads and leave a blocked open() of a named pipe blocked."""
    def expire(signum, frame):
        raise RowTimedOut(f"no answer in {seconds} s: the refusal must come within seconds, before any read blocks")

    previous = signal.signal(signal.SIGALRM, expire)
    timer = threading.Timer(seconds, signal.pthread_kill, (threading.get_ident(), signal.SIGALRM))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGALRM, previous)
