"""Stage 1 and the chat formatting it shares: real tokenizer and target of the tiny embedded default.

Purpose: the loss mask covers exactly the assistant turns; regeneration accounts for every conversation
(total = ok + failed + skipped), fails an over-long prompt alone with a reason, resumes by shard (a finished shard
is never redone, a lost one is redone alone), answers multi-turn conversations turn by turn, keeps the target's
text verbatim, and talks to an OpenAI-compatible server (a real HTTP server on loopback standing in for vLLM),
where a server error is retried and then counted as a failure.
Run: `python -m pytest tests/test_regenerate.py` (about 10 s once the tiny embedded default is built).
Not here: mocks of the model or tokenizer.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from components.data.chat import ChatTemplateError, tokenize_conversation
from components.data.regenerated import read_regenerated
from components.regenerate.stage import RegenerateConfig, hf_answerer, regenerate
from components.targets.target import load_target
from tests.helpers import send_json


@pytest.fixture(scope="module")
def tokenizer(tiny_embedded):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_embedded.target_dir)


def _conv(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "segment": "test", "messages": [{"role": r, "content": c} for r, c in turns]}


def _write_traffic(path: Path, convs: list[dict]) -> str:
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return str(path)


MULTI = [
    ("system", "You write Python."),
    ("user", "def add(a, b):"),
    ("assistant", "    return a + b\n"),
    ("user", "And sub?"),
    ("assistant", "def sub(a, b):\n    return a - b"),
]


# ---- chat -------------------------------------------------------------------------------------------------------


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    msgs = [{"role": r, "content": c} for r, c in MULTI]
    t = tokenize_conversation(tokenizer, msgs, max_len=1024)
    assert not t.truncated and len(t.input_ids) == len(t.loss_mask)
    spans, cur = [], []  # contiguous runs of masked tokens, one per assistant turn
    for tok, m in zip(t.input_ids, t.loss_mask):
        if m:
            cur.append(tok)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    answers = [c for r, c in MULTI if r == "assistant"]
    assert [tokenizer.decode(s) for s in spans] == [a + "<|end|>" for a in answers]  # the turn's end is trained too
    # the same positions as the template's own {% generation %} markers
    ref = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert list(ref["input_ids"]) == t.input_ids
    assert list(ref["assistant_masks"]) == t.loss_mask


def test_truncation_cuts_ids_and_mask_together(tokenizer):
    msgs = [{"role": r, "content": c} for r, c in MULTI]
    full = tokenize_conversation(tokenizer, msgs, max_len=1024)
    cut = tokenize_conversation(tokenizer, msgs, max_len=10)
    assert cut.truncated and cut.input_ids == full.input_ids[:10] and cut.loss_mask == full.loss_mask[:10]


def test_a_template_that_rewrites_past_turns_is_refused(tokenizer):
    """Like templates that drop earlier turns' reasoning: the mask of a prefix would not fit the whole."""
    odd = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    odd.chat_template = tokenizer.chat_template.replace(
        "{{ message['content'] }}<|end|>{% endgeneration %}",
        "{% if not loop.last %}[old] {% endif %}{{ message['content'] }}<|end|>{% endgeneration %}",
    )
    assert odd.chat_template != tokenizer.chat_template
    msgs = [{"role": r, "content": c} for r, c in MULTI]
    tokenize_conversation(odd, msgs[:3], max_len=1024)  # one assistant turn, the last: fine
    with pytest.raises(ChatTemplateError, match="prefix"):
        tokenize_conversation(odd, msgs, max_len=1024)


def test_no_chat_template_is_a_clear_error(tokenizer):
    bare = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenize_conversation(bare, [{"role": "user", "content": "hi"}], max_len=64)


# ---- regenerate with the local target ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traffic(tmp_path_factory) -> str:
    convs = [
        _conv("short-0", ("user", "def f(x):")),
        _conv("multi", *MULTI),
        _conv("short-1", ("user", "import os\n"), ("assistant", "import sys")),
        _conv("too-long", ("user", "x = 1\n" * 1200), ("assistant", "ok")),
        _conv("short-2", ("user", "class A:")),
    ]
    return _write_traffic(tmp_path_factory.mktemp("traffic") / "train.jsonl", convs)


CFG = RegenerateConfig(max_new_tokens=6, temperature=1.0, batch_size=4, shard_size=2, seed=3)


def _files(out: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.glob("shard-*"))}


