"""Quiet libraries: the settings that keep third-party progress bars and advisory chatter out of a run's output.

Purpose: `QUIET_ENV` holds, per library, the switch that turns its noise off where it is made:
    HF_HUB_DISABLE_PROGRESS_BARS=1        the tqdm bars of transformers and huggingface_hub ("Loading weights",
                                          "Writing model shards", downloads); read when they are imported
    TRANSFORMERS_VERBOSITY=error          transformers' logger: deprecation and advisory warnings (errors stay)
    TRANSFORMERS_NO_ADVISORY_WARNINGS=1   transformers' `warning_advice` messages
    MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false
                                          MLflow's bars when it uploads or downloads artifacts (heads, targets)
    MLFLOW_LOGGING_LEVEL=WARNING          MLflow's INFO lines ("Creating initial MLflow database tables...")
`apply_quiet_defaults()` sets each one the user has not set (whoever wants a library's output back sets its
variable) and returns what it set. It runs at the start of a program (`infra.prefect_env.apply_prefect_defaults`
calls it), before those libraries are imported; processes started later (Ray workers, the vLLM server) inherit
the values, and `infra.ray_cluster.ray_session` also passes them to a cluster's workers.
Run: `python -m infra.quiet` prints the settings it would set.
Not here: the progress lines of our own stages (they print them); Ray's switches (infra/ray_cluster.py).
"""

from __future__ import annotations

import os

QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "MLFLOW_LOGGING_LEVEL": "WARNING",
}


def quiet_env() -> dict[str, str]:
    """The quiet settings as this process has them: the user's value where set, else ours."""
    return {k: os.environ.get(k) or v for k, v in QUIET_ENV.items()}


def apply_quiet_defaults() -> dict[str, str]:
    """Set each quiet setting that is absent from the environment; returns the ones it set."""
    applied = {k: v for k, v in QUIET_ENV.items() if not os.environ.get(k)}
    os.environ.update(applied)
    return applied


if __name__ == "__main__":
    for key, value in quiet_env().items():
        print(f"{key}={value}")
