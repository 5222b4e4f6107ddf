"""The live parts of bench/serving_loop.py: traffic clients, `eagle-heads serve` as a subprocess, the live τ sampler,
the check against plain decoding, the plot.

Purpose: `prompts(...)` picks distinct requests from traffic files; `Traffic` sends greedy chat requests of the current
phase from a few client threads and keeps every result (token ids, errors), its clients held while the retrain measures
in vLLM (`measure_hold`, a callback on the retrain child's lines); `Serve` runs serve and keeps its lines with their
times (`serve_events`: what it said of aliases, swaps and rollbacks); `Sampler` reads vLLM's spec-decode counters
through the proxy (`/metrics`, and `/eagle/status` for the head served) and keeps the live τ (since the last reading,
and over a sliding window) per engine; `plain_check` compares served greedy outputs with a plain vLLM of the same
target; `plot` draws live τ over time with the events.
Run: imported by bench/serving_loop.py.
Not here: the cycle itself and its flows (bench/serving_loop.py).
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import common

from components.serving.monitor import window_counts, window_start
from infra.vllm_server import EngineError, SpecCounters


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Sizes:
    preset: str  # the pipeline preset of every run here
    config: dict  # over the preset (the champion's run, the retrain, serve's monitor section)
    max_tokens: int  # per request
    max_prompt_tokens: int
    clients: int
    pause_s: float  # between a client's requests (retrain_pause_s while the retrain runs)
    retrain_pause_s: float
    sample_s: float
    window_s: float
    base_s: float  # seconds of the head's own traffic before the shift
    threshold: int  # shifted conversations captured on disk that start the retrain
    after_s: float  # seconds of shifted traffic after the swap
    check: int  # distinct prompts checked against plain decoding (0: all)


# ---- traffic ----------------------------------------------------------------------------------------------------


def prompts(paths: list[Path], tok, max_tokens: int, segments: set[str] | None = None, skip: int = 0) -> list:
    """Distinct requests (messages up to the last user turn) of the traffic files, at most `max_tokens` long."""
    from components.data.chat import prompt_ids
    from components.data.traffic_io import load_traffic

    out, seen = [], set()
    for path in paths:
        for c in load_traffic(path).conversations[skip:]:
            if segments is not None and c.segment not in segments:
                continue
            last = max(i for i, m in enumerate(c.messages) if m.role == "user")
            msgs = [{"role": m.role, "content": m.content} for m in c.messages[: last + 1]]
            key = json.dumps(msgs)
            if key not in seen and len(prompt_ids(tok, msgs)) <= max_tokens:
                seen.add(key)
                out.append(msgs)
    return out


class Traffic:
    """`clients` threads sending greedy chat requests of the current phase's pool, one at a time each."""

    def __init__(self, url: str, model: str, pools: dict[str, list], sizes: Sizes, t0: float):
        self.url, self.model, self.pools, self.sizes, self.t0 = url, model, pools, sizes, t0
        self.phase, self.pause_s = "base", sizes.pause_s
        self.results: list[dict] = []
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.next_base, self.queue, self.sent, self.late = 0, list(range(len(pools["shift"]))), set(), []
        self.retraining = False
        self.open = threading.Event()  # cleared: clients hold their next request (the retrain measuring)
        self.open.set()
        self.trained: set[int] = set()  # shifted prompts the retrained head was trained on: not sent again
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(sizes.clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(600)

    def retrain_started(self) -> None:
        with self.lock:
            self.retraining = True

    def hold(self, on: bool) -> None:
        """Hold every client's next request (on) or let them go on: requests in flight finish either way."""
        (self.open.clear if on else self.open.set)()

    def mark_trained(self, captured_file: str) -> int:
        """The shifted prompts among the conversations a retrain trained on (its plan's captured.jsonl)."""
        from components.data.traffic_io import load_traffic

        asked = {
            json.dumps([{"role": m.role, "content": m.content} for m in c.messages[:-1]])
            for c in load_traffic(captured_file).conversations
        }
        with self.lock:
            self.trained = {i for i, msgs in enumerate(self.pools["shift"]) if json.dumps(msgs) in asked}
            self.queue = [i for i in self.queue if i not in self.trained]
        return len(self.trained)

    def _pick(self) -> tuple[str, int, bool]:
        """(phase, prompt index, first time sent). The head's own prompts cycle; shifted ones are each sent once
        while fresh ones last, then those first sent after the retrain started again (never a trained one while an
        untrained one is left)."""
        with self.lock:
            if self.phase == "base":
                self.next_base += 1
                return "base", (self.next_base - 1) % len(self.pools["base"]), self.next_base <= len(self.pools["base"])
            if not self.queue:
                every = range(len(self.pools["shift"]))
                self.queue = (
                    [i for i in self.late if i not in self.trained]
                    or [i for i in every if i not in self.trained]
                    or list(every)
                )
            i = self.queue.pop(0)
            fresh = i not in self.sent
            self.sent.add(i)
            if fresh and self.retraining:
                self.late.append(i)
            return "shift", i, fresh

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=900) as http:
            while not self.stop.is_set():
                if not self.open.is_set():
                    self.stop.wait(1.0)
                    continue
                phase, i, fresh = self._pick()
                body = {
                    "model": self.model,
                    "messages": self.pools[phase][i],
                    "max_tokens": self.sizes.max_tokens,
                    "temperature": 0,
                    "return_token_ids": True,
                }
                r = {
                    "phase": phase,
                    "prompt": i,
                    "fresh": fresh,
                    "start": time.monotonic() - self.t0,
                    "error": None,
                    "finish_reason": None,
                    "token_ids": [],
                }
                try:
                    resp = http.post(self.url + "/v1/chat/completions", json=body)
                    if resp.status_code != 200:
                        r["error"] = f"HTTP {resp.status_code}: {resp.text[:300]}"
                    else:
                        c = resp.json()["choices"][0]
                        r["token_ids"], r["finish_reason"] = c.get("token_ids") or [], c.get("finish_reason")
                except Exception as e:  # a failed request is a result of the benchmark, not its crash
                    r["error"] = f"{type(e).__name__}: {e}"
                r["end"] = time.monotonic() - self.t0
                with self.lock:
                    self.results.append(r)
                self.stop.wait(self.pause_s)


