"""Health of the MLflow store: is the tracking server there, and which failures mean "the store is down".

Purpose: `probe_tracking(settings)` fails in seconds when MLFLOW_TRACKING_URI names a server that does not answer
(the CLI calls it before starting a flow); `with store_errors(settings, "registering ..."):` turns the store's
transient failures (a locked SQLite database, a server that is down or answers 5xx) into `TrackingUnreachable`
with the redacted URI and what to do, and lets errors about the request itself (a missing model) through.
Run: `python -m infra.mlflow_health` probes the store named by the environment.
Not here: the store's operations (infra/mlflow_store.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from mlflow.exceptions import MlflowException

from infra.mlflow_store import TrackingUnreachable, probe_http
from infra.settings import Settings, redact_uri


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
        raise TrackingUnreachable(f"MLflow at {redact_uri(settings.mlflow_tracking_uri)} failed while {doing}: "
                                  f"{str(err.message).splitlines()[0][:300]}. {_RETRY_HINT}") from err
    except (ConnectionError, TimeoutError) as err:
        if isinstance(err, TrackingUnreachable):
            raise
        raise TrackingUnreachable(f"MLflow at {redact_uri(settings.mlflow_tracking_uri)} is unreachable while "
                                  f"{doing}: {err}. {_RETRY_HINT}") from err


_TRANSIENT = {"TEMPORARILY_UNAVAILABLE", "INTERNAL_ERROR", "REQUEST_LIMIT_EXCEEDED", "DEADLINE_EXCEEDED",
              "SERVICE_UNDER_MAINTENANCE"}
_RETRY_HINT = ("Bring the store back and re-run the same command: finished stages are reused and the head is "
               "registered exactly once.")


if __name__ == "__main__":
    probe_tracking(Settings.from_env())
    print(f"MLflow store {redact_uri(Settings.from_env().mlflow_tracking_uri)}: reachable")
