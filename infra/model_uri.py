"""Registry URIs and names: one parser for `models:/name/version` and `models:/name@alias`, one name rule, one lookup.

Purpose: `parse_model_uri(uri)` -> (name, version, alias) or `BadModelUri` saying which part is missing or wrong
(`models:/x`: no version or alias; `models:/`: no name; `models:/x@`: no alias; `models:/@champion`: no name;
`models:/a?x=1`: a query). `check_model_name(name)` applies MLflow's own rule for registered model names (no `/`
or `:`, not empty, a plain path) before anything is registered. `lookup(client, uri, store)` finds the version a
URI names and says which part does not exist: the model, its version (listing the versions it has) or its alias
(listing the aliases it has), as `UnknownModel` (a `LookupError` too). `check_registered(settings, uris)` does that
for a command's URIs before it starts, without creating a store.
Run: through infra/mlflow_store.py (`MlflowStore.resolve`) and flows/preflight.py.
Not here: downloading a version (MlflowStore.resolve) or connecting to the store.
"""

from __future__ import annotations

import re
from pathlib import Path

from mlflow.exceptions import MlflowException

from eagle.errors import BadInput

PREFIX = "models:/"
FORMS = "models:/<name>/<version> or models:/<name>@<alias>"
_ALIAS = re.compile(r"^[A-Za-z0-9_-]+$")


class BadModelUri(BadInput):
    """A `models:/` URI that does not parse; the message says which part is missing or wrong."""


class UnknownModel(BadInput, LookupError):
    """A well-formed `models:/` URI whose model, version or alias is not in the registry."""


def _bad(uri: str, problem: str) -> BadModelUri:
    return BadModelUri(f"{uri!r} is not a model URI of the form {FORMS}: {problem}")


def parse_model_uri(uri: str) -> tuple[str, int | None, str | None]:
    """`models:/name/3` -> (name, 3, None); `models:/name@champion` -> (name, None, 'champion')."""
    if not uri.startswith(PREFIX):
        raise _bad(uri, "it must start with models:/")
    rest = uri[len(PREFIX) :]
    if any(c in rest for c in "?#"):
        raise _bad(uri, "a query or fragment (?, #) is not part of one")
    name, at, alias = rest.partition("@")
    if not at:
        name, slash, version = rest.partition("/")
    if not name:
        raise _bad(uri, "the model name is missing")
    if at:
        if not alias:
            raise _bad(uri, "the alias after @ is missing")
        if not _ALIAS.match(alias):
            raise _bad(uri, f"the alias {alias!r} may hold only letters, digits, _ and -")
        return name, None, alias
    if not slash:
        raise _bad(uri, "the version or alias is missing (add /<version> or @<alias>)")
    if not version.isdigit() or int(version) < 1:
        raise _bad(uri, f"the version {version!r} is not a whole number >= 1" if version else "the version is missing")
    return name, int(version), None


def check_model_name(name: str, what: str = "registry name") -> str:
    """`name` if MLflow accepts it as a registered model name; else `BadInput` naming it (checked before any work)."""
    from mlflow.utils.validation import _validate_model_name

    try:
        _validate_model_name(name)
    except MlflowException as e:
        raise BadInput(f"{what} {name!r} is not valid for the MLflow registry: {e.message}") from None
    return name


def _missing(err: MlflowException) -> bool:
    return err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


def lookup(client, uri: str, store: str) -> int:
    """The version `uri` names in the registry of `client` (an MlflowClient); `UnknownModel` says which part is not
    there. `store` is the (redacted) registry URI, for the message."""
    name, version, alias = parse_model_uri(uri)
    try:
        model = client.get_registered_model(name)
    except MlflowException as err:
        if not _missing(err):
            raise
        raise UnknownModel(
            f"{uri}: no registered model {name!r} in {store}; check the name "
            "(`python -m infra.mlflow_store` lists the models)"
        ) from None
    aliases = dict(model.aliases or {})
    if alias is not None:
        if alias not in aliases:
            have = ", ".join(f"@{a} -> {v}" for a, v in sorted(aliases.items())) or "none"
            raise UnknownModel(f"{uri}: registered model {name!r} has no alias {alias!r} (its aliases: {have})")
        return int(aliases[alias])
    try:
        client.get_model_version(name, str(version))
    except MlflowException as err:
        if not _missing(err):
            raise
        found = client.search_model_versions(f"name='{name}'", max_results=1000) if "'" not in name else []
        have = sorted(int(v.version) for v in found)
        raise UnknownModel(
            f"{uri}: registered model {name!r} has no version {version} (its versions: "
            f"{', '.join(map(str, have)) or 'none'})"
        ) from None
    return int(version)


def check_registered(settings, uris: list[str]) -> None:
    """Each `models:/` URI of `uris` parses and names a model, version or alias that exists in the registry of
    `settings` (a `Settings`); writes nothing: a local SQLite store that does not exist yet holds no model."""
    uris = [u for u in uris if u and u.startswith(PREFIX)]
    for uri in uris:
        parse_model_uri(uri)
    if not uris:
        return
    from infra.mlflow_health import open_client, probe_tracking
    from infra.settings import redact_uri

    tracking = settings.mlflow_tracking_uri
    if tracking.startswith("sqlite:///") and not Path(tracking[len("sqlite:///") :]).expanduser().is_file():
        name = parse_model_uri(uris[0])[0]
        raise UnknownModel(
            f"{uris[0]}: no registered model {name!r} in {tracking}: that registry holds no model "
            "yet (its database does not exist); train or register one first, or fix MLFLOW_TRACKING_URI"
        )
    probe_tracking(settings)
    client = open_client(tracking)
    for uri in uris:
        lookup(client, uri, redact_uri(tracking) or "")