def measure_hold(traffic: Traffic, ev):
    """A child-line callback: when the retrain starts measuring in vLLM (its engine evaluation, then the shadow test)
    the clients hold their requests (an event), until the bench lifts the hold at the retrain's end."""

    def on_line(line: str) -> None:
        starts = line.startswith("evaluate (vLLM): starting") or (
            line.startswith("shadow: ") and "held-out captured requests" in line
        )
        if starts and traffic.open.is_set():
            traffic.hold(True)
            ev("measuring: traffic held")

    return on_line


# ---- serve and the live τ ---------------------------------------------------------------------------------------


class Serve:
    """`eagle-heads serve` as a subprocess; its lines kept with the time they came."""

    def __init__(self, cmd: list[str], env: dict, t0: float):
        self.t0, self.lines = t0, []
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.append((time.monotonic() - self.t0, line.rstrip()))
            if "window" not in line:
                _say(f"  {line.rstrip()}")

    def ready(self, timeout_s: float = 900) -> tuple[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for _, ln in list(self.lines):
                if "serve: ready at " in ln:
                    rest = ln.split("serve: ready at ", 1)[1]
                    return rest.split()[0].removesuffix("/v1"), rest.split("(model '", 1)[1].split("'", 1)[0]
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError("serve did not come up:\n" + "\n".join(ln for _, ln in self.lines[-30:]))

    def find(self, text: str, after: float = 0.0) -> float | None:
        return next((t for t, ln in list(self.lines) if t >= after and text in ln), None)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(180)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def stop_all(traffic: Traffic | None, sampler: "Sampler | None", serve: Serve) -> int:
    """The end of a live run: the clients and the sampler stopped, then serve; serve's exit code."""
    if traffic is not None:
        traffic.join()
    if sampler is not None:
        sampler.stop.set()
        sampler.thread.join(60)
    return serve.stop()


def serve_events(serve: Serve, after: float) -> list[dict]:
    """What serve said after `after`: the alias moving, swaps, rollbacks (one event each)."""
    out, rolled = [], False
    for t, ln in serve.lines:
        if t < after:
            continue
        if "serve: the alias moved to version" in ln:
            out.append({"t": round(t, 2), "kind": "alias moved", "line": ln})
        elif "serve: rolling back" in ln:
            rolled = True
            out.append({"t": round(t, 2), "kind": "rollback", "line": ln})
        elif "serve: swapped" in ln:
            out.append({"t": round(t, 2), "kind": "swap back" if rolled else "swap", "line": ln})
    return out


class Sampler:
    """Reads the served engine's spec-decode counters through the proxy every `sample_s`: per reading the head, the
    engine, the cumulative counters, τ since the previous reading of that engine and τ over the last `window_s`."""

    def __init__(self, url: str, sizes: Sizes, t0: float, phase):
        self.url, self.sizes, self.t0, self.phase = url, sizes, t0, phase
        self.raw: list[tuple[float, str, SpecCounters]] = []  # (t, engine, counters)
        self.points: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=30) as http:
            while not self.stop.wait(self.sizes.sample_s):
                try:
                    self.sample(http)
                except Exception as e:  # the proxy busy or gone for a moment: the next reading
                    _say(f"  sampler: {type(e).__name__}: {e}")

    def sample(self, http) -> None:
        st = http.get(self.url + "/eagle/status").json()
        text = http.get(self.url + "/metrics").text
        if http.get(self.url + "/eagle/status").json()["backend"] != st["backend"]:
            return  # swapped between the two: the page may be either engine's
        t, engine, head = time.monotonic() - self.t0, st["backend"], st["meta"].get("head") or "plain"
        point = {
            "t": round(t, 2),
            "utc": time.strftime("%H:%M:%S", time.gmtime()),
            "phase": self.phase(),
            "head": head,
            "engine": engine,
            "captured_rows": (st.get("capture") or {}).get("rows_written"),
            "tau_interval": None,
            "tau_window": None,
            "window_drafts": 0,
        }
        try:
            c = SpecCounters.parse(text)
        except EngineError:  # plain decoding serves (a rollback to no head): no acceptance to read
            self.points.append(point)
            return
        mine = [(rt, rc) for rt, re_, rc in self.raw if re_ == engine] + [(t, c)]
        if len(mine) > 1:
            step = window_counts([mine[-2][1], c])
            point["tau_interval"] = round(step.tau, 4) if step.drafts else None
            w = window_counts([rc for _, rc in mine[window_start([rt for rt, _ in mine], t, self.sizes.window_s) :]])
            point["tau_window"], point["window_drafts"] = (round(w.tau, 4) if w.drafts else None), w.drafts
        point.update(drafts_total=c.drafts, accepted_total=c.accepted)
        self.raw.append((t, engine, c))
        self.points.append(point)

    def span(self, t_from: float, t_to: float, engine: str | None = None) -> dict:
        """τ and drafts over [t_from, t_to] from the readings of one engine (default: the one serving at t_from)."""
        rows = [(t, e, c) for t, e, c in self.raw if t_from <= t <= t_to]
        engine = engine or (rows[0][1] if rows else None)
        counts = window_counts([c for _, e, c in rows if e == engine])
        return {
            "tau": round(counts.tau, 4) if counts.drafts else None,
            "drafts": counts.drafts,
            "from_s": round(t_from, 1),
            "to_s": round(t_to, 1),
        }


