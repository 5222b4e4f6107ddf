"""Live serving in the engine: our proxy in front of real vLLM servers (its CPU build), capture and a swap, no mocks.

Purpose:
- capture: through the proxy, a chat completion and the same request streamed give the target's answer; the stream's
  events equal those of the same request sent to vLLM directly (ids and times aside) and end in `[DONE]`; `/health`,
  `/metrics` (vLLM's counters) and `/eagle/status` answer through it; the captured rows hold the messages, the
  completion each client got and the request's settings; a store that becomes unwritable pauses capture with a
  warning while requests still succeed;
- swap: `eagle-heads serve --follow-alias --capture` on a registered head; under a bounded streaming load (4 clients)
  the alias moves to another version (served with another K): serve starts it beside the running engine, switches
  and drains; 0 failed or truncated requests, every greedy output equal to this project's plain decoding, the
  captured rows name both versions;
- swap faults: a new engine that fails to start (its head's config is broken) leaves the running one serving, with
  0 failed requests under load meanwhile; a drain that times out (the old engine hangs, its processes stopped, with
  a request in flight) cuts that request (its client's connection closes with no answer: an error, never a short
  answer that looks complete), says so, stops the old engine, and the new one serves.
Run: `python -m pytest tests/test_serve_proxy.py` (about 4 minutes on 2 cores: five engine starts). Needs vLLM's
venv (`make vllm`).
Not here: the dataset writer's rotation, cap and atomic files (tests/test_capture.py, no vLLM).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from components.data.traffic_io import load_traffic
from components.serving.capture import CaptureConfig, read_capture
from components.serving.live import LiveConfig, LiveServer, Served
from infra.vllm_engine_spec import EngineSpec

pytestmark = [pytest.mark.slow, pytest.mark.engine]
ROOT = Path(__file__).resolve().parent.parent
NAME = "engine-tiny"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts(engine_target) -> list[list[dict]]:
    convs = load_traffic(engine_target.target_traffic.heldout).conversations[:4]
    out = []
    for c in convs:  # each conversation up to its first user turn: a request a client sends
        first_user = next(i for i, m in enumerate(c.messages) if m.role == "user")
        out.append([{"role": m.role, "content": m.content} for m in c.messages[: first_user + 1]])
    return out


def _body(messages, stream: bool, model: str = NAME) -> dict:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
        "return_token_ids": True,
    }


def _events(raw: bytes) -> list:
    """The stream's events with what differs between two requests (id, time) left out."""
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            e = json.loads(line[6:])
            out.append({k: v for k, v in e.items() if k not in ("id", "created")})
    return out


def _flat(raw: bytes) -> tuple:
    """A stream as the client reads it, however the engine grouped its tokens into events: the first event, the token
    ids and text in order, the last event's finish reason. (Two greedy requests of one prompt may group them
    differently: how many drafts a step accepts first can differ with the prefix cache.)"""
    events = _events(raw)
    choices = [c for e in events[1:] for c in e["choices"]]
    ids = [t for c in choices for t in c.get("token_ids") or []]
    return events[0], ids, "".join(c["delta"].get("content") or "" for c in choices), choices[-1]["finish_reason"]


def _stream(client: httpx.Client, url: str, messages, model: str = NAME) -> bytes:
    with client.stream("POST", url + "/v1/chat/completions", json=_body(messages, True, model)) as r:
        assert r.status_code == 200, r.read()
        return b"".join(r.iter_raw())


def test_capture_records_what_was_served_and_pauses_on_an_unwritable_store(
    engine_target, engine_head, engine_settings, prompts
):
    said: list[str] = []
    spec = EngineSpec(engine_target.target_dir, engine_head.head_dir, num_speculative_tokens=2, served_model_name=NAME)
    cfg = LiveConfig(capture=CaptureConfig(rows_per_file=1, retry_s=600.0))
    with (
        LiveServer(cfg, Served(spec, engine_head.head_dir, NAME, "7"), engine_settings, said.append) as live,
        httpx.Client(timeout=120) as client,
    ):
        assert client.get(live.base_url + "/health").status_code == 200
        metrics = client.get(live.base_url + "/metrics")
        assert metrics.status_code == 200 and "vllm:generation_tokens_total" in metrics.text
        assert client.get(live.base_url + "/eagle/status").json()["backend"] == live.engine.base_url
        whole = client.post(live.base_url + "/v1/chat/completions", json=_body(prompts[0], False)).json()
        through, direct = _stream(client, live.base_url, prompts[0]), _stream(client, live.engine.base_url, prompts[0])
        assert through.endswith(b"data: [DONE]\n\n") and _flat(through) == _flat(direct)
        streamed = "".join(c["delta"].get("content") or "" for e in _events(through) for c in e["choices"])
        assert streamed == whole["choices"][0]["message"]["content"]
        store = live.capture.root / NAME
        _until(lambda: live.capture.stats()["rows_written"] == 2)
        kept = store.with_name("kept")
        store.rename(kept)
        store.write_text("a file where the store's folder should be")  # unwritable, even for root
        late = client.post(live.base_url + "/v1/chat/completions", json=_body(prompts[1], False))
        assert late.status_code == 200 and late.json()["choices"][0]["finish_reason"]
        _until(lambda: live.capture.paused)
        assert client.get(live.base_url + "/eagle/status").json()["capture"]["paused"]
    assert any("capture paused" in s and "serving goes on" in s for s in said), said
    rows = read_capture(kept)
    answer = whole["choices"][0]["message"]["content"]
    assert [r["stream"] for r in rows] == [False, True]
    for r in rows:
        assert r["messages"] == [*prompts[0], {"role": "assistant", "content": answer}]
        assert r["completion"] == answer and r["completion_token_ids"] == whole["choices"][0]["token_ids"]
        assert (r["max_new_tokens"], r["temperature"], r["target_name"], r["target_version"]) == (
            MAX_TOKENS,
            0.0,
            NAME,
            "7",
        )
        assert json.loads(r["params"]) == {"return_token_ids": True}


