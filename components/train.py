"""Stage 3, train: the draft head with training-time test, distributed with Ray Train (DDP), resumable.

Purpose: `train(cfg, extract_dir, out_dir, ...) -> TrainResult`. A Ray `TorchTrainer` runs `train_loop` on
`cfg.num_workers` workers (0 = in the driver process, for tiny runs); each worker reads the extract stage's
output (offline feature shards, or tokens + the target itself in online mode), rank 0 streams per-step TTT
metrics to a `MetricsSink` (MLflow in the pipeline) and prints progress. AdamW with warm-up and cosine decay,
gradient clipping, bf16 autocast on GPU.
Checkpoints (`out_dir/checkpoints/step-XXXXXXX/`: head, optimiser, scheduler, step, RNG; the data position is
the step, since batches are a pure function of (seed, step)) are written atomically by rank 0 and reported to
Ray; a worker restarted by Ray's FailureConfig, or a re-run of the same stage after a crash, continues from the
newest complete checkpoint (and drops the history rows logged past it, which it logs again). At the end rank 0
exports the head (vLLM/SGLang format + probe) to `out_dir/head`. Warm start (`init_head_dir`): training starts
from another exported head of a target with the same shapes (the flows pass the base target's champion head when
training a fine-tune of it), keeping that head's draft vocabulary; `TrainConfig.warm_start_steps` is the step
budget for such runs.
The head fuses the layers the features were extracted at (the manifest's `layer_ids`); a warm-start head or a
checkpoint made for other layer ids is refused, naming both.
Not here: evaluation, registration, the choice of hyper-parameters per target (flows/ pass the config).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from components.atomic import atomic_write_text, remove_stale_temps


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 400
    batch_size: int = 8
    draft_vocab_size: int = 2048
    ttt_steps: int = 7
    gamma: float = 0.8
    lr: float = 1e-3
    warmup_steps: int = 20
    grad_clip: float = 0.5
    seed: int = 0
    num_workers: int = 1  # 0: run in the driver process
    use_gpu: bool = False
    cpus_per_worker: int = 1
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    max_failures: int = 2
    log_every: int = 10
    warm_start: bool = True  # a fine-tune's head starts from its base target's champion head when there is one
    warm_start_steps: int = 0  # steps of a warm-started run (0: `steps`)

    @classmethod
    def tiny(cls) -> "TrainConfig":
        return cls(steps=12, batch_size=4, draft_vocab_size=128, ttt_steps=3, lr=3e-3, warmup_steps=2,
                   num_workers=0, checkpoint_every=5, log_every=2, warm_start_steps=6)


@dataclass(frozen=True)
class TrainResult:
    head_dir: str
    steps: int
    resumed_from_step: int
    final_metrics: dict[str, float]
    history_file: str
    seconds: float


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
class LoopArgs:
    cfg: TrainConfig
    extract_dir: str
    out_dir: str
    target_dir: str | None  # needed in online mode
    lineage: dict[str, Any] = field(default_factory=dict)
    sinks: tuple = ()
    trust_remote_code: bool = False  # for the target (online mode) and its config
    init_head_dir: str | None = None  # warm start: an exported head of a related target (its weights, its vocab)


HISTORY = "history.jsonl"


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    done = sorted(p for p in (Path(out_dir) / "checkpoints").glob("step-*") if (p / "DONE").is_file())
    return done[-1] if done else None


def _save_checkpoint(out_dir: Path, step: int, draft, opt, sched, keep: int) -> Path:
    """Head weights, optimiser, scheduler, step, RNG and the head's layer ids, written atomically."""
    import torch
    from safetensors.torch import save_file

    from eagle.export import head_state_dict

    root = out_dir / "checkpoints"
    final = root / f"step-{step:07d}"
    tmp = root / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(head_state_dict(draft), str(tmp / "head.safetensors"))
        torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "step": step,
                    "rng": torch.get_rng_state(), "aux_layer_ids": list(draft.cfg.aux_layer_ids)}, tmp / "state.pt")
        (tmp / "DONE").write_text(str(step))
    except BaseException as err:  # a full disk: leave no half checkpoint, say where
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise OSError(err.errno, f"cannot write checkpoint {final}: {err.strerror or err}; the previous "
                                     "checkpoint is intact: free space and re-run (training resumes)") from err
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(p for p in root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _load_checkpoint(path: Path, draft, opt, sched) -> int:
    """Restore a checkpoint into `draft`, `opt`, `sched` and the RNG; refuse one made for other layer ids."""
    import torch
    from safetensors.torch import load_file

    state = torch.load(path / "state.pt", weights_only=True)
    _check_checkpoint(path, state, draft.cfg.aux_layer_ids, draft.cfg.target_num_layers)
    draft.load_state_dict(load_file(str(path / "head.safetensors")), strict=False)
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def _check_checkpoint(path: Path, state: dict, layer_ids, num_layers: int) -> None:
    """Refuse a checkpoint (its `state.pt` dict) trained on other fused layers than `layer_ids`."""
    n = num_layers
    theirs = list(state.get("aux_layer_ids") or (2, n // 2, n - 3))  # a checkpoint without ids used (2, N//2, N-3)
    if theirs != list(layer_ids):
        raise ValueError(f"checkpoint {path} was trained on features of layers {theirs}, but the features are of "
                         f"layers {list(layer_ids)}: delete {path.parent} to train afresh, or extract with "
                         f"aux_layer_ids {theirs}")


def _history_rows(path: Path) -> list[dict]:
    """The rows of a history file; a last line torn by a killed writer is dropped."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _trim_history(path: Path, step: int) -> None:
    """Drop the rows logged after checkpoint `step` (and torn lines): the resumed run logs those steps again."""
    if path.is_file():
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in _history_rows(path) if r["step"] <= step))


def train_loop(args: LoopArgs) -> None:
    """Runs on every Ray worker (or in the driver when num_workers == 0)."""
    import torch

    from components.datasets import TrainingData, batches, ttt_batch
    from eagle.export import export_head
    from eagle.train import OptimConfig, TTTModule, head_from_tensors, make_optimizer, train_step
    from eagle.ttt import TTTConfig

    cfg, out = args.cfg, Path(args.out_dir)
    rank, world, device = _dist_context(cfg)
    torch.manual_seed(cfg.seed + rank)
    data = TrainingData.open(args.extract_dir)
    target = None
    if data.manifest["mode"] == "online":
        from components.targets import load_target

        target = load_target(args.target_dir, str(device), trust_remote_code=args.trust_remote_code)[0]
    layer_ids = data.manifest["layer_ids"]
    if args.init_head_dir:
        draft = warm_start_head(args.init_head_dir, data.target_config(args.trust_remote_code),
                                data.embed_tokens, layer_ids).to(device)
    else:
        draft = head_from_tensors(data.target_config(args.trust_remote_code), data.token_counts, data.embed_tokens,
                                  data.lm_head, cfg.draft_vocab_size, aux_layer_ids=layer_ids).to(device)
    ttt = TTTConfig(ttt_steps=cfg.ttt_steps, gamma=cfg.gamma)
    optim = OptimConfig(lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps, grad_clip=cfg.grad_clip)
    opt, sched = make_optimizer(draft.trainable_parameters(), optim)
    ckpt = latest_checkpoint(out)
    start = _load_checkpoint(ckpt, draft, opt, sched) if ckpt else 0
    if rank == 0:
        _trim_history(out / HISTORY, start)
    model = TTTModule(draft, ttt)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                          else None)
    amp = torch.bfloat16 if device.type == "cuda" else None
    t0, seen = time.perf_counter(), 0
    for step, idx in batches(data.n_seqs, cfg.batch_size, cfg.seed, start, rank, world):
        if step >= cfg.steps:
            break
        batch = ttt_batch(data, idx, draft.draft_ids(), device, target)
        try:
            res = train_step(model, draft, batch, ttt, opt, sched, optim.grad_clip, amp)
        except FloatingPointError as e:  # before the optimiser step: the checkpoints stay clean
            raise FloatingPointError(f"{args.extract_dir}, step {step + 1}: {e}") from None
        seen += int(batch.input_ids_BS.numel())
        done = step + 1
        if rank == 0 and (done % cfg.log_every == 0 or done == cfg.steps):
            m = {**res.metrics(), "lr": sched.get_last_lr()[0],
                 "tokens_per_s": seen * world / max(time.perf_counter() - t0, 1e-9)}
            for s in args.sinks:
                s.log(done, m)
            print(f"train: step {done}/{cfg.steps} loss {m['loss']:.3f} acc_0 {m['acc_0']:.3f} "
                  f"acc_{cfg.ttt_steps - 1} {m[f'acc_{cfg.ttt_steps - 1}']:.3f} tau(sim) {m['tau']:.2f} "
                  f"{m['tokens_per_s']:.0f} tok/s", flush=True)
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            path = _save_checkpoint(out, done, draft, opt, sched, cfg.keep_checkpoints) if rank == 0 else None
            _report(done, path)  # every rank reports (a barrier in Ray Train); rank 0 attaches the checkpoint
    if rank == 0:
        export_head(draft, out / "head", lineage={**args.lineage, "train_config": asdict(cfg),
                                                 "resumed_from_step": start})


def warm_start_head(head_dir: str, target_config, embed_VH, aux_layer_ids):
    """The exported head in `head_dir` as the starting point for this target: its weights and draft vocabulary,
    this target's (frozen) embedding. Refuses a head whose shapes do not fit the target, or that fuses other
    layers than `aux_layer_ids` (those of the features), naming both."""
    from eagle.export import HeadMismatchError, check_target, load_head

    draft = load_head(head_dir)
    check_target(draft.cfg, target_config, where=f"warm-start head {head_dir}")
    if list(draft.cfg.aux_layer_ids) != list(aux_layer_ids):
        raise HeadMismatchError(f"warm-start head {head_dir} fuses layers {list(draft.cfg.aux_layer_ids)}, but the "
                                f"features are of layers {list(aux_layer_ids)}: extract with aux_layer_ids "
                                f"{list(draft.cfg.aux_layer_ids)} or train without the warm start")
    draft.embed_tokens.weight.data.copy_(embed_VH.float())
    return draft


def _dist_context(cfg: TrainConfig):
    import torch

    try:
        import ray.train

        ctx = ray.train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
    except Exception:  # not inside a Ray Train worker (num_workers == 0 path)
        rank, world = 0, 1
    if cfg.use_gpu and torch.cuda.is_available():
        import ray.train.torch

        return rank, world, ray.train.torch.get_device()
    return rank, world, torch.device("cpu")


def _report(step: int, path: Path | None) -> None:
    import ray.train

    try:
        ray.train.get_context().get_world_size()
    except Exception:  # outside a Ray Train worker there is nothing to report to
        return
    ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(str(path)) if path else None)


def train(cfg: TrainConfig, extract_dir: str, out_dir: str, target_dir: str | None = None,
          lineage: dict[str, Any] | None = None, sinks: tuple = (), storage_dir: str | None = None,
          trust_remote_code: bool = False, init_head_dir: str | None = None) -> TrainResult:
    """Train a head on the extract stage's output; resumes from `out_dir/checkpoints` when present.

    `init_head_dir` (an exported head) warm-starts training from that head's weights and draft vocabulary instead
    of a fresh head, e.g. the base target's head for a fine-tune of it; a checkpoint still takes precedence."""
    out = Path(out_dir).resolve()  # Ray workers may run in another working directory
    extract_dir = str(Path(extract_dir).resolve())
    target_dir = str(Path(target_dir).resolve()) if target_dir else None
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out, extra=(".head.*", "checkpoints/.tmp-step-*"))  # left by a run killed mid-write
    layer_ids, n_layers = _check_extract(extract_dir, target_dir, trust_remote_code)  # fail fast, in the driver
    history = out / HISTORY
    ckpt = latest_checkpoint(out)
    if ckpt:
        import torch

        _check_checkpoint(ckpt, torch.load(ckpt / "state.pt", weights_only=True), layer_ids, n_layers)
    resumed = int(ckpt.name.split("-")[1]) if ckpt else 0
    if not ckpt:
        history.unlink(missing_ok=True)
    if init_head_dir:
        init_head_dir = str(Path(init_head_dir).resolve())
    args = LoopArgs(cfg, extract_dir, str(out), target_dir, dict(lineage or {}),
                    (JsonlSink(str(history)), *sinks), trust_remote_code, init_head_dir)
    t0 = time.perf_counter()
    if cfg.num_workers == 0:
        train_loop(args)
    else:
        _fit_with_ray(args, storage_dir or str(out / "ray"))
    rows = _history_rows(history)
    return TrainResult(str(out / "head"), cfg.steps, resumed, rows[-1] if rows else {}, str(history),
                       time.perf_counter() - t0)


def _check_extract(extract_dir: str, target_dir: str | None, trust_remote_code: bool) -> tuple[list[int], int]:
    """Shards that match their manifest, the target for online features, layer ids a head can fuse; returns
    (the manifest's layer ids, the target's depth)."""
    from components.datasets import TrainingData
    from eagle.config import check_aux_layer_ids

    data = TrainingData.open(extract_dir, verify=True)
    if data.manifest["mode"] == "online" and not target_dir:
        raise ValueError("online features need the target: pass target_dir")
    n = data.target_config(trust_remote_code).num_hidden_layers
    try:
        return list(check_aux_layer_ids(data.manifest.get("layer_ids") or (), n)), n
    except ValueError as e:
        raise ValueError(f"{data.root / 'manifest.json'}: {e}; re-run the extract stage") from None


def _ray_run_name(out_dir: str) -> str:
    """One Ray run per output directory: the flows share one storage path and name every output dir `train`."""
    return f"{Path(out_dir).name}-{hashlib.sha256(str(Path(out_dir).resolve()).encode()).hexdigest()[:12]}"


def _fit_with_ray(args: LoopArgs, storage: str) -> None:
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cfg = args.cfg
    trainer = TorchTrainer(
        train_loop, train_loop_config=args,
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                     resources_per_worker={"CPU": cfg.cpus_per_worker}),
        run_config=RunConfig(name=_ray_run_name(args.out_dir), storage_path=str(Path(storage).resolve()),
                             failure_config=FailureConfig(max_failures=cfg.max_failures),
                             logging_config=LoggingConfig(log_level="WARNING")))  # no INFO lines per worker start
    result = trainer.fit()
    if result.error:
        raise RuntimeError(f"training failed after {cfg.max_failures} restarts: {result.error}") from result.error
