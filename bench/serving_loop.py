"""One cycle of the serving loop, live: traffic shifts, the served head's τ drops, capture, retrain, shadow, swap.

Run: `python bench/serving_loop.py [--quick] [--shift finetune|explain] [--no-rollback]` (`make serving-loop` runs
the default: the embedded default's real SmolLM2, its champion trained here once by `train-head` at the `default`
preset, about an hour on 2 cores the first time; `--quick`: the tiny toy target, a few minutes).
In its own state dir (`<cache>/serving-loop[-quick][-explain]/.eagle`: registry, captures, runs; the champion is
trained once and reused, the alias is put back on it and the captures cleared at each start) it:
1. registers the base target (with its traffic) and trains its champion head through `train-head`;
2. runs `eagle-heads serve --head models:/HEAD@champion --capture --follow-alias` (a subprocess, as an operator
   runs it; K = the evaluation's depth so the live τ compares with the registered one);
3. sends greedy chat requests from `--clients` clients: first the head's own domain (base training conversations
   past the ones its head was trained on; not the registered held-out set, which the retrain's evaluation uses),
   then shifted traffic (`finetune`: the fine-tune's domain, the standard library's tests; `explain`: the base
   domain's explain-code requests, the champion then trained on the code requests only, in a state dir of its own),
   each shifted prompt sent once while fresh ones last;
4. reads the live τ from the engine's own counters through the proxy (`/metrics`, and `/eagle/status` for the head
   served) every `sample_s`, over a sliding `window_s`;
5. once `threshold` shifted conversations are in the capture files, runs the `retrain-on-capture` flow (a child process:
   warm start from the champion, the shadow test in vLLM; the alias moves only when the shadow passes) while traffic
   goes on more slowly, held while the retrain measures in vLLM (its engine evaluation and shadow test;
   `--measure-beside-traffic`: not held, and on 2 cores their served figures then read unreliable); serve swaps when the
   alias moves (or rolls back, `monitor.rollback`);
6. keeps sending shifted prompts never trained on for `after_s` after the swap, stops, and checks the served greedy
   outputs of `check` distinct prompts against a plain vLLM of the same target (0 mismatches expected).
7. then (unless `--no-offline`) the offline reference: a fresh head trained on the same captured shifted traffic,
   measured beside the retrained head in vLLM on the same held-out captured requests (bench/serving_loop_offline.py:
   issue 48's 0.95x goal), printed and kept under `offline`.
Prints τ before the shift, after it, during the retrain and after the swap, failed requests (must be 0) and
mismatches; writes bench/results/serving_loop.json (the timeline: readings, events, serve's log lines, requests) and
serving_loop.png (live τ over time, a vertical line at each event; `--quick`: under .eagle/bench/results-quick/).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import common
import serving_loop_offline

from serving_loop_live import Sampler, Serve, Traffic, measure_hold, plain_check, plot, prompts, serve_events, stop_all
from serving_loop_setup import CODE, DEFAULT, QUICK, build, isolated_env, segments_file, write_config

RESULT = "SERVING_LOOP_RESULT "  # the line a child prints its result on


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- children: the flows, each in its own process with Prefect's local API ----------------------------------------


def child(kind: str, p: dict) -> dict:
    from infra.prefect_env import apply_prefect_defaults, start_local_api
    from infra.settings import Settings

    settings = Settings.from_env()
    apply_prefect_defaults(settings)
    start_local_api()
    if kind == "retrain":
        from flows.retrain_capture import retrain_on_capture

        return retrain_on_capture(p["name"], p["version"], p["preset"], p["config"])
    if kind == "offline":
        return serving_loop_offline.child(p)
    from components.registry.register import register_target
    from components.targets.target import weights_sha256
    from flows.train_head import train_head
    from infra.mlflow_store import MlflowStore

    store = MlflowStore.connect(settings)
    tref = register_target(
        store,
        p["name"],
        p["target_dir"],
        role="base",
        base_model="",
        weights_sha256=weights_sha256(p["target_dir"]),
        extra_tags={"traffic_train": p["train"], "traffic_heldout": p["heldout"]},
    )
    run = train_head(f"models:/{p['name']}/{tref.version}", p["train"], p["heldout"], p["preset"], p["config"])
    return {
        "head_uri": run.head_uri,
        "alias": run.alias,
        "tau": run.tau,
        "tau_raw": run.tau_raw,
        "tau_vllm": run.tau_vllm,
        "target_version": tref.version,
    }


def run_child(kind: str, p: dict, env: dict, on_line=None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, json.dumps(p)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = None
    for line in proc.stdout:
        if line.startswith(RESULT):
            out = json.loads(line[len(RESULT) :])
        else:
            _say(f"  {kind}: {line.rstrip()}")
            if on_line is not None:
                on_line(line)
    if proc.wait() != 0 or out is None:
        raise RuntimeError(f"the {kind} child failed (exit {proc.returncode})")
    return out


# ---- the cycle --------------------------------------------------------------------------------------------------


def verdict(s: dict, swapped: bool, tags: dict) -> str:
    before, shifted, after = (s[k]["tau"] for k in ("before_shift", "after_shift", "after_swap"))
    if before is None or shifted is None:
        return "too few drafts to read tau before or after the shift"
    drop = f"the shift moved tau {before:.2f} -> {shifted:.2f} ({shifted / before:.2f}x)" + (
        "" if shifted < before else ": it did not drop"
    )
    if not swapped:
        why = tags.get("shadow_reason") or tags.get("gate") or "no head registered"
        return f"{drop}; no swap: the retrained head was not promoted ({why}), so tau did not recover in this cycle"
    if after is None:
        return f"{drop}; swapped, but too few drafts after the swap to read tau"
    how = (
        "no drop to recover from; the new head's tau is " + ("higher" if after > shifted else "NOT higher")
        if shifted >= before
        else "recovered to the pre-shift tau"
        if after >= 0.95 * before
        else "partly recovered"
        if after > shifted
        else "did NOT recover"
    )
    return (
        f"{drop}; after the swap {after:.2f} ({after / shifted:.2f}x the shifted tau, {after / before:.2f}x the "
        f"pre-shift tau): {how}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # a flow in its own process (run_child)
        print(RESULT + json.dumps(child(argv[1], json.loads(argv[2])), default=str), flush=True)
        return 0
    p = common.base_args(__doc__.splitlines()[0])
    p.add_argument(
        "--shift",
        choices=["finetune", "explain"],
        default="finetune",
        help="finetune: the fine-tune's domain (the stdlib's tests); explain: the base domain's explain "
        "requests (the head's own traffic is then the code requests)",
    )
    p.add_argument("--no-rollback", action="store_true", help="serve with --no-rollback")
    p.add_argument(
        "--no-offline",
        action="store_true",
        help="skip the offline reference after the cycle (bench/serving_loop_offline.py)",
    )
    p.add_argument(
        "--retrain-pause",
        type=float,
        help="seconds between a client's requests during the retrain and until the swap (default 1.5 quick, 20 "
        "otherwise): on 2 cores live traffic at the full rate starves the vLLM engines the retrain starts beside the "
        "serving one (serve's own swap binds its new engine apart: infra/vllm_cpus.py)",
    )
    p.add_argument(
        "--measure-beside-traffic",
        action="store_true",
        help="send live traffic while the retrain measures in vLLM (by default the clients hold their requests from "
        "the start of its engine evaluation to the retrain's end: on 2 cores a served speedup measured beside live "
        "traffic read unreliable; in production the retrain runs on other cores)",
    )
    p.add_argument(
        "--promote-anyway",
        action="store_true",
        help="when the shadow test keeps the champion, move the alias to the new head anyway, to see the "
        "swap and the new head's live tau (a forced cycle: labelled so in the output, results under "
        "serving_loop-forced)",
    )
    a = p.parse_args(argv)
    load_before = common.start(a)
    sizes = QUICK if a.quick else DEFAULT
    if a.retrain_pause is not None:
        sizes = dataclasses.replace(sizes, retrain_pause_s=a.retrain_pause)
    state = (
        common.CACHE
        / ("serving-loop" + ("-quick" if a.quick else "") + ("-explain" if a.shift == "explain" else ""))
        / ".eagle"
    )
    state.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    from components.data.captured_traffic import CapturePlan, new_conversations
    from infra.mlflow_store import MlflowStore
    from infra.settings import Settings

    env = isolated_env(state)
    cfg_path = state.parent / "pipeline.json"
    cfg = write_config(sizes, cfg_path)
    emb, name = build(a.quick)
    train, heldout = emb.target_traffic.train, emb.target_traffic.heldout
    if a.shift == "explain":  # the champion never sees an explain request: its traffic is the code requests
        train, heldout = (segments_file(f, CODE, state.parent / f"code-{f.name}") for f in (train, heldout))
    _say(f"serving-loop: target {emb.target_dir}; training (or finding) its champion head in {state}")
    t_setup = time.monotonic()
    champ = run_child(
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
    setup_s = time.monotonic() - t_setup
    head_name, v1 = champ["head_uri"].removeprefix("models:/").split("/")
    settings = Settings.local(state)
    store = MlflowStore.connect(settings)
    store.set_alias(head_name, "champion", int(v1))  # an earlier run's retrained head may hold it
    shutil.rmtree(state / "capture", ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(emb.target_dir))
    limit = cfg.regenerate.limit or 0  # the champion trained on the first `limit` conversations: past them
    base, base_source = prompts([train], tok, sizes.max_prompt_tokens, skip=limit), f"{train} past its first {limit}"
    if not base:
        base, base_source = prompts([heldout], tok, sizes.max_prompt_tokens), f"{heldout} (the registered held-out)"
    shifted = (
        [emb.finetune_traffic.train, emb.finetune_traffic.heldout]
        if a.shift == "finetune"
        else [emb.target_traffic.train, emb.target_traffic.heldout]
    )
    shift = prompts(shifted, tok, sizes.max_prompt_tokens, None if a.shift == "finetune" else {"explain"})
    _say(
        f"serving-loop: {len(base)} prompts of the head's own traffic ({base_source}), {len(shift)} shifted "
        f"({a.shift}); champion models:/{head_name}/{v1} (registered tau {champ['tau']})"
    )
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "serve",
        "--head",
        f"models:/{head_name}@champion",
        "--k",
        str(cfg.evaluate.spec.depth),
        "--capture",
        "--follow-alias",
        "--follow-interval",
        "2",
        "--preset",
        sizes.preset,
        "--config",
        str(cfg_path),
        *(["--no-rollback"] if a.no_rollback else []),
    ]
    events: list[dict] = []
    t0, started_utc = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def ev(kind: str, t: float | None = None, **detail) -> float:
        t = time.monotonic() - t0 if t is None else t
        events.append({"t": round(t, 2), "kind": kind, **detail})
        _say(f"serving-loop: {t / 60:5.1f} min: {kind} {detail or ''}")
        return t

    serve, traffic, sampler, result, tags, at, error = Serve(cmd, env, t0), None, None, {}, {}, {}, None
    trained = forced = None
    try:
        url, model = serve.ready()
        at["ready"] = ev("serving", head=f"models:/{head_name}/{v1}")
        traffic = Traffic(url, model, {"base": base, "shift": shift}, sizes, t0)
        sampler = Sampler(url, sizes, t0, lambda: traffic.phase)
        sampler.thread.start()
        traffic.start()
        time.sleep(sizes.base_s)
        traffic.phase, shift_ms = "shift", int(time.time() * 1000)
        at["shift"] = ev("shift", traffic=a.shift)
        deadline = time.monotonic() + 1800
        while (n := new_conversations(state / "capture", name, champ["target_version"], shift_ms)) < sizes.threshold:
            if time.monotonic() > deadline or serve.proc.poll() is not None:
                raise RuntimeError(f"only {n} shifted conversations were captured (serve exit {serve.proc.poll()})")
            time.sleep(5)
        ev("capture threshold", conversations=n)
        traffic.pause_s = sizes.retrain_pause_s
        traffic.retrain_started()
        at["retrain"] = ev("retrain start")
        result = run_child(
            "retrain",
            {"name": name, "version": champ["target_version"], "preset": sizes.preset, "config": str(cfg_path)},
            env,
            None if a.measure_beside_traffic else measure_hold(traffic, ev),
        )
        traffic.hold(False)
        if result.get("head_uri"):
            hn, hv = result["head_uri"].removeprefix("models:/").split("/")
            tags = {
                k: v
                for k, v in store.get_version(hn, int(hv)).tags.items()
                if k.startswith(("shadow", "capture_", "tau", "gate", "speedup", "init_from"))
            }
        at["retrain_end"] = ev(
            "retrain end", head=result.get("head_uri"), alias=result.get("alias"), shadow=tags.get("shadow_verdict")
        )
        if result.get("plan"):  # from now on only shifted prompts the new head was not trained on
            trained = traffic.mark_trained(CapturePlan.read(result["plan"]).captured_file)
            _say(f"serving-loop: {trained} shifted prompts were trained on; they are not sent again")
        forced = a.promote_anyway and result.get("head_uri") and result.get("alias") != "champion"
        if forced:  # not the pipeline's decision: said so in every output
            store.set_alias(hn, "champion", int(hv))
            ev("alias forced", version=int(hv))
        if result.get("alias") == "champion" or forced:
            deadline = time.monotonic() + 900
            while (
                (t := serve.find("serve: swapped", at["retrain"])) is None
                and time.monotonic() < deadline
                and serve.proc.poll() is None
            ):
                time.sleep(1)
            if t is not None:
                at["swap"] = t
        # the retrain's pause holds until the swap, as in the cycles measured: before serve bound the new engine's
        # worker apart from the serving one's (infra/vllm_cpus.py), that worker starved at the full rate on 2 cores
        traffic.pause_s = sizes.pause_s
        end = t0 + at.get("swap", time.monotonic() - t0) + sizes.after_s
        while time.monotonic() < end and serve.proc.poll() is None:
            time.sleep(1)
    except Exception as e:  # the timeline so far is still written, with the error
        error = f"{type(e).__name__}: {e}"
        ev("error", error=error)
    finally:
        at["end"] = time.monotonic() - t0
        rc = stop_all(traffic, sampler, serve)
    if sampler is None:
        raise RuntimeError(error or "serve did not come up")
    events += serve_events(serve, 0.0)
    events.sort(key=lambda e: e["t"])
    t_swap = at.get("swap")
    after_engine = next((e for t, e, _ in sampler.raw if t_swap is not None and t > t_swap), None)

    def span(key_from: str, key_to: str, pad: float = 0.0, engine: str | None = None) -> dict:
        if key_from not in at or key_to not in at:
            return {"tau": None, "drafts": 0}
        return sampler.span(at[key_from] + pad, at[key_to], engine)

    summary = {
        "before_shift": span("ready", "shift"),
        "after_shift": span("shift", "retrain", sizes.sample_s),
        "during_retrain": span("retrain", "swap" if t_swap is not None else "end"),
        "after_swap": span("swap", "end", 0.0, after_engine),
    }
    failed = [r for r in traffic.results if r["error"] or r["finish_reason"] is None]
    _say("serving-loop: checking served greedy outputs against a plain vLLM of the target")
    check = plain_check(
        str(emb.target_dir), model, traffic.pools, traffic.results, t_swap, sizes.check, sizes.max_tokens, settings
    )
    offline = None
    if result.get("plan") and result.get("head_uri") and not a.no_offline:
        _say("serving-loop: the offline reference: a fresh head on the captured shifted traffic, then both in vLLM")
        run = lambda kind, p: run_child(kind, p, env)  # noqa: E731
        target = (name, champ["target_version"])
        offline = serving_loop_offline.reference(run, store, state.parent / "offline", sizes, target, result, summary)
    line = (
        (f"ERROR: {error}; " if error else "")
        + (
            "FORCED: the shadow test kept the champion, the bench moved the alias itself (--promote-anyway); "
            if forced
            else ""
        )
        + verdict(summary, t_swap is not None, tags)
    )
    rows = [{"span": k, "tau": v["tau"], "drafts": v["drafts"]} for k, v in summary.items()]
    common.print_table(rows, ["span", "tau", "drafts"], "live tau through one serving-loop cycle (vLLM's counters)")
    print(
        f"requests: {len(traffic.results)}, failed {len(failed)}; greedy outputs of {check['prompts_checked']} "
        f"prompts ({check['requests_checked']} requests) against plain vLLM: {check['mismatched_requests']} "
        f"mismatched\n{line}\nretrain: {result.get('head_uri')} alias {result.get('alias')}; shadow "
        f"{tags.get('shadow_verdict')}: {tags.get('shadow_reason')}",
        flush=True,
    )
    if offline is not None:
        print(offline.get("error") or serving_loop_offline.line(offline), flush=True)
    out_name = "serving_loop" + ("" if a.shift == "finetune" else f"-{a.shift}") + ("-forced" if forced else "")
    png = common.results_dir(a.quick) / f"{out_name}.png"
    what = "--quick: the tiny toy target" if a.quick else "SmolLM2-135M"
    plot(
        png,
        sampler.points,
        events,
        f"one serving-loop cycle ({what}, shift: {a.shift}, "
        f"{time.strftime('%Y-%m-%d')}, {common.cpu_info().get('model', '')})",
        f"{line}; {len(traffic.results)} requests, {len(failed)} failed, {check['mismatched_requests']} of "
        f"{check['requests_checked']} checked greedy outputs differ from plain vLLM",
    )
    payload = {
        "plot": str(png),
        "started_utc": started_utc,
        "shift": a.shift,
        "sizes": dataclasses.asdict(sizes),
        "target": str(emb.target_dir),
        "base_prompts": base_source,
        "champion": champ,
        "champion_setup_s": round(setup_s, 1),
        "retrain": result,
        "retrained_tags": tags,
        "summary": summary,
        "verdict": line,
        "error": error,
        "forced_promotion": bool(forced),
        "shifted_prompts": len(shift),
        "shifted_prompts_trained_on": trained,
        "requests": len(traffic.results),
        "failed_requests": len(failed),
        "failures": failed[:10],
        "plain_check": check,
        "offline": offline,
        "serve_exit": rc,
        "events": events,
        "points": sampler.points,
        "serve_log": [[round(t, 2), ln] for t, ln in serve.lines],
        "request_log": [
            {k: r[k] for k in ("phase", "prompt", "fresh", "start", "end", "error", "finish_reason")}
            | {"tokens": len(r["token_ids"])}
            for r in traffic.results
        ],
    }
    common.write_results(out_name, a.quick, payload, load_before)
    return 0 if not error and not failed and not check["mismatched_requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
