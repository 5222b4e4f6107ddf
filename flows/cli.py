"""The `eagle-heads` command line: demo, train, evaluate, serve, watch, monitor, config show.

Purpose: argument parsing with clear errors, the command's preflight, then one call into a flow or a stage. The
commands are rows of one table (flows/commands.py: name, arguments, preflight, run, needs Prefect); what each does
is in flows/command_runs.py. `--help` and argument errors import nothing heavy; Prefect, MLflow and torch load only
once a command runs.
  eagle-heads demo [--preset default|tiny|gpu] [--embedded-preset smollm2|toy|tiny|gpu]
  eagle-heads train --target DIR|models:/name/version --traffic FILE --heldout FILE [--name N] [CONFIG]
  eagle-heads evaluate --head DIR|models:/name/version [--target DIR|models:/...] --traffic FILE [--json OUT]
                      [--method chain|tree] [--depth D] [--limit N] [--engine local|vllm] [--load] [CONFIG]
  eagle-heads serve --head models:/name@alias|DIR [--target ...] [--port P] [--k K | --concurrency C] [--print-only]
  eagle-heads watch [--once] [--interval S] [--dispatch event|local] [CONFIG]
  eagle-heads monitor --metrics-url URL --target models:/name/version [--once] [--interval S] [--window S]
                      [--ratio R] [--sustain S] [CONFIG]
  eagle-heads config show [CONFIG]: the resolved config as JSON
CONFIG is [--preset P] [--config FILE] [--set KEY.PATH=VALUE ...]: a preset (components/config/presets.py), a JSON
file's sections over it, then single values over both, all checked strictly (an unknown key or a wrong type: exit 2).
Settings come from the environment (infra/settings.py): EAGLE_HOME, MLFLOW_TRACKING_URI, RAY_ADDRESS,
PREFECT_API_URL. Exit codes: 0 success; 2 bad arguments, bad input (`eagle.errors.BadInput`: arguments, files,
URIs, settings, config values, checked by flows/preflight.py before any work starts) or unreachable services, as one
line `eagle-heads: error: ...`; 1 a failure of the job, as one line naming the log file that holds its traceback.
A stage's own refusal met inside a running flow (a `BadInput` only the stage can see) is the same one line, exit 2:
Prefect's log of the failed task and flow is kept off the terminal (infra/prefect_env.py `hide_bad_input_failures`).
Not here: any stage logic.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from flows.commands import COMMANDS, parser as _parser


def _check_files(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for opt in ("target", "head", "traffic", "heldout", "config"):
        p = getattr(a, opt, None)
        if not p or p.startswith("models:/"):
            continue
        if not Path(p).exists():
            link = Path(p).is_symlink()  # exists() follows links: a loop or a dangling one reads as missing
            parser.error(
                f"--{opt} {p}: "
                + (
                    "a symbolic link loop or a link to nothing; point the link at the file itself"
                    if link
                    else "no such file or directory"
                )
            )
        if opt == "config" and not Path(p).is_file():
            parser.error(f"--{opt} {p}: not a file")  # traffic may be a `datasets` save_to_disk directory


def _setup(a):
    """The settings, checked (state dir, tracking URI), and the command's preflight (its row's function, from
    flows/preflight.py), which returns the config the command runs with (resolved once, here); Prefect's defaults
    only then, so that a refusal leaves nothing under the state dir. The libraries' quiet settings come first: they
    write nothing, and the preflight imports MLflow and transformers, which read them at import. A command that needs
    no settings (config show) gets None."""
    from infra.quiet import apply_quiet_defaults

    apply_quiet_defaults()
    from infra.prefect_env import apply_prefect_defaults
    from infra.settings import Settings

    command = COMMANDS[a.command]
    settings = Settings.from_env().check() if command.needs_settings else None
    cfg = command.preflight(a, settings)
    if settings is not None:
        apply_prefect_defaults(settings)
    return settings, cfg


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


def _run_command(a, settings, cfg) -> int:
    """The command, its preflight passed (flows/preflight.py, from `_setup`), with the config it resolved."""
    command = COMMANDS[a.command]
    if command.needs_prefect:
        from infra.prefect_env import hide_bad_input_failures, start_local_api

        start_local_api()  # Prefect's own start-up races with another process on a new Prefect home
        hide_bad_input_failures()  # a stage's refusal is our one line, not Prefect's failure log above it
        a.prefect_started = True
    return command.run(a, settings, cfg)


def _quiet_prefect(a) -> None:
    """Before the last line of a command that ran flows: Prefect's shutdown chatter must not follow it."""
    if getattr(a, "prefect_started", False):
        from flows.command_runs import quiet_prefect

        quiet_prefect()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split("\n")).strip() or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    _check_files(parser, a)
    settings = None
    try:
        settings, cfg = _setup(a)
        return _run_command(a, settings, cfg)
    except KeyboardInterrupt:
        return 130
    except _refusals() as e:
        _quiet_prefect(a)
        print(f"eagle-heads: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # the job failed, or a bug: one line here, the traceback in a log file
        _quiet_prefect(a)
        print(
            f"eagle-heads: {a.command} failed: {type(e).__name__}: {_one_line(e)[:500]} (traceback: "
            f"{_log_failure(a, settings)})",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
