"""HTTP adapter: a thin reverse proxy on the public port in front of one vLLM server at a time (aiohttp).

Purpose: `ServeProxy(Backend(url, meta), port=..., record=..., rate=...)` listens on 127.0.0.1 and forwards every
request (method, path, query, headers, body) to the current backend and its answer back as it comes: status,
headers and body bytes unchanged, a streamed answer (server-sent events) chunk by chunk, so `/v1/*`, `/health`
and `/metrics` of vLLM are reachable through it. It runs on its own thread with its own event loop (`start()`,
`stop()`), so the caller's thread stays free to start and stop engines.
- Capture: with `record`, a sampled share `rate` of POSTs to `/v1/chat/completions` and `/v1/completions` that
  answered 200 and ran to the end is handed to `record(Exchange)` after the answer went out: the request body, the
  answer's bytes, the backend's `meta` (what it serves). `record` must not block (components/serving/capture.py queues
  it); nothing is parsed here, and a failing `record` never reaches the client.
- Swap: `route_to(backend)` sends new requests to another backend (on the loop's thread, so a request is counted
  in flight on the backend it went to before the switch returns); `drain(old, timeout_s)` waits until the old one
  has no request in flight; `cut(old)` closes the connections of the requests it still has (a drain that timed
  out). A client that hangs up closes its upstream request (vLLM aborts it).
- `GET /eagle/status`: the current backend, requests in flight per backend, and `status_extra()` (capture counts).
  `backend.url + "/metrics"` is where the live acceptance of what is served now is read (infra/vllm_server.py
  `SpecCounters`).
Run: `python -m infra.serve_proxy UPSTREAM_URL [PORT]` proxies until Ctrl-C.
Not here: starting engines or following the registry (components/serving/live.py), the captured dataset
(components/serving/capture.py).
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from infra.settings import BIND_HOST

CAPTURED_PATHS = ("/v1/chat/completions", "/v1/completions")
# hop-by-hop headers (RFC 9110 7.6.1) and the ones aiohttp sets itself for each leg (Expect: it answers 100-continue)
_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "expect",
}
MAX_BODY = 256 << 20  # aiohttp refuses bodies over 1 MiB by default; long chats exceed that


@dataclass(eq=False)
class Backend:
    """One engine behind the proxy: its base URL, what capture records of it, and its requests in flight."""

    url: str
    meta: Mapping[str, str] = field(default_factory=dict)
    in_flight: int = 0  # touched on the proxy's loop thread only
    # its requests in flight by id (aiohttp's requests are not hashable); the loop's thread only
    requests: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class Exchange:
    """A finished request the proxy sampled for capture, as it went over the wire."""

    path: str
    request: bytes
    response: bytes
    meta: Mapping[str, str]
    started: float  # time.time() when the request arrived
    seconds: float  # until the last byte of the answer went out


class ServeProxy:
    def __init__(
        self,
        backend: Backend,
        port: int = 0,
        record: Callable[[Exchange], None] | None = None,
        rate: float = 1.0,
        status_extra: Callable[[], dict[str, Any]] | None = None,
    ):
        self._backend, self._known = backend, [backend]
        self.port, self._record, self._rate, self._extra = port, record, rate, status_extra
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def base_url(self) -> str:
        return f"http://{BIND_HOST}:{self.port}"

    @property
    def backend(self) -> Backend:
        return self._backend

    # ---- life cycle (any thread) -----------------------------------------------------------------------------
    def start(self) -> "ServeProxy":
        started: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(started,), name="serve-proxy", daemon=True)
        self._thread.start()
        started.result()  # an error binding the port is raised here
        return self

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and self._stopped is not None:
            loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(30)

    def __enter__(self) -> "ServeProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def route_to(self, backend: Backend) -> Backend:
        """Send new requests to `backend`; returns the one they went to before (still draining)."""
        return self._call(self._switch, backend)

    def in_flight(self, backend: Backend) -> int:
        return self._call(lambda: backend.in_flight)

    def drain(self, backend: Backend, timeout_s: float) -> bool:
        """Wait until `backend` has no request in flight (True), or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight(backend):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        self._call(lambda: backend in self._known and self._known.remove(backend))
        return True

    def cut(self, backend: Backend) -> int:
        """Close the client connections of `backend`'s requests in flight (a drain that timed out): each client sees
        its connection cut before the answer's end (a stream without `[DONE]`), never a short answer that looks
        complete, and nothing of them is captured. Returns how many were cut; `backend` is forgotten."""

        def run() -> int:
            n = 0
            for request in list(backend.requests.values()):
                if request.transport is not None:
                    request.transport.abort()
                    n += 1
            if backend in self._known:
                self._known.remove(backend)
            return n

        return self._call(run)

    def status(self) -> dict[str, Any]:
        return self._call(self._status)

    def _call(self, fn, *args):
        """Run `fn` on the loop's thread (where requests pick and count their backend) and return its result."""
        if self._loop is None:
            return fn(*args)
        done: Future = Future()

        def run() -> None:
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # handed to the caller's thread
                done.set_exception(e)

        self._loop.call_soon_threadsafe(run)
        return done.result(30)

    def _switch(self, backend: Backend) -> Backend:
        old, self._backend = self._backend, backend
        self._known.append(backend)
        return old

    def _status(self) -> dict[str, Any]:
        return {
            "backend": self._backend.url,
            "meta": dict(self._backend.meta),
            "in_flight": {b.url: b.in_flight for b in self._known},
            "capture": self._extra() if self._extra else None,
        }

    # ---- the loop's thread -----------------------------------------------------------------------------------
    def _run(self, started: Future) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve(loop, started))
        finally:
            loop.close()

    async def _serve(self, loop: asyncio.AbstractEventLoop, started: Future) -> None:
        import aiohttp
        from aiohttp import web

        self._stopped = asyncio.Event()
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/eagle/status", self._status_page)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0)
        # no read timeout: a long generation streams for as long as it takes; answers are passed on as they come
        self._session = aiohttp.ClientSession(
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            connector=aiohttp.TCPConnector(limit=0),
        )
        try:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((BIND_HOST, self.port))  # port 0: a free one, known before anything is served
            self.port = sock.getsockname()[1]
            await runner.setup()
            await web.SockSite(runner, sock).start()
        except BaseException as e:
            await self._session.close()
            await runner.cleanup()
            started.set_exception(e)
            return
        self._loop = loop
        started.set_result(None)
        try:
            await self._stopped.wait()
        finally:
            await runner.cleanup()
            await self._session.close()

    async def _forward(self, request):
        import aiohttp
        from aiohttp import web

        backend = self._backend  # picked and counted with no await between: route_to() sees it in flight
        backend.in_flight += 1
        backend.requests[id(request)] = request
        t0, wall = time.perf_counter(), time.time()
        kept: list[bytes] | None = None
        try:
            body = await request.read()
            if (
                self._record is not None
                and request.method == "POST"
                and request.path in CAPTURED_PATHS
                and random.random() < self._rate
            ):
                kept = []
            headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
            try:
                upstream = await self._session.request(
                    request.method, backend.url + request.raw_path, data=body if body else None, headers=headers
                )
            except (aiohttp.ClientError, OSError) as e:
                return web.json_response(
                    {
                        "error": {
                            "message": f"the engine at {backend.url} did not answer: {e}",
                            "type": "bad_gateway",
                            "code": 502,
                        }
                    },
                    status=502,
                )
            async with upstream:
                resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for k, v in upstream.headers.items():
                    if k.lower() not in _HOP:
                        resp.headers.add(k, v)
                if upstream.content_length is not None and "chunked" not in upstream.headers.get(
                    "Transfer-Encoding", ""
                ):
                    resp.content_length = upstream.content_length
                await resp.prepare(request)
                try:
                    async for chunk in upstream.content.iter_any():
                        await resp.write(chunk)
                        if kept is not None:
                            kept.append(chunk)
                    await resp.write_eof()
                except (ConnectionResetError, aiohttp.ClientError, OSError):
                    # the client hung up (vLLM aborts the request when its connection closes), or the engine died
                    # mid-answer: the client's connection is cut too, so a short answer never looks complete
                    upstream.close()
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                if kept is not None and upstream.status == 200:
                    self._hand_over(
                        Exchange(request.path, body, b"".join(kept), backend.meta, wall, time.perf_counter() - t0)
                    )
                return resp
        finally:
            backend.in_flight -= 1
            backend.requests.pop(id(request), None)

    async def _status_page(self, request):
        from aiohttp import web

        return web.json_response(self._status())

    def _hand_over(self, ex: Exchange) -> None:
        try:
            self._record(ex)  # type: ignore[misc]
        except Exception:  # capture must never fail a request (components/serving/capture.py counts its own drops)
            pass


if __name__ == "__main__":
    import sys

    with ServeProxy(Backend(sys.argv[1]), port=int(sys.argv[2]) if len(sys.argv) > 2 else 0) as proxy:
        print(f"proxying {proxy.base_url} -> {sys.argv[1]}; Ctrl-C stops it", flush=True)
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
