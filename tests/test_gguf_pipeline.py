"""A GGUF target through the whole pipeline: `eagle-heads train --target model.gguf`, then `--target models:/...`.

Purpose: a tiny tied Llama written as a GGUF file (tests/helpers_gguf.py, F32 tensors, ChatML template; its branches
and final norm scaled up so that it says something other than its last token) is trained on through the CLI with the
`tiny` preset and the evaluation in vLLM (its CPU build): the file is converted once under the state dir, the
target is registered with the GGUF's lineage (`gguf_file`, `gguf_sha256`, `gguf_quantization`), the head registers,
and vLLM serves it with output identical to plain decoding and to ours, its counters equal to ours. A second `train`
on the registered version (`models:/<name>/1`) finds the same target and run (nothing converted or registered
again). The converted directory's checks (logits, cache, refusals) are tests/test_gguf_target.py's.
Run: `python -m pytest tests/test_gguf_pipeline.py` (about a minute on 2 cores; two vLLM starts). Needs vLLM's venv.
Not here: quantized tensors (the real Q4_1 file: tests/test_gguf_target.py's slow test), the family tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.settings import Settings
from infra.vllm_server import vllm_python
from tests.helpers import our_counts, state_dir_env
from tests.helpers_gguf import tiny_llama, tiny_tokenizer, write_tiny_gguf

pytestmark = [pytest.mark.slow, pytest.mark.engine]

PROMPTS = [
    "the quick brown fox",
    "hello world, how are you today?",
    "speculative decoding drafts tokens",
    "user assistant system: 12345",
    "jumps over the lazy dog",
    "the target verifies them",
    "how are you",
    "brown dog, quick fox",
    "12345 67890 hello",
    "drafts that the target verifies",
]


def _traffic(path: Path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts))
    return str(path)


@pytest.fixture(scope="module")
def gguf_run(prefect_harness, tmp_path_factory):
    import torch

    from flows import cli

    root = tmp_path_factory.mktemp("gguf-pipeline")
    state = root / ".eagle"
    vllm_python(Settings.local(state))  # a missing vLLM venv fails here with the line that says how to make it
    tokenizer = tiny_tokenizer()
    model = tiny_llama(tokenizer, tied=True)
    with torch.no_grad():  # a random tied model repeats its last token: strong branches move it on
        for name, p in model.named_parameters():
            if "mlp" in name or "v_proj" in name or "o_proj" in name:
                p.mul_(5.0)
        model.model.norm.weight.mul_(10.0)
    gguf = write_tiny_gguf(model, tokenizer, root / "tiny-chat.F32.gguf", name="tiny-chat")
    train = _traffic(root / "train.jsonl", [f"{p} {i}" for i in range(3) for p in PROMPTS])
    heldout = _traffic(root / "heldout.jsonl", [f"{p}!" for p in PROMPTS[:4]])
    cfg = root / "pipeline.json"
    cfg.write_text(
        json.dumps(
            {
                "regenerate": {"temperature": 0.0, "max_new_tokens": 24},
                "extract": {"max_len": 96},
                "train": {"steps": 60},
                "evaluate": {"engine": "vllm", "limit": 4, "spec": {"depth": 3, "max_new_tokens": 24}},
            }
        )
    )
    args = ["--traffic", train, "--heldout", heldout, "--preset", "tiny", "--config", str(cfg)]
    with state_dir_env(state):
        first = cli.main(["train", "--target", str(gguf), *args])
        converted = sorted(p.name for p in (state / "gguf").iterdir() if not p.name.startswith("."))
        again = cli.main(["train", "--target", "models:/tiny-chat.F32/1", *args])
    yield Settings.local(state), gguf, first, again, converted


def test_a_gguf_target_trains_registers_with_lineage_and_serves_identically(gguf_run):
    from components.data.atomic import file_sha256
    from infra.mlflow_store import MlflowStore

    settings, gguf, first, again, converted = gguf_run
    assert first == 0 and again == 0
    store = MlflowStore.connect(settings)
    assert [v.version for v in store.list_versions("tiny-chat.F32")] == [1]  # the GGUF's name, registered once
    tags = store.get_version("tiny-chat.F32", 1).tags
    sha = file_sha256(gguf)
    assert (tags["gguf_file"], tags["gguf_sha256"], tags["gguf_quantization"]) == (gguf.name, sha, "F32")
    assert converted == [sha[:16]]  # converted once, cached by the file's hash
    heads = store.list_versions("tiny-chat.F32-v1-eagle3")
    assert [v.version for v in heads] == [1]  # the registered version's run is the same run: not trained twice
    runs = sorted((settings.state_dir / "runs" / "tiny-chat.F32-v1").iterdir())
    report = json.loads((runs[0] / "evaluate" / "vllm" / "engine_evaluation.json").read_text())["result"]
    assert report["identical_to_plain"] is True and report["identical_to_ours"] is True
    steps, per_pos = our_counts(runs[0] / "evaluate" / "evaluation.json", 3)
    assert (report["drafts"], report["accepted_per_pos"]) == (steps, per_pos) and sum(per_pos) > 0
