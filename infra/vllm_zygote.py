"""vLLM's API server forked from a process that imported it already, and its engine core forked from that server.

Purpose: on vLLM's CPU build an engine start cost ~18 CPU-s, most of it importing vLLM (torch's dynamo and inductor,
transformers, openai's types) in the API server and again in each process it spawns (engine core, worker).
`launch(python, argv, env, cwd, log_path)` runs `python -m vllm.entrypoints.openai.api_server ARGV` as a fork of a
*zygote*, `python infra/vllm_zygote.py`, which imported that module's dependencies once and forks a child per
request. The child runs the module as `python -m` does (`runpy.run_module(..., "__main__")`, ending through the
interpreter's own exit) in its own session (its pid leads its process group, as with `start_new_session`), with
the request's environment, working directory and log.
Only the imports differ from a fresh interpreter: they ran before the fork, in the zygote's environment. So a zygote
takes only requests whose environment equals the one it was started with (but for variables vLLM does not read,
`VOLATILE`, and those it reads only after the fork, `AFTER_FORK`); another environment gets a zygote of its own, at
most `MAX_ZYGOTES` per process (then `launch` returns None and the caller starts a fresh interpreter).
The handle `launch` returns acts as `subprocess.Popen`'s for what infra/vllm_server.py uses: `pid`, `poll()`,
`wait(timeout)`, `returncode` (negative: killed by that signal). The zygote reaps its children and writes each exit
code to `<log>.rc`, which the handle reads.
The engine core too: vLLM's CPU platform has every process it starts spawned (a fresh interpreter importing vLLM
again, ~5 CPU-s) because its worker reads its OpenMP thread binding from the environment at start-up. The engine core
binds nothing (under `VLLM_ENABLE_V1_MULTIPROCESSING=0` it runs the model unbound either way), so a zygote's child
starts it by fork, vLLM's default method off the CPU, from the server that imported vLLM already (the zygote also
imported the engine core's and the CPU worker's modules, `PRELOAD`); the worker is still spawned, its binding as
before. The server's log says `FORKED_CORE`. Same outputs (tests/test_vllm.py); what it saves: bench/README.md.
Lifetime: a zygote is a session of its own (a terminal's Ctrl-C does not reach it) and lives as long as the process
that started it: it reads requests on its stdin, and when that pipe closes (the process exited or was killed), it
stops its children (SIGTERM to each group, SIGKILL after 10 s) and exits. Each child also gets SIGTERM if the zygote
dies (PR_SET_PDEATHSIG). An engine so lives at most as long as the process that started it, as a directly started one.
A zygote that cannot start (vLLM missing or broken) is not tried again in this process: `launch` returns None and
the fresh interpreter reports the error as before.
Off: `EAGLE_VLLM_ZYGOTE=0` (infra/settings.py); infra/vllm_server.py also starts a fresh interpreter for an engine not
on the CPU or with an environment of its own (`EngineSpec.env`, e.g. the extraction engines' storage mark).
`close_all()` closes this process's zygotes now (a benchmark that reads its children's CPU time).
Run: imported by infra/vllm_server.py; `python infra/vllm_zygote.py [MODULE]` is the zygote (vLLM's venv; this file
imports only the standard library; MODULE, default vLLM's server, lets tests use a module of their own).
Not here: the server's arguments and its life cycle (infra/vllm_server.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

SERVER = "vllm.entrypoints.openai.api_server"
MAX_ZYGOTES = 3  # per process: each holds an imported vLLM (~0.6 GB) until the process exits
# environment that vLLM does not read and that may change between requests: pytest's, ours and other services'
VOLATILE = ("PYTEST_", "EAGLE_", "MLFLOW_", "PREFECT_")
# vLLM's variables that its engine core reads only after the fork, when it spawns the worker: they may differ between
# requests of one zygote (a swap binds its new engine's worker to other CPUs: infra/vllm_cpus.py)
AFTER_FORK = ("VLLM_CPU_OMP_THREADS_BIND",)
# imported by a zygote of vLLM's server after it, for the engine core forked from each child (optional: a module
# that vLLM does not have is left out, its error in the zygote's log)
PRELOAD = (
    "setproctitle",
    "vllm.v1.engine.core",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.llama_eagle3",
)
FORKED_CORE = "vllm_zygote: the engine core is forked from this server"  # the server's log says so
READY_TIMEOUT_S = 300.0
STOP_WAIT_S = 10.0


# ---- our side ---------------------------------------------------------------------------------------------------
class ZygoteChild:
    """A server forked by a zygote: `pid` (its process group too), `poll()`, `wait(timeout)`, `returncode`."""

    def __init__(self, pid: int, rc_path: Path, zygote: "Zygote", args: list[str]):
        self.pid, self.rc_path, self.zygote, self.args = pid, rc_path, zygote, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = _read_rc(self.rc_path)
            if code is None and not _alive(self.pid):  # its zygote writes the code right after reaping it
                deadline = time.monotonic() + 1.0
                while code is None and time.monotonic() < deadline and self.zygote.alive():
                    time.sleep(0.05)
                    code = _read_rc(self.rc_path)
                code = _read_rc(self.rc_path) if code is None else code
                code = -signal.SIGKILL if code is None else code  # the zygote died: init reaped it, code unknown
            self.returncode = code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _read_rc(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class Zygote:
    """One zygote process (see the module doc), its request pipe guarded by a lock."""

    def __init__(self, python: str, env: dict[str, str], log_path: Path, module: str = SERVER):
        self.python, self.env, self.log_path, self.module = python, env, log_path, module
        self.lock = threading.Lock()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [python, str(Path(__file__).resolve()), module],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,
                cwd=str(log_path.parent),
            )
        reply = self._reply(READY_TIMEOUT_S)
        if reply.get("ready") is not True:
            self.close()
            raise RuntimeError(f"the vLLM zygote did not start ({reply.get('error', 'no answer')}; log {log_path})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _reply(self, timeout_s: float) -> dict:
        result: list[bytes] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not result or not result[0]:
            self.proc.kill()  # no answer: never asked again (a reader may still wait on its pipe)
            return {"error": "no answer in time" if reader.is_alive() else "it exited"}
        return json.loads(result[0])

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, log_path: Path) -> ZygoteChild:
        rc_path = log_path.with_name(log_path.name + ".rc")
        request = {"argv": argv, "env": env, "cwd": cwd, "log": str(log_path), "rc": str(rc_path)}
        with self.lock:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._reply(60.0)
        if "pid" not in reply:
            raise RuntimeError(f"the vLLM zygote did not fork: {reply.get('error')} (log {self.log_path})")
        return ZygoteChild(int(reply["pid"]), rc_path, self, [self.python, "-m", self.module, *argv])

    def close(self) -> None:
        """Close its stdin: it stops its children and exits (what our process's exit does too)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(STOP_WAIT_S + 5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


_zygotes: dict[tuple, Zygote | None] = {}  # (python, environment) -> its zygote; None: it could not start
_registry_lock = threading.Lock()


def launch(
    python: str, argv: list[str], env: dict[str, str], cwd: str, log_path: Path, module: str = SERVER
) -> ZygoteChild | None:
    """`python -m MODULE ARGV` (vLLM's server) forked from a zygote for this interpreter, environment and module
    (started on first use); None when no zygote can take it (the caller then starts it directly)."""
    kept = ((k, v) for k, v in env.items() if not k.startswith(VOLATILE) and k not in AFTER_FORK)
    key = (python, module, tuple(sorted(kept)))
    with _registry_lock:
        if key not in _zygotes:
            if len([z for z in _zygotes.values() if z is not None]) >= MAX_ZYGOTES:
                return None
            try:
                _zygotes[key] = Zygote(python, dict(env), log_path.parent / f"vllm-zygote-{os.getpid()}.log", module)
            except (OSError, RuntimeError, ValueError):
                _zygotes[key] = None
        zygote = _zygotes[key]
    if zygote is None or not zygote.alive():
        return None
    try:
        return zygote.fork(argv, env, cwd, log_path)
    except (OSError, RuntimeError, ValueError):
        return None


def close_all() -> None:
    """Close every zygote this process started (each stops its children first); the process's exit does the same."""
    with _registry_lock:
        zygotes = [z for z in _zygotes.values() if z is not None]
        _zygotes.clear()
    for z in zygotes:
        z.close()


# ---- the zygote -------------------------------------------------------------------------------------------------
def _serve(module: str) -> None:
    """The zygote's loop: import `module`, answer `{"ready": true}`, then fork one child per request line."""
    import select

    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the answers' channel; fd 1 now goes to the log, as 2 does
    os.dup2(2, 1)
    try:
        import runpy  # noqa: F401  (imported before the fork, as the server module)

        __import__(module)
        # as under `python -m`, the module itself runs only as __main__ (what it imported stays imported)
        del sys.modules[module]
        if "." in module:
            vars(sys.modules[module.rpartition(".")[0]]).pop(module.rpartition(".")[2], None)
        for name in PRELOAD if module == SERVER else ():
            try:
                __import__(name)
            except Exception as e:  # noqa: BLE001  (only a cost: the engine core imports it itself)
                print(f"vllm_zygote: not preloaded: {name}: {type(e).__name__}: {e}", file=sys.stderr)
        if "setproctitle" in sys.modules:  # it finds the command line's memory now, before a child's environment moves
            sys.modules["setproctitle"].getproctitle()
    except BaseException as e:  # noqa: BLE001  (any failure is the answer; the caller starts vLLM directly)
        import traceback

        traceback.print_exc()  # into the zygote's log
        replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"[:500]}) + "\n")
        return
    replies.write(json.dumps({"ready": True}) + "\n")
    children: dict[int, str] = {}  # pid -> its rc file
    stdin = sys.stdin.buffer
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.2)
        if ready:
            line = stdin.readline()
            if not line:
                break
            try:
                request = json.loads(line)
                rc_file = request["rc"]
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
            except (OSError, ValueError, KeyError) as e:
                replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"[:500]}) + "\n")
                continue
            if pid == 0:
                _child(module, request, replies)  # never returns: the child ends as the interpreter it became
            children[pid] = rc_file
            replies.write(json.dumps({"pid": pid}) + "\n")
        _reap(children)
    _stop_children(children)


