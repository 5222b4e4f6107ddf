"""The `eagle-heads` command table: one row per command (name, help, arguments, preflight, run, needs Prefect).

Purpose: adding a command is one row here (plus its run function in flows/command_runs.py and, when it checks
anything before starting, its preflight in flows/preflight.py); flows/cli.py builds the parser from `COMMANDS`,
runs the row's preflight (which returns the config the command runs with, resolved once), starts Prefect's local
API for rows that run flows, then the row's run function with that config.
The argument types here refuse bad numbers at parse time (exit 2, argparse's usage line); `--set KEY.PATH=VALUE`
(repeatable) is parsed by components/config/presets.py `assignment` and checked against the config by the same strict
override machinery as a `--config` file, in the command's preflight.
Run: through `eagle-heads ...` (flows/cli.py). Importing this module loads nothing heavy (no torch, Prefect, MLflow,
Ray; flows/preflight.py and flows/command_runs.py import those inside their functions): `--help` and argument errors
stay instant.
Not here: what a command does (flows/command_runs.py, flows/command_serve.py), its checks (flows/preflight.py), exit
codes (flows/cli.py).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable

from components.config.presets import NAMES as PRESETS
from components.config.presets import assignment
from flows import command_runs as runs
from flows import command_serve
from flows import preflight


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]  # adds the command's arguments to its subparser
    run: Callable[..., int]  # (parsed arguments, settings or None, the preflight's config or None) -> exit code
    # flows/preflight.py check_<name>: (parsed arguments, settings or None) -> the config the command runs with (None:
    # it takes none); raises BadInput before any work
    preflight: Callable[..., Any]
    needs_prefect: bool = False  # runs flows: Prefect's local API is started first
    needs_settings: bool = True  # False: no state dir or services are touched (config show)


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


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return value


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
        raise argparse.ArgumentTypeError(
            f"{text!r}: at most 16 speculative tokens per step (the head is trained for "
            "7 positions; deeper drafts are almost never accepted)"
        )
    return value


def _assignment(text: str):
    try:
        return assignment(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _config_args(p: argparse.ArgumentParser, config_help: str = "JSON file overriding the preset, section by section"):
    """--preset, --config and --set: the arguments of every command that takes a pipeline config."""
    p.add_argument(
        "--preset", default="default", choices=PRESETS, help="pipeline preset (components/config/presets.py)"
    )
    p.add_argument("--config", help=config_help)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        type=_assignment,
        metavar="KEY.PATH=VALUE",
        help="override one config value after --config, e.g. --set train.steps=50 (repeatable; the "
        "value is JSON, else a string); `eagle-heads config show` prints the result",
    )


def _demo_args(p):
    p.add_argument("--preset", default="default", choices=PRESETS, help="pipeline preset")
    p.add_argument(
        "--embedded-preset",
        default="smollm2",
        choices=["smollm2", "toy", "tiny", "gpu"],
        help="smollm2 (default): the real pretrained chat model and its LoRA fine-tune; toy, tiny, gpu: the "
        "stdlib Llama built here",
    )


def _train_args(p):
    p.add_argument("--target", required=True, help="HF model directory or models:/name/version")
    p.add_argument(
        "--traffic",
        required=True,
        help="training traffic: JSONL, Parquet, Arrow or a datasets "
        "save_to_disk directory (OpenAI messages or ShareGPT conversations)",
    )
    p.add_argument("--heldout", required=True, help="held-out traffic for evaluation")
    p.add_argument("--name", help="registry name for a target given as a directory (default: its folder name)")
    _config_args(p)


def _head_args(p):
    p.add_argument("--head", required=True, help="exported head directory, models:/name/version or models:/name@alias")
    p.add_argument("--target", help="target directory or models:/...; default: the head's target from lineage")


def _evaluate_args(p):
    _head_args(p)
    p.add_argument("--traffic", required=True, help="held-out traffic (same formats as train --traffic)")
    p.add_argument("--json", help="write the result here as JSON")
    _config_args(p, "JSON file overriding the preset (its `evaluate` section is used)")
    p.add_argument("--method", choices=["chain", "tree"], help="drafting method (default: the preset's, chain)")
    p.add_argument(
        "--depth",
        type=_count,
        help="draft depth (default: the preset's; a well-trained head pays "
        "deeper, see README 'How much to train and how deep to draft')",
    )
    p.add_argument("--limit", type=_count, help="held-out conversations to decode (default: the preset's)")
    p.add_argument(
        "--engine",
        choices=["local", "vllm"],
        help="vllm: also serve the head in vLLM and measure tau, alpha_k and speedup there",
    )
    p.add_argument(
        "--load",
        action="store_true",
        help="also sweep load in vLLM (evaluate.load: concurrency levels x K values, vLLM's own load "
        "client) and derive the K schedule; the default preset's levels when the config has none",
    )


def _serve_args(p):
    _head_args(p)
    p.add_argument("--port", type=_port, help="port on 127.0.0.1 (default: a free one)")
    p.add_argument(
        "--k",
        type=_k,
        help="pin K speculative tokens per verification step (at most 16); default: the "
        "head's registered K schedule (evaluate.load), else 5",
    )
    p.add_argument(
        "--concurrency",
        type=_count,
        help="the requests you expect at once: serve the registered schedule's K at that batch size as a "
        "fixed K, or plain decoding (no head) where the schedule says K 0 (vLLM still runs the head "
        "once a step in a K-0 range)",
    )
    p.add_argument(
        "--print-only",
        action="store_true",
        help="print the equivalent vLLM and SGLang launch commands for a GPU cluster and exit",
    )
    p.add_argument(
        "--capture",
        action="store_true",
        help="put our proxy in front of vLLM and record sampled requests (messages, completion, settings) "
        "to <state>/capture/<target>/*.parquet (docs/operations.md)",
    )
    p.add_argument("--capture-rate", type=_ratio, default=1.0, help="share of requests recorded, in (0, 1]")
    p.add_argument(
        "--capture-max-mb",
        type=_count,
        default=1024,
        help="size cap of the capture files in MiB; the oldest file is deleted first",
    )
    p.add_argument(
        "--follow-alias",
        action="store_true",
        help="--head models:/NAME@ALIAS: poll the registry and, when the alias moves, start the new "
        "version's vLLM beside the old one and switch to it without failing a request (proxy in front)",
    )
    p.add_argument("--follow-interval", type=_positive, default=30.0, help="seconds between polls of the alias")
    p.add_argument(
        "--rollback",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --follow-alias: swap a head whose live tau collapses (below monitor.rollback.floor_tau, "
        "or monitor.ratio x the previous champion's) back to the previous champion (plain decoding "
        "when none) and move the alias back (default: monitor.rollback.enabled, on)",
    )
    p.add_argument(
        "--rollback-window",
        type=_positive,
        help="seconds per judged window of live acceptance (default: monitor.rollback.window_s)",
    )
    p.add_argument(
        "--rollback-floor", type=float, help="window tau below this is a collapse (default: monitor.rollback.floor_tau)"
    )
    _config_args(p, "JSON file overriding the preset (its `monitor` section is used: ratio and rollback)")


def _watch_args(p):
    p.add_argument("--once", action="store_true", help="poll once and exit")
    p.add_argument("--interval", type=_positive, default=60.0, help="seconds between polls")
    p.add_argument(
        "--dispatch",
        default="event",
        choices=["event", "local"],
        help="event: emit Prefect events for the trigger; local: also train here",
    )
    _config_args(p)


def _monitor_args(p):
    p.add_argument("--metrics-url", required=True, help="the server's Prometheus page, e.g. http://HOST:8000/metrics")
    p.add_argument("--target", required=True, help="the target version it serves: models:/name/version")
    p.add_argument("--once", action="store_true", help="scrape once and exit (exit 1 when it cannot)")
    p.add_argument("--interval", type=_positive, help="seconds between scrapes (default: monitor.interval_s)")
    p.add_argument("--window", type=_nonnegative, help="sliding window in seconds (default: monitor.window_s)")
    p.add_argument("--ratio", type=_ratio, help="drop: window tau < ratio x registered tau (default: monitor.ratio)")
    p.add_argument("--sustain", type=_nonnegative, help="... for this many seconds (default: monitor.sustain_s)")
    _config_args(p, "JSON file overriding the preset (its `monitor` section is used)")


def _config_cmd_args(p):
    actions = p.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="print the resolved config (preset, then --config, then --set) as JSON")
    _config_args(show)


COMMANDS = {
    c.name: c
    for c in (
        Command(
            "demo",
            "the whole job on the embedded default",
            _demo_args,
            runs.demo,
            preflight.check_demo,
            needs_prefect=True,
        ),
        Command(
            "train",
            "train, evaluate and register a head for one target",
            _train_args,
            runs.train,
            preflight.check_train,
            needs_prefect=True,
        ),
        Command(
            "evaluate",
            "measure a head: tau, acceptance, speedup, identical outputs",
            _evaluate_args,
            runs.evaluate,
            preflight.check_evaluate,
        ),
        Command(
            "serve",
            "serve a head with its target in vLLM (OpenAI-compatible server on loopback)",
            _serve_args,
            command_serve.serve,
            preflight.check_serve,
        ),
        Command(
            "watch",
            "poll the registry and announce target versions without a head",
            _watch_args,
            runs.watch,
            preflight.check_watch,
            needs_prefect=True,
        ),
        Command(
            "monitor",
            "watch a vLLM server's acceptance; announce a drop (retrains the head)",
            _monitor_args,
            runs.monitor,
            preflight.check_monitor,
        ),
        Command(
            "config",
            "show the pipeline config a command would run with",
            _config_cmd_args,
            runs.config_show,
            preflight.check_config,
            needs_settings=False,
        ),
    )
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle-heads", description="Train, evaluate and register EAGLE-3 heads.")
    sub = p.add_subparsers(dest="command", required=True)
    for c in COMMANDS.values():
        c.arguments(sub.add_parser(c.name, help=c.help))
    return p
