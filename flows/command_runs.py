"""What each `eagle-heads` command does once its preflight passed: one function per row of flows/commands.py (but
`serve`, flows/command_serve.py).

Purpose: each `name(args, settings, cfg) -> exit code` calls one flow or component and prints its result in a line
or two; `cfg` is the pipeline config the command's preflight resolved (flows/preflight.py; None for a command that
takes none), never resolved again here. `evaluate` measures a head through flows/evaluate_head.py, the path the
`train-head` flow takes too; `config_file` turns the resolved config into the one file a flow takes
(`<state>/configs/<hash>.json`, the whole resolved config, which loads back to the same config), so the flows keep
taking a preset and a file.
Run: through `eagle-heads ...` (flows/cli.py). Heavy imports (torch, Prefect, MLflow, vLLM) happen inside the
functions: importing this module is instant.
Not here: arguments (flows/commands.py), checks before the work (flows/preflight.py), exit codes (flows/cli.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time


def quiet_prefect() -> None:
    """After the job (or its failure): keep Prefect's shutdown chatter ("Stopping temporary server") from following
    our last line."""
    logging.getLogger("prefect").setLevel(logging.WARNING)


def config_file(a, settings, cfg) -> str | None:
    """`--config` as given when there is no `--set`; else `cfg` (the config the command resolved) written whole under
    the state dir (named by its content: the same command line gives the same file, and a flow's run key does not
    change)."""
    if not a.set:
        return a.config
    import hashlib

    from components.data.atomic import atomic_write_text

    text = json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n"
    path = settings.state_dir / "configs" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)
    return str(path)


def config_show(a, settings, cfg) -> int:
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


def demo(a, settings, cfg) -> int:
    """`cfg` is None: the demo runs each of its flows with `--preset`."""
    from flows.demo import demo as run_demo

    res = run_demo(preset=a.preset, embedded_preset=a.embedded_preset)
    quiet_prefect()
    print("\n".join(res["lines"]), flush=True)
    return 0


def train(a, settings, cfg) -> int:
    from flows.train_head import CheckedInputs, train_head

    checked = CheckedInputs(cfg, a.target, a.traffic, a.heldout)  # what the preflight, check_train, checked
    s = train_head(a.target, a.traffic, a.heldout, a.preset, config_file(a, settings, cfg), a.name, checked=checked)
    quiet_prefect()
    served = s.tau != s.tau and s.tau_vllm is not None  # target.runtime vllm: only the engine measured the head
    tau = s.tau_vllm if served else s.tau
    # ours unless it was not timed (target.runtime vllm, evaluate.time_local false): then the engine's
    ours = s.speedup == s.speedup
    speedup = s.speedup if ours else s.speedup_vllm
    print(
        f"train: head={s.head_uri} tau{'(vLLM)' if served else ''}={tau:.2f} "
        f"speedup{'' if ours else '(vLLM)'}={speedup or float('nan'):.2f}x "
        f"identical={'yes' if s.identical or (served and s.vllm and s.vllm.identical_to_plain) else 'no'}"
    )
    return 0


def watch(a, settings, cfg) -> int:
    from flows.watch import watch_registry

    path = config_file(a, settings, cfg)
    while True:
        done = watch_registry(dispatch=a.dispatch, preset=a.preset, config_path=path)
        print(f"watch: {len(done)} version(s) announced")
        if a.once:
            return 0
        time.sleep(a.interval)


def monitor(a, settings, cfg) -> int:
    """Print the window tau each interval; a drop emits the event (with a Prefect API) once."""
    from flows.watch_acceptance import monitor_forever, open_monitor

    mon = open_monitor(a.metrics_url, a.target, cfg, settings)
    m = cfg.monitor
    print(
        f"monitor: {a.target} (champion {mon.baseline.head_uri}, registered tau {mon.baseline.tau:.2f} "
        f"from {mon.baseline.tau_source}) at {a.metrics_url}: a drop is window tau < {m.ratio} x registered "
        f"for {m.sustain_s:.0f} s (window {m.window_s:.0f} s, >= {m.min_drafts} drafts)",
        flush=True,
    )
    return monitor_forever(mon, a.metrics_url, a.once, lambda line: print(line, flush=True))


def resolve_head(a, settings) -> tuple[str, str, dict]:
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
    from components.targets.gguf import materialize_target

    target = None if a.target is None else materialize_target(a.target, settings.state_dir)  # GGUF: converted once
    if target is None:
        if "target_name" not in lineage:
            from eagle.errors import BadInput

            raise BadInput(f"{head}: the head names no target (lineage or registry tags); pass --target")
        target = f"models:/{lineage['target_name']}/{lineage['target_version']}"
    if target.startswith("models:/"):
        store = store or MlflowStore.connect(settings)
        target = str(store.resolve(target))
    return head, target, lineage


def _speed_text(res: dict) -> str:
    """ "1.52x [1.47, 1.58]" from an evaluation result's speedup fields; "(unreliable: why)" when it is; "-
    (why)" when it was not timed."""
    if res["speedup"] != res["speedup"]:
        return f"- ({res['speedup_note']})"
    text = f"{res['speedup']:.2f}x [{res['speedup_lo']:.2f}, {res['speedup_hi']:.2f}]"
    return text if res["speedup_reliable"] else f"{text} (unreliable: {res['speedup_note']})"


