"""Health of the MLflow store: is the tracking server there, and which failures mean "the store is down".

Purpose: `probe_tracking(settings)` (`probe_http(uri)` underneath; `MlflowStore` probes with it too) fails in seconds
with `TrackingUnreachable` when MLFLOW_TRACKING_URI names a server that does not answer (the CLI calls it before
starting a flow); `with store_errors(settings, "registering ..."):` turns the store's transient failures (a locked
SQLite database, a server that is down or answers 5xx) into `TrackingUnreachable` with the redacted URI and what to
do, and lets errors about the request itself (a missing model) through. `open_client(uri)` opens an `MlflowClient`
safely when processes create a new SQLite store at once (MLflow creates its tables in the client's constructor).
Run: `python -m infra.mlflow_health` probes the store named by the environment.
Not here: the store's operations (infra/mlflow_store.py).
"""

from __future__ import annotations

import fcntl
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit, urlunsplit

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from infra.settings import Settings, redact_uri


class TrackingUnreachable(ConnectionError):
    """The MLflow tracking server named by the settings does not answer."""


def probe_http(uri: str, timeout_s: float) -> None:
    """Any HTTP answer from `<uri>/health` counts as reachable; no answer within `timeout_s` does not.

    Credentials in the URI (`user:password@`) are left out of the probe: urllib cannot send them, and any answer,
    401 included, proves the server is there.
    """
    parts = urlsplit(uri)
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else (parts.hostname or "")
    bare = urlunsplit(parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")))
    try:
        urllib.request.urlopen(bare.rstrip("/") + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # the server answered (auth, proxy or a 404): it is there
    except (OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise TrackingUnreachable(
            f"MLflow tracking server {redact_uri(uri)} is unreachable ({reason}). Start it, for example "
            "`mlflow server --host 127.0.0.1 --port 5000 --workers 1`, or fix MLFLOW_TRACKING_URI; unset "
            "MLFLOW_TRACKING_URI to use the local SQLite store under the state dir (EAGLE_HOME)."
        ) from err


def probe_tracking(settings: Settings, timeout_s: float = 5.0) -> None:
    """`TrackingUnreachable` now if the tracking URI is a server that does not answer (a local store: nothing)."""
    if settings.mlflow_tracking_uri.startswith(("http://", "https://")):
        probe_http(settings.mlflow_tracking_uri, timeout_s)


@contextmanager
def store_errors(settings: Settings, doing: str) -> Iterator[None]:
    """Turn the store's transient failures (locked database, server down or erroring) into `TrackingUnreachable`.

    Errors that are about the request (a missing model, a bad name) pass through unchanged.
    """
    try:
        yield
    except MlflowException as err:
        if err.error_code not in _TRANSIENT:
            raise
        raise TrackingUnreachable(
            f"MLflow at {redact_uri(settings.mlflow_tracking_uri)} failed while {doing}: "
            f"{str(err.message).splitlines()[0][:300]}. {_RETRY_HINT}"
        ) from err
    except (ConnectionError, TimeoutError) as err:
        if isinstance(err, TrackingUnreachable):
            raise
        raise TrackingUnreachable(
            f"MLflow at {redact_uri(settings.mlflow_tracking_uri)} is unreachable while {doing}: {err}. {_RETRY_HINT}"
        ) from err


_TRANSIENT = {
    "TEMPORARILY_UNAVAILABLE",
    "INTERNAL_ERROR",
    "REQUEST_LIMIT_EXCEEDED",
    "DEADLINE_EXCEEDED",
    "SERVICE_UNDER_MAINTENANCE",
}
_RETRY_HINT = (
    "Bring the store back and re-run the same command: finished stages are reused and the head is "
    "registered exactly once."
)


@contextmanager
def creating_store(uri: str) -> Iterator[None]:
    """Hold `<db>.lock` while MLflow opens a SQLite store: two processes creating its tables at once corrupt
    the schema migration (alembic: "expected to match one row", or "table ... already exists"); the second
    waits and finds them made."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    with open(Path(uri[len("sqlite:///") :]).expanduser().with_suffix(".lock"), "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def open_client(uri: str) -> MlflowClient:
    """An `MlflowClient` on `uri` for tracking and registry. MLflow opens the tracking store (and creates a new
    SQLite store's tables) in the constructor, so a SQLite store is opened under `creating_store`'s lock."""
    with creating_store(uri):
        return MlflowClient(tracking_uri=uri, registry_uri=uri)


if __name__ == "__main__":
    probe_tracking(Settings.from_env())
    print(f"MLflow store {redact_uri(Settings.from_env().mlflow_tracking_uri)}: reachable")
