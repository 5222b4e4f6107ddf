"""A head that collapses in service, live: `eagle-heads serve` rolls it back (issue 48's goal: within 2 monitor
windows, no request failed while it happens).

Run: `python bench/rollback_live.py [--quick] [--window 60] [--after 60] [--clients 2]` (default: the embedded
default's real SmolLM2 and its champion head, trained once by bench/serving_loop.py in its state dir and reused here;
about 8 minutes on 2 cores once it is; `--quick`: the tiny toy target, a few minutes).
In the serving loop's state dir (`<cache>/serving-loop[-quick]/.eagle`: its registry, the alias put back on the
champion at the start) it:
1. runs `eagle-heads serve --head models:/HEAD@champion --follow-alias` (a subprocess, as an operator runs it; the
   rollback on, its window `--window` seconds, the other `monitor.rollback` settings at their defaults) and sends
   greedy chat requests of the head's own domain from `--clients` clients;
2. once the champion's first window was judged, registers a copy of its head made to accept nothing (its `d2t` maps
   every draft token to one token the target did not emit in the answers so far: the same format, every draft
   rejected) as a new version with the champion's tags, and moves the alias onto it;
3. serve swaps the collapsed head in, judges its windows from vLLM's counters and swaps back; the clients go on for
   `--after` seconds after the swap back;
4. checks the served greedy outputs of `--check` distinct prompts against a plain vLLM of the target.
Prints the window the collapse was judged in (goal <= 2), the seconds from the collapsed head's first request to the
rollback decision and to the swap back, failed requests (goal 0), mismatches (0), the alias and the
`rollback_reason` tag; writes bench/results/rollback_live.json and .png (live tau over time, the events marked;
`--quick`: under .eagle/bench/results-quick/).
Not here: the rule on synthetic counters (tests/test_rollback.py); the same on the toy as a test
(tests/test_rollback_engine.py); the serving loop's retrain and swap (bench/serving_loop.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
import time
from pathlib import Path

import common
import serving_loop

from serving_loop_live import Sampler, Serve, Traffic, plain_check, plot, prompts, serve_events, stop_all
from serving_loop_setup import DEFAULT, QUICK, build, isolated_env, write_config

GOAL_WINDOWS = 2


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def accepting_nothing(head_dir: Path, out: Path, never: int) -> None:
    """A copy of the head whose every draft token maps to target token `never` (d2t[j] = never - j)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(head_dir, out)
    weights = load_file(out / "model.safetensors")
    weights["d2t"] = never - torch.arange(weights["d2t"].numel(), dtype=torch.int64)
    save_file(weights, out / "model.safetensors")


def unused_token(results: list[dict], vocab: int) -> int:
    """The highest token id no answer so far emitted (ids near the top of a vocabulary are the rarest here)."""
    seen = {t for r in results for t in r["token_ids"]}
    return next(t for t in range(vocab - 1, -1, -1) if t not in seen)


def register_collapsed(store, head_name: str, champion: int, head_dir: Path, never: int, work: Path) -> int:
    """The collapsed copy as a new version of `head_name`, with the champion's tags; returns its version."""
    bad = work / "collapsed-head"
    accepting_nothing(head_dir, bad, never)
    tags = {k: v for k, v in store.get_version(head_name, champion).tags.items() if k != "run_key"}
    with store.run(f"collapsed-{champion}-{int(time.time())}") as run_id:
        store.log_dir(run_id, bad, "head")
        ref = store.register(head_name, run_id, "head", run_key=f"collapsed-{run_id}", tags=tags)
    return ref.version