def _evaluate_plan(cfg, load: bool):
    """What `evaluate` measures: ours always, vLLM's where the config's runtime evaluates in the engine, and with
    `--load` the load sweep (at the default preset's levels when `evaluate.load` has none)."""
    from flows.evaluate_head import EvalPlan

    sweep = None
    if load:
        from components.config.pipeline import PipelineConfig

        sweep = cfg.evaluate.load if cfg.evaluate.load.enabled else PipelineConfig.preset("default").evaluate.load
    return EvalPlan(local=True, engine=cfg.runtime.evaluates_in_engine, sweep=sweep)


def evaluate(a, settings, cfg) -> int:
    """The head measured by flows/evaluate_head.py (bare stages: no Prefect), with the target's scale."""
    from dataclasses import asdict

    from components.evaluate.stage import HeadEval
    from flows.evaluate_head import evaluate_head

    head, target, _ = resolve_head(a, settings)
    out = settings.state_dir / "evaluations" / time.strftime("%Y%m%d-%H%M%S")
    try:
        fig = evaluate_head(
            cfg,
            HeadEval(target, head, a.traffic, str(out)),
            cfg.runtime.engine_settings(settings),
            _evaluate_plan(cfg, a.load),
        )
        res = {
            **asdict(fig.local),
            **({"vllm": asdict(fig.engine)} if fig.engine else {}),
            **({"load": asdict(fig.sweep)} if fig.sweep else {}),
        }
    except BaseException:
        for folder in (out, out.parent):  # a refusal leaves no empty evaluation folder behind
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    if a.json:
        from components.data.atomic import atomic_write_text

        atomic_write_text(a.json, json.dumps(res, indent=2) + "\n")
    print(f"evaluate: tau={res['tau']:.2f} speedup={_speed_text(res)} identical={res['identical']}")
    if "vllm" in res:
        v = res["vllm"]
        print(
            f"evaluate (vLLM): tau={v['tau']:.2f} speedup={_speed_text(v)} "
            f"identical={v['identical_to_plain'] and v['identical_to_ours'] is not False} "
            f"alpha={' '.join(f'{x:.2f}' for x in v['acceptance'])}"
        )
    if "load" in res:
        w = res["load"]
        at = " ".join(f"{c}:{x:.2f}x" for c, x in w["speedup_at"].items())
        print(
            f"evaluate (vLLM, load): speedup by concurrency {at}; crossover={w['crossover']} "
            f"schedule={json.dumps(w['schedule'])} (plot {w['plot_file']})"
        )
    return 0
