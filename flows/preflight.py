"""Preflight: every argument, file, URI, setting and config value a command will use, checked before it starts.

Purpose: `check_<command>(args, settings)` (the preflight of the command's row in flows/commands.py) runs the checks
of one `eagle-heads` command before anything is started or written (no Prefect, no Ray, no MLflow write, no engine)
and returns the config the command runs with, resolved once (None: demo): files exist, are the right kind and parse
(the error names the file); safetensors headers of every weights file of a target or head are read (the header and
the file's size only: a truncated file is caught in milliseconds); registry names are valid for MLflow; `models:/`
URIs parse and the model, version or alias they name exists (infra/model_uri.py); a port to serve on is free; URLs
are http(s) with a host; output paths are writable; a GPU preset finds CUDA; a target fits what the settings ask of
its context (`check_context`, flows/preflight_context.py) and is of a proven family (a GGUF file too, by its
header); a command that starts vLLM finds its python (`check_engine_python`). Every refusal is `BadInput`
(eagle/errors.py) or an unreachable service (`ConnectionError`), which the CLI prints as one line with exit 2.
`command_config(args)` is the config a command runs with (preset, `--config`, `--set`, its own flags).
`check_inputs` is the train flow's own check (the flow calls it when not handed a checked config, so deployments
get it).
Run: through `eagle-heads ...` (flows/cli.py); tests/test_bad_input_table.py has one row per refusal.
Not here: the commands themselves (flows/cli.py), checks that need the work done (a head that does not fit its
target is found when both are loaded). This module imports no Prefect, and nothing heavy at import (MLflow, torch:
inside the functions): the command table holds its functions, and `--help` stays instant.
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from components.data import safe_read
from components.data.traffic_io import TrafficFormatError, TrafficLoad, load_traffic
from components.targets.runtime import TARGET_STAGES
from eagle.errors import BadInput
from flows.preflight_context import check_context, check_first_turns_fit
from flows.preflight_files import check_head, check_weights
from infra.settings import Settings, check_http_url

if TYPE_CHECKING:
    from components.config.pipeline import PipelineConfig

MAX_K = 16  # serve --k: see `_k` in flows/commands.py for why


def check_target_dir(target: str, settings: Settings):
    """A target directory (config, tokenizer, chat template, whole weights); returns its (config, tokenizer). A GGUF
    file is checked as one (`check_gguf`: header, architecture, chat template) and, once converted (by the run,
    cached under the state dir: components/targets/gguf.py), as the directory it becomes: its (config, tokenizer) then,
    else None."""
    from components.targets.gguf import check_gguf, converted_dir, is_gguf_target
    from components.targets.target import check_target

    if is_gguf_target(target):
        from components.targets.target import check_family

        arch = check_gguf(target).architecture  # llama.cpp spells MoE families without the underscore (qwen3moe)
        check_family(arch[:-3] + "_moe" if arch.endswith("moe") else arch, [], f"{target} (general.architecture)")
        done = converted_dir(target, settings.state_dir)
        return None if done is None else check_target(done, settings.trust_remote_code)

    safe_read.check_model_files(target)  # before transformers opens them: a named pipe would hang it
    check_weights(target)  # a damaged file is named as such before check_target reads the tensor names
    return check_target(target, settings.trust_remote_code)


def check_model(opt: str, value: str | None, settings: Settings) -> None:
    """`--head` or `--target`: a directory (a head or a target, checked as such), or a registry URI that must parse
    (its lookup in the registry comes last, with the others: `check_registered`)."""
    if value is None:
        return
    if value.startswith("models:/"):
        from infra.model_uri import parse_model_uri

        parse_model_uri(value)
    elif opt == "head":
        check_head(value)
    else:
        check_target_dir(value, settings)


def _check_traffic(path: str, what: str) -> TrafficLoad:
    try:
        return load_traffic(path)
    except TrafficFormatError as e:
        hint = (
            "give JSONL, Parquet, Arrow or a datasets save_to_disk directory with at least one conversation"
            if e.line == 0
            else f"fix or remove {e.unit} {e.line} (each {e.unit}: an OpenAI `messages` or "
            "ShareGPT `conversations` record)"
        )
        raise TrafficFormatError(e.path, e.line, f"{e.reason} ({what}; {hint})", e.unit) from None


def check_inputs(target: str, traffic: str, heldout: str, cfg: PipelineConfig, settings: Settings) -> None:
    """Refuse bad input before anything is written: traffic files, a target directory (and the training traffic's
    first turns against its context), a Ray address in use."""
    from components.targets.target import TargetError

    load = _check_traffic(traffic, "training traffic")
    _check_traffic(heldout, "held-out traffic")
    if not target.startswith("models:/"):
        checked = check_target_dir(target, settings)
        if checked is not None:  # None: a GGUF file not converted yet (its directory is checked once it is)
            check_context(target, *checked, heldout, cfg, TARGET_STAGES)
            check_first_turns_fit(load, *checked, cfg.regenerate)
    else:
        from infra.model_uri import parse_model_uri

        try:
            parse_model_uri(target)
        except ValueError as e:
            raise TargetError(f"{e}; pass a model directory or a registered target version") from None
    if cfg.train.ray.num_workers > 0 and settings.ray_address:
        from infra.ray_cluster import probe_ray

        probe_ray(settings)
    check_engine_python(cfg, settings)
    check_engine_sampling(cfg, settings)


def _engine_user(cfg: PipelineConfig, stages: tuple[str, ...]) -> str | None:
    """The setting that makes the `stages` (of TARGET_STAGES) of a run start vLLM here (None: none of them does;
    regeneration by `endpoint_url` asks a server the user runs)."""
    rt = cfg.runtime
    used = [s for s in stages if s in rt.engine_stages and not (s == "regenerate" and cfg.regenerate.endpoint_url)]
    if not used:
        return None
    return f"target.runtime {rt.name!r}" if rt.name != "local" else f"{used[0]}.engine 'vllm'"


def check_engine_python(
    cfg: PipelineConfig | None, settings: Settings, stages: tuple[str, ...] = TARGET_STAGES, who: str | None = None
) -> None:
    """vLLM's python (EAGLE_VLLM_PYTHON, checked with the settings, else the project's `.venv-vllm`, checked here)
    exists and can be run, where `cfg` puts one of `stages` in an engine started here or `who` (`serve`) starts one;
    else the stage's `EngineError` would come after the work before it (a target registered, a head trained)."""
    who = who or (_engine_user(cfg, stages) if cfg is not None else None)
    if who is None:
        return
    from infra.vllm_server import EngineError, vllm_python

    try:
        vllm_python(settings)
    except EngineError as e:
        raise BadInput(f"{who} starts vLLM here, but {e}") from None


