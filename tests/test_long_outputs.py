"""Per-sample length limits and `ignore_eos`: what measuring acceptance at long output positions needs.

Purpose: the traffic's per-sample `max_new_tokens` is honoured by regeneration (local batches grouped by limit, the
endpoint path per request) and by the evaluation (each prompt decoded to its own limit); with
`evaluate.ignore_eos` every prompt runs to that limit past the end-of-sequence token, plain and speculative alike,
so outputs still compare token for token; the setting is checked at config load. On the tiny embedded default
(built once per session) with a random head: identity does not need a good head, and lengths are exact.
Run: `python -m pytest tests/test_long_outputs.py` (about 30 s). The engine side (vLLM's `ignore_eos` and limits
per request) runs in bench/long_variants.py's quick row of tests/test_bench_quick.py.
Not here: the long traffic itself (tests/test_long_traffic.py), acceptance by output position (test_emitted_stats).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from components.config.pipeline import ConfigError, PipelineConfig
from components.data.regenerated import read_regenerated
from components.data.traffic_io import Conversation, Message, write_openai_jsonl
from components.evaluate.stage import EvaluateConfig, HeadEval, evaluate, held_out_samples
from components.regenerate.endpoint import answer_concurrently
from components.regenerate.stage import RegenerateConfig, hf_answerer, regenerate
from components.targets.target import load_target
from eagle.config import DraftConfig
from eagle.draft import Eagle3Draft
from eagle.export import export_head
from eagle.run_config import SpecConfig
from eagle.speculative import generate_plain, generate_speculative

QUIET = dict(progress=lambda s: None)
LIMITS = (7, None, 19, 3)  # per sample; None: the global limit
GLOBAL = 11


def _traffic(path: Path, limits=LIMITS) -> Path:
    convs = [
        Conversation(
            id=f"c{i}",
            segment="long-module",
            max_new_tokens=n,
            messages=(Message("user", f"Continue this module:\n\nimport os{i}\n"), Message("assistant", "x = 1\n")),
        )
        for i, n in enumerate(limits)
    ]
    write_openai_jsonl(path, convs)
    return path


class _Biased(torch.nn.Module):
    """The target's lm_head plus `bias` on one token (the end-of-sequence id below)."""

    def __init__(self, lm_head, token: int, bias: float):
        super().__init__()
        self.inner, self.token, self.bias = lm_head, token, bias

    @property
    def weight(self) -> torch.Tensor:  # the vocabulary size, for the speculative decoder
        return self.inner.weight

    def forward(self, x):
        out = self.inner(x)
        out[..., self.token] += self.bias
        return out


@pytest.fixture(scope="module")
def random_head(tiny_embedded, tmp_path_factory) -> str:
    target, _ = load_target(tiny_embedded.target_dir)
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.from_target(target.config, draft_vocab_size=64))
    return str(export_head(draft, tmp_path_factory.mktemp("head") / "head"))


def _eos(target) -> int:
    eos = target.generation_config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


def test_ignore_eos_goes_past_eos_and_speculative_equals_plain(tiny_embedded, random_head):
    """A target that says EOS often: plain stops at the first one; with no EOS (ignore_eos) both decoders run to
    the limit, EOS tokens inside the output, and the speculative output equals the plain one."""
    from eagle.export import load_head

    target, tok = load_target(tiny_embedded.target_dir)
    eos = _eos(target)
    target.set_output_embeddings(_Biased(target.get_output_embeddings(), eos, 4.0))
    draft = load_head(random_head, target).eval()
    ids = torch.tensor([tok("def f(x):\n", add_special_tokens=False)["input_ids"]])
    stop = SpecConfig(depth=3, max_new_tokens=40, eos_token_id=eos)
    go_on = SpecConfig(depth=3, max_new_tokens=40, eos_token_id=None)
    stopped = generate_plain(target, ids, None, stop)
    plain = generate_plain(target, ids, None, go_on)
    spec = generate_speculative(target, draft, ids, None, go_on)
    n_stop = int(stopped.lengths[0])
    assert n_stop < 40 and int(stopped.sequences[0, n_stop - 1]) == eos
    assert int(plain.lengths[0]) == int(spec.lengths[0]) == 40
    assert torch.equal(plain.sequences, spec.sequences)
    assert int((plain.sequences[0] == eos).sum()) >= 2  # past the first EOS, more of them
    assert torch.equal(plain.sequences[0, :n_stop], stopped.sequences[0, :n_stop])


def test_evaluation_decodes_each_sample_to_its_limit(tiny_embedded, random_head, tmp_path):
    traffic = _traffic(tmp_path / "heldout.jsonl")
    cfg = EvaluateConfig(
        spec=SpecConfig(depth=3, max_new_tokens=GLOBAL),
        limit=None,
        ignore_eos=True,
        speed=EvaluateConfig.tiny().speed,
        position_edges=(0, 8, 64),
    )
    res = evaluate(cfg, HeadEval(tiny_embedded.target_dir, random_head, str(traffic), str(tmp_path / "eval")), **QUIET)
    samples = json.loads(Path(res.report_file).read_text())["samples"]
    want = [n or GLOBAL for n in LIMITS]
    assert [s["max_new_tokens"] for s in samples] == want
    assert [s["tokens"] for s in samples] == [len(s["output_ids"]) for s in samples] == want
    assert res.identical is True and res.n_tokens == sum(want)
    assert sum(b["steps"] for b in res.by_position) == sum(len(s["accept_lengths"]) for s in samples)


