"""Safe defaults, checked by reading the source (ast) and by small behavioural probes.

Purpose:
- weights only through safetensors: no pickle import, every `torch.load` has `weights_only=True`, the target
  is loaded with `use_safetensors=True`;
- `trust_remote_code` is off unless the user sets EAGLE_TRUST_REMOTE_CODE: every `from_pretrained` passes it
  explicitly (the files in FROM_PRETRAINED_ALLOWLIST load only models this process just built), and the setting
  reaches every model load of every stage;
- services we start listen on loopback (Prefect's API, checked on the live test server); nothing binds 0.0.0.0;
  a local Ray keeps its token auth unless the settings say otherwise (Ray itself listens on all interfaces:
  HARDENING.md);
- credentials never appear in messages or reprs (f-strings never format a URI or secret without redact_uri);
- writes are atomic: pipeline code writes files only through components/data/atomic.py, into a temp dir that is
  renamed whole, or in the few places of WRITE_ALLOWLIST (with the reason).
Run: `python -m pytest tests/test_safe_defaults.py` (a few seconds; the loopback check reuses the session's
Prefect test server when another module started it, else it starts one).
Not here: the tests of the behaviour behind these rules (test_bad_input.py, test_faults.py, test_infra.py).
"""

from __future__ import annotations

import ast
import os
import re
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle", "components", "flows", "infra", "embedded")
FROM_PRETRAINED_ALLOWLIST = {
    "embedded/build.py": "loads the Llama it has just trained and written itself",
    "eagle/selfcheck.py": "loads the random tiny model it has just written itself",
}
WRITE_ALLOWLIST = {  # (file, source snippet of the call) -> why it need not be atomic
    ("components/train/state.py", "(tmp / 'DONE').write_text"): "inside the checkpoint's temp dir, renamed whole",
    ("components/train/state.py", "torch.save"): "inside the checkpoint's temp dir, renamed whole",
    ("components/train/state.py", "save_file"): "inside a temp dir or atomic_path temp file, renamed whole",
    (
        "infra/vllm_plugins/cpu_hidden_states_connector.py",
        "save_file",
    ): "runs inside vLLM (no project imports); readers wait on the file's lock, released after the write",
    (
        "components/train/stage.py",
        "open(self.path, 'a')",
    ): "appends one history line; a torn last line is dropped on read",
    ("infra/locks.py", "open(path, 'a+')"): "a lock file: its content is never read",
    ("components/targets/gguf.py", "open(path, 'a+')"): "a lock file: its content is never read",
    ("components/targets/gguf.py", "fresh.save_pretrained"): "inside the conversion's temp dir, renamed whole",
    ("components/targets/gguf.py", "tokenizer.save_pretrained"): "inside the conversion's temp dir, renamed whole",
    ("infra/ray_cluster.py", "markers[path].write_text"): "an empty probe marker: only its existence is read",
    ("infra/vllm_server.py", "self.log_path.write_text"): "the engine's log (a new file per server): its command line",
    ("infra/vllm_server.py", "open(self.log_path, 'a')"): "the engine's log, written by the engine as it runs",
    ("infra/vllm_zygote.py", "open(log_path, 'ab')"): "the zygote's own log, read by people only",
    ("infra/vllm_sampling.py", "cache.write_text"): "a cache of the probe's answer: a torn or unreadable one is probed "
    "again",
    ("infra/vllm_zygote.py", "open(tmp, 'w')"): "a server's exit code into a temp file, then os.replace'd (the zygote "
    "imports only the standard library, not components.data.atomic)",
    ("infra/prefect_env.py", "open(home / 'local-api-start.lock', 'a+')"): "a lock file: its content is never read",
    ("infra/vllm_bench.py", "Path(path).write_text"): "the load client's prompts, rewritten whole before each sweep's "
    "first client starts; no other process reads it",
    ("infra/vllm_bench.py", "Path(tmp, 'jobs.json').write_text"): "inside the client's own temp dir, read only by "
    "the client process started after it is written",
    (
        "infra/vllm_bench.py",
        "open(log, 'a')",
    ): "the load client's stderr log inside its own temp dir, read by people only",
    ("flows/cli.py", "path.write_text"): "a failed command's traceback log, a new file each time, read by people only",
    (
        "infra/mlflow_health.py",
        "open(Path(uri[len('sqlite:///'):]).expanduser().with_suffix('.lock'), 'a+')",
    ): "a lock file: its content is never read",
}