def test_regenerate_accounts_fails_alone_and_resumes_by_shard(tiny_embedded, traffic, tmp_path):
    out = tmp_path / "regen"
    res = regenerate(CFG, tiny_embedded.target_dir, traffic, str(out), progress=lambda s: None)
    assert (res.total, res.ok, res.failed, res.skipped) == (5, 4, 1, 0)
    assert res.total == res.ok + res.failed + res.skipped
    assert list(res.failures) == ["too-long"] and "exceeds the target's context" in res.failures["too-long"]
    acc = json.loads((out / "accounting.json").read_text())
    assert (acc["total"], acc["ok"], acc["failed"], acc["skipped"]) == (5, 4, 1, 0)
    assert len(res.shards) == 3 and all(Path(s).is_file() for s in res.shards)
    convs = {c.id: c for c in read_regenerated(str(out))}
    assert sorted(convs) == ["multi", "short-0", "short-1", "short-2"]
    multi = convs["multi"]
    roles = [m.role for m in multi.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant"]  # answered turn by turn
    assert [m.content for m in multi.messages if m.role != "assistant"] == [c for r, c in MULTI if r != "assistant"]
    assert [m.content for m in convs["short-1"].messages if m.role == "assistant"] != ["import sys"]  # the target's
    before = _files(out)

    again = regenerate(CFG, tiny_embedded.target_dir, traffic, str(out), progress=lambda s: None)
    assert (again.total, again.ok, again.failed, again.skipped) == (5, 0, 0, 5)
    assert _files(out) == before  # nothing rewritten

    for p in out.glob("shard-00002.*"):  # an interrupted run: the last shard never finished
        p.unlink()
    resumed = regenerate(CFG, tiny_embedded.target_dir, traffic, str(out), progress=lambda s: None)
    assert (resumed.total, resumed.ok, resumed.failed, resumed.skipped) == (5, 1, 0, 4)
    after = _files(out)
    assert {k: v for k, v in after.items() if not k.startswith("shard-00002")} == {
        k: v for k, v in before.items() if not k.startswith("shard-00002")
    }
    assert after["shard-00002.jsonl"][1] == before["shard-00002.jsonl"][1]  # seeded per shard: the same samples


class _Biased(torch.nn.Module):
    """The target's lm_head with a huge bias on one token (the target then says only that token)."""

    def __init__(self, lm_head, token):
        super().__init__()
        self.inner = lm_head
        self.token = token

    def forward(self, x):
        out = self.inner(x)
        out[..., self.token] += 1e4
        return out


def test_answers_are_the_targets_text_verbatim(tiny_embedded):
    """A target whose every token is a run of spaces: the answer is those spaces, not an empty string."""
    target, tok = load_target(tiny_embedded.target_dir)
    tok.padding_side = "left"
    spaces = tok.convert_tokens_to_ids(tok.tokenize("    "))
    assert len(spaces) == 1
    target.set_output_embeddings(_Biased(target.get_output_embeddings(), spaces[0]))
    answer = hf_answerer(target, tok, RegenerateConfig(max_new_tokens=3, temperature=0.0))
    msgs = [{"role": "user", "content": "def f(x):"}]
    assert answer([msgs, [{"role": "system", "content": "Be brief."}, *msgs]]) == ["            "] * 2


def test_a_batch_answers_each_conversation_as_if_alone(tiny_embedded):
    """Left padding with its attention mask and positions: batching must not change a greedy answer."""
    target, tok = load_target(tiny_embedded.target_dir)
    tok.padding_side = "left"
    torch.manual_seed(2)
    with torch.no_grad():  # the tiny target answers dots to everything; a noisy lm_head makes answers differ
        target.lm_head.weight.normal_(std=0.5)
    answer = hf_answerer(target, tok, RegenerateConfig(max_new_tokens=8, temperature=0.0))
    batch = [
        [{"role": "user", "content": "def f(x):"}],
        [
            {"role": "system", "content": "You write Python code for a living."},
            {"role": "user", "content": "class Foo(object):\n    pass"},
        ],
        [{"role": "user", "content": "import os"}],
    ]
    together = answer(batch)
    assert len(set(together)) == 3
    assert together == [answer([msgs])[0] for msgs in batch]


def test_regeneration_runs_a_fixed_target_path(tiny_embedded, monkeypatch):
    """Never "auto" (a per-process timing could differ between workers or a resume): the default path, or the one
    EAGLE_TARGET_PATH pins."""
    from eagle import speculative, target_path

    def no_timing(target):
        raise AssertionError("regeneration must not time the target's paths")

    seen = []
    real_init = speculative.TargetRunner.__init__

    def spy(self, *a, **kw):
        real_init(self, *a, **kw)
        seen.append(self.path)

    monkeypatch.setattr(target_path, "measure", no_timing)
    monkeypatch.setattr(speculative.TargetRunner, "__init__", spy)
    monkeypatch.delenv(target_path.ENV, raising=False)
    target, tok = load_target(tiny_embedded.target_dir)
    tok.padding_side = "left"
    msgs = [[{"role": "user", "content": "def f(x):"}]]
    first = hf_answerer(target, tok, RegenerateConfig(max_new_tokens=4, temperature=0.0))(msgs)
    monkeypatch.setenv(target_path.ENV, "hf-torch")
    assert hf_answerer(target, tok, RegenerateConfig(max_new_tokens=4, temperature=0.0))(msgs) == first
    assert seen == [target_path.DEFAULT, "hf-torch"]


# ---- regenerate through an OpenAI-compatible endpoint -----------------------------------------------------------


class _FakeVllm(BaseHTTPRequestHandler):
    """POST /v1/chat/completions: answers `echo:<last user turn>`; a last user turn containing FAIL gets a 500."""

    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append({"path": self.path, **body})
        last = body["messages"][-1]["content"]
        if self.path != "/v1/chat/completions" or "FAIL" in last:
            self.send_response(500 if "FAIL" in last else 404)
            self.end_headers()
            return
        send_json(self, 200, {"choices": [{"message": {"role": "assistant", "content": f"echo:{last}"}}]})

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_vllm():
    _FakeVllm.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _FakeVllm.requests
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_endpoint_answers_turn_by_turn_and_counts_server_errors(fake_vllm, tmp_path):
    url, seen = fake_vllm
    traffic = _write_traffic(
        tmp_path / "t.jsonl",
        [_conv("multi", *MULTI), _conv("bad", ("user", "FAIL please")), _conv("one", ("user", "hello"))],
    )
    cfg = RegenerateConfig(
        endpoint_url=url + "/",
        endpoint_model="tiny",
        max_new_tokens=7,
        temperature=0.5,
        shard_size=8,
        endpoint_timeout_s=10,
    )
    res = regenerate(cfg, str(tmp_path / "no-local-target"), traffic, str(tmp_path / "out"), progress=lambda s: None)
    assert (res.total, res.ok, res.failed, res.skipped) == (3, 2, 1, 0)
    assert "500" in res.failures["bad"] and res.failures["bad"].startswith("turn 1:")
    assert sum("FAIL" in r["messages"][-1]["content"] for r in seen) == 3  # retried, then given up
    multi = [r for r in seen if r["messages"][0]["role"] == "system"]
    assert [len(r["messages"]) for r in multi] == [2, 4]  # turn 2 carries turn 1's answer as its history
    assert multi[1]["messages"][2] == {"role": "assistant", "content": "echo:def add(a, b):"}
    assert all(
        r["path"] == "/v1/chat/completions"
        and r["model"] == "tiny"
        and r["max_tokens"] == 7
        and r["temperature"] == 0.5
        for r in seen
    )
    convs = {c.id: c for c in read_regenerated(str(tmp_path / "out"))}
    assert [m.content for m in convs["multi"].messages if m.role == "assistant"] == [
        "echo:def add(a, b):",
        "echo:And sub?",
    ]
    assert [m.role for m in convs["one"].messages] == ["user", "assistant"]


def test_parquet_traffic_regenerates_what_its_jsonl_does(tiny_embedded, traffic, tmp_path):
    """The same conversations as a Parquet file: the same regenerated answers, the same accounting."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in Path(traffic).read_text().splitlines() if line.strip()]
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    a = regenerate(CFG, tiny_embedded.target_dir, traffic, str(tmp_path / "a"), progress=lambda s: None)
    b = regenerate(CFG, tiny_embedded.target_dir, str(parquet), str(tmp_path / "b"), progress=lambda s: None)
    assert (a.total, a.ok, a.failed) == (b.total, b.ok, b.failed)
    assert [c.to_openai() for c in read_regenerated(a.out_dir)] == [c.to_openai() for c in read_regenerated(b.out_dir)]
