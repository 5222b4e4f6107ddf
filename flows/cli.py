"""The `eagle-heads` command line: demo, train, evaluate, watch.

Purpose: argument parsing with clear errors, then one call into a flow (or the evaluate stage). `--help` and
argument errors import nothing heavy; Prefect, MLflow and torch load only once a command runs.
  eagle-heads demo [--preset default|tiny] [--embedded-preset default|tiny]
  eagle-heads train --target DIR|models:/name/version --traffic FILE --heldout FILE [--name N] [--config F]
  eagle-heads evaluate --head DIR|models:/name/version [--target DIR|models:/...] --traffic FILE [--json OUT]
                      [--method chain|tree] [--depth D] [--limit N]
  eagle-heads watch [--once] [--interval S] [--dispatch event|local]
Settings come from the environment (infra/settings.py): EAGLE_HOME, MLFLOW_TRACKING_URI, RAY_ADDRESS,
PREFECT_API_URL. Exit codes: 0 success, 1 failure of the job, 2 bad arguments, bad input (traffic, target,
config, registry name; checked before any work starts) or unreachable services.
Not here: any stage logic.
"""

from __future__ import annotations

import argparse
import json
import logging
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
    t.add_argument("--traffic", required=True, help="training traffic (OpenAI messages or ShareGPT JSONL)")
    t.add_argument("--heldout", required=True, help="held-out traffic for evaluation")
    t.add_argument("--name", help="registry name for a target given as a directory (default: its folder name)")
    t.add_argument("--preset", default="default", choices=["default", "tiny"])
    t.add_argument("--config", help="JSON file overriding the preset, section by section")
    e = sub.add_parser("evaluate", help="measure a head: tau, acceptance, speedup, identical outputs")
    e.add_argument("--head", required=True, help="exported head directory or models:/name/version|@alias")
    e.add_argument("--target", help="target directory or models:/...; default: the head's target from lineage")
    e.add_argument("--traffic", required=True, help="held-out traffic JSONL")
    e.add_argument("--json", help="write the result here as JSON")
    e.add_argument("--preset", default="default", choices=["default", "tiny"])
    e.add_argument("--method", choices=["chain", "tree"], help="drafting method (default: the preset's, chain)")
    e.add_argument("--depth", type=_count, help="draft depth (default: the preset's; a well-trained head pays "
                                                "deeper, see README 'How much to train and how deep to draft')")
    e.add_argument("--limit", type=_count, help="held-out conversations to decode (default: the preset's)")
    w = sub.add_parser("watch", help="poll the registry and announce target versions without a head")
    w.add_argument("--once", action="store_true", help="poll once and exit")
    w.add_argument("--interval", type=_positive, default=60.0, help="seconds between polls")
    w.add_argument("--dispatch", default="event", choices=["event", "local"],
                   help="event: emit Prefect events for the trigger; local: also train here")
    w.add_argument("--preset", default="default", choices=["default", "tiny"])
    return p


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the interval must be > 0 seconds")
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
        if opt in ("traffic", "heldout", "config") and not Path(p).is_file():
            parser.error(f"--{opt} {p}: not a file")


def _setup():
    from infra.prefect_env import apply_prefect_defaults
    from infra.settings import Settings

    settings = Settings.from_env()
    apply_prefect_defaults(settings)
    return settings


def _input_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input (exit 2): each names the input and what to do."""
    from components.chat import ChatTemplateError
    from components.pipeline_config import ConfigError
    from components.regenerate import RegenerateError
    from components.targets import TargetError
    from components.traffic_io import TrafficFormatError
    from eagle.export import HeadMismatchError
    from infra.mlflow_store import RegistryCollision

    return (TrafficFormatError, ConfigError, TargetError, RegistryCollision, RegenerateError, ChatTemplateError,
            HeadMismatchError)


def _preflight_train(a, settings) -> None:
    """Bad input and unreachable services fail here, in seconds, before the flow starts or writes anything."""
    from components.pipeline_config import PipelineConfig
    from flows.train_head import check_inputs
    from infra.mlflow_health import probe_tracking

    cfg = PipelineConfig.load(a.config, a.preset)
    check_inputs(a.target, a.traffic, a.heldout, cfg, settings)
    probe_tracking(settings)


def _quiet_prefect() -> None:
    """After the job: keep Prefect's shutdown chatter from following our last line."""
    logging.getLogger("prefect").setLevel(logging.WARNING)