def test_without_ignore_eos_the_limit_is_a_ceiling(tiny_embedded, random_head, tmp_path):
    traffic = _traffic(tmp_path / "heldout.jsonl")
    cfg = EvaluateConfig(spec=SpecConfig(depth=3, max_new_tokens=GLOBAL), limit=None, speed=EvaluateConfig.tiny().speed)
    res = evaluate(cfg, HeadEval(tiny_embedded.target_dir, random_head, str(traffic), str(tmp_path / "eval")), **QUIET)
    samples = json.loads(Path(res.report_file).read_text())["samples"]
    assert all(s["tokens"] <= (n or GLOBAL) for s, n in zip(samples, LIMITS)) and res.identical is True
    target, tok = load_target(tiny_embedded.target_dir)
    assert [h.max_new_tokens for h in held_out_samples(tok, str(traffic), cfg)] == [n or GLOBAL for n in LIMITS]


def test_local_regeneration_honours_each_samples_limit(tiny_embedded, tmp_path):
    """A target that says only four spaces (one token) and never EOS: each answer is exactly its limit long."""
    target, tok = load_target(tiny_embedded.target_dir)
    tok.padding_side = "left"
    spaces = tok.convert_tokens_to_ids(tok.tokenize("    "))[0]
    target.set_output_embeddings(_Biased(target.get_output_embeddings(), spaces, 1e4))
    cfg = RegenerateConfig(max_new_tokens=GLOBAL, temperature=0.0, batch_size=2, shard_size=8)
    regenerate(
        cfg,
        tiny_embedded.target_dir,
        str(_traffic(tmp_path / "t.jsonl")),
        str(tmp_path / "regen"),
        answer=hf_answerer(target, tok, cfg),
        **QUIET,
    )
    got = {c.id: c.messages[-1].content for c in read_regenerated(str(tmp_path / "regen"))}
    assert got == {f"c{i}": " " * 4 * (n or GLOBAL) for i, n in enumerate(LIMITS)}


def test_endpoint_regeneration_asks_each_samples_limit():
    """`answer_concurrently` passes a conversation's own limit to the request (the global one when it has none)."""
    asked = {}

    def ask(msgs, max_new_tokens=None):
        asked[msgs[-1]["content"]] = max_new_tokens
        return "ok"

    convs = [
        Conversation(id=f"c{i}", messages=(Message("user", f"q{i}"),), max_new_tokens=n) for i, n in enumerate(LIMITS)
    ]
    records = answer_concurrently(convs, ask, concurrency=2)
    assert all("messages" in r for r in records)
    assert asked == {f"q{i}": n for i, n in enumerate(LIMITS)}


def test_ignore_eos_is_checked_at_config_load(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"evaluate": {"ignore_eos": True}}))
    assert PipelineConfig.load(good).evaluate.ignore_eos is True
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"evaluate": {"ignore_eos": "yes"}}))
    with pytest.raises(ConfigError, match="evaluate.ignore_eos"):
        PipelineConfig.load(bad)
    assert EvaluateConfig().ignore_eos is False


@pytest.mark.slow
@pytest.mark.engine
def test_vllm_evaluation_runs_each_sample_to_its_limit_past_eos(engine_target, engine_head, engine_settings, tmp_path):
    """The engine evaluation asks each sample's limit with vLLM's `ignore_eos`: vLLM's plain and speculative outputs
    are that long, equal to each other and to ours (which went past EOS the same way)."""
    from components.evaluate.engine import evaluate_in_vllm, our_outputs
    from components.evaluate.speed import SpeedupConfig

    limits = (40, None, 64)
    traffic = _traffic(tmp_path / "heldout.jsonl", limits)
    cfg = EvaluateConfig(
        spec=SpecConfig(depth=3, max_new_tokens=24),
        limit=None,
        ignore_eos=True,
        speed=SpeedupConfig.tiny(),
        position_edges=(0, 16, 128),
    )
    head = HeadEval(engine_target.target_dir, engine_head.head_dir, str(traffic), str(tmp_path / "ours"))
    ours = evaluate(cfg, head, **QUIET)
    res = evaluate_in_vllm(
        cfg,
        dataclasses.replace(head, out_dir=str(tmp_path / "vllm")),
        engine_settings,
        ours=our_outputs(ours.report_file),
        **QUIET,
    )
    want = [n or 24 for n in limits]
    samples = json.loads(Path(res.report_file).read_text())["samples"]
    assert [s["max_new_tokens"] for s in samples] == want
    assert [len(s["plain"]) for s in samples] == [len(s["spec"]) for s in samples] == want
    assert res.identical_to_plain and res.identical_to_ours and res.n_tokens == sum(want)
    assert sum(b["steps"] for b in res.by_position) == sum(len(s["accept_lengths"]) for s in samples)