def check_engine_sampling(cfg: PipelineConfig, settings: Settings) -> None:
    """A sampled evaluation in vLLM (`cfg.runtime` evaluates in the engine: `evaluate.engine` or `target.runtime`
    vllm; `evaluate.spec.temperature` > 0) refused before any work where this vLLM's CPU build verifies sampled
    drafts wrongly (infra/vllm_sampling.py: probed once per
    installation, its answer not cached here: a preflight writes nothing); the engine evaluation refuses it again for
    callers without a preflight."""
    if cfg.runtime.evaluates_in_engine:
        from infra.vllm_sampling import refuse_sampled_drafts
        from infra.vllm_engine_spec import host_device

        refuse_sampled_drafts(
            host_device(), cfg.evaluate.spec.temperature, settings, "evaluate.spec.temperature", write_cache=False
        )


def check_output_file(path: str | None, opt: str) -> None:
    """`--<opt> PATH` can be written as a file: not a directory, in a directory that exists and is writable."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise BadInput(f"--{opt} {path}: a directory; give a file path, e.g. {p / 'result.json'}")
    if not p.parent.is_dir():
        raise BadInput(f"--{opt} {path}: the directory {p.parent} does not exist")
    import os

    if not os.access(p.parent, os.W_OK):
        raise BadInput(f"--{opt} {path}: the directory {p.parent} is not writable")


def check_port_free(port: int | None) -> None:
    """`--port P` is free on 127.0.0.1 (vLLM would fail after minutes, or another server would answer for it)."""
    if port is None:
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: a closing socket is no owner
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise BadInput(
                f"--port {port}: 127.0.0.1:{port} is taken ({e.strerror}); pick another port or leave "
                "--port out for a free one"
            ) from None


def check_registry_name(a, cfg: PipelineConfig) -> None:
    """The names `train` registers under (the target's, and its head's `<name>-v<N><suffix>`) are valid in MLflow."""
    if a.target.startswith("models:/"):
        return
    from components.targets.gguf import default_target_name
    from infra.model_uri import check_model_name

    name = a.name if a.name is not None else default_target_name(a.target)
    check_model_name(name, "--name" if a.name is not None else "--target's folder name (the default --name)")
    check_model_name(f"{name}-v1{cfg.register.experiment_suffix}", "head name (register.experiment_suffix)")


def check_cuda(preset: str) -> None:
    if preset == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise BadInput(
                "--embedded-preset gpu: no CUDA device here (torch.cuda.is_available() is False); use "
                "--embedded-preset smollm2, toy or tiny on a CPU machine"
            )


def _flag_values(a) -> dict:
    """The values command `a`'s own flags give its config section (None: not given, the config's stays)."""
    if a.command == "evaluate":
        return {
            "spec": {k: v for k, v in (("method", a.method), ("depth", a.depth)) if v is not None},
            **{k: v for k, v in (("limit", a.limit), ("engine", a.engine)) if v is not None},
        }
    if a.command == "monitor":
        return {
            k: v
            for k, v in (
                ("interval_s", a.interval),
                ("window_s", a.window),
                ("ratio", a.ratio),
                ("sustain_s", a.sustain),
            )
            if v is not None
        }
    if a.command == "serve":
        rollback = {
            k: v
            for k, v in (("enabled", a.rollback), ("window_s", a.rollback_window), ("floor_tau", a.rollback_floor))
            if v is not None
        }
        return {"rollback": rollback} if rollback else {}
    return {}


def command_config(a) -> PipelineConfig:
    """The pipeline config command `a` runs with: `--preset`, `--config`'s sections, `--set` values, then the
    command's own flags (evaluate: --method, --depth, --limit, --engine into `evaluate`; monitor: --interval,
    --window, --ratio, --sustain into `monitor`), each layer checked like a config file (`ConfigError` naming the
    key path). The flags change this invocation's section only (no cross-section rule: `evaluate --engine local`
    stays valid under a preset that gates on the engine's tau)."""
    from components.config.pipeline import override_values, resolve

    cfg = resolve(a.preset, a.config, a.set)
    flags = _flag_values(a)
    if not flags:
        return cfg
    section = "monitor" if a.command == "serve" else a.command  # serve's flags are the monitor's rollback
    return dataclasses.replace(cfg, **{section: override_values(getattr(cfg, section), flags, "command line", section)})