def _evaluate(a) -> dict:
    from dataclasses import replace

    from components.evaluate import evaluate
    from components.pipeline_config import PipelineConfig
    from infra.mlflow_store import MlflowStore
    from infra.settings import Settings
    from eagle.export import read_head_meta

    settings = Settings.from_env()
    store = MlflowStore.connect(settings) if "models:/" in (a.head + (a.target or "")) else None
    head = str(store.resolve(a.head)) if a.head.startswith("models:/") else a.head
    target = a.target
    if target is None:
        lin = read_head_meta(head)["lineage"]
        if "target_name" not in lin:
            raise SystemExit(f"{head}: no target in the head's lineage; pass --target")
        target = f"models:/{lin['target_name']}/{lin['target_version']}"
    if target.startswith("models:/"):
        store = store or MlflowStore.connect(settings)
        target = str(store.resolve(target))
    cfg = PipelineConfig.preset(a.preset).evaluate
    cfg = replace(cfg, **{k: v for k, v in (("method", a.method), ("depth", a.depth), ("limit", a.limit))
                          if v is not None})
    out = settings.state_dir / "evaluations" / time.strftime("%Y%m%d-%H%M%S")
    res = evaluate(cfg, target, head, a.traffic, str(out), trust_remote_code=settings.trust_remote_code)
    from dataclasses import asdict

    return asdict(res)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    _check_files(parser, a)
    try:
        settings = _setup()
    except ValueError as e:  # a malformed setting in the environment
        print(f"eagle-heads: error: {e}", file=sys.stderr)
        return 2
    try:
        if a.command in ("demo", "watch"):
            from infra.mlflow_health import probe_tracking

            probe_tracking(settings)  # in seconds, before a flow starts
        if a.command == "train":
            _preflight_train(a, settings)
        if a.command != "evaluate":
            from infra.prefect_env import start_local_api

            start_local_api()  # Prefect's own start-up races with another process on a new Prefect home
        if a.command == "demo":
            from flows.demo import demo

            res = demo(preset=a.preset, embedded_preset=a.embedded_preset)
            _quiet_prefect()
            print("\n".join(res["lines"]), flush=True)
            return 0
        if a.command == "train":
            from flows.train_head import train_head

            s = train_head(a.target, a.traffic, a.heldout, a.preset, a.config, a.name)
            _quiet_prefect()
            print(f"train: head={s['head_uri']} tau={s['tau']:.2f} speedup={s['speedup']:.2f}x "
                  f"identical={'yes' if s.get('identical') else 'no'}")
            return 0
        if a.command == "evaluate":
            res = _evaluate(a)
            if a.json:
                from components.atomic import atomic_write_text

                atomic_write_text(a.json, json.dumps(res, indent=2) + "\n")
            print(f"evaluate: tau={res['tau']:.2f} speedup={res['speedup']:.2f}x identical={res['identical']}")
            return 0
        from flows.watch import watch_registry

        while True:
            done = watch_registry(dispatch=a.dispatch, preset=a.preset)
            print(f"watch: {len(done)} version(s) announced")
            if a.once:
                return 0
            time.sleep(a.interval)
    except KeyboardInterrupt:
        return 130
    except (ConnectionError, FileNotFoundError, LookupError) as e:
        print(f"eagle-heads: error: {e}", file=sys.stderr)
        return 2
    except _input_errors() as e:
        print(f"eagle-heads: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the job failed: one clear line, the traceback is in the logs above
        print(f"eagle-heads: {a.command} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
