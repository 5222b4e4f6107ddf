"""Adapters and local defaults for MLflow, Ray and Prefect; the only package that reads environment variables.

Purpose: `infra.settings.Settings.from_env()` says where state lives and which services to use;
`infra.mlflow_store.MlflowStore` records runs and registers heads; `infra.ray_cluster.ray_session` gives a
connected Ray; `infra.prefect_env` sets Prefect's local defaults and emits events.
Run: each module has a `python -m infra.<module>` that prints what it resolves.
Not here: pipeline logic, and imports: importing the package loads nothing, so `python -m infra.<module>`
runs cleanly and a fast CLI path pays for none of MLflow, Ray or Prefect. Import the module you use.
"""