def plain_check(
    target_dir: str,
    model: str,
    pools: dict,
    results: list[dict],
    t_swap: float | None,
    n: int,
    max_tokens: int,
    settings,
) -> dict:
    """Every served greedy output of up to `n` distinct prompts (0: all; half served before the swap, half after)
    against a plain vLLM of the same target: mismatching requests and prompts."""
    from components.targets.target import target_context
    from infra.vllm_engine_spec import EngineSpec
    from infra.vllm_server import VllmServer

    served: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        if not r["error"] and r["finish_reason"] is not None:
            served.setdefault((r["phase"], r["prompt"]), []).append(r)
    keys = list(served)
    if n:
        cut = t_swap if t_swap is not None else float("inf")
        early = [k for k in keys if served[k][0]["start"] < cut]
        late = [k for k in keys if served[k][0]["start"] >= cut]
        pick = lambda ks, m: ks[:: max(1, len(ks) // m)][:m] if m else []  # noqa: E731  (spread over time)
        keys = pick(late, n // 2) + pick(early, n - min(n // 2, len(late)))
    spec = EngineSpec(
        target_dir, None, method=None, max_model_len=min(target_context(target_dir), 4096), served_model_name=model
    )
    bad_requests = bad_prompts = 0
    with VllmServer(spec, settings) as srv:
        for k in keys:
            ref = srv.chat(pools[k[0]][k[1]], max_tokens=max_tokens).token_ids
            wrong = sum(r["token_ids"] != ref for r in served[k])
            bad_requests, bad_prompts = bad_requests + wrong, bad_prompts + bool(wrong)
    return {
        "prompts_checked": len(keys),
        "requests_checked": sum(len(served[k]) for k in keys),
        "mismatched_requests": bad_requests,
        "mismatched_prompts": bad_prompts,
    }


def plot(path: Path, points: list[dict], events: list[dict], title: str, note: str) -> None:
    """Window τ per head served (lines, broken where a window holds no drafts: traffic held), τ between readings
    (dots), a dashed vertical line per event."""
    import textwrap

    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(11, 5.6))
    heads = list(dict.fromkeys(p["head"] for p in points))
    for n, head in enumerate(heads):
        mine = [p for p in points if p["head"] == head]  # a reading with no drafts in its window breaks the line
        color = f"C{n}"
        ax.plot(
            [p["t"] / 60 for p in mine],
            [math.nan if p["tau_window"] is None else p["tau_window"] for p in mine],
            "-",
            color=color,
            label=f"window tau, {head.removeprefix('models:/')}",
        )
        dots = [p for p in points if p["head"] == head and p["tau_interval"] is not None]
        ax.plot([p["t"] / 60 for p in dots], [p["tau_interval"] for p in dots], ".", color=color, alpha=0.35)
    top = max([p["tau_interval"] or 0 for p in points] + [p["tau_window"] or 0 for p in points] + [1.5])
    for i, e in enumerate(events):
        ax.axvline(e["t"] / 60, color="grey", ls="--", lw=0.8)
        ax.text(e["t"] / 60, top * (1.02 - 0.05 * (i % 4)), " " + e["kind"], fontsize=8, rotation=0, va="top")
    ax.set_xlabel("minutes since serve started")
    ax.set_ylabel("live tau (tokens per verification step, vLLM counters)")
    ax.set_ylim(0.9, top * 1.08)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower left", fontsize=8)
    fig.text(0.01, 0.01, textwrap.fill(note, 170), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
