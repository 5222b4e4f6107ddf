"""The `eagle-heads` command line: demo, train, evaluate, watch.

Purpose: argument parsing with clear errors, then one call into a flow (or the evaluate stage). `--help` and
argument errors import nothing heavy; Prefect, MLflow and torch load only once a command runs.
  eagle-heads demo [--preset default|tiny] [--embedded-preset default|tiny]
  eagle-heads train --target DIR|models:/name/version --traffic FILE --heldout FILE [--name N] [--config F]
  eagle-heads evaluate --head DIR|models:/name/version [--target DIR|models:/...] --traffic FILE [--json OUT]
                      [--method chain|tree] [--depth D] [--limit N]
                      [--engine local|vllm]
  eagle-heads serve --head models:/name@alias|DIR [--target ...] [--port P] [--k K] [--print-only]
  eagle-heads watch [--once] [--interval S] [--dispatch event|local]
  eagle-heads monitor --metrics-url URL --target models:/name/version [--once] [--interval S] [--window S]
                      [--ratio R] [--sustain S] [--config F]
Settings come from the environment (infra/settings.py): EAGLE_HOME, MLFLOW_TRACKING_URI, RAY_ADDRESS,
PREFECT_API_URL. Exit codes: 0 success; 2 bad arguments, bad input (`eagle.errors.BadInput`: arguments, files,
URIs, settings, config values, checked by flows/preflight.py before any work starts) or unreachable services, as one
line `eagle-heads: error: ...`; 1 a failure of the job, as one line naming the log file that holds its traceback.
Not here: any stage logic.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import time
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle-heads", description="Train, evaluate and register EAGLE-3 heads.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="the whole job on the embedded default")
    d.add_argument("--preset", default="default", choices=["default", "tiny"], help="pipeline preset")
    d.add_argument("--embedded-preset", default="default", choices=["default", "tiny", "gpu"])
    t = sub.add_parser("train", help="train, evaluate and register a head for one target")
    t.add_argument("--target", required=True, help="HF model directory or models:/name/version")
    t.add_argument("--traffic", required=True, help="training traffic: JSONL, Parquet, Arrow or a datasets "
                   "save_to_disk directory (OpenAI messages or ShareGPT conversations)")
    t.add_argument("--heldout", required=True, help="held-out traffic for evaluation")
    t.add_argument("--name", help="registry name for a target given as a directory (default: its folder name)")
    t.add_argument("--preset", default="default", choices=["default", "tiny"])
    t.add_argument("--config", help="JSON file overriding the preset, section by section")
    e = sub.add_parser("evaluate", help="measure a head: tau, acceptance, speedup, identical outputs")
    e.add_argument("--head", required=True, help="exported head directory or models:/name/version|@alias")
    e.add_argument("--target", help="target directory or models:/...; default: the head's target from lineage")
    e.add_argument("--traffic", required=True, help="held-out traffic (same formats as train --traffic)")
    e.add_argument("--json", help="write the result here as JSON")
    e.add_argument("--preset", default="default", choices=["default", "tiny"])
    e.add_argument("--method", choices=["chain", "tree"], help="drafting method (default: the preset's, chain)")
    e.add_argument("--depth", type=_count, help="draft depth (default: the preset's; a well-trained head pays "
                                                "deeper, see README 'How much to train and how deep to draft')")
    e.add_argument("--limit", type=_count, help="held-out conversations to decode (default: the preset's)")
    e.add_argument("--engine", choices=["local", "vllm"],
                   help="vllm: also serve the head in vLLM and measure tau, alpha_k and speedup there")
    e.add_argument("--load", action="store_true",
                   help="also sweep load in vLLM (evaluate.load: concurrency levels x K values, vLLM's own load "
                        "client) and derive the K schedule; the default preset's levels when the preset has none")
    s = sub.add_parser("serve", help="serve a head with its target in vLLM (OpenAI-compatible server on loopback)")
    s.add_argument("--head", required=True, help="models:/name@alias, models:/name/version or a head directory")
    s.add_argument("--target", help="target directory or models:/...; default: the head's target from lineage")
    s.add_argument("--port", type=_port, help="port on 127.0.0.1 (default: a free one)")
    s.add_argument("--k", type=_k, help="pin K speculative tokens per verification step (at most 16); default: the "
                   "head's registered K schedule (evaluate.load), else 5")
    s.add_argument("--print-only", action="store_true",
                   help="print the equivalent vLLM and SGLang launch commands for a GPU cluster and exit")
    w = sub.add_parser("watch", help="poll the registry and announce target versions without a head")
    w.add_argument("--once", action="store_true", help="poll once and exit")
    w.add_argument("--interval", type=_positive, default=60.0, help="seconds between polls")
    w.add_argument("--dispatch", default="event", choices=["event", "local"],
                   help="event: emit Prefect events for the trigger; local: also train here")
    w.add_argument("--preset", default="default", choices=["default", "tiny"])
    m = sub.add_parser("monitor", help="watch a vLLM server's acceptance; announce a drop (retrains the head)")
    m.add_argument("--metrics-url", required=True, help="the server's Prometheus page, e.g. http://HOST:8000/metrics")
    m.add_argument("--target", required=True, help="the target version it serves: models:/name/version")
    m.add_argument("--once", action="store_true", help="scrape once and exit (exit 1 when it cannot)")
    m.add_argument("--interval", type=_positive, help="seconds between scrapes (default: monitor.interval_s)")
    m.add_argument("--window", type=_nonnegative, help="sliding window in seconds (default: monitor.window_s)")
    m.add_argument("--ratio", type=_ratio, help="drop: window tau < ratio x registered tau (default: monitor.ratio)")
    m.add_argument("--sustain", type=_nonnegative, help="... for this many seconds (default: monitor.sustain_s)")
    m.add_argument("--preset", default="default", choices=["default", "tiny"])
    m.add_argument("--config", help="JSON file overriding the preset (its `monitor` section)")
    return p


def _number(check, rule: str, what: str = "a number of seconds"):
    """An argparse type: a float that passes `check`, else the error '<text>: <rule>'."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value) or not check(value):
            raise argparse.ArgumentTypeError(f"{text!r}: {rule}")
        return value

    return parse


