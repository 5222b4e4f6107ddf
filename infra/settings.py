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
    TMPDIR                      temporary space (default: the system's, `tempfile.gettempdir()`); read for the check
    EAGLE_VLLM_ZYGOTE           `0`: every vLLM server on the CPU starts its own interpreter; default `1`: they are
                                forked from one that imported vLLM already (infra/vllm_zygote.py)
    EAGLE_TARGET_PATH           pins how our loop runs the target (`lean-packed`, `lean-torch`, `hf-packed`,
                                `hf-torch`; default: timed per process). Read by eagle/target_path.py itself, in
                                every process that decodes (eagle/ imports no infra), not by Settings.
    EAGLE_TARGET_PATH_TIMINGS   the file where the target paths' timings are kept across processes, so that every
                                process of a machine picks the same path (eagle/target_path.py); default, set by
                                `state_env_defaults` at the CLI's start: `<state>/target_paths.json`; empty: none
    MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD, PREFECT_API_KEY
                                read so that `describe()` can say they are set; never printed (`repr` redacts)

Run: `python -m infra.settings` prints the resolved settings (credentials redacted).
`Settings.check()` refuses a state dir that is a file or cannot be written, a state subfolder (`STATE_DIRS`) that is
a file or cannot be written, a state dir or temporary space with less than `MIN_FREE_MIB` free, a TMPDIR that is
missing, a file or read-only, an EAGLE_VLLM_PYTHON that is missing, not a file or not executable (`program_problem`,
also used by infra/vllm_server.py for the default `.venv-vllm`), and a tracking URI of a scheme MLflow does not know
or a SQLite file in a directory that does not exist (`BadSetting`, one line each, writing nothing); `check_http_url`
is the one rule for the URLs we connect to (http or https, with a host and a valid port).
Not here: starting anything, creating directories (the adapters do that when they connect).
MLflow and Prefect read their own credential variables themselves; these fields do not feed them.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit, urlunsplit

from eagle.errors import BadInput

BIND_HOST = "127.0.0.1"  # servers we start (Prefect, MLflow) listen on loopback; Ray cannot: see ray_cluster

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_SECRET_FIELDS = ("mlflow_tracking_token", "mlflow_tracking_username", "mlflow_tracking_password", "prefect_api_key")
# MLflow's tracking stores: a directory (file), SQLAlchemy databases (`dialect+driver://`), a server, Databricks
_TRACKING_SCHEMES = {
    "",
    "file",
    "sqlite",
    "postgresql",
    "mysql",
    "mssql",
    "http",
    "https",
    "databricks",
    "databricks-uc",
    "uc",
}
# the folders the project makes under the state dir (each made on first use); one that is a file, or read-only, would
# fail the stage that first writes there, after the work before it
STATE_DIRS = (
    "configs",
    "demo",
    "embedded",
    "evaluations",
    "gguf",
    "locks",
    "logs",
    "mlartifacts",
    "models",
    "monitor",
    "prefect",
    "ray_results",
    "runs",
    "servable",
    "vllm",
    "watcher",
)
# a state dir or temporary space with less free than this is full: a run writes shards, checkpoints and copies of
# the target there, and a full disk would fail it in the middle (the stages leave nothing half-written, but the work
# is lost)
MIN_FREE_MIB = 100


class BadSetting(BadInput):
    """A setting in the environment that cannot work (a malformed value, an unknown scheme, a state dir that is a
    file); the message names the variable."""


def state_env_defaults(settings: "Settings") -> dict[str, str]:
    """Variables that carry the state dir to code that builds no Settings (eagle/, Ray workers, benchmark
    children), for the user not to set: the kept target-path timings' file."""
    return {"EAGLE_TARGET_PATH_TIMINGS": str(settings.target_path_timings)}


def env_with(overrides: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with `overrides` set: the `env` of a child process (benchmarks' children)."""
    return {**os.environ, **overrides}


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
    raise BadSetting(f"{name}={env[name]!r} is not a boolean: use 1/0, true/false, yes/no or on/off")


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def _not_writable(folder: Path) -> str | None:
    """Why nothing can be created in `folder`, or None: an empty directory is made and removed again (`os.access`
    says yes to root on a read-only mount or in /proc)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".eagle-write-check-", dir=folder))
    except OSError as e:
        return e.strerror or str(e)
    return None


def _folder_problem(folder: Path) -> str | None:
    """Why `folder` (it exists, or is a link) cannot take a run's files: not a directory, not writable, or full."""
    if not folder.exists():
        return "a symbolic link to no directory (dangling, or a loop)"
    if not folder.is_dir():
        return "a file, not a directory"
    why = _not_writable(folder)
    if why:
        return f"not writable ({why})"
    fs = os.statvfs(folder)
    free = fs.f_bavail * fs.f_frsize
    if fs.f_blocks and free < MIN_FREE_MIB << 20:  # f_blocks 0: a pseudo file system, refused as not writable
        return f"full: {free >> 20} MiB free, less than the {MIN_FREE_MIB} MiB a run needs at least; free space"
    return None


def program_problem(path: Path) -> str | None:
    """Why the program at `path` cannot be run (missing, a dangling link or a link loop, a directory, not
    executable), or None. 'no such file' exactly when nothing is there."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ENOENT and os.path.islink(path):
            return f"a symbolic link to {os.readlink(path)}, which does not exist (was its python removed?)"
        if e.errno == errno.ENOENT:
            return "no such file"
        return "a symbolic link loop" if e.errno == errno.ELOOP else f"cannot be read ({e.strerror})"
    if stat.S_ISDIR(st.st_mode):
        return "a directory, not a program"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if not os.access(path, os.X_OK):
        return f"not executable, mode {stat.S_IMODE(st.st_mode):o}"
    return None


def is_local_tracking_uri(uri: str) -> bool:
    """True for URIs whose store is a file on this machine (sqlite, file, a bare path)."""
    scheme = urlsplit(uri).scheme
    return scheme in ("", "file", "sqlite") or len(scheme) == 1  # one letter: a Windows drive


def http_url_problem(url: str) -> str | None:
    """What is wrong with `url` as an http(s)://HOST[:PORT][/path] URL, or None when nothing is."""
    try:
        parts = urlsplit(url)
        port = parts.port  # a port that is not a number in 0..65535 raises here
    except ValueError as e:
        return f"not a URL ({e})"
    if parts.scheme not in ("http", "https"):
        got = f"not {parts.scheme}://" if parts.scheme else "and the scheme is missing"
        return f"only http:// and https:// URLs are accepted, {got}"
    if not parts.hostname:
        return "no host; give http://HOST:PORT/..."
    return "port 0 is not a port to connect to" if port == 0 else None


def check_http_url(url: str, what: str) -> str:
    """`url` when it is an http(s) URL with a host; else `BadInput` naming `what` and the part that is wrong."""
    problem = http_url_problem(url)
    if problem:
        raise BadInput(f"{what} {url!r}: {problem}")
    return url


def _check_sqlite_dir(uri: str, default: str) -> None:
    """A sqlite URI whose directory does not exist would silently start a new, empty registry: refused (but the
    default store under the state dir, which is made on first use)."""
    path = Path(uri[len("sqlite:///") :]).expanduser() if uri.startswith("sqlite:///") else None
    if path is not None and uri != default and not path.parent.is_dir():
        raise BadSetting(
            f"MLFLOW_TRACKING_URI={uri!r}: the directory {path.parent} does not exist; fix the path "
            "(a new store needs its directory created first) or unset it for the default store"
        )


@dataclass(frozen=True, repr=False)
class Settings:
    state_dir: Path
    mlflow_tracking_uri: str
    ray_address: str | None = None
    ray_auth_mode: str | None = None
    prefect_api_url: str | None = None
    trust_remote_code: bool = False
    vllm_python: str | None = None
    vllm_zygote: bool = True
    temp_dir: str | None = None  # TMPDIR as set (None: the system's); read for `check` only
    mlflow_tracking_token: str | None = None
    mlflow_tracking_username: str | None = None
    mlflow_tracking_password: str | None = None
    prefect_api_key: str | None = None
    # not from the environment: the run's vLLM scale (infra.vllm_server.EngineScale), put here by the train flow from
    # its config's `target` section so that every engine the run starts, in any stage, is started with it
    engine_scale: Any = None
    # not from the environment: whether vLLM on the CPU runs the target and head compiled (vLLM's own default there:
    # torch.compile with inductor) rather than eager, put here by the evaluation from `evaluate.compiled` so that
    # every engine whose speed it measures, and the champion's beside it, runs as `serve` will run the head
    engine_compiled: bool = False

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
            vllm_zygote=_flag(env, "EAGLE_VLLM_ZYGOTE") if _get(env, "EAGLE_VLLM_ZYGOTE") else True,
            temp_dir=_get(env, "TMPDIR"),
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
    def target_path_timings(self) -> Path:
        """Where eagle/target_path.py keeps each target path's fastest pass across processes (per machine)."""
        return self.state_dir / "target_paths.json"

    @property
    def models_dir(self) -> Path:
        """Where registered model versions are downloaded to (one directory per name and version)."""
        return self.state_dir / "models"

    def check(self) -> Settings:
        """Self, when the state dir, its folders and the temporary space can be written and have room, an
        EAGLE_VLLM_PYTHON can be run and the tracking URI names a store MLflow knows; else `BadSetting` naming the
        variable. Writes nothing."""
        self._check_state_dir()
        self._check_temp_dir()
        problem = program_problem(Path(self.vllm_python)) if self.vllm_python else None
        if problem:
            raise BadSetting(
                f"EAGLE_VLLM_PYTHON={self.vllm_python}: {problem}; point it at the python of an "
                "environment with vLLM (its venv's bin/python) or unset it for the project's .venv-vllm"
            )
        uri = self.mlflow_tracking_uri
        scheme = uri.partition("://")[0].split("+")[0].lower() if "://" in uri else urlsplit(uri).scheme
        problem = http_url_problem(uri) if scheme in ("http", "https") else None
        if scheme not in _TRACKING_SCHEMES and len(scheme) != 1:
            problem = (
                f"unknown scheme {scheme}://; use sqlite:///PATH, http(s)://HOST:PORT (a tracking server), a "
                "database URI (postgresql://, mysql://, mssql://) or a directory; unset it for the local store "
                "under EAGLE_HOME"
            )
        if problem:
            shown = redact_uri(uri) if "@" not in uri or not problem.startswith("not a URL") else "(credentials)@..."
            raise BadSetting(f"MLFLOW_TRACKING_URI={shown!r}: {problem}")
        _check_sqlite_dir(uri, f"sqlite:///{self.state_dir / 'mlflow.db'}")
        return self

    def _check_state_dir(self) -> None:
        """EAGLE_HOME (or the folder it will be made in) and the state folders already there: writable, with room."""
        home, probe = self.state_dir, self.state_dir
        if home.exists() and not home.is_dir():
            raise BadSetting(f"EAGLE_HOME={home}: a file, not a directory; point EAGLE_HOME at a directory")
        while not probe.exists():
            probe = probe.parent
        problem = _folder_problem(probe)
        if problem:
            raise BadSetting(
                f"EAGLE_HOME={home}: {probe} is {problem}; point EAGLE_HOME at a writable directory with room"
            )
        for name in STATE_DIRS if probe == home else ():
            sub = home / name
            problem = _folder_problem(sub) if sub.exists() or sub.is_symlink() else None
            if problem:
                raise BadSetting(
                    f"EAGLE_HOME={home}: its folder {name}/ is {problem}; make {sub} a writable directory "
                    "(or move it away: the project makes it on first use)"
                )

    def _check_temp_dir(self) -> None:
        """TMPDIR when set (Python would quietly use another, the libraries that read it would fail), else the
        system's temporary directory: a writable directory with room."""
        if self.temp_dir:
            tmp = Path(self.temp_dir)
            problem = _folder_problem(tmp) if tmp.exists() or tmp.is_symlink() else "no such directory"
            if problem:
                raise BadSetting(
                    f"TMPDIR={self.temp_dir}: {problem}; point TMPDIR at a writable directory with room or unset it"
                )
            return
        tmp = Path(tempfile.gettempdir())
        problem = _folder_problem(tmp)
        if problem:
            raise BadSetting(
                f"the temporary directory {tmp} is {problem}; set TMPDIR to a writable directory with room"
            )

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
            "vllm_zygote": str(self.vllm_zygote),
            "temp_dir": self.temp_dir or tempfile.gettempdir(),
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