def _register_twice(settings, head_dir: str) -> str:
    """The same head registered as versions 1 and 2 (the second with a K schedule, so it is served with K 2, the
    first with K 5); alias champion on 1."""
    from infra.mlflow_store import MlflowStore

    store = MlflowStore.connect(settings)
    name = "engine-tiny-head"
    for v, tags in ((1, {}), (2, {"k_schedule": json.dumps([[1, 256, 2]])})):
        with store.run(f"head-{v}") as run_id:
            store.log_dir(run_id, Path(head_dir), "head")
            ref = store.register(name, run_id, "head", run_key=f"swap-test-{v}", tags=tags)
        assert ref.version == v
    store.set_alias(name, "champion", 1)
    return name


def _plain(engine_target, prompts) -> list[list[int]]:
    """This project's greedy decoding of each prompt (the reference every served output must equal)."""
    import torch
    from transformers import AutoTokenizer

    from components.data.chat import prompt_ids
    from components.targets.target import load_target
    from eagle.speculative import SpecConfig, generate_plain

    tok = AutoTokenizer.from_pretrained(engine_target.target_dir)
    target = load_target(engine_target.target_dir)[0]
    out = []
    for msgs in prompts:
        res = generate_plain(
            target,
            torch.tensor([prompt_ids(tok, msgs)]),
            None,
            SpecConfig(max_new_tokens=MAX_TOKENS, eos_token_id=target.generation_config.eos_token_id),
        )
        out.append(res.sequences[0, : int(res.lengths[0])].tolist())
    return out


