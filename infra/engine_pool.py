"""Running vLLM engines handed from one stage to the next, so that a server of the same spec is not started twice.

Purpose: `with EnginePool() as engines:` spans stages that serve the same target, e.g. the vLLM evaluation and the
load sweep of one head. `with engines.running(plain, spec) as (p, s):` is `infra.vllm_server.running` except that
a server of an engine the pool holds idle (`same_engine`) is taken from the pool instead of started, and that on a
clean exit the servers are parked in the pool (`keep=False`: stopped) for the next stage; on an error they are
stopped. `take_each(servers)` gives a stage that starts its servers its own way the parked ones of the same engines
and stops the rest first (their memory is the stage's). Closing the pool stops whatever is parked. Each start the
pool saves is the engine's import and load: ~18 s of both cores for the tiny CPU targets here, minutes for a large
target on GPUs.
`launch(*servers)` starts servers early, parked before they are up (the evaluation's pair while this process decodes
untimed, flows/train_head.py).
Engines are started from the pool's own threads, which live until it closes: an engine dies with the thread that
started it (`PR_SET_PDEATHSIG` is per thread), so one parked by a stage outlives the stage's threads.
A parked server keeps its cumulative counters and its prefix cache: every consumer here reads counter deltas, and
a stage that measures speed treats all its servers alike (the load sweep's rounds repeat the same prompts, so
every server's cache holds them after its first round).
Not here: starting and talking to one engine (infra/vllm_server.py).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Iterator

from infra.vllm_server import EngineError, VllmServer, start_each, start_groups

MAX_THREADS = 16  # engines one pool can start at once; more wait for a thread


def same_engine(a: VllmServer, b: VllmServer) -> bool:
    """Whether `a` and `b` run the same engine: the same server arguments (ports aside) and environment; specs that
    differ only where vLLM cannot tell (a plain engine's `num_speculative_tokens`) match."""
    return (a.spec.server_args(0), a.spec.env) == (b.spec.server_args(0), b.spec.env)


@contextlib.contextmanager
def stopping(*servers: VllmServer) -> Iterator[list[VllmServer]]:
    """`with stopping(*running_servers) as up:` the servers, stopped on exit (`running` for servers already up)."""
    try:
        yield list(servers)
    finally:
        for s in servers:
            s.stop()


class EnginePool:
    """Idle running servers by spec, for the stages of one scope; see the module doc."""

    def __init__(self) -> None:
        self._threads = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="vllm-pool")
        self._idle: list[VllmServer] = []
        self.started = 0  # engines this pool started
        self.reused = 0  # servers handed on from one stage to another

    def take(self, server: VllmServer) -> VllmServer | None:
        """A parked, still healthy server of `server`'s spec (removed from the pool), else None."""
        for i, idle in enumerate(self._idle):
            if not same_engine(idle, server):
                continue
            del self._idle[i]
            try:
                return idle.wait_ready()  # one /health request when it is up
            except EngineError:
                idle.stop()  # died while parked: the caller starts a new one
                return None
        return None

    def launch(self, *servers: VllmServer) -> None:
        """Start `servers` now, from the pool's threads, without waiting for them, and park them: a later `running`
        (or `take`) of the same engine takes each and waits until it is up, so that its start overlaps whatever this
        process does meanwhile. One that fails to start is stopped there and started anew by the taker. Of compiled
        CPU engines only the first is launched (their starts go one at a time, `start_groups`): the taker starts the
        rest."""
        servers = tuple(group[0] for group in start_groups(servers))  # every eager one, the first compiled one
        for f in [self._threads.submit(s.launch) for s in servers]:
            f.result()
        self.started += len(servers)
        self.park(*servers)

    def park(self, *servers: VllmServer) -> None:
        self._idle += [s for s in servers if s.proc is not None and s.proc.poll() is None]

    @contextlib.contextmanager
    def running(self, *servers: VllmServer, keep: bool = True) -> Iterator[list[VllmServer]]:
        """Every server up (parked ones of the same spec taken, the rest started at once from the pool's threads),
        yielded once all are healthy; on a clean exit parked (`keep`) or stopped, on an error stopped. When one
        fails to start, the others are still waited for and stopped, and the first failure is raised."""
        up = [self.take(s) or s for s in servers]
        fresh = [s for s, before in zip(up, servers) if s is before]
        self.reused += len(up) - len(fresh)
        self.started += len(fresh)
        ok = False
        try:
            starts = [self._threads.submit(start_each, group) for group in start_groups(fresh)]
            wait(starts)
            for f in starts:
                f.result()
            yield up
            ok = True
        finally:
            if ok and keep:
                self.park(*up)
            else:
                for s in up:
                    s.stop()

    def take_each(self, servers: list[VllmServer]) -> list[VllmServer | None]:
        """For each of `servers` a parked, healthy server of its spec (taken: the caller stops it), else None; every
        parked server not taken is stopped, so that a stage sized for its own engines finds their memory free (a
        server taken has the very memory arguments of the one it replaces)."""
        taken = [self.take(s) for s in servers]
        self.reused += sum(t is not None for t in taken)
        self.drop()
        return taken

    def drop(self) -> None:
        """Stop every parked server."""
        idle, self._idle = self._idle, []
        for s in idle:
            s.stop()

    def close(self) -> None:
        self.drop()
        self._threads.shutdown(wait=True)

    def __enter__(self) -> "EnginePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
