"""A picklable metrics sink that streams training metrics to an MLflow run from any process (Ray workers too).

Purpose: `MlflowSink(tracking_uri, run_id).log(step, metrics)`; the MLflow client is created lazily in the
process that logs, so the sink can travel to Ray workers. Failures to log are reported once and do not stop
training (metrics are also written to the run's history.jsonl by the trainer).
Not here: run creation (infra/mlflow_store.py).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field


@dataclass
class MlflowSink:
    tracking_uri: str = field(repr=False)  # may hold credentials: never in a repr (Ray and Prefect log reprs)
    run_id: str = ""
    _client: object = field(default=None, repr=False, compare=False)
    _warned: bool = field(default=False, repr=False, compare=False)

    def __getstate__(self):
        return {"tracking_uri": self.tracking_uri, "run_id": self.run_id, "_client": None, "_warned": False}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        try:
            if self._client is None:
                self._client = MlflowClient(tracking_uri=self.tracking_uri)
            now = int(time.time() * 1000)
            rows = [Metric(f"train/{k}", float(v), now, int(step)) for k, v in metrics.items()]
            self._client.log_batch(self.run_id, metrics=rows)  # type: ignore[attr-defined]
        except Exception as e:  # never kill a training run over a metrics hiccup
            if not self._warned:
                print(f"warning: could not log metrics to MLflow run {self.run_id}: {e}", file=sys.stderr)
                self._warned = True
