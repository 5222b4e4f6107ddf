"""Stage 3, train: the draft head with training-time test, distributed with Ray Train (DDP), resumable.

Purpose: `train(cfg, extract_dir, out_dir, ...) -> TrainResult`. A Ray `TorchTrainer` runs `train_loop`
(components/train/loop.py) on `cfg.ray.num_workers` workers (0 = in the driver process, for tiny runs;
components/train/ray_train.py); each worker
reads the extract stage's output (offline feature shards, or tokens + the target itself in online mode), rank 0
streams per-step TTT metrics to a `MetricsSink` (MLflow in the pipeline) and prints progress. AdamW with warm-up
and cosine decay, gradient clipping, bf16 autocast on a GPU, and with `autocast: auto` on a CPU with bf16 matrix
units too (Intel AMX or AVX512-BF16; eagle/train.py `autocast_dtype`): a head's step 1.34-1.45x with AMX and
1.68x on a Zen 4, its held-out tau that of fp32 (bench/cpu_autocast.py).
Checkpoints (`out_dir/checkpoints/step-XXXXXXX/`, components/train/state.py: head, optimiser, scheduler, step,
RNG, the held-out selection; the data position is the step, since batches are a pure function of (seed, step)) are
written atomically by rank 0 and reported to Ray; a worker restarted by Ray's FailureConfig, or a re-run of the
same stage after a crash, continues from the newest complete checkpoint (and drops the history rows logged past it,
which it logs again).
Held-out selection: a seeded slice of the sequences (`holdout_seqs`) never trains; every `eval_every` steps and at
the last, rank 0 measures the head's TTT loss and simulated tau on it (no gradients) and logs `heldout_tau` /
`heldout_loss`. The best weights so far (highest tau, then lowest loss) live in `out_dir/best/` (replaced atomically)
and in every checkpoint, so a resumed run selects what an uninterrupted one selects. At the end rank 0 exports the
best (`select="best_tau"`) or the last weights (`"last"`), vLLM/SGLang format + probe, to `out_dir/head`; its
lineage and the `TrainResult` say which step and why. Warm start (`init_head_dir`): training starts
from another exported head of a target with the same shapes (the flows pass the base target's champion head when
training a fine-tune of it), keeping that head's draft vocabulary; `TrainConfig.warm_start_steps` is the step
budget for such runs.
The head fuses the layers the features were extracted at (the manifest's `layer_ids`); a warm-start head or a
checkpoint made for other layer ids is refused, naming both.
Workers on several hosts must all see `out_dir` and the Ray checkpoint storage (a shared filesystem mounted at the
same path; the storage may be an object-store URI instead): checked before training, refused by name otherwise.
Not here: evaluation, registration, the choice of hyper-parameters per target (flows/ pass the config).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from components.data.atomic import remove_stale_temps
from components.train.config import RayConfig, TrainConfig
from components.train.loop import WARM_START_FILE, LoopArgs, holdout_size, train_loop
from components.train.state import HISTORY, check_checkpoint, history_rows, latest_checkpoint

# what the exported head's lineage and the TrainResult say of the selection (eagle.train.Selection.lineage)
CHOICE_KEYS = (
    "selected_step",
    "selection_rule",
    "selected_heldout_tau",
    "last_heldout_tau",
    "best_step",
    "best_heldout_tau",
    "heldout_seqs",
    "warm_start_heldout_tau",
)

__all__ = ["RayConfig", "TrainConfig", "TrainResult", "TrainSetup", "latest_checkpoint", "train"]


@dataclass(frozen=True)
class TrainResult:
    head_dir: str
    steps: int
    resumed_from_step: int
    final_metrics: dict[str, float]
    history_file: str
    seconds: float
    selected_step: int = 0  # the step whose weights were exported
    selection_rule: str = ""  # why, in words: "best held-out tau at step 80 of 120 (3.12 vs last 3.05)"
    selected_heldout_tau: float | None = None  # None: no held-out evaluation
    last_heldout_tau: float | None = None
    best_step: int = 0  # the step of the best held-out tau (0: none), whichever rule
    best_heldout_tau: float | None = None
    heldout_seqs: int = 0
    # a warm-started run: the starting head's held-out tau on these features before any step (how far the target
    # it was trained for is from this one: the base head on its fine-tune); None otherwise
    warm_start_heldout_tau: float | None = None


class MetricsSink(Protocol):
    """Where rank 0 sends metrics; must be picklable (it travels to Ray workers)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...


