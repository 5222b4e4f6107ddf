"""What `eagle-heads serve` does once its preflight passed: the head chosen, its K, vLLM started, and behind our proxy
when it captures or follows an alias.

Purpose: `serve(args, settings, cfg) -> exit code`, the `serve` row's run function of flows/commands.py: the head's
engine spec (`_serve_spec`: a registered K schedule, or the schedule's K at `--concurrency`, or `--k`, else the K
measured best at batch size 1, tag `depth`, else 5), a note when
the registry's gate did not make it champion (`gate_note`), the launch commands with `--print-only`; else vLLM alone,
or vLLM behind our proxy (`--capture`, `--follow-alias`: swaps, and a rollback that moves the alias back and
announces it). Run: through `eagle-heads serve ...` (flows/cli.py). Heavy imports happen inside the functions.
Not here: the other commands (flows/command_runs.py), the live server and its swaps (components/serving/live.py),
the rollback's judgement (components/serving/rollback.py).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows.command_runs import resolve_head


def _registered_tags(uri: str, settings) -> dict[str, str]:
    """The tags of a registered head version ({} for a directory)."""
    if not uri.startswith("models:/"):
        return {}
    from infra.mlflow_store import MlflowStore, parse_model_uri

    store = MlflowStore.connect(settings)
    name, version, alias = parse_model_uri(uri)
    ref = store.get_version(name, version) if version is not None else store.get_alias(name, alias or "")
    return dict(ref.tags) if ref else {}


def _registered_schedule(uri: str, settings) -> list[list[int]] | None:
    """The `k_schedule` tag of a registered head version (None: a directory, or no load sweep registered)."""
    text = _registered_tags(uri, settings).get("k_schedule")
    return json.loads(text) if text else None


def _registered_depth(uri: str, settings) -> int | None:
    """The `depth` tag of a registered head version: the K measured best at batch size 1 (evaluate.pick; None: not
    picked, or a directory)."""
    text = _registered_tags(uri, settings).get("depth")
    return int(text) if text else None


def _registered_compiled(uri: str, settings) -> bool:
    """Whether vLLM ran compiled where the registered head was measured (tag `compiled`, evaluate.compiled): `serve`
    runs it the same way on the CPU. False for a directory or a head measured before the tag (eager, as then)."""
    return _registered_tags(uri, settings).get("compiled") == "true"


def gate_note(uri: str, settings) -> str | None:
    """What `serve` says of a registered head its gate did not make champion (None: champion, or a directory)."""
    tags = _registered_tags(uri, settings)
    if tags.get("promoted") != "false":
        return None
    return (
        f"serve: note: {uri} is not champion: its gate refused it ({tags.get('gate', 'no reason recorded')}); "
        "serving it anyway"
    )


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _k_at(schedule, concurrency: int, head: str) -> tuple[int, str]:
    """(K, how it was chosen) for `serve --concurrency`: the registered schedule's K at that batch size (0: plain
    decoding, served without the head: in a K-0 range vLLM still runs the head's first pass every step to keep its
    cache in sync, so the schedule's K 0 is slower than plain; bench/README.md "Does the K schedule hold?")."""
    from eagle.errors import BadInput

    if not schedule:
        raise BadInput(
            f"serve --concurrency {concurrency}: {head} has no registered K schedule (evaluate.load); "
            "pass --k, or measure one with `eagle-heads evaluate --engine vllm --load`"
        )
    k = next((r[2] for r in schedule if r[0] <= concurrency <= r[1]), schedule[-1][2])
    src = f"the registered schedule {json.dumps(schedule)} at concurrency {concurrency}"
    return k, (f"{k} speculative tokens, {src}" if k else f"plain decoding, no head: {src} says K 0 (plain is faster)")


def _serve_spec(a, settings, uri: str, name: str | None = None):
    """What `serve` runs for head `uri` with `a`'s K choice: (EngineSpec, head dir served, lineage, how K was chosen).
    `name`: the served model name (a swap keeps the first one, so that clients' requests keep working)."""
    import argparse

    from components.targets.servable import servable_head
    from components.targets.target import target_context
    from infra.vllm_engine_spec import EngineSpec

    head, target, lineage = resolve_head(argparse.Namespace(**{**vars(a), "head": uri}), settings)
    served = servable_head(head, target, settings.state_dir / "servable", settings.trust_remote_code)
    lineage["target_name"] = lineage.get("target_name") or Path(target).name
    schedule = None if a.k else _registered_schedule(uri, settings)
    picked = None if a.k or schedule else _registered_depth(uri, settings)
    k = a.k or (max(max(r[2] for r in schedule), 1) if schedule else picked or 5)
    at = getattr(a, "concurrency", None)
    if at:  # one fixed K for the stated load: the schedule's, or no head where plain wins
        k, how = _k_at(schedule, at, uri)
        schedule = None
    else:
        how = (
            f"the registered K schedule {json.dumps(schedule)} ([first batch size, last, K]; K 0: no drafts)"
            if schedule
            else f"{k} speculative tokens"
            + ("" if a.k else " (measured best at batch size 1)" if picked else " (no K schedule registered)")
        )
    spec = EngineSpec(
        target,
        str(served) if k else None,
        method="eagle3" if k else None,
        num_speculative_tokens=k or 1,
        max_model_len=min(target_context(target), 4096),
        served_model_name=name or lineage["target_name"],
        k_schedule=tuple(tuple(r) for r in schedule) if schedule else None,
        compiled=_registered_compiled(uri, settings),
    )
    if served != Path(head):
        print(f"serve: {uri} predates the engine format; serving its lossless re-export {served}")
    return spec, served, lineage, how


