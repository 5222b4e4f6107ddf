"""vLLM adapter: start the serving engine users run (an OpenAI-compatible server) with or without a head, talk to it.

Purpose: `VllmServer(EngineSpec(...), settings)` is a context manager that starts `python -m
vllm.entrypoints.openai.api_server` from vLLM's own virtual environment (vLLM pins other torch and transformers versions
than this project, so it never shares our venv) on 127.0.0.1 at a free port, waits for `/health`, keeps the engine's log
under the state dir, and stops it by its own process group (and the engine dies with us). On the CPU it is forked from a
process that imported vLLM once (infra/vllm_zygote.py). While it runs: `chat(...)` and `complete(...)` return token ids
(greedy by default) and, from a server started with `PER_REQUEST_METRICS`, the drafts accepted per verification step;
`spec_counters()` reads the speculative-decoding counters from `/metrics`. `running(a, b, ...)` starts several servers
at once (compiled CPU engines one at a time, `start_groups`) and stops them all on exit or when one fails to start;
`launch()`, `wait_ready()`: a start in two. What to serve is an `EngineSpec` (infra/vllm_engine_spec.py: the server's
arguments, the exact `--speculative-config` a user passes on a GPU cluster, the CPU build's memory settings). Errors: a
missing vLLM environment, an engine that dies or stays unhealthy at start-up, and a refused request (HTTP 4xx: its JSON
body, which names the reason) are each one `EngineError` line that says what to do.
Run: `python -m infra.vllm_server TARGET_DIR [HEAD_DIR]` serves until Ctrl-C (what `eagle-heads serve` does).
Not here: choosing a head (flows/cli.py resolves registry URIs) or comparing engines (components/evaluate/stage.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from infra import vllm_zygote
from infra.settings import BIND_HOST, Settings, program_problem
from infra.vllm_engine_spec import EngineSpec

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# After each request a vLLM worker keeps polling its input queue in a busy loop for 1 s before it sleeps on a socket
# (vLLM 0.32 distributed/device_communicators/shm_broadcast.py: `SpinCondition`, `busy_loop_s` = 1): nearly a whole
# core for that second (bench/README.md, "An idle vLLM server spins a core"). A second server timed during that
# second shares its cores with the spin (components/evaluate/engine.py waits it out).
IDLE_SPIN_S = 1.0
# how often a starting engine is asked if it is healthy: one local request and one read of its log per poll (a 1 s
# poll left ~0.5 s idle per start of 10-25 s on 2 cores; the suite starts ~80)
HEALTH_POLL_S = 0.25
UNSUPPORTED = "are not supported for now"  # vLLM 0.32's refusal of a model architecture it does not have


class EngineError(RuntimeError):
    """The serving engine is missing, did not start, died, or refused a request; the message says what to do."""


def vllm_python(settings: Settings) -> Path:
    """The interpreter of vLLM's environment: EAGLE_VLLM_PYTHON, else `.venv-vllm/bin/python` in the project."""
    path = Path(settings.vllm_python or Path(__file__).resolve().parents[1] / ".venv-vllm/bin/python")
    if problem := program_problem(path):  # missing, a directory, a dangling link, not executable: not an OSError later
        raise EngineError(
            f"vLLM is not installed at {path} ({problem}): run `make vllm` (its own venv, ~3 min, "
            "3.5 GB) or set EAGLE_VLLM_PYTHON to a python that has vllm (the `vllm` package on a GPU)"
        )
    return path


