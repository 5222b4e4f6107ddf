"""Process settings read from the environment: where state lives and which MLflow, Ray and Prefect to use.

Purpose: one frozen `Settings`, built once by `Settings.from_env()` at the edge of a program (the CLI, a flow's
entry) and passed down. This is the only module of the project that reads environment variables, but for one
(EAGLE_TARGET_PATH, below; tests/test_layout.py's allowlist).

    EAGLE_HOME                  state dir (default `.eagle/` in the working dir)
    MLFLOW_TRACKING_URI         default `sqlite:///<state>/mlflow.db`, artifacts under `<state>/mlartifacts`
    RAY_ADDRESS                 a Ray cluster (`host:port`, `ray://host:port`, `auto`); default: a local Ray
    RAY_AUTH_MODE               passed to a local Ray (`disabled` in tests); default: Ray's own (token auth)
    PREFECT_API_URL             a Prefect server; default: Prefect's ephemeral mode
    EAGLE_TRUST_REMOTE_CODE     `1` lets transformers run code shipped with a model (default off)
    EAGLE_VLLM_PYTHON           the python of an environment with vLLM (default: the project's `.venv-vllm`)
    EAGLE_TARGET_PATH           pins how our loop runs the target (`lean-packed`, `lean-torch`, `hf-packed`,
                                `hf-torch`; default: timed per process). Read by eagle/target_path.py itself, in
                                every process that decodes (eagle/ imports no infra), not by Settings.
    MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD, PREFECT_API_KEY
                                read so that `describe()` can say they are set; never printed (`repr` redacts)

Run: `python -m infra.settings` prints the resolved settings (credentials redacted).
Not here: starting anything, creating directories (the adapters do that when they connect).
MLflow and Prefect read their own credential variables themselves; these fields do not feed them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping
from urllib.parse import urlsplit, urlunsplit

BIND_HOST = "127.0.0.1"  # servers we start (Prefect, MLflow) listen on loopback; Ray cannot: see ray_cluster

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_SECRET_FIELDS = ("mlflow_tracking_token", "mlflow_tracking_username", "mlflow_tracking_password", "prefect_api_key")


def redact_uri(uri: str | None) -> str | None:
    """`uri` with any `user:password@` part replaced by `***@`, safe to print or put in an error."""
    if not uri or "@" not in uri:
        return uri
    parts = urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    host = parts.hostname or ""
    netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={env[name]!r} is not a boolean: use 1/0, true/false, yes/no or on/off")


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def is_local_tracking_uri(uri: str) -> bool:
    """True for URIs whose store is a file on this machine (sqlite, file, a bare path)."""
    scheme = urlsplit(uri).scheme
    return scheme in ("", "file", "sqlite") or len(scheme) == 1  # one letter: a Windows drive


@dataclass(frozen=True, repr=False)
class Settings:
    state_dir: Path
    mlflow_tracking_uri: str
    ray_address: str | None = None
    ray_auth_mode: str | None = None
    prefect_api_url: str | None = None
    trust_remote_code: bool = False
    vllm_python: str | None = None
    mlflow_tracking_token: str | None = None
    mlflow_tracking_username: str | None = None
    mlflow_tracking_password: str | None = None
    prefect_api_key: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Settings:
        """Settings from `env` (default: the process environment); relative paths resolve against `cwd`."""
        env = os.environ if env is None else env
        base = Path.cwd() if cwd is None else Path(cwd)
        state_dir = (base / Path(_get(env, "EAGLE_HOME") or ".eagle").expanduser()).resolve()
        ray_address = _get(env, "RAY_ADDRESS")
        return cls(
            state_dir=state_dir,
            mlflow_tracking_uri=_get(env, "MLFLOW_TRACKING_URI") or f"sqlite:///{state_dir / 'mlflow.db'}",
            ray_address=None if ray_address == "local" else ray_address,
            ray_auth_mode=_get(env, "RAY_AUTH_MODE"),
            prefect_api_url=_get(env, "PREFECT_API_URL"),
            trust_remote_code=_flag(env, "EAGLE_TRUST_REMOTE_CODE"),
            vllm_python=_get(env, "EAGLE_VLLM_PYTHON"),
            mlflow_tracking_token=_get(env, "MLFLOW_TRACKING_TOKEN"),
            mlflow_tracking_username=_get(env, "MLFLOW_TRACKING_USERNAME"),
            mlflow_tracking_password=_get(env, "MLFLOW_TRACKING_PASSWORD"),
            prefect_api_key=_get(env, "PREFECT_API_KEY"),
        )

    @classmethod
    def local(cls, state_dir: Path, **overrides: object) -> Settings:
        """All-local defaults under `state_dir`, ignoring the environment (tests, demos)."""
        return dataclasses.replace(cls.from_env({"EAGLE_HOME": str(state_dir)}), **overrides)

    @property
    def mlflow_is_local(self) -> bool:
        return is_local_tracking_uri(self.mlflow_tracking_uri)

    @property
    def mlflow_artifact_location(self) -> str | None:
        """Where new experiments keep artifacts: under the state dir for a local store, else the server's choice."""
        return (self.state_dir / "mlartifacts").as_uri() if self.mlflow_is_local else None

    @property
    def prefect_home(self) -> Path:
        return self.state_dir / "prefect"

    @property
    def ray_storage_dir(self) -> Path:
        return self.state_dir / "ray_results"

    @property
    def models_dir(self) -> Path:
        """Where registered model versions are downloaded to (one directory per name and version)."""
        return self.state_dir / "models"

    def describe(self) -> dict[str, str]:
        """Printable summary: URIs with credentials redacted, secrets only as 'set'/'unset'."""
        out = {
            "state_dir": str(self.state_dir),
            "mlflow_tracking_uri": redact_uri(self.mlflow_tracking_uri) or "",
            "mlflow_artifact_location": self.mlflow_artifact_location or "(server default)",
            "ray_address": self.ray_address or "(local)",
            "ray_auth_mode": self.ray_auth_mode or "(ray default)",
            "prefect_api_url": redact_uri(self.prefect_api_url) or "(ephemeral)",
            "trust_remote_code": str(self.trust_remote_code),
            "vllm_python": self.vllm_python or "(the project's .venv-vllm)",
        }
        out.update({name: "set" if getattr(self, name) else "unset" for name in _SECRET_FIELDS})
        return out

    def __repr__(self) -> str:
        shown = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _SECRET_FIELDS:
                shown.append(f"{f.name}={'***' if value else None}")
            elif f.name in ("mlflow_tracking_uri", "prefect_api_url", "ray_address"):
                shown.append(f"{f.name}={redact_uri(value)!r}")
            else:
                shown.append(f"{f.name}={value!r}")
        return f"Settings({', '.join(shown)})"

    __str__ = __repr__


if __name__ == "__main__":
    for key, val in Settings.from_env().describe().items():
        print(f"{key:26s} {val}")