def parse_args(argv: list[str] | None):
    p = common.base_args(__doc__.splitlines()[0])
    p.add_argument("--window", type=float, default=60.0, help="serve's rollback window in seconds (its default 60)")
    p.add_argument("--after", type=float, default=60.0, help="seconds of traffic after the swap back")
    p.add_argument("--clients", type=int, default=2, help="concurrent greedy clients")
    p.add_argument("--check", type=int, default=16, help="distinct prompts checked against plain vLLM (0: all)")
    a = p.parse_args(argv)
    if a.window <= 0 or a.after < 0 or a.clients < 1 or a.check < 0:
        p.error("--window > 0, --after >= 0, --clients >= 1, --check >= 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    load_before = common.start(a)
    sizes = dataclasses.replace(QUICK if a.quick else DEFAULT, clients=a.clients)
    state = common.CACHE / ("serving-loop" + ("-quick" if a.quick else "")) / ".eagle"
    state.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    from infra.mlflow_store import MlflowStore
    from infra.settings import Settings

    env = isolated_env(state)
    cfg_path = state.parent / "rollback.json"
    cfg = write_config(sizes, cfg_path)
    emb, name = build(a.quick)
    train, heldout = emb.target_traffic.train, emb.target_traffic.heldout
    _say(f"rollback: target {emb.target_dir}; training (or finding) its champion head in {state}")
    champ = serving_loop.run_child(
        "champion",
        {
            "name": name,
            "target_dir": str(emb.target_dir),
            "preset": sizes.preset,
            "train": str(train),
            "heldout": str(heldout),
            "config": str(cfg_path),
        },
        env,
    )
    head_name, v1 = champ["head_uri"].removeprefix("models:/").split("/")
    settings = Settings.local(state)
    store = MlflowStore.connect(settings)
    store.set_alias(head_name, "champion", int(v1))
    head_dir = Path(store.resolve(f"models:/{head_name}/{v1}"))
    tok = AutoTokenizer.from_pretrained(str(emb.target_dir))
    base = prompts([heldout, train], tok, sizes.max_prompt_tokens)
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "serve",
        "--head",
        f"models:/{head_name}@champion",
        "--k",
        str(cfg.evaluate.spec.depth),
        "--follow-alias",
        "--follow-interval",
        "2",
        "--rollback-window",
        f"{a.window:g}",
        "--preset",
        sizes.preset,
        "--config",
        str(cfg_path),
    ]
    t0, started_utc = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    events: list[dict] = []
    at: dict[str, float] = {}

    def ev(kind: str, **detail) -> float:
        t = time.monotonic() - t0
        events.append({"t": round(t, 2), "kind": kind, **detail})
        _say(f"rollback: {t / 60:5.1f} min: {kind} {detail or ''}")
        return t

    serve, traffic, sampler, error, bad_version = Serve(cmd, env, t0), None, None, None, None
    try:
        url, model = serve.ready()
        at["ready"] = ev("serving", head=f"models:/{head_name}/{v1}")
        traffic = Traffic(url, model, {"base": base, "shift": base}, sizes, t0)
        sampler = Sampler(url, sizes, t0, lambda: traffic.phase)
        sampler.thread.start()
        traffic.start()
        mine = f"models:/{head_name}/{v1} window"
        _until(lambda: any(mine in ln for _, ln in serve.lines), 20 * a.window + 600, serve, "the champion's window")
        vocab = json.loads((head_dir / "config.json").read_text())["vocab_size"]
        never = unused_token(traffic.results, vocab)
        bad_version = register_collapsed(store, head_name, int(v1), head_dir, never, state.parent)
        store.set_alias(head_name, "champion", bad_version)
        at["alias"] = ev("alias moved to the collapsed copy", version=bad_version, never_token=never)
        bad = f"models:/{head_name}/{bad_version}"
        swapped_in = f"-> {bad} "
        _until(lambda: serve.find(swapped_in, at["alias"]) is not None, 900, serve, "the swap to the collapsed head")
        at["swap_in"] = serve.find(swapped_in, at["alias"])
        back = f"serve: swapped {bad} -> "
        _until(lambda: serve.find(back, at["swap_in"]) is not None, 20 * a.window + 900, serve, "the swap back")
        at["rollback"] = serve.find("serve: rolling back", at["swap_in"])
        at["swap_back"] = serve.find(back, at["swap_in"])
        end = time.monotonic() + a.after
        while time.monotonic() < end and serve.proc.poll() is None:
            time.sleep(1)
    except Exception as e:  # the timeline so far is still written, with the error
        error = f"{type(e).__name__}: {e}"
        ev("error", error=error)
    finally:
        at["end"] = time.monotonic() - t0
        rc = stop_all(traffic, sampler, serve)
    if traffic is None or sampler is None:
        raise RuntimeError(error or "serve did not come up")
    events += serve_events(serve, 0.0)
    events.sort(key=lambda e: e["t"])
    verdicts = [ln for _, ln in serve.lines if bad_version and f"/{bad_version} window" in ln]
    decided = next((ln for ln in verdicts if ln.rstrip().endswith((": collapse", ": drop"))), None)
    window = int(re.search(r"window (\d+):", decided).group(1)) if decided else None
    failed = [r for r in traffic.results if r["error"] or r["finish_reason"] is None]
    on_bad = [r for r in traffic.results if "swap_in" in at and at["swap_in"] <= r["start"] < at.get("swap_back", 1e9)]
    _say("rollback: checking served greedy outputs against a plain vLLM of the target")
    check = plain_check(
        str(emb.target_dir),
        model,
        traffic.pools,
        traffic.results,
        at.get("swap_in"),
        a.check,
        sizes.max_tokens,
        settings,
    )
    alias_now = store.get_alias(head_name, "champion")
    reason = store.get_version(head_name, bad_version).tags.get("rollback_reason") if bad_version else None
    secs = lambda k: round(at[k] - at["swap_in"], 1) if k in at and "swap_in" in at else None  # noqa: E731
    met = window is not None and window <= GOAL_WINDOWS and not failed and not check["mismatched_requests"]
    line = (
        (f"ERROR: {error}; " if error else "")
        + f"collapse judged in window {window} (goal <= {GOAL_WINDOWS}), rollback decided {secs('rollback')} s and "
        f"swapped back {secs('swap_back')} s after the collapsed head came in; {len(traffic.results)} requests "
        f"({len(on_bad)} started on the collapsed head), {len(failed)} failed; {check['mismatched_requests']} of "
        f"{check['requests_checked']} checked greedy outputs differ from plain vLLM; alias champion on version "
        f"{alias_now.version if alias_now else None}: goal {'met' if met else 'NOT met'}"
    )
    print(f"{line}\nverdicts: {verdicts}\nrollback_reason: {reason}", flush=True)
    png = common.results_dir(a.quick) / "rollback_live.png"
    what = "--quick: the tiny toy target" if a.quick else "SmolLM2-135M"
    plot(
        png,
        sampler.points,
        events,
        f"a collapsed head rolled back in service ({what}, window {a.window:g} s, {time.strftime('%Y-%m-%d')}, "
        f"{common.cpu_info().get('model', '')})",
        line,
    )
    payload = {
        "plot": str(png),
        "started_utc": started_utc,
        "target": str(emb.target_dir),
        "champion": champ,
        "collapsed_version": bad_version,
        "window_s": a.window,
        "clients": a.clients,
        "at_s": {k: round(v, 1) for k, v in at.items() if v is not None},
        "window_judged": window,
        "verdicts": verdicts,
        "rollback_reason": reason,
        "alias_after": alias_now.version if alias_now else None,
        "requests": len(traffic.results),
        "requests_on_collapsed": len(on_bad),
        "failed": failed[:10],
        "failed_count": len(failed),
        "check": check,
        "serve_rc": rc,
        "events": events,
        "points": sampler.points,
        "line": line,
        "error": error,
        "goal_met": met,
        "serve_log": [[round(t, 2), ln] for t, ln in serve.lines],
    }
    common.write_results("rollback_live", a.quick, payload, load_before)
    return 0 if met else 1


def _until(cond, timeout_s: float, serve: Serve, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if serve.proc.poll() is not None:
            raise RuntimeError(f"serve exited ({serve.proc.returncode}) waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} in {timeout_s:.0f} s")
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
