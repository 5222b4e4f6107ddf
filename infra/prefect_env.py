"""Prefect adapter: local defaults for the ephemeral mode, and emitting the events that trigger deployments.

Purpose: `apply_prefect_defaults(settings)` keeps Prefect's state under the state dir (`PREFECT_HOME`), turns
analytics off, keeps a server we start on loopback and gives the temporary API 120 s to start (longer than
Prefect's own wait, which a loaded machine can exceed), each only where the user has not set it, and applies the
libraries' quiet defaults (infra/quiet.py). Call it at the start of a program, before Prefect is imported when
possible (Prefect reads its settings at import; if it is already imported, its settings are refreshed).
`emit_event(...)` sends one event (the registry watcher announces a new target version with it) to the Prefect
API, where a deployment's `triggers:` entry can start a flow run from it.

`start_local_api()` starts Prefect's temporary local API (loopback) under a lock, so that two processes sharing a
new Prefect home do not migrate its database at the same time, and ties the server's life to this process (a
`kill -9` would otherwise leave it running).
`hide_bad_input_failures()` keeps Prefect's log of a task or flow that failed on bad input (`eagle.errors.BadInput`,
a stage's own refusal) off the terminal: the CLI prints that refusal as its one line. The records still reach
Prefect's API (the run's logs in its UI); any other failure is printed as before.

Run: `python -m infra.prefect_env` prints the defaults it would set.
Not here: flows, deployments, `serve()`. Triggers need a running server (`prefect server start`, or
`serve()` against one): with no Prefect API, `emit_event` logs a warning and sends nothing.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from infra.quiet import apply_quiet_defaults
from infra.settings import BIND_HOST, Settings, state_env_defaults

logger = logging.getLogger(__name__)


def prefect_env_defaults(settings: Settings) -> dict[str, str]:
    """The Prefect variables this project wants when the user has not chosen otherwise."""
    return {
        "PREFECT_HOME": str(settings.prefect_home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": BIND_HOST,
        # the temporary API's start-up (a database migration) can outlast Prefect's own wait on a loaded machine
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }


def _refresh_prefect_settings() -> None:
    """Prefect reads the environment once, at import: make an already imported Prefect read it again."""
    if "prefect.context" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


def apply_prefect_defaults(settings: Settings) -> dict[str, str]:
    """Set each default that is absent from the environment (the libraries' quiet defaults too); returns the ones
    it set."""
    applied = apply_quiet_defaults()
    applied |= {k: v for k, v in prefect_env_defaults(settings).items() if not os.environ.get(k)}
    # the state's variables: only where absent (set empty, the user turned it off)
    applied |= {k: v for k, v in state_env_defaults(settings).items() if k not in os.environ}
    if "PREFECT_HOME" in applied:
        settings.prefect_home.mkdir(parents=True, exist_ok=True)  # the ephemeral server's SQLite lives there
    os.environ.update(applied)
    if applied:
        _refresh_prefect_settings()
    return applied


@contextmanager
def prefect_defaults(settings: Settings) -> Iterator[dict[str, str]]:
    """`apply_prefect_defaults` for the block only (tests): the variables it set are removed afterwards."""
    applied = apply_prefect_defaults(settings)
    try:
        yield applied
    finally:
        for key in applied:
            os.environ.pop(key, None)
        if applied:
            _refresh_prefect_settings()


def start_local_api() -> str | None:
    """Start Prefect's temporary local API now, under a lock in the Prefect home, when no PREFECT_API_URL is set.

    Prefect starts it by itself at the first flow run; two processes sharing a new Prefect home then create and
    migrate its database at the same time and one of them fails ("duplicate column name"). Started here first (the
    server is one per process and the flows reuse it), the second process waits for the first one's migration.
    The server process is tied to this one (Linux: it gets SIGTERM when this process dies, `kill -9` included):
    Prefect stops it from `atexit`, which a kill skips, and it would keep running.
    Returns the API URL, or None when a Prefect server is configured (nothing to start).
    """
    import fcntl

    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED, get_current_settings

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    from prefect.server.api.server import SubprocessASGIServer

    home = get_current_settings().home
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "local-api-start.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            server = SubprocessASGIServer()
            with _children_die_with_us():
                server.start()
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return server.api_url


_FAILED_STATE = re.compile(r"encountered an exception:? ([A-Za-z_]\w*): ")


def _bad_input_names() -> set[str]:
    """The class names of `BadInput` and every subclass loaded now (a raised one is loaded)."""
    from eagle.errors import BadInput

    names, todo = set(), [BadInput]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names


def is_bad_input_failure(record: logging.LogRecord) -> bool:
    """Whether `record` is Prefect's log of a run that failed on bad input: its exception (`exc_info`: "Encountered
    exception during execution", a retry's log) is a `BadInput`, or its message is a final state whose exception is
    one ("Finished in state Failed('Task run encountered an exception TrafficFormatError: ...')"; the state's message
    names the class only, so this matches by class name)."""
    from eagle.errors import BadInput

    if record.exc_info and record.exc_info[1] is not None:
        return isinstance(record.exc_info[1], BadInput)
    if record.levelno < logging.ERROR and "Finished in state" not in str(record.msg):
        return False
    found = _FAILED_STATE.search(record.getMessage())
    return bool(found) and found.group(1) in _bad_input_names()


class _HideBadInputFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith("prefect") and is_bad_input_failure(record))


def hide_bad_input_failures() -> None:
    """Filter Prefect's logs of runs that failed on bad input out of the terminal handlers (the root logger's, where
    Prefect's console handler is; its API handlers keep them). Call it once Prefect is imported (its logging set
    up); calling it again adds nothing."""
    import prefect.main  # noqa: F401 (sets up Prefect's logging, whose console handler is filtered here)

    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _HideBadInputFailures) for f in handler.filters):
            handler.addFilter(_HideBadInputFailures())


@contextmanager
def _children_die_with_us() -> Iterator[None]:
    """Processes started in the block (by this thread) get SIGTERM when this process dies (Linux; else nothing).

    Uses `preexec_fn`, which is safe while the process has a single thread: call it before any flow runs.
    """
    import ctypes
    import signal
    import subprocess

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        yield
        return

    def tie() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG

    real = subprocess.Popen

    class Tied(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("preexec_fn", tie)
            super().__init__(*args, **kwargs)

    subprocess.Popen = Tied  # type: ignore[misc]
    try:
        yield
    finally:
        subprocess.Popen = real  # type: ignore[misc]


def emit_event(
    event: str,
    resource_id: str,
    *,
    payload: Mapping[str, Any] | None = None,
    labels: Mapping[str, str] | None = None,
    related: list[Mapping[str, str]] | None = None,
    flush_timeout_s: float | None = 10.0,
) -> str | None:
    """Emit `event` about resource `resource_id`; returns the event id, or None when nothing was sent.

    Nothing is sent without a Prefect API (PREFECT_API_URL, or a test harness): Prefect would otherwise start
    a throwaway ephemeral server for the event, where no trigger can see it. Events leave through a
    background worker: with `flush_timeout_s` set, wait up to that long for it to send, so that a
    short-lived process does not exit with the event still queued.
    """
    from prefect.events import emit_event as prefect_emit
    from prefect.events.worker import EventsWorker
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        logger.warning("no Prefect API (PREFECT_API_URL unset): event %s about %s not sent", event, resource_id)
        return None
    resource = {"prefect.resource.id": resource_id, **{str(k): str(v) for k, v in (labels or {}).items()}}
    sent = prefect_emit(
        event=event,
        resource=resource,
        payload=dict(payload or {}),
        related=[dict(r) for r in related] if related else None,
    )
    if sent is None:
        return None
    if flush_timeout_s:
        waiter = threading.Thread(target=EventsWorker.instance().wait_until_empty, daemon=True)
        waiter.start()
        waiter.join(flush_timeout_s)
        if waiter.is_alive():
            raise TimeoutError(f"event {event} was not sent within {flush_timeout_s} s: is PREFECT_API_URL up?")
    return str(sent.id)


if __name__ == "__main__":
    for key, value in prefect_env_defaults(Settings.from_env()).items():
        print(f"{key}={value}")
