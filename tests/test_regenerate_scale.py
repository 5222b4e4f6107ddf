"""Stage 1 at scale: concurrent endpoint requests, a real vLLM server, shards answered by Ray workers.

Purpose:
- endpoint concurrency: against a real HTTP server on loopback that counts requests in flight, `regenerate` keeps
  exactly `endpoint_concurrency` in flight at most (and reaches it), answers multi-turn conversations turn by turn,
  fails a refused request (HTTP 400) at once with the server's body and that conversation only, and writes the same
  bytes as with one request at a time;
- Ray: `num_workers` 2 (a local Ray that regenerate starts and stops through infra.ray_cluster.ray_session) writes
  shard files byte-identical (sha256) to the in-process run, with the same accounting, and resumes by shard;
- vLLM (slow): regeneration through a real vLLM server (plain decoding, fp32, greedy) answers every conversation
  with vLLM's own chat-completions output for the same messages, records an over-long prompt as failed with vLLM's
  400 body in accounting.json, keeps total = ok + failed + skipped, and a re-run skips every finished shard.
Run: `python -m pytest tests/test_regenerate_scale.py` (about 1 minute without vLLM; the vLLM test adds 1-2 minutes
for the tiny target's training and the engine start; it needs vLLM's venv, `make vllm`).
Not here: the single-process behaviour (tests/test_regenerate.py), heads served by vLLM (tests/test_vllm.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from components.data.regenerated import read_regenerated
from components.regenerate.stage import RegenerateConfig, regenerate
from components.targets.runtime import StageContext
from eagle.config_checks import FieldError
from infra.settings import Settings
from tests.helpers import send_json

QUIET = dict(progress=lambda s: None)
MULTI = [
    ("system", "You write Python."),
    ("user", "def add(a, b):"),
    ("assistant", "    return a + b\n"),
    ("user", "And sub?"),
    ("assistant", "def sub(a, b):\n    return a - b"),
    ("user", "And mul?"),
]


def _conv(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "segment": "test", "messages": [{"role": r, "content": c} for r, c in turns]}


def _write_traffic(path: Path, convs: list[dict]) -> str:
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return str(path)


def _digests(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("shard-*"))}


def _counts(res) -> tuple[int, int, int, int]:
    return res.total, res.ok, res.failed, res.skipped


# ---- endpoint concurrency ---------------------------------------------------------------------------------------


class _CountingServer(BaseHTTPRequestHandler):
    """POST /v1/chat/completions: `echo<n messages>:<last turn>`; REFUSE in the last turn gets a 400 with a JSON
    body. Counts the requests in flight and keeps their maximum. A request is held until `expect` are in flight (at
    most HOLD_S) the first time, so a client that keeps that many in flight reaches it however loaded the machine is."""

    HOLD_S = 2.0
    expect = 1
    lock = threading.Lock()
    arrived = threading.Condition(lock)
    in_flight = 0
    max_in_flight = 0
    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        cls = type(self)
        with cls.arrived:
            cls.in_flight += 1
            cls.max_in_flight = max(cls.max_in_flight, cls.in_flight)
            cls.arrived.notify_all()
            # held only until the bound has been reached once: after that, the tail's fewer requests need not wait
            cls.arrived.wait_for(lambda: cls.max_in_flight >= cls.expect, timeout=cls.HOLD_S)
        try:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            cls.requests.append(body)
            last = body["messages"][-1]["content"]
            if "REFUSE" in last:
                answer = 400, {"error": {"message": "This model's maximum context length is 512 tokens (fake)"}}
            else:
                answer = (
                    200,
                    {"choices": [{"message": {"role": "assistant", "content": f"echo{len(body['messages'])}:{last}"}}]},
                )
        finally:
            # out of flight before the answer is written: once the client has it, it may send its next request
            # while this thread would still be on its way to the decrement (a false 2 in flight under load)
            with cls.lock:
                cls.in_flight -= 1
        self._send(*answer)

    def _send(self, code: int, payload: dict) -> None:
        send_json(self, code, payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def counting_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CountingServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def reset() -> None:
        _CountingServer.in_flight, _CountingServer.max_in_flight, _CountingServer.requests = 0, 0, []

    reset()
    yield f"http://127.0.0.1:{server.server_address[1]}", reset
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_endpoint_requests_run_concurrently_within_the_bound(counting_server, tmp_path):
    url, reset = counting_server
    convs = [_conv(f"one-{i}", ("user", f"print({i})")) for i in range(7)]
    convs[2:2] = [_conv("multi-a", *MULTI), _conv("refused", ("user", "REFUSE this")), _conv("multi-b", *MULTI[1:])]
    traffic = _write_traffic(tmp_path / "t.jsonl", convs)
    base = RegenerateConfig(
        endpoint_url=url, endpoint_model="tiny", max_new_tokens=5, shard_size=4, endpoint_timeout_s=10
    )
    runs = {}
    for bound in (3, 1):
        reset()
        _CountingServer.expect = bound
        out = tmp_path / f"c{bound}"
        res = regenerate(
            dataclasses.replace(base, endpoint_concurrency=bound), "no-local-target", traffic, str(out), **QUIET
        )
        runs[bound] = (res, _digests(out), _CountingServer.max_in_flight, list(_CountingServer.requests))
    res, digests, peak, seen = runs[3]
    assert peak == 3, "the bound is reached and never exceeded"
    assert runs[1][2] == 1
    assert digests == runs[1][1] and len(digests) == 6  # 3 shards: the same bytes whatever the concurrency
    assert _counts(res) == (10, 9, 1, 0) and list(res.failures) == ["refused"]
    assert res.failures["refused"].startswith("turn 1: ") and "HTTP 400" in res.failures["refused"]
    assert "maximum context length is 512 tokens" in res.failures["refused"]  # the server's body, verbatim
    assert sum("REFUSE" in r["messages"][-1]["content"] for r in seen) == 1  # a refusal is not retried
    turns = [len(r["messages"]) for r in seen if r["messages"][0]["content"] == "You write Python."]
    assert turns == [2, 4, 6]  # turn by turn: each request carries the previous answers
    convs_out = {c.id: c for c in read_regenerated(res.out_dir)}
    assert [m.content for m in convs_out["multi-a"].messages if m.role == "assistant"] == [
        "echo2:def add(a, b):",
        "echo4:And sub?",
        "echo6:And mul?",
    ]
    assert [c.id for c in read_regenerated(res.out_dir)] == [c["id"] for c in convs if c["id"] != "refused"]


def test_the_concurrency_bound_is_checked():
    with pytest.raises(FieldError, match="endpoint_concurrency must be an integer >= 1"):
        RegenerateConfig(endpoint_concurrency=0)
    with pytest.raises(FieldError, match="num_workers"):
        RegenerateConfig(num_workers=-1)


# ---- Ray workers ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ray_workers_write_what_one_process_writes_and_resume(tiny_embedded, tmp_path):
    import ray

    convs = [_conv(f"short-{i}", ("user", f"def f{i}(x):")) for i in range(5)]
    convs[1:1] = [_conv("multi", *MULTI), _conv("too-long", ("user", "x = 1\n" * 1200))]
    traffic = _write_traffic(tmp_path / "t.jsonl", convs)
    cfg = RegenerateConfig(max_new_tokens=6, temperature=1.0, batch_size=4, shard_size=2, seed=3)  # sampled
    local = regenerate(cfg, tiny_embedded.target_dir, traffic, str(tmp_path / "local"), **QUIET)
    was_running = ray.is_initialized()  # the suite's own local Ray, if a test before this one started it
    settings = Settings.local(tmp_path / ".eagle", ray_auth_mode="disabled")
    lines: list[str] = []
    on_ray = regenerate(
        dataclasses.replace(cfg, num_workers=2),
        tiny_embedded.target_dir,
        traffic,
        str(tmp_path / "ray"),
        progress=lines.append,
        context=StageContext(settings=settings),
    )
    assert ray.is_initialized() == was_running, "regenerate left a Ray it started running"
    assert not any("holds" in line for line in lines), lines  # both workers fitted
    assert _counts(on_ray) == _counts(local) == (7, 6, 1, 0) and on_ray.failures == local.failures
    before = _digests(tmp_path / "ray")
    assert before == _digests(tmp_path / "local") and len(before) == 8  # byte-identical: 4 shards + sidecars
    assert (tmp_path / "ray" / "accounting.json").read_bytes() == (tmp_path / "local" / "accounting.json").read_bytes()

    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ray").glob("shard-*")}
    for p in (tmp_path / "ray").glob("shard-00001.*"):  # an interrupted run: one shard never finished
        p.unlink()
    resumed = regenerate(
        dataclasses.replace(cfg, num_workers=2),
        tiny_embedded.target_dir,
        traffic,
        str(tmp_path / "ray"),
        context=StageContext(settings=settings),
        **QUIET,
    )
    assert _counts(resumed) == (7, 1, 1, 5)  # shard 1 holds "too-long" and "short-1"
    assert _digests(tmp_path / "ray") == before
    assert {
        p.name: p.stat().st_mtime_ns for p in (tmp_path / "ray").glob("shard-*") if not p.name.startswith("shard-00001")
    } == {k: v for k, v in mtimes.items() if not k.startswith("shard-00001")}
    assert ray.is_initialized() == was_running


def test_an_injected_answerer_is_refused_on_ray(tmp_path):
    with pytest.raises(ValueError, match="num_workers 0"):
        regenerate(RegenerateConfig(num_workers=2), "t", "x.jsonl", str(tmp_path), answer=lambda b: [], **QUIET)


# ---- a real vLLM server -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_plain(engine_target, tmp_path_factory):
    from infra.vllm_engine_spec import EngineSpec
    from infra.vllm_server import VllmServer, vllm_python

    settings = Settings.local(tmp_path_factory.mktemp("regen-engine-state") / ".eagle")
    vllm_python(settings)  # a missing vLLM venv fails here with the line that says how to make it
    with VllmServer(EngineSpec(engine_target.target_dir, method=None, served_model_name="regen-tiny"), settings) as srv:
        yield srv


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.engine
def test_regenerate_through_vllm_gives_vllms_own_answers(engine_target, vllm_plain, tmp_path):
    from components.data.traffic_io import load_traffic

    convs = [c.to_openai() for c in load_traffic(engine_target.target_traffic.train).conversations[:9]]
    convs[3:3] = [_conv("multi", *MULTI), _conv("too-long", ("user", "x = 1\n" * 1200))]
    traffic = _write_traffic(tmp_path / "t.jsonl", convs)
    cfg = RegenerateConfig(
        endpoint_url=vllm_plain.base_url,
        endpoint_model="regen-tiny",
        temperature=0.0,
        max_new_tokens=24,
        shard_size=4,
        endpoint_concurrency=4,
    )
    out = tmp_path / "regen"
    res = regenerate(cfg, "no-local-target", traffic, str(out), **QUIET)
    acc = json.loads((out / "accounting.json").read_text())
    assert acc["total"] == acc["ok"] + acc["failed"] + acc["skipped"] == len(convs) and acc["skipped"] == 0
    assert "too-long" in acc["failures"] and acc["failures"] == res.failures
    for cid, reason in acc["failures"].items():  # only prompts longer than the context fail, with vLLM's reason
        assert "HTTP 400" in reason and "maximum context length is 512 tokens" in reason, (cid, reason)
    answered = read_regenerated(str(out))
    assert len(answered) == res.ok >= len(convs) - 3 and any(c.id == "multi" for c in answered)
    n_checked = 0
    for conv in answered:  # each answer is vLLM's own for the history regenerate sent
        msgs = [{"role": m.role, "content": m.content} for m in conv.messages]
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                assert m["content"] == vllm_plain.chat(msgs[:i], max_tokens=cfg.max_new_tokens).text, (conv.id, i)
                n_checked += 1
    assert n_checked >= res.ok + 2  # "multi" has three turns
    assert len({m.content for c in answered for m in c.messages if m.role == "assistant"}) > 1  # not one reply

    before = _digests(out)
    again = regenerate(cfg, "no-local-target", traffic, str(out), **QUIET)
    assert _counts(again) == (len(convs), 0, 0, len(convs)) and _digests(out) == before
