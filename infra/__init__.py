"""Adapters and local defaults for MLflow, Ray and Prefect; the only package that reads environment variables.

Purpose: `infra.settings.Settings.from_env()` says where state lives and which services to use;
`infra.mlflow_store.MlflowStore` records runs and registers heads; `infra.ray_cluster.ray_session` gives a
connected Ray; `infra.prefect_env` sets Prefect's local defaults and emits events.
Run: each module has a `python -m infra.<module>` that prints what it resolves.
Not here: pipeline logic. Importing this package imports only the standard library (`Settings`); the MLflow,
Ray and Prefect adapters are imported by name where they are used.
"""

from infra.settings import Settings

__all__ = ["Settings"]
