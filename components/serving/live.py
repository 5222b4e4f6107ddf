"""Live serving: vLLM behind our proxy, with capture of what is served and a swap of the head without a failed request.

Purpose: `LiveServer(LiveConfig(...), Served(spec, head, target_name, target_version), settings)` is a context
manager that starts vLLM on a free loopback port, puts the proxy (infra/serve_proxy.py) on the public port in front
of it and, with `LiveConfig.capture`, a capture writer (components/serving/capture.py) under `<state>/capture`.
- `swap_to(served)`: starts a second vLLM with the new head beside the running one (another loopback port; on the
  CPU its worker on the CPUs the running one's leaves, infra/vllm_cpus.py, when they are enough), waits for its
  health, routes new requests to it, waits until the old one has finished the requests it had (at most
  `drain_timeout_s`), then stops it. A new engine that does not start leaves the old one serving (False).
- `follow(live, Follow(...), say)`: the loop of `eagle-heads serve --follow-alias`: every `interval_s` it asks
  `alias_version()` which version the alias names and, when it moved, `prepare(version)` (the flow builds the
  engine spec of that version) and `swap_to`; a registry that does not answer is a warning and the next poll.
  A drain that times out cuts the requests still running on the old engine (their clients' connections are closed
  before the answer's end: an error, never a short answer that looks complete), says how many, and stops it.
- `spec_counters()`: vLLM's speculative-decoding counters of what is served now (the live acceptance).
- Rollback (`Follow.rollback`, `monitor.rollback`): every `window_s` the loop reads those counters and judges the
  window of the head served now (components/serving/rollback.py `Judge`) against the previous champion's registered τ
  x `ratio` and the collapse floor; a rollback swaps back to what served before it (plain decoding when nothing
  did), never swaps the rolled-back version in again, and hands `RolledBack` to `rolled_back` (the flow moves the
  alias back with the reason and announces it).
Run: `eagle-heads serve --capture` / `--follow-alias` (flows/command_serve.py `serve`).
Not here: choosing the head and its K (flows/command_serve.py), the proxy's HTTP (infra/serve_proxy.py), the
dataset (components/serving/capture.py), the rollback's rules (components/serving/rollback.py), the registry and the
event.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

from components.serving.capture import CaptureConfig, CaptureWriter
from components.serving.monitor import RollbackConfig
from components.serving.rollback import Judge, Judgement
from infra.serve_proxy import Backend, ServeProxy
from infra.settings import Settings
from infra.vllm_engine_spec import EngineSpec
from infra.vllm_cpus import allowed_cpus, beside, bound_cpus
from infra.vllm_server import EngineError, SpecCounters, VllmServer, read_metrics


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
class RolledBack:
    """A rollback that happened: the version swapped out (None: not a registered one) and the one served now (None:
    plain decoding), with the window that decided it."""

    from_version: int | None
    to_version: int | None
    from_head: str
    to_head: str
    judgement: Judgement


@dataclass(frozen=True)
class Follow:
    alias_version: Callable[[], int | None]  # the version the alias names now (None: no such alias)
    prepare: Callable[[int], Served]  # the engine spec of that version
    version: int  # the version served at the start
    interval_s: float = 30.0
    rollback: RollbackConfig | None = None  # None or not enabled: never swapped back
    ratio: float = 0.8  # monitor.ratio: below ratio x the previous champion's registered tau is a drop
    registered_tau: Callable[[int], float | None] = lambda version: None  # a version's registered tau (None: none)
    rolled_back: Callable[[RolledBack], None] = lambda event: None  # moves the alias back and announces it


class LiveServer:
    def __init__(self, cfg: LiveConfig, first: Served, settings: Settings, say: Callable[[str], None] = print):
        self.cfg, self.settings, self.say = cfg, settings, say
        self.served = first
        self.engine: VllmServer | None = None
        self.proxy: ServeProxy | None = None
        self.capture = (
            CaptureWriter(settings.state_dir / "capture", cfg.capture, say) if cfg.capture is not None else None
        )

    @property
    def base_url(self) -> str:
        assert self.proxy is not None
        return self.proxy.base_url

    def __enter__(self) -> "LiveServer":
        try:
            self.engine = VllmServer(self.served.spec, self.settings).start()
            if self.capture is not None:
                self.capture.start()
            self.proxy = ServeProxy(
                Backend(self.engine.base_url, self.served.meta()),
                port=self.cfg.port or 0,
                record=self.capture.submit if self.capture else None,
                rate=self.cfg.capture.rate if self.cfg.capture else 1.0,
                status_extra=self.capture.stats if self.capture else None,
            ).start()
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
        bound = bound_cpus(self.engine.log_path) if served.spec.resolved_device() == "cpu" else None
        new = VllmServer(served.spec, self.settings, cpu_bind=beside(bound, allowed_cpus()))
        where = f" on CPU(s) {new.cpu_bind} (its worker holds {bound})" if new.cpu_bind else ""
        self.say(f"serve: starting vLLM with {served.head} beside the running one{where} (log {new.log_path})")
        try:
            new.start()
        except EngineError as e:
            new.stop()
            self.say(
                f"serve: warning: the engine for {served.head} did not start ({e}); still serving {self.served.head}"
            )
            return False
        except BaseException:  # Ctrl-C while it starts: the running one is stopped by __exit__, this one here
            new.stop()
            raise
        old_engine, old = self.engine, self.proxy.route_to(Backend(new.base_url, served.meta()))
        self.engine, previous, self.served = new, self.served, served
        t0 = time.monotonic()
        drained = self.proxy.drain(old, self.cfg.drain_timeout_s)
        cut = 0 if drained else self.proxy.cut(old)  # before the stop: they end as cut, not as short answers
        old_engine.stop()
        how = (
            f"drained in {time.monotonic() - t0:.1f} s"
            if drained
            else f"drain timed out after {self.cfg.drain_timeout_s:g} s: {cut} request(s) still running were cut, "
            "their clients' connections closed before the answer's end"
        )
        self.say(f"serve: swapped {previous.head} -> {served.head} ({how}); new requests go to {new.base_url}")
        return True


def plain(served: Served) -> Served:
    """The same target served without a head (what a rollback with no previous champion returns to)."""
    spec = dataclasses.replace(served.spec, head_dir=None, method=None, num_speculative_tokens=1, k_schedule=None)
    return Served(spec, "", served.target_name, served.target_version)


def follow(live: LiveServer, f: Follow | None, say: Callable[[str], None] = print) -> int:
    """Serve until the engine dies (1) or Ctrl-C; with `f`, swap when the alias moves and, with `f.rollback`, swap
    back when the served head's live acceptance collapses. A version that failed to start is not tried again until
    the alias moves on; a version rolled back is not swapped in again by this server."""
    if f is None:
        while live.alive():
            time.sleep(1.0)
        return 1
    return _Following(live, f, say).run()


class _Following:
    """The loop of `follow`: what this server served (newest last), alias polls and a judged window each
    `rollback.window_s`."""

    def __init__(self, live: LiveServer, f: Follow, say: Callable[[str], None]):
        self.live, self.f, self.say = live, f, say
        self.history: list[tuple[int | None, Served]] = [(f.version, live.served)]
        self.failed: int | None = None
        self.refused: set[int] = set()
        self.judge: Judge | None = None

    @property
    def version(self) -> int | None:
        return self.history[-1][0]

    def run(self) -> int:
        rb = self.f.rollback if self.f.rollback is not None and self.f.rollback.enabled else None
        step = min(1.0, self.f.interval_s, rb.window_s if rb else 1.0)
        next_poll = time.monotonic() + self.f.interval_s
        self._judge_anew(time.monotonic())
        next_read = time.monotonic() + (rb.window_s if rb else 0.0)
        while self.live.alive():
            time.sleep(step)
            now = time.monotonic()
            if rb is not None and self.judge is not None and now >= next_read:
                next_read = now + rb.window_s
                self._read(now)
            if now >= next_poll:
                next_poll = time.monotonic() + self.f.interval_s
                self._poll()
        return 1

    def _judge_anew(self, now: float) -> None:
        """A fresh judge for the head served now (none for plain decoding, or with rollback off), its first reading."""
        rb, self.judge = self.f.rollback, None
        if rb is None or not rb.enabled or not self.live.served.head:
            return
        before, tau = self.history[-2][0] if len(self.history) > 1 else None, None
        try:
            tau = self.f.registered_tau(before) if before is not None else None
        except Exception as e:  # a registry that does not answer: the collapse floor still holds
            self.say(
                f"serve: warning: cannot read version {before}'s registered tau ({type(e).__name__}: {e}); "
                "judging against the collapse floor only"
            )
        self.judge = Judge(rb, self.f.ratio, tau)
        self._read(now)

    def _read(self, now: float) -> None:
        assert self.judge is not None
        try:
            counters = self.live.spec_counters()
        except Exception as e:  # a page that does not answer now may at the next window
            self.say(f"serve: warning: cannot read the live acceptance ({type(e).__name__}: {e})")
            return
        j = self.judge.observe(counters, now)
        if j.windows:
            self.say(f"serve: {self.live.served.head} window {j.windows}: {j.reason}: {j.verdict}")
        if j.roll_back:
            self._roll_back(j)

    def _roll_back(self, j: Judgement) -> None:
        bad_version, bad = self.history[-1]
        to_version, to = self.history[-2] if len(self.history) > 1 else (None, plain(bad))
        self.say(f"serve: rolling back {bad.head} -> {to.head or 'plain decoding'} ({j.reason})")
        if not self.live.swap_to(to):
            self.say(
                f"serve: warning: the rollback did not start; still serving {bad.head}, the next window judges again"
            )
            return
        self.history.pop()
        if not self.history:
            self.history.append((None, to))
        if bad_version is not None:
            self.refused.add(bad_version)
        self.f.rolled_back(RolledBack(bad_version, to_version, bad.head, to.head, j))
        self._judge_anew(time.monotonic())

    def _poll(self) -> None:
        try:
            now = self.f.alias_version()
        except Exception as e:  # a registry that does not answer now may answer at the next poll
            self.say(f"serve: warning: cannot read the alias ({type(e).__name__}: {e}); serving version {self.version}")
            return
        if now is None or now in (self.version, self.failed) or now in self.refused:
            return
        self.say(f"serve: the alias moved to version {now} (serving {self.version})")
        try:
            served = self.f.prepare(now)
        except Exception as e:  # a version whose files cannot be fetched or served: keep the one that works
            self.say(
                f"serve: warning: version {now} cannot be served ({type(e).__name__}: {e}); serving {self.version}"
            )
            self.failed = now
            return
        if self.live.swap_to(served):
            self.history.append((now, served))
            self.failed = None
            self._judge_anew(time.monotonic())
        else:
            self.failed = now
