"""MLflow adapter: runs, batched metrics, head directories as artifacts, and the model registry of heads.

Purpose: `MlflowStore.connect(settings)` gives one small object over `MlflowClient` that the components use to
record a training run and register its head: log the head's safetensors directory with `log_dir`, register
`runs:/<run_id>/<path>` with `register` (idempotent on a `run_key` tag), move the `champion`/`challenger`
aliases, and `resolve` a `models:/name/version` or `models:/name@alias` URI to a local directory.
Registered models that hold heads carry the tag `kind=eagle3-head`; registering a head into a model without
it is refused, so a head never lands among a target's versions (`check_kind` checks a name without writing).
Two processes opening a new SQLite store at once take turns creating its tables (`creating_store`, a lock beside
the file, in infra/mlflow_health.py).
A failed run body ends its MLflow run FAILED without hiding the body's error if the store is down too.

Run: `python -m infra.mlflow_store` connects with `Settings.from_env()` and lists registered models.
Not here: what a head is or how it is scored (components), the promotion gate, tracking-server management,
probing the server and classifying its failures (infra/mlflow_health.py).
`connect` also points MLflow's process-wide tracking and registry URIs at the store, because MLflow resolves
some URIs (logged models, `models:/<model_id>`) through its global client.
`register` tries a tracking server that does not answer again (`REGISTER_ATTEMPTS`, doubling delays) and keeps
one version per `run_key` even when MLflow's client re-sent a create whose answer was lost (the server died after
committing it): the key's later versions are deleted, the oldest kept.
Not safe against two processes registering the same `run_key` at the same instant (MLflow has no conditional
create); the flows run one registration per key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import mlflow
import mlflow.artifacts
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH

from eagle.errors import BadInput
from infra.mlflow_health import creating_store
from infra.mlflow_health import TrackingUnreachable, probe_http  # noqa: F401  (callers import them from here)
from infra.model_uri import lookup, parse_model_uri  # noqa: F401  (callers import parse_model_uri from here)
from infra.settings import Settings, redact_uri

logger = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "eagle3-heads"
KIND_TAG = "kind"
HEAD_KIND = "eagle3-head"
RUN_KEY_TAG = "run_key"
CHAMPION = "champion"
CHALLENGER = "challenger"
REGISTER_ATTEMPTS = 7  # a server that does not answer: tried again 1, 2, 4, 8, 16 and 32 s later (63 s in all)
REGISTER_FIRST_DELAY_S = 1.0

_TAG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


class RegistryCollision(BadInput):
    """A registered model of that name exists but holds something else than what is being registered."""


@dataclass(frozen=True)
class ModelVersionRef:
    """One registered model version, as plain data (no MLflow entity leaks out of this module)."""

    name: str
    version: int
    run_id: str | None
    source: str
    tags: Mapping[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


@dataclass(frozen=True)
class RegisteredModelRef:
    name: str
    tags: Mapping[str, str] = field(default_factory=dict)
    aliases: Mapping[str, int] = field(default_factory=dict)  # alias -> version


def _quoted(value: str, what: str) -> str:
    if "'" in value or "\\" in value:
        raise ValueError(f"{what} {value!r} may not contain quotes or backslashes")
    return f"'{value}'"


def _version_ref(mv, aliases: Iterable[str] = ()) -> ModelVersionRef:
    return ModelVersionRef(
        name=mv.name,
        version=int(mv.version),
        run_id=mv.run_id or None,
        source=mv.source,
        tags=dict(mv.tags or {}),
        aliases=tuple(sorted(set(aliases) | set(mv.aliases or ()))),
    )


def _check_kind(rm, kind: str) -> None:
    found = (rm.tags or {}).get(KIND_TAG)
    if found != kind:
        raise RegistryCollision(
            f"registered model {rm.name!r} exists with {KIND_TAG}={found!r}, not {kind!r}: refusing to add a "
            f"version of kind {kind!r} to it. Register under another name (heads are usually '<target>-eagle3'; "
            "for a target given as a directory pass another --name)."
        )


def _prepare_local_store(uri: str) -> None:
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).expanduser().parent.mkdir(parents=True, exist_ok=True)


def _create_experiment(client: MlflowClient, name: str, settings: Settings):
    try:
        client.create_experiment(name, artifact_location=settings.mlflow_artifact_location)
    except MlflowException as race:  # another process (on a tracking server) created it first
        if race.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    return client.get_experiment_by_name(name)


class MlflowStore:
    """Tracking and registry operations for heads, over one `MlflowClient`. Build it with `connect`."""

    def __init__(self, client: MlflowClient, settings: Settings, experiment_id: str):
        self.client = client
        self.settings = settings
        self.experiment_id = experiment_id

    @classmethod
    def connect(cls, settings: Settings, experiment: str = DEFAULT_EXPERIMENT, timeout_s: float = 5.0) -> MlflowStore:
        """Open the store named by `settings`, creating the SQLite directory and the experiment when missing."""
        uri = settings.mlflow_tracking_uri
        if uri.startswith(("http://", "https://")):
            probe_http(uri, timeout_s)
        _prepare_local_store(uri)
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        try:
            with creating_store(uri):  # MLflow creates a new store's tables in the client; one process at a time
                client = MlflowClient(tracking_uri=uri, registry_uri=uri)
                exp = client.get_experiment_by_name(experiment) or _create_experiment(client, experiment, settings)
            exp_id = exp.experiment_id
            if exp.lifecycle_stage == "deleted":
                client.restore_experiment(exp_id)
        except MlflowException as err:
            raise TrackingUnreachable(
                f"MLflow at {redact_uri(uri)} refused the experiment {experiment!r}: {err.message}"
            ) from err
        return cls(client, settings, exp_id)

    @property
    def tracking_uri(self) -> str:
        return self.settings.mlflow_tracking_uri

    # ---- runs -------------------------------------------------------------------------------------------

    def start_run(self, run_name: str, tags: Mapping[str, str] | None = None) -> str:
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=dict(tags or {}))
        return run.info.run_id

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    @contextmanager
    def run(self, run_name: str, tags: Mapping[str, str] | None = None) -> Iterator[str]:
        """A run that ends FINISHED, or FAILED (KILLED on Ctrl-C) when the body raises."""
        run_id = self.start_run(run_name, tags)
        try:
            yield run_id
        except KeyboardInterrupt:
            self._end_quietly(run_id, "KILLED")
            raise
        except BaseException:
            self._end_quietly(run_id, "FAILED")  # the store may be what failed: keep the original error
            raise
        self.end_run(run_id, "FINISHED")

    def _end_quietly(self, run_id: str, status: str) -> None:
        try:
            self.end_run(run_id, status)
        except Exception as err:  # noqa: BLE001 (reported, and the body's error propagates)
            logger.warning("could not mark MLflow run %s %s: %s", run_id, status, err)

    def log_params(self, run_id: str, params: Mapping[str, object]) -> None:
        items = [Param(str(k), str(v)) for k, v in params.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=items[i : i + MAX_PARAMS_TAGS_PER_BATCH])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
        self.log_metric_rows(run_id, [(step, metrics)])

    def log_metric_rows(self, run_id: str, rows: Iterable[tuple[int, Mapping[str, float]]]) -> None:
        """Per-step metrics `[(step, {name: value})]`, sent in batches of MLflow's maximum size."""
        now_ms = int(time.time() * 1000)
        batch: list[Metric] = []
        for step, metrics in rows:
            for key, value in metrics.items():
                batch.append(Metric(key, float(value), now_ms, int(step)))
                if len(batch) == MAX_METRICS_PER_BATCH:
                    self.client.log_batch(run_id, metrics=batch)
                    batch = []
        if batch:
            self.client.log_batch(run_id, metrics=batch)

    def log_dir(self, run_id: str, local_dir: Path, artifact_path: str) -> str:
        """Upload every file under `local_dir` to `<run>/<artifact_path>`; returns `runs:/<run_id>/<path>`."""
        local_dir = Path(local_dir)
        if not local_dir.is_dir() or not any(local_dir.iterdir()):
            raise FileNotFoundError(f"{local_dir} is not a directory with files to log")
        artifact_path = artifact_path.strip("/")
        self.client.log_artifacts(run_id, str(local_dir), artifact_path)
        return f"runs:/{run_id}/{artifact_path}"

    # ---- registry ---------------------------------------------------------------------------------------

    def check_kind(self, name: str, kind: str) -> None:
        """Read-only: `RegistryCollision` if registered model `name` exists with another kind (absent is fine)."""
        try:
            rm = self.client.get_registered_model(name)
        except MlflowException as err:
            if err.error_code == "RESOURCE_DOES_NOT_EXIST":
                return
            raise
        _check_kind(rm, kind)

    def ensure_model(
        self, name: str, kind: str | None = HEAD_KIND, tags: Mapping[str, str] | None = None
    ) -> RegisteredModelRef:
        """Create registered model `name` tagged `kind=<kind>`, or check that the existing one has that kind."""
        try:
            rm = self.client.get_registered_model(name)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            all_tags = dict(tags or {}) | ({KIND_TAG: kind} if kind else {})
            try:
                rm = self.client.create_registered_model(name, tags=all_tags)
            except MlflowException as race:
                if race.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                rm = self.client.get_registered_model(name)
        if kind is not None:
            _check_kind(rm, kind)
        return RegisteredModelRef(name=rm.name, tags=dict(rm.tags or {}), aliases=dict(rm.aliases or {}))

    def register(
        self,
        name: str,
        run_id: str,
        artifact_path: str,
        *,
        run_key: str,
        tags: Mapping[str, str] | None = None,
        kind: str | None = HEAD_KIND,
    ) -> ModelVersionRef:
        """Register `runs:/<run_id>/<artifact_path>` as a version of `name`, once per `run_key`.

        A version of `name` already tagged `run_key=<run_key>` is returned as it is, so a retried flow
        does not create a second version. `kind=None` skips the kind check (for targets registered here).
        A tracking server that does not answer is tried again (each try re-checks the key first); a server that
        answers with an error (4xx, 5xx) is not retried here.
        """
        delay = REGISTER_FIRST_DELAY_S
        for attempt in range(1, REGISTER_ATTEMPTS):
            try:
                return self._register_once(name, run_id, artifact_path, run_key, tags, kind)
            except ConnectionError as err:  # the probe's TrackingUnreachable; MLflow's answers are MlflowException
                logger.warning(
                    "registering a version of %s: try %d of %d failed (%s); retrying in %.0f s",
                    name,
                    attempt,
                    REGISTER_ATTEMPTS,
                    err,
                    delay,
                )
                time.sleep(delay)
                delay *= 2
        return self._register_once(name, run_id, artifact_path, run_key, tags, kind)  # the last try raises

    def _register_once(
        self, name: str, run_id: str, artifact_path: str, run_key: str, tags: Mapping[str, str] | None, kind: str | None
    ) -> ModelVersionRef:
        if self.tracking_uri.startswith(("http://", "https://")):
            probe_http(self.tracking_uri, 5.0)  # fails in seconds; MLflow's client would retry silently for minutes
        self.ensure_model(name, kind)
        existing = self.find_versions(name, **{RUN_KEY_TAG: run_key})
        if existing:
            return existing[0]
        source = f"runs:/{run_id}/{artifact_path.strip('/')}"
        all_tags = {str(k): str(v) for k, v in (tags or {}).items()} | {RUN_KEY_TAG: run_key}
        mv = _version_ref(self.client.create_model_version(name, source, run_id=run_id, tags=all_tags))
        # A second version of the key: MLflow's client re-sent the create after its answer was lost (the server
        # died after committing it). Keep the oldest.
        found = self.find_versions(name, **{RUN_KEY_TAG: run_key})
        for extra in found[1:]:
            logger.warning(
                "%s: deleting version %d, a second one of run_key %s (a create re-sent after its answer "
                "was lost); keeping version %d",
                name,
                extra.version,
                run_key[:12],
                found[0].version,
            )
            self.client.delete_model_version(name, str(extra.version))
        return found[0] if found else mv

    def find_versions(self, name: str, **tags: str) -> list[ModelVersionRef]:
        """Versions of `name` carrying every given tag, oldest first (aliases not filled: see `get_version`)."""
        clauses = [f"name={_quoted(name, 'model name')}"]
        for key, value in tags.items():
            if not _TAG_NAME.match(key):
                raise ValueError(f"tag name {key!r} must match {_TAG_NAME.pattern}")
            clauses.append(f"tag.{key}={_quoted(str(value), 'tag value')}")
        found = self._search_versions(" and ".join(clauses))
        return sorted(found, key=lambda ref: ref.version)

    def _search_versions(self, filter_string: str) -> list[ModelVersionRef]:
        out, token = [], None
        while True:
            page = self.client.search_model_versions(filter_string, max_results=1000, page_token=token)
            out.extend(_version_ref(mv) for mv in page)
            token = page.token
            if not token:
                return out

    def get_version(self, name: str, version: int) -> ModelVersionRef:
        return _version_ref(self.client.get_model_version(name, str(version)))

    def set_alias(self, name: str, alias: str, version: int) -> None:
        self.client.set_registered_model_alias(name, alias, str(version))

    def delete_alias(self, name: str, alias: str) -> None:
        self.client.delete_registered_model_alias(name, alias)

    def set_version_tag(self, name: str, version: int, key: str, value: str) -> None:
        self.client.set_model_version_tag(name, str(version), key, value)

    def get_alias(self, name: str, alias: str) -> ModelVersionRef | None:
        """The version `alias` points to, or None when the alias is not set."""
        try:
            return _version_ref(self.client.get_model_version_by_alias(name, alias))
        except MlflowException as err:
            if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise

    def list_models(self, kind: str | None = None) -> list[RegisteredModelRef]:
        """Registered models (only those tagged `kind=<kind>` when given), by name."""
        filt = f"tags.{KIND_TAG} = {_quoted(kind, 'kind')}" if kind else None
        out, token = [], None
        while True:
            page = self.client.search_registered_models(filter_string=filt, max_results=1000, page_token=token)
            out.extend(
                RegisteredModelRef(name=rm.name, tags=dict(rm.tags or {}), aliases=dict(rm.aliases or {}))
                for rm in page
            )
            token = page.token
            if not token:
                return sorted(out, key=lambda ref: ref.name)

    def list_versions(self, name: str) -> list[ModelVersionRef]:
        """Every version of `name`, oldest first, with tags and the aliases that point at it."""
        aliases = dict(self.client.get_registered_model(name).aliases or {})
        by_version: dict[int, list[str]] = {}
        for alias, version in aliases.items():
            by_version.setdefault(int(version), []).append(alias)
        versions = self._search_versions(f"name={_quoted(name, 'model name')}")
        return sorted(
            (dataclasses.replace(v, aliases=tuple(sorted(by_version.get(v.version, ())))) for v in versions),
            key=lambda ref: ref.version,
        )

    def resolve(self, uri: str, dst_root: Path | None = None) -> Path:
        """Download the files of `models:/name/version` or `models:/name@alias` and return their directory.

        Versions are immutable, so a version already downloaded under `dst_root` (default: the state dir's
        `models/`) is reused. The download lands in a temporary sibling and is renamed into place.
        """
        name, version, _ = parse_model_uri(uri)
        store_key = hashlib.sha256(self.tracking_uri.encode()).hexdigest()[:8]
        safe_name = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "_"
        versions = Path(dst_root or self.settings.models_dir) / store_key / safe_name
        if version is None or not (versions / str(version)).is_dir():
            version = lookup(self.client, uri, redact_uri(self.tracking_uri))  # UnknownModel: which part is missing
        dest = versions / str(version)
        if dest.is_dir():
            return dest
        download_uri = self.client.get_model_version_download_uri(name, str(version))
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{version}.partial-", dir=dest.parent))
        try:
            got = Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=download_uri, dst_path=str(tmp), tracking_uri=self.tracking_uri
                )
            )
            try:
                (got if got.is_dir() else tmp).rename(dest)
            except OSError:
                if not dest.is_dir():  # another process renamed its copy first: keep theirs
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest


if __name__ == "__main__":
    store = MlflowStore.connect(Settings.from_env())
    for model in store.list_models():
        print(model.name, dict(model.tags), dict(model.aliases))