def check_config(a, settings: Settings | None) -> PipelineConfig:
    """config show: the config resolves."""
    return command_config(a)


def check_demo(a, settings: Settings) -> None:  # the demo's flows take `--preset`: no config of its own
    from components.config.pipeline import resolve
    from infra.mlflow_health import probe_tracking

    check_cuda(a.embedded_preset)
    if a.embedded_preset == "smollm2":
        from embedded.real import real_gguf

        real_gguf()  # the package that ships the model: its one line now
    check_engine_python(resolve(a.preset), settings)
    probe_tracking(settings)


def check_watch(a, settings: Settings) -> PipelineConfig:
    from infra.mlflow_health import probe_tracking

    cfg = command_config(a)
    probe_tracking(settings)
    return cfg


def check_train(a, settings: Settings) -> PipelineConfig:
    """The config and inputs of `train`, checked once: the flow is handed both (flows/train_head.py `CheckedInputs`)."""
    from infra.mlflow_health import probe_tracking
    from infra.model_uri import check_registered

    cfg = command_config(a)
    check_registry_name(a, cfg)
    check_inputs(a.target, a.traffic, a.heldout, cfg, settings)
    probe_tracking(settings)
    check_registered(settings, [a.target])
    return cfg


def check_evaluate(a, settings: Settings) -> PipelineConfig:
    from infra.model_uri import check_registered

    check_model("head", a.head, settings)
    checked = None
    if a.target and not a.target.startswith("models:/"):
        checked = check_target_dir(a.target, settings)
    else:
        check_model("target", a.target, settings)
    check_output_file(a.json, "json")
    _check_traffic(a.traffic, "held-out traffic")
    cfg = command_config(a)
    if checked is not None:  # a registered target (or the head's own) is known only once resolved by the run
        check_context(a.target, *checked, a.traffic, cfg, ("evaluate",))
    check_engine_python(cfg, settings, ("evaluate",))
    check_engine_sampling(cfg, settings)
    check_registered(settings, [a.head, a.target or ""])
    return cfg


def check_serve(a, settings: Settings) -> PipelineConfig:
    from infra.model_uri import check_registered

    if getattr(a, "k", None) and getattr(a, "concurrency", None):
        raise BadInput("serve: --k pins K, --concurrency picks it from the registered schedule: give one of them")
    check_model("head", a.head, settings)
    check_model("target", a.target, settings)
    cfg = command_config(a)  # the monitor's ratio and rollback settings, checked before an engine starts
    if not a.print_only:
        check_port_free(a.port)
        check_engine_python(None, settings, who="serve")
    check_registered(settings, [a.head, a.target or ""])
    return cfg


def check_monitor(a, settings: Settings) -> PipelineConfig:
    from infra.model_uri import check_registered, parse_model_uri

    check_http_url(a.metrics_url, "--metrics-url")
    parse_model_uri(a.target)
    cfg = command_config(a)
    check_registered(settings, [a.target])
    return cfg