def _modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            yield rel, ast.parse(path.read_text(encoding="utf-8"), filename=rel)


MODULES = list(_modules())


def _calls(name: str):
    """(file, line, call) for every call of `<anything>.name(...)` or `name(...)`."""
    for rel, tree in MODULES:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Attribute) and f.attr == name) or (isinstance(f, ast.Name) and f.id == name):
                    yield rel, node.lineno, node


def _kw(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


# ---- weights and remote code --------------------------------------------------------------------------------------


def test_no_pickle_and_every_torch_load_is_weights_only():
    pickles = [
        f"{rel}:{node.lineno}"
        for rel, tree in MODULES
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(a.name.split(".")[0] in ("pickle", "dill", "cloudpickle") for a in node.names)
        or isinstance(node, ast.ImportFrom)
        and (node.module or "").split(".")[0] in ("pickle", "dill")
    ]
    assert not pickles, f"pickle imported at {pickles}"
    loads = list(_calls("load"))
    torch_loads = [
        (rel, line, c)
        for rel, line, c in loads
        if isinstance(c.func, ast.Attribute) and ast.unparse(c.func.value) == "torch"
    ]
    assert torch_loads, "the rule should see the checkpoint's torch.load"
    bad = [
        f"{rel}:{line}"
        for rel, line, c in torch_loads
        if not (isinstance(_kw(c, "weights_only"), ast.Constant) and _kw(c, "weights_only").value is True)
    ]
    assert not bad, f"torch.load without weights_only=True at {bad}"


def test_every_from_pretrained_passes_trust_remote_code():
    calls = list(_calls("from_pretrained"))
    assert len(calls) >= 4
    bad = [
        f"{rel}:{line}"
        for rel, line, c in calls
        if _kw(c, "trust_remote_code") is None
        and not any(k.arg is None for k in c.keywords)
        and rel not in FROM_PRETRAINED_ALLOWLIST
    ]
    assert not bad, f"from_pretrained without an explicit trust_remote_code at {bad}"
    constant_true = [
        f"{rel}:{line}"
        for rel, line, c in calls
        if isinstance(_kw(c, "trust_remote_code"), ast.Constant) and _kw(c, "trust_remote_code").value
    ]
    assert not constant_true, f"trust_remote_code=True hard-coded at {constant_true}"
    model_loads = [
        c
        for rel, _, c in calls
        if rel == "components/targets/target.py" and ast.unparse(c.func).startswith("AutoModelForCausalLM")
    ]
    assert model_loads and all(ast.unparse(_kw(c, "use_safetensors")) == "True" for c in model_loads)


class _Stop(Exception):
    pass


def test_the_trust_setting_reaches_every_model_load(monkeypatch, tmp_path):
    """EAGLE_TRUST_REMOTE_CODE -> Settings -> the flow's tasks -> each stage -> load_target / AutoConfig."""
    import components.extract.stage
    import components.targets.target
    from components.evaluate.stage import EvaluateConfig, HeadEval
    from components.extract.stage import ExtractConfig
    from components.regenerate.stage import RegenerateConfig
    from components.train.data import TrainingData
    from components.train.loop import LoopArgs, train_loop
    from components.train.stage import TrainConfig
    from flows import tasks
    from infra.settings import Settings

    assert Settings.from_env({"EAGLE_TRUST_REMOTE_CODE": "1"}).trust_remote_code is True
    assert Settings.from_env({}).trust_remote_code is False
    seen: list[bool] = []

    def spy(*args, trust_remote_code=None, **kwargs):
        seen.append(trust_remote_code)
        raise _Stop

    monkeypatch.setattr(components.targets.target, "load_target", spy)
    monkeypatch.setattr(components.extract.stage, "load_target", spy)
    traffic = tmp_path / "t.jsonl"
    traffic.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    for call in (
        lambda: tasks.regenerate_task.fn(RegenerateConfig(), "tgt", str(traffic), str(tmp_path / "r"), True),
        lambda: tasks.extract_task.fn(ExtractConfig(), "tgt", "regen", str(tmp_path / "e"), True),
        lambda: tasks.evaluate_task.fn(
            EvaluateConfig(), HeadEval("tgt", "head", str(traffic), str(tmp_path / "v")), True
        ),
    ):
        with pytest.raises(_Stop):
            call()
    monkeypatch.setattr(
        TrainingData,
        "open",
        classmethod(
            lambda cls, *a, **k: type(
                "D",
                (),
                {
                    "manifest": {"mode": "online"},
                    "target_config": lambda self, trust=None: spy(trust_remote_code=trust),
                },
            )()
        ),
    )
    with pytest.raises(_Stop):  # online training loads the target
        train_loop(LoopArgs(TrainConfig.tiny(), "ext", str(tmp_path / "o"), "tgt", trust_remote_code=True))
    assert seen == [True, True, True, True]
    source = (ROOT / "flows" / "train_head.py").read_text() + (ROOT / "flows" / "evaluate_head.py").read_text()
    passed = source.count("trust)") + source.count("trust,") + source.count("settings.trust_remote_code)")
    assert passed >= 3 and "trust = settings.trust_remote_code" in source  # regenerate, extract, evaluate
    assert "ray_settings.trust_remote_code" in (ROOT / "flows" / "tasks.py").read_text()


# ---- services on loopback -----------------------------------------------------------------------------------------


def test_nothing_binds_all_interfaces_and_prefect_defaults_to_loopback():
    from infra.prefect_env import prefect_env_defaults
    from infra.settings import BIND_HOST, Settings

    assert BIND_HOST == "127.0.0.1"
    assert prefect_env_defaults(Settings.local(Path("/x")))["PREFECT_SERVER_API_HOST"] == "127.0.0.1"
    wide = [
        f"{rel}:{node.lineno}"
        for rel, tree in MODULES
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.search(r"0\.0\.0\.0|--host[ =](?!127\.0\.0\.1)|\[::\]", node.value)
    ]
    assert not wide, f"a service bound beyond loopback at {wide}"


def _listening(pids: set[int]) -> list[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                raw = bytes.fromhex(f[1].split(":")[0])
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                out.append(socket.inet_ntop(family, raw))
    return out


def _children(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += kids.get(p, [])
    return out - {pid}


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc (Linux)")
def test_the_prefect_api_we_start_listens_on_loopback_only(prefect_harness):
    servers = {
        p
        for p in _children(os.getpid())  # Prefect's API server process(es), not a session's Ray
        if b"prefect.server.api.server" in Path(f"/proc/{p}/cmdline").read_bytes()
    }
    addresses = _listening(servers)
    assert addresses, "no listening socket found for the Prefect test server"
    assert all(a in ("127.0.0.1", "::1") for a in addresses), addresses


def test_a_local_ray_keeps_its_token_auth(monkeypatch, tmp_path):
    import ray

    from infra.ray_cluster import ray_session
    from infra.settings import Settings

    seen = {}
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(
        ray, "init", lambda **kw: seen.update(kw, env=os.environ.get("RAY_AUTH_MODE")) or (_ for _ in ()).throw(_Stop())
    )
    with pytest.raises(_Stop):
        with ray_session(Settings.from_env({"EAGLE_HOME": str(tmp_path)})):
            pass
    assert seen["include_dashboard"] is False and seen["env"] is None
    assert "RAY_AUTH_MODE" not in seen["runtime_env"]["env_vars"]  # workers inherit no auth override either


# ---- credentials --------------------------------------------------------------------------------------------------


def test_no_fstring_formats_a_uri_or_secret_unredacted():
    secret = re.compile(r"tracking_uri|api_url|password|api_key|\btoken\b|secret|username")
    bad = []
    for rel, tree in MODULES:
        for node in ast.walk(tree):
            if isinstance(node, ast.FormattedValue):
                src = ast.unparse(node.value)
                if secret.search(src) and not src.startswith("redact_uri("):
                    bad.append(f"{rel}:{node.lineno}: {{{src}}}")
    assert not bad, "format credentials through infra.settings.redact_uri:\n" + "\n".join(bad)


def test_store_errors_and_sinks_never_show_credentials():
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

    from infra.metrics_sink import MlflowSink
    from infra.mlflow_health import store_errors
    from infra.mlflow_store import TrackingUnreachable
    from infra.settings import Settings

    settings = Settings.from_env({"MLFLOW_TRACKING_URI": "https://alice:hunter2-pw@mlflow.example/"})
    with pytest.raises(TrackingUnreachable) as err:
        with store_errors(settings, "registering"):
            raise MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE)
    assert "mlflow.example" in str(err.value) and "hunter2-pw" not in str(err.value) and "alice" not in str(err.value)
    assert "hunter2-pw" not in repr(MlflowSink(settings.mlflow_tracking_uri, "run"))


# ---- atomic writes ------------------------------------------------------------------------------------------------


def test_pipeline_code_writes_files_atomically():
    found = []
    for name in ("write_text", "write_bytes", "open", "save_file", "save", "savefig", "save_pretrained"):
        for rel, line, c in _calls(name):
            if rel.startswith(("eagle/", "embedded/")) or rel == "components/data/atomic.py":
                continue  # eagle/ writes only through export.py's temp-dir rename; embedded renames its build dir
            src = ast.unparse(c.func)
            if name == "open":
                mode = c.args[1] if len(c.args) > 1 else _kw(c, "mode")
                if not (isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax+")):
                    continue  # reading
                src = ast.unparse(c)
            if name == "save" and src != "torch.save":
                continue
            target = c.args[1] if name == "save_file" and len(c.args) > 1 else (c.args[0] if c.args else None)
            if name in ("save_file", "savefig") and target is not None and "tmp" in ast.unparse(target):
                continue  # into an atomic_path temp file
            found.append((rel, line, src))
    bad = [
        f"{rel}:{line}: {src}"
        for rel, line, src in found
        if not any(rel == f and src.startswith(snippet) for f, snippet in WRITE_ALLOWLIST)
    ]
    assert not bad, "write through components.data.atomic (atomic_path / atomic_write_text):\n" + "\n".join(bad)


_AUTH_MODES_IN_TURN = """
import sys, tempfile
from pathlib import Path
import ray
from infra.ray_cluster import ray_session
from infra.settings import Settings

@ray.remote(num_cpus=0)
class Echo:
    def ping(self):
        return "pong"

for mode in sys.argv[1:]:
    settings = Settings.local(Path(tempfile.mkdtemp()), ray_auth_mode=None if mode == "default" else mode)
    with ray_session(settings, num_cpus=1):
        print(mode, ray.get(Echo.remote().ping.remote(), timeout=60), flush=True)
"""


@pytest.mark.live
def test_local_rays_with_and_without_token_auth_in_one_process(tmp_path):
    """One process, local Rays in turn: Ray's default (token auth), then `disabled`, then the default again. Ray
    reads the mode once; without `ray_session` making it read again, the second Ray dropped every actor the driver
    created ("The actor never ran") and the third refused the driver's token-less calls."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"} | {"HOME": str(tmp_path)}  # the token: here
    run = subprocess.run(
        [sys.executable, "-c", _AUTH_MODES_IN_TURN, "default", "disabled", "default"],
        env=env,
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.stdout.split() == ["default", "pong", "disabled", "pong", "default", "pong"], run.stderr[-3000:]
    assert (tmp_path / ".ray" / "auth_token").is_file()  # the default really was token auth