def free_port(host: str = BIND_HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class VllmServer:
    """One vLLM OpenAI-compatible server on loopback; `with VllmServer(spec, settings) as srv: srv.chat(...)`."""

    def __init__(
        self,
        spec: EngineSpec,
        settings: Settings,
        port: int | None = None,
        start_timeout_s: float = 600.0,
        log_dir: Path | None = None,
        cpu_bind: str | None = None,  # VLLM_CPU_OMP_THREADS_BIND of its worker (None: vLLM's; infra/vllm_cpus.py)
    ):
        if spec.scale is None and settings.engine_scale is not None:  # the run's scale reaches every engine it starts
            spec = dataclasses.replace(spec, scale=settings.engine_scale)
        if spec.compiled is None:  # the run's: compiled where the evaluation measures what `serve` will serve
            spec = dataclasses.replace(spec, compiled=settings.engine_compiled)
        self.spec, self.settings, self.start_timeout_s, self.cpu_bind = spec, settings, start_timeout_s, cpu_bind
        self.port = port or free_port()
        self.base_url = f"http://{BIND_HOST}:{self.port}"
        self.log_path = (log_dir or settings.state_dir / "vllm") / time.strftime(f"vllm-%Y%m%d-%H%M%S-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    # ---- life cycle -------------------------------------------------------------------------------------------
    def start(self) -> "VllmServer":
        return self.launch().wait_ready()

    @property
    def compiles(self) -> bool:
        """Whether its start compiles (a compiled engine on the CPU): such starts go one at a time (`start_groups`)."""
        return self.spec.compiles

    def launch(self) -> "VllmServer":
        """Start the engine's process, not waiting for it (`wait_ready()`); it dies with the thread that launched it."""
        python = vllm_python(self.settings)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "VLLM_CONFIGURE_LOGGING": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            # compiled: vLLM 0.32's AOT artefacts never load back with torch 2.13 (every start compiled again, ~50 s);
            # inductor's own cache does (~12 s). Eager engines ignore it (so one zygote serves both; STACK-NOTES)
            "VLLM_USE_AOT_COMPILE": "0",
        }
        env.pop("PYTHONPATH", None)  # our venv's packages must not shadow vLLM's pinned ones
        env.update(dict(self.spec.env))
        if self.cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        cmd = [str(python), "-m", vllm_zygote.SERVER, *self.spec.server_args(self.port)]
        self.log_path.write_text("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        forked = self.settings.vllm_zygote and not self.spec.env and self.spec.resolved_device() == "cpu"
        cwd = str(self.log_path.parent)
        proc = vllm_zygote.launch(str(python), cmd[3:], env, cwd, self.log_path) if forked else None
        if proc is None:  # not forked from a zygote (infra/vllm_zygote.py): an interpreter of its own
            with open(self.log_path, "a") as log:
                proc = subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                    preexec_fn=vllm_zygote.die_with_parent,
                )
        self.proc = proc
        return self

    def wait_ready(self) -> "VllmServer":
        """Wait until the launched engine answers `/health` (one request when it does already)."""
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc is None:  # stop() ran while it started (`running`: another server failed, or Ctrl-C)
                raise EngineError(f"vLLM was stopped while starting (log: {self.log_path})")
            if self.proc.poll() is not None:
                raise EngineError(
                    f"vLLM exited with code {self.proc.returncode} while starting: {self.last_error()} "
                    f"(full log: {self.log_path})"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200 and self._listening():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(HEALTH_POLL_S)
        self.stop()
        raise EngineError(f"vLLM did not become healthy in {self.start_timeout_s:.0f} s; log: {self.log_path}")

    def _listening(self) -> bool:
        """Whether the engine this object started says it listens on our port (its log's "Starting vLLM server on
        http://HOST:PORT" line), so that another process answering `/health` on that port is never taken for it."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return False
        return f":{self.port}" in "".join(ln for ln in text.splitlines() if "Starting vLLM" in ln and "http" in ln)

    def last_error(self) -> str:
        """The most telling line of the engine's log: the last exception line, else the last line."""
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
        family = [ln for ln in lines if UNSUPPORTED in ln]  # its list of every supported architecture left out
        if family:
            return (
                family[-1].split(" Supported architectures:", 1)[0][-400:] + " (this vLLM does not run the "
                "target's family: run it in our process, target.runtime 'local', or use a vLLM that has it)"
            )
        return (errors or lines or ["(empty log)"])[-1][-500:]

    def stop(self) -> None:
        """Stop the engine and every process it started (its process group); idempotent."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # workers in the group that outlived the leader
            os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- requests ---------------------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        req = urllib.request.Request(
            self.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise EngineError(f"vLLM refused {path} (HTTP {e.code}): {detail}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # IncompleteRead: died mid-answer
            dead = self.proc is None or self.proc.poll() is not None
            raise EngineError(
                f"vLLM at {self.base_url} {'has died' if dead else 'did not answer'} ({e}); "
                f"{self.last_error()} (log: {self.log_path})"
            ) from None

    def chat(self, messages: list[dict[str, str]], max_tokens: int, temperature: float = 0.0) -> "Completion":
        r = self._post(
            "/v1/chat/completions",
            {
                "model": self.spec.served_model_name,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "return_token_ids": True,
            },
        )
        c = r["choices"][0]
        return Completion(
            list(r.get("prompt_token_ids") or c.get("prompt_token_ids") or []),
            list(c["token_ids"]),
            c["message"]["content"] or "",
            c.get("finish_reason"),
        )

    def complete(
        self, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0, ignore_eos: bool = False
    ) -> "Completion":
        """`ignore_eos`: decode `max_tokens` tokens, past the end-of-sequence ids (vLLM's sampling parameter)."""
        body = {
            "model": self.spec.served_model_name,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "return_token_ids": True,
        }
        r = self._post("/v1/completions", {**body, "ignore_eos": True} if ignore_eos else body)
        c = r["choices"][0]
        return Completion(
            list(c.get("prompt_token_ids") or prompt_ids),
            list(c["token_ids"]),
            c["text"],
            c.get("finish_reason"),
            accepted_per_step(r),
        )

    def metrics_text(self) -> str:
        return read_metrics(self.base_url + "/metrics")

    def spec_counters(self) -> "SpecCounters":
        return SpecCounters.parse(self.metrics_text())


@contextlib.contextmanager
def running(*servers: VllmServer) -> Iterator[list[VllmServer]]:
    """`with running(plain, spec) as (p, s):` every server started at once, yielded once all are healthy, and all
    stopped on exit; when one fails to start, the others are still waited for (so that none is left starting) and
    stopped, and the first failure is raised. The starting threads outlive the engines: an engine dies with the
    thread that started it (PR_SET_PDEATHSIG is per thread), so the pool shuts down only after every stop."""
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(max(1, len(servers)), thread_name_prefix="vllm-start"))
        for srv in servers:
            stack.callback(srv.stop)
        starts = [pool.submit(start_each, group) for group in start_groups(servers)]
        wait(starts)
        for f in starts:
            f.result()
        yield list(servers)


def start_groups(servers) -> list[list[VllmServer]]:
    """The servers in groups started at once, each group's one after another: every engine alone, but the compiled
    CPU engines in one group. While a worker compiles, its engine core busy-polls a core: four cold compiled starts
    at once took ~320 s each on 2 cores (bench/README.md "Compiled, not eager")."""
    servers = list(servers)
    compiled = [s for s in servers if s.compiles]
    return [[s] for s in servers if not s.compiles] + ([compiled] if compiled else [])


def start_each(servers: list[VllmServer]) -> None:
    """Start `servers` one after another (in the calling thread, whose life each engine's is tied to)."""
    for srv in servers:
        srv.start()


def running_requests(text: str) -> float | None:
    """`vllm:num_requests_running` summed over engines (the load at the moment of the scrape); None when absent."""
    values = [
        float(ln.rpartition(" ")[2])
        for ln in text.splitlines()
        if ln.startswith("vllm:num_requests_running") and not ln.startswith("#")
    ]
    return sum(values) if values else None


def read_metrics(url: str, timeout_s: float = 10.0) -> str:
    """The Prometheus text at `url` (a vLLM server's `/metrics`); one `EngineError` line when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        raise EngineError(f"cannot read {url}: HTTP {e.code} {e.reason}: is this a vLLM server's /metrics?") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise EngineError(f"cannot read {url}: {reason}: is the vLLM server running there?") from None


@dataclass(frozen=True)
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    # drafts accepted per verification step, in output order (raw, as the counters count), when the server runs
    # with `--per-request-spec-decode-metrics detailed` (PER_REQUEST_METRICS); None otherwise
    accepted_per_step: list[int] | None = None


PER_REQUEST_METRICS = ("--per-request-spec-decode-metrics", "detailed")  # vLLM >= 0.32 server flag


def accepted_per_step(response: dict[str, Any]) -> list[int] | None:
    """`metrics.speculative_decoding.per_step_accepted` of a completion response (n = 1): [] when the request
    had no verification step (vLLM then omits the array), None when the server gives no per-request metrics."""
    spec = (response.get("metrics") or {}).get("speculative_decoding")
    return None if spec is None else [int(a) for a in spec.get("per_step_accepted") or []]


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's cumulative speculative-decoding counters (summed over engines); subtract two readings for a window."""

    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> "SpecCounters":
        """From Prometheus text. Raises EngineError when the page has no spec-decode counters (not a speculating
        vLLM)."""
        totals: dict[str, float] = {}
        per_pos: dict[int, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            if name == PER_POS:
                pos = int(name_labels.split('position="', 1)[1].split('"', 1)[0])
                per_pos[pos] = per_pos.get(pos, 0.0) + float(value)
            elif name in SPEC_COUNTERS:
                totals[name] = totals.get(name, 0.0) + float(value)
        if not all(n in totals for n in SPEC_COUNTERS):
            raise EngineError(
                "the metrics page has no vLLM speculative-decoding counters "
                f"({', '.join(SPEC_COUNTERS)}): is this a vLLM server started with a speculative config?"
            )
        return cls(
            int(totals[SPEC_COUNTERS[0]]),
            int(totals[SPEC_COUNTERS[1]]),
            int(totals[SPEC_COUNTERS[2]]),
            tuple(int(per_pos[k]) for k in sorted(per_pos)),
        )

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        return self._combine(other, -1)

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        return self._combine(other, 1)

    def _combine(self, other: "SpecCounters", sign: int) -> "SpecCounters":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = list(self.accepted_per_pos) + [0] * (n - len(self.accepted_per_pos))
        b = list(other.accepted_per_pos) + [0] * (n - len(other.accepted_per_pos))
        return SpecCounters(
            self.drafts + sign * other.drafts,
            self.draft_tokens + sign * other.draft_tokens,
            self.accepted + sign * other.accepted,
            tuple(x + sign * y for x, y in zip(a, b)),
        )

    def went_back(self, earlier: "SpecCounters") -> bool:
        """Whether any counter is lower than in the `earlier` reading: the engine restarted in between."""
        return (
            self.drafts < earlier.drafts
            or self.accepted < earlier.accepted
            or any(x < y for x, y in zip(self.accepted_per_pos, earlier.accepted_per_pos))
        )

    @property
    def tau(self) -> float:
        """Mean tokens per verification step, the bonus token included (as our evaluation counts it)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 0.0

    @property
    def acceptance(self) -> list[float]:
        """alpha_k conditional: accepted at position k / accepted at position k-1 (drafts for k = 1)."""
        prev = [self.drafts, *self.accepted_per_pos[:-1]]
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_pos, prev)]


if __name__ == "__main__":
    import sys

    spec = EngineSpec(
        sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None, method="eagle3" if len(sys.argv) > 2 else None
    )
    with VllmServer(spec, Settings.from_env()) as srv:
        print(f"vLLM serving {spec.target_dir} at {srv.base_url} (log {srv.log_path}); Ctrl-C stops it", flush=True)
        try:
            while srv.proc is not None and srv.proc.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