def _followed(a, settings):
    """`--follow-alias`: (the version `--head models:/NAME@ALIAS` names now, a reader of the version it names)."""
    from eagle.errors import BadInput
    from infra.mlflow_store import MlflowStore, parse_model_uri

    name, _, alias = parse_model_uri(a.head) if a.head.startswith("models:/") else (None, None, None)
    if alias is None:
        raise BadInput(f"serve --follow-alias: --head {a.head} names no alias; give models:/NAME@ALIAS")
    store = MlflowStore.connect(settings)

    def alias_version() -> int | None:
        ref = store.get_alias(name, alias)
        return int(ref.version) if ref else None

    version = alias_version()
    if version is None:
        raise BadInput(f"serve --follow-alias: {a.head}: no version holds alias {alias!r}")
    return name, version, alias_version


def _rollback_hooks(a, settings, say, m) -> dict:
    """`Follow`'s rollback fields for `serve --follow-alias`: the monitor's settings (`m`, the config's `monitor`), the
    registered τ of a version, and what a rollback does beyond the swap: the alias moved back with the reason, the
    event announced."""
    from components.serving.monitor import registered_tau
    from components.serving.rollback import EVENT, move_alias_back
    from infra.mlflow_store import MlflowStore, parse_model_uri
    from infra.prefect_env import emit_event

    store = MlflowStore.connect(settings)
    name, _, alias = parse_model_uri(a.head)

    def rolled_back(r) -> None:
        reason = r.judgement.reason
        if r.from_version is not None:
            try:
                move_alias_back(store, name, alias, r.from_version, r.to_version, reason)
                say(
                    f"serve: alias {alias} of {name} "
                    + (f"back on version {r.to_version}" if r.to_version else "removed (plain decoding serves)")
                    + f"; version {r.from_version} tagged rollback_reason"
                )
            except Exception as e:  # the swap is done; the registry is told at no later time, so say it plainly
                say(f"serve: warning: the alias could not be moved back ({type(e).__name__}: {e})")
        payload = {
            "name": name,
            "from_version": r.from_version,
            "to_version": r.to_version,
            "from_head": r.from_head,
            "to_head": r.to_head or "plain",
            "reason": reason,
            "window_tau": round(r.judgement.window_tau, 4),
            "drafts": r.judgement.drafts,
            "windows": r.judgement.windows,
        }
        try:
            sent = emit_event(EVENT, f"mlflow.model_version.{name}.{r.from_version}", payload=payload)
        except Exception as e:  # an API that does not answer must not stop serving
            sent, payload["error"] = None, f"{type(e).__name__}: {e}"
        why = payload.get("error", "no Prefect API")
        say(f"serve: announced {EVENT}" if sent else f"serve: {EVENT} not sent ({why})")

    return dict(
        rollback=m.rollback,
        ratio=m.ratio,
        rolled_back=rolled_back,
        registered_tau=lambda v: registered_tau(store.get_version(name, v).tags)[0],
    )


@dataclass(frozen=True)
class Serving:
    """What `serve` starts: head `uri` as `_serve_spec` made it (the engine's spec, the head's lineage, how K was
    chosen)."""

    uri: str
    spec: Any
    lineage: dict
    how: str