@dataclass(frozen=True)
class JsonlSink:
    path: str

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


@dataclass(frozen=True)
class TrainSetup:
    """How a run starts beyond its config: from another exported head (`init_head_dir`, warm start: its weights and
    draft vocabulary, e.g. the base target's head for a fine-tune of it; a checkpoint still takes precedence), where
    Ray Train keeps its checkpoints (`storage_dir`; None: `out_dir/ray`), whether the target's code may run."""

    init_head_dir: str | None = None
    storage_dir: str | None = None
    trust_remote_code: bool = False


def train(
    cfg: TrainConfig,
    extract_dir: str,
    out_dir: str,
    target_dir: str | None = None,
    lineage: dict[str, Any] | None = None,
    sinks: tuple = (),
    setup: TrainSetup = TrainSetup(),
) -> TrainResult:
    """Train a head on the extract stage's output; resumes from `out_dir/checkpoints` when present. `setup`: a warm
    start, Ray's storage, trust in the target's code (`TrainSetup`)."""
    init_head_dir, trust_remote_code = setup.init_head_dir, setup.trust_remote_code
    out = Path(out_dir).resolve()  # Ray workers may run in another working directory
    extract_dir = str(Path(extract_dir).resolve())
    target_dir = str(Path(target_dir).resolve()) if target_dir else None
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out, extra=(".head.*", "checkpoints/.tmp-step-*"))  # left by a run killed mid-write
    layer_ids, n_layers, n_seqs = _check_extract(extract_dir, target_dir, trust_remote_code)  # fail fast, here
    n_heldout = holdout_size(cfg, n_seqs)
    if cfg.eval_every and n_heldout < cfg.holdout_seqs:
        print(
            f"train: holding out {n_heldout} of {n_seqs} sequences (holdout_seqs {cfg.holdout_seqs}: at most a "
            "quarter of them)",
            flush=True,
        )
    history = out / HISTORY
    ckpt = latest_checkpoint(out)
    if ckpt:
        import torch

        state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)  # a GPU run's, read anywhere
        check_checkpoint(ckpt, state, layer_ids, n_layers)
    resumed = int(ckpt.name.split("-")[1]) if ckpt else 0
    if not ckpt:
        history.unlink(missing_ok=True)
        (out / WARM_START_FILE).unlink(missing_ok=True)
    if init_head_dir:
        init_head_dir = str(Path(init_head_dir).resolve())
    args = LoopArgs(
        cfg,
        extract_dir,
        str(out),
        target_dir,
        dict(lineage or {}),
        (JsonlSink(str(history)), *sinks),
        trust_remote_code,
        init_head_dir,
    )
    t0 = time.perf_counter()
    if cfg.ray.num_workers == 0:
        train_loop(args)
    else:
        from components.train.ray_train import fit_with_ray

        fit_with_ray(train_loop, args, setup.storage_dir or str(out / "ray"))
    from eagle.export import read_head_meta

    rows = history_rows(history)
    lineage = read_head_meta(out / "head")["lineage"]
    return TrainResult(
        str(out / "head"),
        cfg.steps,
        resumed,
        rows[-1] if rows else {},
        str(history),
        time.perf_counter() - t0,
        **{k: lineage.get(k) for k in CHOICE_KEYS},
    )


def _check_extract(extract_dir: str, target_dir: str | None, trust_remote_code: bool) -> tuple[list[int], int, int]:
    """Shards that match their manifest, the target for online features, layer ids a head can fuse; returns
    (the manifest's layer ids, the target's depth, the number of sequences)."""
    from components.train.data import TrainingData
    from eagle.config import check_aux_layer_ids

    data = TrainingData.open(extract_dir, verify=True)
    if data.manifest["mode"] == "online" and not target_dir:
        raise ValueError("online features need the target: pass target_dir")
    n = data.target_config(trust_remote_code).num_hidden_layers
    try:
        return list(check_aux_layer_ids(data.manifest.get("layer_ids") or (), n)), n, data.n_seqs
    except ValueError as e:
        raise ValueError(f"{data.root / 'manifest.json'}: {e}; re-run the extract stage") from None