def test_a_swap_under_streaming_load_fails_no_request(engine_target, engine_head, tmp_path, prompts):
    from infra.settings import Settings

    settings = Settings.local(tmp_path / ".eagle")
    shutil.copytree(Path(engine_head.head_dir), tmp_path / "head")
    name = _register_twice(settings, str(tmp_path / "head"))
    env = {**os.environ, "EAGLE_HOME": str(settings.state_dir), "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "serve",
        "--head",
        f"models:/{name}@champion",
        "--target",
        engine_target.target_dir,
        "--follow-alias",
        "--follow-interval",
        "1",
        "--capture",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in iter(proc.stdout.readline, ""):
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    results, stop = [], threading.Event()
    try:
        url, model = _ready(lines, proc)
        clients = [threading.Thread(target=_client, args=(url, model, prompts, i, stop, results)) for i in range(4)]
        for c in clients:
            c.start()
        _until(lambda: len(results) >= 4, 300)
        from infra.mlflow_store import MlflowStore

        MlflowStore.connect(settings).set_alias(name, "champion", 2)
        _until(lambda: any("serve: swapped" in ln for ln in lines), 300)
        after = len(results)
        _until(lambda: len(results) >= after + 4, 300)
        stop.set()
        for c in clients:
            c.join(120)
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
    assert rc in (0, 130), "".join(lines[-30:])
    failed = [r for r in results if r["error"] or not r["done"] or r["finish_reason"] is None]
    assert not failed and len(results) >= 8, (failed, "".join(lines[-30:]))
    plain = _plain(engine_target, prompts)
    assert all(r["token_ids"] == plain[r["prompt"]] for r in results), [(r["prompt"], r["token_ids"]) for r in results]
    assert any("K 2" in ln or "[[1, 256, 2]]" in ln for ln in lines)  # version 2 came up with its own schedule
    rows = read_capture(settings.state_dir / "capture")
    assert {r["head"] for r in rows} == {f"models:/{name}/1", f"models:/{name}/2"}
    assert len(rows) == len(results)


def _client(url: str, model: str, prompts, seed: int, stop: threading.Event, results: list) -> None:
    """Streams greedy requests one after another (prompt by prompt, from `seed`) until `stop` (at least one)."""
    i = seed
    with httpx.Client(timeout=300) as client:
        while not (stop.is_set() and i > seed):
            p = i % len(prompts)
            i += 1
            r = {"prompt": p, "error": None, "done": False, "finish_reason": None, "token_ids": []}
            try:
                raw = _stream(client, url, prompts[p], model)
                r["done"] = raw.endswith(b"data: [DONE]\n\n")
                for e in _events(raw):
                    for c in e["choices"]:
                        r["token_ids"] += c.get("token_ids") or []
                        r["finish_reason"] = c.get("finish_reason") or r["finish_reason"]
            except Exception as e:  # any failure is a result of this test, not its crash
                r["error"] = f"{type(e).__name__}: {e}"
            results.append(r)
            time.sleep(0.2)  # a bounded load: four clients, each a request at a time with a pause


def _ready(lines: list[str], proc: subprocess.Popen, timeout_s: float = 300.0) -> tuple[str, str]:
    """The proxy's URL and the served model name from serve's "ready at" line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ln in list(lines):
            if "serve: ready at " in ln:
                rest = ln.split("serve: ready at ", 1)[1]
                return rest.split()[0].removesuffix("/v1"), rest.split("(model '", 1)[1].split("'", 1)[0]
        assert proc.poll() is None, "".join(lines[-30:])
        time.sleep(0.5)
    raise AssertionError("serve did not report ready:\n" + "".join(lines[-30:]))


def _until(cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_swap_that_does_not_start_or_drain_in_time_fails_no_request_it_need_not(
    engine_target, engine_head, engine_settings, prompts, tmp_path
):
    said: list[str] = []
    spec = EngineSpec(engine_target.target_dir, engine_head.head_dir, num_speculative_tokens=2, served_model_name=NAME)
    broken = tmp_path / "broken-head"
    shutil.copytree(engine_head.head_dir, broken)
    (broken / "config.json").write_text("{ not json")
    plain = _plain(engine_target, prompts)
    cfg = LiveConfig(drain_timeout_s=1.0)
    with LiveServer(cfg, Served(spec, engine_head.head_dir, NAME), engine_settings, said.append) as live:
        first = live.engine.base_url
        results, stop = [], threading.Event()
        clients = [
            threading.Thread(target=_client, args=(live.base_url, NAME, prompts, i, stop, results)) for i in range(3)
        ]
        for c in clients:
            c.start()
        try:
            _until(lambda: len(results) >= 3, 120)
            assert not live.swap_to(Served(dataclasses.replace(spec, head_dir=str(broken)), str(broken), NAME))
            after = len(results)
            _until(lambda: len(results) >= after + 3, 120)  # still served by the first engine
        finally:
            stop.set()
            for c in clients:
                c.join(120)
        assert any("did not start" in s and "still serving" in s for s in said), said
        assert live.engine.base_url == first and live.proxy.status()["backend"] == first
        failed = [r for r in results if r["error"] or not r["done"] or r["finish_reason"] is None]
        assert not failed and all(r["token_ids"] == plain[r["prompt"]] for r in results), failed

        # the drain: the old engine hangs (stopped) with a request in flight past drain_timeout_s
        old_pid, hung = live.engine.proc.pid, []
        os.killpg(old_pid, signal.SIGSTOP)
        try:
            waiter = threading.Thread(target=_client, args=(live.base_url, NAME, prompts, 0, _set(), hung))
            waiter.start()
            _until(lambda: sum(live.proxy.status()["in_flight"].values()) == 1, 30)
            swapped: list[bool] = []
            swapper = threading.Thread(
                target=lambda: swapped.append(
                    live.swap_to(
                        Served(dataclasses.replace(spec, num_speculative_tokens=3), engine_head.head_dir, NAME)
                    )
                )
            )
            swapper.start()
            _until(lambda: bool(hung), 300)  # the cut comes once the new engine is up and the drain timed out
        finally:
            os.killpg(old_pid, signal.SIGCONT)  # the stop's SIGTERM then ends it at once
        swapper.join(120)
        waiter.join(30)
        assert swapped == [True]
        [r] = hung
        assert r["error"] and not r["done"] and not r["token_ids"], r  # cut: an error, no answer, no [DONE]
        line = next(s for s in said if "serve: swapped" in s and "drain timed out" in s)
        assert "after 1 s: 1 request(s) still running were cut" in line, said
        assert live.engine.base_url != first and live.proxy.status()["in_flight"] == {live.engine.base_url: 0}
        with httpx.Client(timeout=120) as client:
            raw = _stream(client, live.base_url, prompts[1])
        ids = [t for e in _events(raw) for c in e["choices"] for t in c.get("token_ids") or []]
        assert raw.endswith(b"data: [DONE]\n\n") and ids == plain[1]
    _until(lambda: not _alive(old_pid), 30)


def _set() -> threading.Event:
    """A stop event already set: `_client` sends exactly one request."""
    e = threading.Event()
    e.set()
    return e


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