_positive = _number(lambda v: v > 0, "the interval must be > 0 seconds")
_nonnegative = _number(lambda v: v >= 0, "must be >= 0 seconds")
_ratio = _number(lambda v: 0 < v <= 1, "the ratio must be in (0, 1]", "a number")


def _port(text: str) -> int:
    value = _count(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: a port is 1..65535")
    return value


def _k(text: str) -> int:
    """Speculative tokens per step, 1..16. vLLM bounds `num_speculative_tokens` only below (> 0), and an EAGLE-3
    head drafts autoregressively to any depth, but it is trained for `ttt_steps` positions (7 by default) and its
    acceptance falls with each one past them: beyond ~2x that, every extra draft costs a head step and a verified
    token slot and is almost never accepted. 16 also keeps K+1 verified tokens far inside any engine's context."""
    value = _count(text)
    if value > 16:
        raise argparse.ArgumentTypeError(f"{text!r}: at most 16 speculative tokens per step (the head is trained for "
                                         "7 positions; deeper drafts are almost never accepted)")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return value


def _check_files(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for opt in ("target", "head", "traffic", "heldout", "config"):
        p = getattr(a, opt, None)
        if not p or p.startswith("models:/"):
            continue
        if not Path(p).exists():
            parser.error(f"--{opt} {p}: no such file or directory")
        if opt == "config" and not Path(p).is_file():
            parser.error(f"--{opt} {p}: not a file")  # traffic may be a `datasets` save_to_disk directory


def _setup(a):
    """The settings, checked (state dir, tracking URI), and the command's preflight; Prefect's defaults only then,
    so that a refusal leaves nothing under the state dir."""
    from flows.preflight import preflight
    from infra.prefect_env import apply_prefect_defaults
    from infra.settings import Settings

    settings = Settings.from_env().check()
    preflight(a, settings)
    apply_prefect_defaults(settings)
    return settings


def _refusals() -> tuple[type[BaseException], ...]:
    """Errors that exit 2 with one line: bad input (`BadInput`: each names the input and what to do), unreachable
    services (`ConnectionError`), an engine that cannot start (`EngineError`)."""
    from eagle.errors import BadInput
    from infra.vllm_server import EngineError

    return (BadInput, ConnectionError, EngineError)


def _log_failure(a, settings) -> str:
    """Write the current exception's traceback to `<state>/logs/<command>-<time>.log` (or the temp dir when the
    state dir is unusable) and return its path."""
    import tempfile
    import traceback

    stamp = time.strftime("%Y%m%d-%H%M%S")
    for folder in ([settings.state_dir / "logs"] if settings else []) + [Path(tempfile.gettempdir())]:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"eagle-heads-{a.command}-{stamp}.log"
            path.write_text(traceback.format_exc())
            return str(path)
        except OSError:
            continue
    return "(no log: nowhere writable)"


def _quiet_prefect() -> None:
    """After the job: keep Prefect's shutdown chatter from following our last line."""
    logging.getLogger("prefect").setLevel(logging.WARNING)


def _resolve_head(a, settings) -> tuple[str, str, dict]:
    """Local directories of `--head` and `--target`, and the head's lineage. The target defaults to the one the head
    names: its lineage, else (a head registered from elsewhere) its registry version's `target_*` tags."""
    from eagle.export import read_head_meta
    from infra.mlflow_store import MlflowStore, parse_model_uri

    store = MlflowStore.connect(settings) if "models:/" in (a.head + (a.target or "")) else None
    head = str(store.resolve(a.head)) if store and a.head.startswith("models:/") else a.head
    lineage = dict(read_head_meta(head).get("lineage", {}))
    if "target_name" not in lineage and store and a.head.startswith("models:/"):
        name, version, alias = parse_model_uri(a.head)
        ref = store.get_version(name, version) if version is not None else store.get_alias(name, alias or "")
        tags = ref.tags if ref else {}
        if "target_name" in tags:
            lineage.update(target_name=tags["target_name"], target_version=tags["target_version"])
    target = a.target
    if target is None:
        if "target_name" not in lineage:
            from eagle.errors import BadInput

            raise BadInput(f"{head}: the head names no target (lineage or registry tags); pass --target")
        target = f"models:/{lineage['target_name']}/{lineage['target_version']}"
    if target.startswith("models:/"):
        store = store or MlflowStore.connect(settings)
        target = str(store.resolve(target))
    return head, target, lineage


def _evaluate(a, settings) -> dict:
    import dataclasses
    from dataclasses import asdict

    from components.evaluate import evaluate
    from components.pipeline_config import PipelineConfig, override_values

    head, target, _ = _resolve_head(a, settings)
    given = {"spec": {k: v for k, v in (("method", a.method), ("depth", a.depth)) if v is not None},
             **{k: v for k, v in (("limit", a.limit), ("engine", a.engine)) if v is not None}}
    cfg = override_values(PipelineConfig.preset(a.preset).evaluate, given, "command line", "evaluate")
    out = settings.state_dir / "evaluations" / time.strftime("%Y%m%d-%H%M%S")
    try:
        res = asdict(evaluate(cfg, target, head, a.traffic, str(out), trust_remote_code=settings.trust_remote_code))
    except BaseException:
        for folder in (out, out.parent):  # a refusal leaves no empty evaluation folder behind
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    if cfg.engine == "vllm":
        from components.engine_eval import evaluate_in_vllm, our_outputs
        from components.serve import servable_head

        served = servable_head(head, target, settings.state_dir / "servable", settings.trust_remote_code)
        res["vllm"] = asdict(evaluate_in_vllm(cfg, target, str(served), a.traffic, str(out / "vllm"), settings,
                                              ours=our_outputs(res["report_file"])))
    if getattr(a, "load", False):
        from components.load_sweep import load_sweep
        from components.serve import servable_head

        if not cfg.load.enabled:
            cfg = dataclasses.replace(cfg, load=PipelineConfig.preset("default").evaluate.load)
        served = servable_head(head, target, settings.state_dir / "servable", settings.trust_remote_code)
        res["load"] = asdict(load_sweep(cfg, target, str(served), a.traffic, str(out / "load"), settings))
    return res


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _serve(a, settings) -> int:
    import signal

    from components.engine_eval import target_context
    from components.serve import launch_commands, servable_head
    from infra.vllm_server import EngineSpec, VllmServer

    head, target, lineage = _resolve_head(a, settings)
    served = servable_head(head, target, settings.state_dir / "servable", settings.trust_remote_code)
    name = lineage.get("target_name") or Path(target).name
    schedule = None if a.k else _registered_schedule(a.head, settings)
    k = a.k or (max(max(r[2] for r in schedule), 1) if schedule else 5)
    spec = EngineSpec(target, str(served), method="eagle3", num_speculative_tokens=k,
                      max_model_len=min(target_context(target), 4096), served_model_name=name,
                      k_schedule=tuple(tuple(r) for r in schedule) if schedule else None)
    if served != Path(head):
        print(f"serve: {head} predates the engine format; serving its lossless re-export {served}")
    how = (f"the registered K schedule {json.dumps(schedule)} ([first batch size, last, K]; K 0: no drafts)"
           if schedule else f"{k} speculative tokens" + ("" if a.k else " (no K schedule registered)"))
    if a.print_only:
        cmds = launch_commands(spec, a.port or 8000)
        print(f"# vLLM with {how} (GPU; copy {served} and {target} to the cluster first)\n{cmds['vllm']}")
        sglang_note = (f"; SGLang has no per-batch-size K: it runs K {k} at every load (pass --k for the K of "
                       "your typical concurrency)" if schedule else "")
        print(f"# SGLang{sglang_note}\n{cmds['sglang']}")
        return 0
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` stops the engine as Ctrl-C does
    print(f"serve: starting vLLM with {a.head} ({how}); log under {settings.state_dir / 'vllm'}", flush=True)
    with VllmServer(spec, settings, port=a.port) as srv:
        print(f"serve: ready at {srv.base_url}/v1 (model {name!r}); try\n  curl {srv.base_url}/v1/chat/completions "
              f"-H 'Content-Type: application/json' -d '{{\"model\": \"{name}\", \"messages\": "
              f"[{{\"role\": \"user\", \"content\": \"def add(a, b):\"}}], \"max_tokens\": 32}}'\n"
              f"  acceptance: curl -s {srv.base_url}/metrics | grep spec_decode; Ctrl-C stops the server", flush=True)
        while srv.proc is not None and srv.proc.poll() is None:
            time.sleep(1.0)
        print(f"eagle-heads: error: vLLM stopped: {srv.last_error()} (log: {srv.log_path})", file=sys.stderr)
        return 1


def _registered_schedule(uri: str, settings) -> list[list[int]] | None:
    """The `k_schedule` tag of a registered head version (None: a directory, or no load sweep registered)."""
    if not uri.startswith("models:/"):
        return None
    from infra.mlflow_store import MlflowStore, parse_model_uri

    store = MlflowStore.connect(settings)
    name, version, alias = parse_model_uri(uri)
    ref = store.get_version(name, version) if version is not None else store.get_alias(name, alias or "")
    text = ref.tags.get("k_schedule") if ref else None
    return json.loads(text) if text else None


def _monitor(a, settings) -> int:
    """Print the window tau each interval; a drop emits the event (with a Prefect API) once."""
    from flows.watch_acceptance import monitor_config, monitor_forever, open_monitor

    cfg = monitor_config(a.preset, a.config, interval_s=a.interval, window_s=a.window, ratio=a.ratio,
                         sustain_s=a.sustain)
    monitor = open_monitor(a.metrics_url, a.target, cfg, settings)
    m = cfg.monitor
    print(f"monitor: {a.target} (champion {monitor.baseline.head_uri}, registered tau {monitor.baseline.tau:.2f} "
          f"from {monitor.baseline.tau_source}) at {a.metrics_url}: a drop is window tau < {m.ratio} x registered "
          f"for {m.sustain_s:.0f} s (window {m.window_s:.0f} s, >= {m.min_drafts} drafts)", flush=True)
    return monitor_forever(monitor, a.metrics_url, a.once, lambda line: print(line, flush=True))


def _demo(a, settings) -> int:
    from flows.demo import demo

    res = demo(preset=a.preset, embedded_preset=a.embedded_preset)
    _quiet_prefect()
    print("\n".join(res["lines"]), flush=True)
    return 0


def _train(a, settings) -> int:
    from flows.train_head import train_head

    s = train_head(a.target, a.traffic, a.heldout, a.preset, a.config, a.name)
    _quiet_prefect()
    print(f"train: head={s.head_uri} tau={s.tau:.2f} speedup={s.speedup:.2f}x "
          f"identical={'yes' if s.identical else 'no'}")
    return 0


def _speed_text(res: dict) -> str:
    """"1.52x [1.47, 1.58]" from an evaluation result's speedup fields; "(unreliable: why)" when it is."""
    text = f"{res['speedup']:.2f}x [{res['speedup_lo']:.2f}, {res['speedup_hi']:.2f}]"
    return text if res["speedup_reliable"] else f"{text} (unreliable: {res['speedup_note']})"


def _evaluate_command(a, settings) -> int:
    res = _evaluate(a, settings)
    if a.json:
        from components.atomic import atomic_write_text

        atomic_write_text(a.json, json.dumps(res, indent=2) + "\n")
    print(f"evaluate: tau={res['tau']:.2f} speedup={_speed_text(res)} identical={res['identical']}")
    if "vllm" in res:
        v = res["vllm"]
        print(f"evaluate (vLLM): tau={v['tau']:.2f} speedup={_speed_text(v)} "
              f"identical={v['identical_to_plain'] and v['identical_to_ours'] is not False} "
              f"alpha={' '.join(f'{x:.2f}' for x in v['acceptance'])}")
    if "load" in res:
        w = res["load"]
        at = " ".join(f"{c}:{x:.2f}x" for c, x in w["speedup_at"].items())
        print(f"evaluate (vLLM, load): speedup by concurrency {at}; crossover={w['crossover']} "
              f"schedule={json.dumps(w['schedule'])} (plot {w['plot_file']})")
    return 0


def _watch(a, settings) -> int:
    from flows.watch import watch_registry

    while True:
        done = watch_registry(dispatch=a.dispatch, preset=a.preset)
        print(f"watch: {len(done)} version(s) announced")
        if a.once:
            return 0
        time.sleep(a.interval)


COMMANDS = {"demo": _demo, "train": _train, "evaluate": _evaluate_command, "serve": _serve, "watch": _watch,
            "monitor": _monitor}
NEEDS_PREFECT = {"demo", "train", "watch"}  # commands that run flows


def _run_command(a, settings) -> int:
    """The command, its preflight passed (flows/preflight.py, from `_setup`)."""
    if a.command in NEEDS_PREFECT:
        from infra.prefect_env import start_local_api

        start_local_api()  # Prefect's own start-up races with another process on a new Prefect home
    return COMMANDS[a.command](a, settings)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split("\n")).strip() or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    _check_files(parser, a)
    settings = None
    try:
        settings = _setup(a)
        return _run_command(a, settings)
    except KeyboardInterrupt:
        return 130
    except _refusals() as e:
        print(f"eagle-heads: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # the job failed, or a bug: one line here, the traceback in a log file
        print(f"eagle-heads: {a.command} failed: {type(e).__name__}: {_one_line(e)[:500]} (traceback: "
              f"{_log_failure(a, settings)})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
