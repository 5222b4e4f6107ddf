"""The inputs the bad-input table's rows name, made: damaged copies of good inputs, files and folders that are not what
they seem, the state dirs.

Purpose: the `files` fixture (module scope: the paths the rows' argv templates name: the tiny embedded default's
target and traffic, damaged copies of the target (`TARGET_DAMAGE` and truncated, garbage or sharded weights, a broken
config, no lm_head) and of a fake head (`HEAD_DAMAGE`), GGUF files that are not what they claim, one `--config` file
per bad config (`BAD_CONFIGS`), other encodings, deep or huge JSON, named pipes, devices, sockets, link loops and
unreadable files (`odd_files`), a taken port) and the `homes` fixture (the state dirs by kind: `empty`, `registry`
with target `t` v1 registered, `file`, and `odd_homes`'s folders that are files or cannot be written).
Run: imported by tests/test_bad_input_table.py (the fixtures by name); nothing runs at import.
Not here: the rows (tests/test_bad_input_table.py, tests/helpers_bad_input.py) and their test functions.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from tests.helpers import fake_head, target_copy
from tests.helpers_bad_input import BAD_CONFIGS, EMPTY, REGISTRY


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
    texts = {
        "c_utf16.json": ('{"train": {"steps": 3}}', "utf-16"),
        "c_latin1.json": ('{"register": {"experiment_suffix": "-caf\u00e9"}}', "latin-1"),
        "c_bom.json": ('\ufeff{"train": {"ttt": {"ttt_steps": 0}}}', "utf-8"),
        "c_deep.json": ('{"train": ' + _deep(10000) + "}", "utf-8"),  # past Python's own recursion limit
        "c_keys.json": (json.dumps({f"k{i}": 0 for i in range(1_000_000)}), "utf-8"),
        "u16.jsonl": (json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n", "utf-16"),
        "u16nobom.jsonl": (json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n", "utf-16-le"),
        "deep.jsonl": (json.dumps({"messages": "@"}).replace('"@"', _deep(100)) + "\n", "utf-8"),
        "noexec": ("#!/bin/sh\n", "utf-8"),  # a held-out first turn of ~200 tokens: within 384, past 128
        "heldlong.jsonl": (
            json.dumps({"id": "long-prompt", "messages": [{"role": "user", "content": "x = 1\n" * 40}]}) + "\n",
            "utf-8",
        ),
    }
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
    for name, damage in {
        "ds_u16": lambda d: _resave(d / "state.json", "utf-16"),
        "ds_fifo": lambda d: _fifo(d / data),
    }.items():
        (root / name).mkdir()
        (root / name / "state.json").write_text(json.dumps({"_data_files": [{"filename": data}]}))
        damage(root / name)
        p[name] = str(root / name)
    for name in (
        "c_unreadable.json",
        "c_fifo.json",
        "fifo.jsonl",
        "fifo.parquet",
        "zero.jsonl",
        "sock.jsonl",
        "unreadable.jsonl",
        "huge.jsonl",
        "loop.jsonl",
    ):
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
    header = json.loads(raw[8 : 8 + n])
    header[name]["dtype"] = "I32"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


TARGET_DAMAGE = {
    "t_phi3": lambda d: _edit_config(d, model_type="phi3", architectures=["Phi3ForCausalLM"]),
    "t_nochat": lambda d: (d / "chat_template.jinja").unlink(),
    "t_short": lambda d: _edit_config(d, max_position_embeddings=128),
    "t_fp8": lambda d: _edit_config(d, dtype="float8_e4m3fn"),
    "t_int32": _int32_tensor,
    "t_u16": lambda d: _resave(d / "config.json", "utf-16"),
    "t_bom": lambda d: _resave(d / "config.json", "utf-8-sig"),
    "t_deep": lambda d: (d / "config.json").write_text(_deep(100)),
    "t_toklatin1": lambda d: (d / "tokenizer.json").write_bytes(b'{"x": "caf\xe9"}'),
    "t_fifo": lambda d: _fifo(d / "tokenizer_config.json"),
}
HEAD_DAMAGE = {
    "h_u16": lambda d: _resave(d / "config.json", "utf-16"),
    "h_bom": lambda d: _resave(d / "eagle_head.json", "utf-8-sig"),
    "h_deep": lambda d: (d / "eagle_head.json").write_text(_deep(100)),
    "h_fifo": lambda d: _fifo(d / "model.safetensors"),
    "h_loop": _head_link_loop,
}


def odd_homes(root: Path) -> dict[str, Path]:
    """State dirs `parent-file` (in a folder that is a file), `folder-file` (its `runs` a file), `folder-ro` (its
    `mlartifacts` a link to /proc, which no one can write, root included)."""
    (root / "a-file").write_text("not a directory\n")
    for kind in ("folder-file", "folder-ro"):
        (root / kind).mkdir()
    (root / "folder-file" / "runs").write_text("not a directory\n")
    (root / "folder-ro" / "mlartifacts").symlink_to("/proc")
    return {"parent-file": root / "a-file" / "home", **{kind: root / kind for kind in ("folder-file", "folder-ro")}}


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 16])


def _drop_lm_head(d: Path) -> None:
    """The tiny target (untied) without its output layer."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def _lose_a_shard(d: Path) -> None:
    """The tiny target saved in two shards with an index, the second shard then lost."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(d / f), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}})
    )
    (d / "model-00002-of-00002.safetensors").unlink()


def _gguf_files(root: Path) -> dict[str, str]:
    """A tiny GGUF cut to half its length, a text file named .gguf, one of an architecture transformers lacks."""
    from tests.helpers_gguf import tiny_llama, tiny_tokenizer, write_tiny_gguf

    tokenizer = tiny_tokenizer()
    model = tiny_llama(tokenizer)
    whole = write_tiny_gguf(model, tokenizer, root / "whole.gguf").read_bytes()
    (root / "trunc.gguf").write_bytes(whole[: len(whole) // 2])
    (root / "text.gguf").write_text("not a model\n")
    write_tiny_gguf(model, tokenizer, root / "arch.gguf", architecture="mamba2")
    return {"g_trunc": str(root / "trunc.gguf"), "g_text": str(root / "text.gguf"), "g_arch": str(root / "arch.gguf")}


@pytest.fixture(scope="module")
def files(tiny_embedded, tmp_path_factory):
    """The paths the rows' argv templates name: good inputs, damaged copies, config files, a taken port."""
    root = tmp_path_factory.mktemp("bad-table")
    p = {
        "target": str(tiny_embedded.target_dir),
        "traffic": str(tiny_embedded.target_traffic.train),
        "heldout": str(tiny_embedded.target_traffic.heldout),
        "dir": str(root),
    }
    for name, damage in {
        "t_trunc": lambda d: _truncate(d / "model.safetensors"),
        "t_garbage": lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64),
        "t_badcfg": lambda d: (d / "config.json").write_text('{"architectures": ['),
        "t_nohead": _drop_lm_head,
        "t_shard": _lose_a_shard,
        **TARGET_DAMAGE,
        "t_colon": None,
    }.items():
        d = target_copy(tiny_embedded, root / name)
        if damage:
            damage(d)
        p[name] = str(d if name != "t_colon" else d.rename(d.parent / "x:y"))
    p.update(_gguf_files(root))
    p["head"] = fake_head(root, "head")
    for name, damage in {
        "h_meta": lambda d: (d / "eagle_head.json").write_text('{"format_version": '),
        "h_cfg": lambda d: (d / "config.json").write_text('{"architectures": '),
        "h_trunc": lambda d: _truncate(d / "model.safetensors"),
        "h_noweights": lambda d: (d / "model.safetensors").unlink(),
        "h_probe": lambda d: _truncate(d / "probe" / "probe.safetensors"),
        **HEAD_DAMAGE,
    }.items():
        p[name] = fake_head(root, name, damage)
    p.update(odd_files(root))
    for name, cfg in {
        "c_list": [],
        "c_suffix": {"register": {"experiment_suffix": "/eagle3"}},
        "c_interval0": {"monitor": {"interval_s": 0}},
        "c_window": {"monitor": {"window_s": -1}},
        "c_ftp": {"regenerate": {"endpoint_url": "ftp://h:21/"}},
        "c_noscheme": {"regenerate": {"endpoint_url": "127.0.0.1:8000"}},
        "c_ttt0": {"train": {"ttt": {"ttt_steps": 0}}},
    }.items():
        (root / f"{name}.json").write_text(json.dumps(cfg))
        p[name] = str(root / f"{name}.json")
    for rid, (cfg, _) in BAD_CONFIGS.items():  # json writes inf and nan as Infinity and NaN, which the loader reads
        name = "bad_config_" + rid.replace("-", "_")
        (root / f"{name}.json").write_text(json.dumps(cfg))
        p[name] = str(root / f"{name}.json")
    (root / "empty.jsonl").touch()
    (root / "bad.jsonl").write_text('{"messages": [\n')
    (root / "long.jsonl").write_text(
        "\n"
        + "".join(
            json.dumps({"id": f"long-{i}", "messages": [{"role": "user", "content": "x = 1\n" * 400}]}) + "\n"
            for i in range(2)
        )
    )  # line 1 is blank
    p.update(
        empty_jsonl=str(root / "empty.jsonl"), bad_jsonl=str(root / "bad.jsonl"), long_jsonl=str(root / "long.jsonl")
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        p["taken_port"] = str(taken.getsockname()[1])
        yield p


@pytest.fixture(scope="module")
def homes(tiny_embedded, tmp_path_factory):
    """State dirs by kind: `empty` (not created), `registry` (target `t` v1 registered), `file` (a file), and
    `odd_homes`'s (above)."""
    from components.registry.register import register_target
    from infra.mlflow_store import MlflowStore
    from infra.settings import Settings

    root = tmp_path_factory.mktemp("homes")
    registry = root / "registry"
    register_target(
        MlflowStore.connect(Settings.local(registry)),
        "t",
        str(tiny_embedded.target_dir),
        role="base",
        base_model="",
        weights_sha256="a" * 64,
    )
    (root / "file").write_text("not a directory\n")
    return {EMPTY: root / "empty", REGISTRY: registry, "file": root / "file", **odd_homes(root)}