def _serve_live(a, settings, head: Serving, followed, monitor) -> int:
    """`serve --capture` / `--follow-alias`: vLLM behind our proxy, capture, swaps (components/serving/live.py);
    `monitor`: the config's `monitor` section (the rollback's settings)."""
    from components.serving.capture import CaptureConfig
    from components.serving.live import Follow, LiveConfig, LiveServer, Served, follow

    uri, spec, lineage, how = head.uri, head.spec, head.lineage, head.how

    def say(line: str) -> None:
        print(line, flush=True)

    def served_as(uri: str, spec, lineage) -> "Served":
        return Served(spec, uri if spec.method else "", lineage["target_name"], str(lineage.get("target_version", "")))

    following = None
    if followed is not None:
        name, version, alias_version = followed

        def prepare(v: int) -> "Served":
            new_uri = f"models:/{name}/{v}"
            new_spec, _, new_lineage, new_how = _serve_spec(a, settings, new_uri, spec.served_model_name)
            say(f"serve: version {v} with {new_how}")
            return served_as(new_uri, new_spec, new_lineage)

        following = Follow(
            alias_version, prepare, version, a.follow_interval, **_rollback_hooks(a, settings, say, monitor)
        )
    capture = CaptureConfig(rate=a.capture_rate, max_bytes=a.capture_max_mb << 20) if a.capture else None
    say(f"serve: starting vLLM with {uri} ({how}) behind our proxy; log under {settings.state_dir / 'vllm'}")
    with LiveServer(LiveConfig(port=a.port, capture=capture), served_as(uri, spec, lineage), settings, say) as live:
        if capture is not None:
            say(
                f"serve: capturing {capture.rate:.0%} of requests to {live.capture.root}/{lineage['target_name']} "
                f"(Parquet, at most {a.capture_max_mb} MiB, oldest dropped first)"
            )
        if following is not None:
            rb = following.rollback
            say(
                f"serve: following {a.head} (every {a.follow_interval:g} s): a new version is swapped in without "
                "failing a request"
                + (
                    f"; rolled back when its live tau over a {rb.window_s:g} s window is below "
                    f"{rb.floor_tau:g} or {following.ratio:g} x the previous champion's for "
                    f"{rb.sustain_windows} windows"
                    if rb.enabled
                    else "; no rollback"
                )
            )
        say(f"serve: vLLM at {live.engine.base_url}; proxy status: {live.base_url}/eagle/status")
        say(f"serve: ready at {live.base_url}/v1 (model {spec.served_model_name!r}); Ctrl-C stops the server")
        follow(live, following, say)
        print(
            f"eagle-heads: error: vLLM stopped: {live.engine.last_error()} (log: {live.engine.log_path})",
            file=sys.stderr,
        )
        return 1


def serve(a, settings, cfg) -> int:
    import signal

    from components.serving.launch import launch_commands
    from infra.vllm_sampling import sampled_drafts_ok
    from infra.vllm_server import VllmServer

    uri, followed = a.head, None
    if getattr(a, "follow_alias", False):  # the version the alias names now, pinned: a move is a swap, later
        followed = _followed(a, settings)
        uri = f"models:/{followed[0]}/{followed[1]}"
    spec, served, lineage, how = _serve_spec(a, settings, uri)
    name, k, schedule = spec.served_model_name, spec.num_speculative_tokens if spec.method else 0, spec.k_schedule
    if (note := gate_note(uri, settings)) is not None:
        print(note, flush=True)
    if a.print_only:
        cmds = launch_commands(spec, a.port or 8000)
        print(f"# vLLM with {how} (GPU; copy {served} and {spec.target_dir} to the cluster first)\n{cmds['vllm']}")
        sglang_note = (
            f"; SGLang has no per-batch-size K: it runs K {k} at every load (pass --k for the K of "
            "your typical concurrency)"
            if schedule
            else ""
        )
        print(f"# SGLang{sglang_note}\n{cmds['sglang']}")
        return 0
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` stops the engine as Ctrl-C does
    if k and spec.resolved_device() == "cpu" and not sampled_drafts_ok(settings):
        print(
            "serve: note: this vLLM's CPU build verifies sampled drafts wrongly (infra/vllm_sampling.py): send "
            "greedy requests (temperature 0); sampled ones accept almost no draft and are not distributed as the "
            "target's",
            flush=True,
        )
    if getattr(a, "capture", False) or getattr(a, "follow_alias", False):
        return _serve_live(a, settings, Serving(uri, spec, lineage, how), followed, cfg.monitor)
    compiled = "; compiled, as it was measured (the first start on a machine compiles for about a minute)"
    mode = compiled if spec.compiles else ""
    print(f"serve: starting vLLM with {a.head} ({how}{mode}); log under {settings.state_dir / 'vllm'}", flush=True)
    with VllmServer(spec, settings, port=a.port) as srv:
        print(
            f"serve: ready at {srv.base_url}/v1 (model {name!r}); try\n  curl {srv.base_url}/v1/chat/completions "
            f'-H \'Content-Type: application/json\' -d \'{{"model": "{name}", "messages": '
            f'[{{"role": "user", "content": "def add(a, b):"}}], "max_tokens": 32, "temperature": 0}}\'\n'
            f"  acceptance: curl -s {srv.base_url}/metrics | grep spec_decode; Ctrl-C stops the server",
            flush=True,
        )
        while srv.proc is not None and srv.proc.poll() is None:
            time.sleep(1.0)
        print(f"eagle-heads: error: vLLM stopped: {srv.last_error()} (log: {srv.log_path})", file=sys.stderr)
        return 1