def _reap(children: dict[int, str]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        rc = children.pop(pid, None)
        if rc is not None:
            tmp = f"{rc}.tmp"
            with open(tmp, "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(tmp, rc)


def _stop_children(children: dict[int, str]) -> None:
    """Our process is gone: SIGTERM every child's group, SIGKILL what is left after STOP_WAIT_S."""
    for sig, wait_s in ((signal.SIGTERM, STOP_WAIT_S), (signal.SIGKILL, 2.0)):
        for pid in list(children):
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        while children and time.monotonic() < deadline:
            _reap(children)
            time.sleep(0.1)


def _child(module: str, request: dict, replies) -> None:
    """In the forked child: become what `python -m MODULE ARGV` would be, and end as it
    would (SystemExit through the interpreter's own exit, so that its atexit handlers run; an uncaught exception
    printed, exit 1)."""
    try:
        zygote = os.getppid()
        os.setsid()
        die_with_parent()
        if os.getppid() != zygote:  # it died before the line above
            os._exit(1)
        replies.close()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, to in ((devnull, 0), (log, 1), (log, 2)):
            os.dup2(fd, to)
        os.close(log)
        os.close(devnull)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [module, *request["argv"]]
    except BaseException:  # noqa: BLE001  (it could not become the server: nothing of it ran)
        os._exit(1)
    import runpy
    import traceback

    try:
        if module == SERVER:
            _fork_engine_core()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code: object = 0
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001  (as the interpreter reports an uncaught exception)
        traceback.print_exc()
        code = 1
    raise SystemExit(code)


def _fork_engine_core() -> None:
    """In a child about to be vLLM's server: the engine core process it starts is forked, not spawned (module doc).
    Only the engine core's start (`vllm.v1.engine.utils`); the executor's workers keep vLLM's choice. A vLLM without
    that hook starts its engine core as it would."""
    import multiprocessing

    try:
        from vllm.v1.engine import utils
    except ImportError:
        return
    if not callable(getattr(utils, "get_mp_context", None)):
        return

    def forked() -> multiprocessing.context.BaseContext:
        print(FORKED_CORE, file=sys.stderr, flush=True)
        return multiprocessing.get_context("fork")

    utils.get_mp_context = forked


def die_with_parent() -> None:
    """SIGTERM to this process when the thread that started it (for a zygote's child: the zygote) ends."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    _serve(sys.argv[1] if len(sys.argv) > 1 else SERVER)
