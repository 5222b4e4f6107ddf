"""The serving proxy without vLLM: bytes passed through unchanged, a switch of backend that drains the old one, a
dead backend answered with one 502, and what capture is handed.

Purpose: infra/serve_proxy.py against two small stdlib HTTP servers standing in for engines (each answers with its
own name, a JSON body or a slow event stream), so the routing rules are checked in about a second; the same rules
with real vLLM servers are in tests/test_serve_proxy.py.
Run: `python -m pytest tests/test_serve_proxy_fast.py` (a few seconds).
Not here: the dataset (tests/test_capture.py), real engines (tests/test_serve_proxy.py).
"""

from __future__ import annotations

import http.server
import json
import threading
import time

import httpx
import pytest

from infra.serve_proxy import Backend, ServeProxy
from infra.vllm_server import free_port


class _Engine(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        body = f"ok {self.server.name}".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not req.get("stream"):
            body = json.dumps(
                {"engine": self.server.name, "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(req.get("events", 3)):
            event = {
                "engine": self.server.name,
                "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}],
            }
            self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
            time.sleep(req.get("pause", 0.0))
        self._chunk(b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@pytest.fixture
def engines():
    servers = []
    for name in ("a", "b"):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
        srv.name = name
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    yield [Backend(f"http://127.0.0.1:{s.server_address[1]}", {"head": s.name}) for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


def test_streams_and_bodies_pass_through_unchanged_and_capture_gets_them(engines):
    got = []
    with ServeProxy(engines[0], record=got.append) as proxy, httpx.Client(timeout=30) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
        with client.stream("POST", proxy.base_url + "/v1/chat/completions", json=body) as r:
            through, ctype = b"".join(r.iter_raw()), r.headers["content-type"]
        with client.stream("POST", engines[0].url + "/v1/chat/completions", json=body) as r:
            direct = b"".join(r.iter_raw())
        assert through == direct and ctype == "text/event-stream" and through.endswith(b"data: [DONE]\n\n")
        whole = client.post(proxy.base_url + "/v1/chat/completions?x=1", json={**body, "stream": False})
        assert whole.json()["engine"] == "a" and whole.headers["content-length"] == str(len(whole.content))
        assert client.get(proxy.base_url + "/health").text == "ok a"  # GETs are passed on, not captured
        time.sleep(0.1)
    assert [(ex.path, ex.meta["head"]) for ex in got] == [("/v1/chat/completions", "a")] * 2
    assert got[0].response == through and json.loads(got[0].request) == body


def test_a_switch_sends_new_requests_on_and_drains_the_old_backend(engines):
    a, b = engines
    with ServeProxy(a) as proxy, httpx.Client(timeout=30) as client:
        slow: dict = {}

        def long_stream() -> None:
            body = {"stream": True, "events": 10, "pause": 0.1}
            with client.stream("POST", proxy.base_url + "/v1/completions", json=body) as r:
                slow["raw"] = b"".join(r.iter_raw())

        t = threading.Thread(target=long_stream)
        t.start()
        deadline = time.monotonic() + 10
        while proxy.in_flight(a) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert proxy.route_to(b) is a
        assert client.get(proxy.base_url + "/health").text == "ok b"  # new requests: the new backend
        assert proxy.in_flight(a) == 1 and proxy.status()["in_flight"] == {a.url: 1, b.url: 0}
        assert proxy.drain(a, timeout_s=30)  # waits for the running stream, which ends whole
        t.join(10)
        assert slow["raw"].endswith(b"data: [DONE]\n\n") and slow["raw"].count(b'"engine": "a"') == 10
        assert proxy.status()["in_flight"] == {b.url: 0}


def test_a_backend_that_does_not_answer_is_one_502(engines):
    with ServeProxy(Backend(f"http://127.0.0.1:{free_port()}")) as proxy:
        r = httpx.post(proxy.base_url + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 502 and "did not answer" in r.json()["error"]["message"]
