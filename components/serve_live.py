"""Live serving: vLLM behind our proxy, with capture of what is served and a swap of the head without a failed request.

Purpose: `LiveServer(LiveConfig(...), Served(spec, head, target_name, target_version), settings)` is a context
manager that starts vLLM on a free loopback port, puts the proxy (infra/serve_proxy.py) on the public port in front
of it and, with `LiveConfig.capture`, a capture writer (components/capture.py) under `<state>/capture`.
- `swap_to(served)`: starts a second vLLM with the new head beside the running one (another loopback port), waits
  for its health, routes new requests to it, waits until the old one has finished the requests it had (at most
  `drain_timeout_s`), then stops it. A new engine that does not start leaves the old one serving (False).
- `follow(live, Follow(...), say)`: the loop of `eagle-heads serve --follow-alias`: every `interval_s` it asks
  `alias_version()` which version the alias names and, when it moved, `prepare(version)` (the flow builds the
  engine spec of that version) and `swap_to`; a registry that does not answer is a warning and the next poll.
- `spec_counters()`: vLLM's speculative-decoding counters of what is served now (the live acceptance).
Run: `eagle-heads serve --capture` / `--follow-alias` (flows/command_runs.py `serve`).
Not here: choosing the head and its K (flows/command_runs.py), the proxy's HTTP (infra/serve_proxy.py), the
dataset (components/capture.py), rolling back on a collapse of acceptance.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from components.capture import CaptureConfig, CaptureWriter
from infra.serve_proxy import Backend, ServeProxy
from infra.settings import Settings
from infra.vllm_server import EngineError, EngineSpec, SpecCounters, VllmServer, read_metrics


@dataclass(frozen=True)
class Served:
    """One head serving one target: the engine's spec and what a captured row says served it."""

    spec: EngineSpec
    head: str  # as named: models:/NAME/VERSION, or a directory ("" for plain decoding)
    target_name: str
    target_version: str = ""

    def meta(self) -> dict[str, str]:
        return {"head": self.head, "target_name": self.target_name, "target_version": self.target_version}


@dataclass(frozen=True)
class LiveConfig:
    port: int | None = None  # the public port (None: a free one)
    capture: CaptureConfig | None = None  # None: record nothing
    drain_timeout_s: float = 600.0  # how long a replaced engine may take to finish its requests before it is stopped


@dataclass(frozen=True)
class Follow:
    alias_version: Callable[[], int | None]  # the version the alias names now (None: no such alias)
    prepare: Callable[[int], Served]  # the engine spec of that version
    version: int  # the version served at the start
    interval_s: float = 30.0


class LiveServer:
    def __init__(self, cfg: LiveConfig, first: Served, settings: Settings, say: Callable[[str], None] = print):
        self.cfg, self.settings, self.say = cfg, settings, say
        self.served = first
        self.engine: VllmServer | None = None
        self.proxy: ServeProxy | None = None
        self.capture = (CaptureWriter(settings.state_dir / "capture", cfg.capture, say)
                        if cfg.capture is not None else None)

    @property
    def base_url(self) -> str:
        assert self.proxy is not None
        return self.proxy.base_url

    def __enter__(self) -> "LiveServer":
        try:
            self.engine = VllmServer(self.served.spec, self.settings).start()
            if self.capture is not None:
                self.capture.start()
            self.proxy = ServeProxy(Backend(self.engine.base_url, self.served.meta()), port=self.cfg.port or 0,
                                    record=self.capture.submit if self.capture else None,
                                    rate=self.cfg.capture.rate if self.cfg.capture else 1.0,
                                    status_extra=self.capture.stats if self.capture else None).start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proxy is not None:
            self.proxy.stop()  # first: no request reaches an engine that is stopping
        if self.engine is not None:
            self.engine.stop()
        if self.capture is not None:
            self.capture.close()

    def alive(self) -> bool:
        proc = self.engine.proc if self.engine else None
        return proc is not None and proc.poll() is None

    def spec_counters(self) -> SpecCounters:
        assert self.proxy is not None
        return SpecCounters.parse(read_metrics(self.proxy.backend.url + "/metrics"))

    def swap_to(self, served: Served) -> bool:
        """Serve `served` from now on without failing a request (see the module docstring); False: not swapped."""
        assert self.proxy is not None and self.engine is not None
        new = VllmServer(served.spec, self.settings)
        self.say(f"serve: starting vLLM with {served.head} beside the running one (log {new.log_path})")
        try:
            new.start()
        except EngineError as e:
            new.stop()
            self.say(f"serve: warning: the engine for {served.head} did not start ({e}); still serving "
                     f"{self.served.head}")
            return False
        except BaseException:  # Ctrl-C while it starts: the running one is stopped by __exit__, this one here
            new.stop()
            raise
        old_engine, old = self.engine, self.proxy.route_to(Backend(new.base_url, served.meta()))
        self.engine, previous, self.served = new, self.served, served
        t0 = time.monotonic()
        drained = self.proxy.drain(old, self.cfg.drain_timeout_s)
        old_engine.stop()
        how = (f"drained in {time.monotonic() - t0:.1f} s" if drained else
               f"{self.proxy.in_flight(old)} requests still running after {self.cfg.drain_timeout_s:.0f} s were cut")
        self.say(f"serve: swapped {previous.head} -> {served.head} ({how}); new requests go to {new.base_url}")
        return True


def follow(live: LiveServer, f: Follow | None, say: Callable[[str], None] = print) -> int:
    """Serve until the engine dies (1) or Ctrl-C; with `f`, swap when the alias moves. A version that failed to start
    is not tried again until the alias moves on."""
    if f is None:
        while live.alive():
            time.sleep(1.0)
        return 1
    version, failed = f.version, None
    next_poll = time.monotonic() + f.interval_s
    while live.alive():
        time.sleep(min(1.0, f.interval_s))
        if time.monotonic() < next_poll:
            continue
        next_poll = time.monotonic() + f.interval_s
        try:
            now = f.alias_version()
        except Exception as e:  # a registry that does not answer now may answer at the next poll
            say(f"serve: warning: cannot read the alias ({type(e).__name__}: {e}); serving version {version}")
            continue
        if now is None or now in (version, failed):
            continue
        say(f"serve: the alias moved to version {now} (serving {version})")
        try:
            served = f.prepare(now)
        except Exception as e:  # a version whose files cannot be fetched or served: keep the one that works
            say(f"serve: warning: version {now} cannot be served ({type(e).__name__}: {e}); serving {version}")
            failed = now
            continue
        if live.swap_to(served):
            version, failed = now, None
        else:
            failed = now
    return 1
