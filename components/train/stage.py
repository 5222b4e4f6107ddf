"""Stage 3, train: the draft head with training-time test, distributed with Ray Train (DDP), resumable.

Purpose: `train(cfg, extract_dir, out_dir, ...) -> TrainResult`. A Ray `TorchTrainer` runs `train_loop` on
`cfg.ray.num_workers` workers (0 = in the driver process, for tiny runs; components/train/ray_train.py); each worker
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from components.data.atomic import remove_stale_temps
from components.train.config import RayConfig, TrainConfig
from components.train.state import (HISTORY, check_checkpoint, history_rows, latest_checkpoint, load_checkpoint,
                                    save_checkpoint, sync_best, trim_history, write_best)
from eagle.config import default_mask_token_id

# what the exported head's lineage and the TrainResult say of the selection (eagle.train.Selection.lineage)
CHOICE_KEYS = ("selected_step", "selection_rule", "selected_heldout_tau", "last_heldout_tau", "best_step",
               "best_heldout_tau", "heldout_seqs", "warm_start_heldout_tau")
WARM_START_FILE = "warm_start.json"  # the warm-start head's held-out figures before any step (kept across a resume)

if TYPE_CHECKING:
    from eagle.train import BestSoFar

__all__ = ["LoopArgs", "RayConfig", "TrainConfig", "TrainResult", "TrainSetup", "holdout_size", "latest_checkpoint",
           "train", "train_loop", "warm_start_head"]


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


def train_loop(args: LoopArgs) -> None:
    """Runs on every Ray worker (or in the driver when num_workers == 0); only rank 0 evaluates on held-out data
    (no collective op in it: the other ranks wait at the next gradient all-reduce)."""
    import torch

    from components.train.data import TeacherCache, TrainingData, batches, heldout_split, ttt_batch
    from eagle.heap import kept_heap
    from eagle.train import TTTModule, autocast_dtype, make_optimizer, train_step

    cfg, out = args.cfg, Path(args.out_dir)
    rank, world, device = _dist_context(cfg)
    torch.manual_seed(cfg.seed + rank)
    data = TrainingData.open(args.extract_dir)
    target = None
    if data.manifest["mode"] == "online":
        from components.targets.target import load_target

        target = load_target(args.target_dir, str(device), trust_remote_code=args.trust_remote_code)[0]
    draft = new_head(args, data).to(device)
    opt, sched = make_optimizer(draft.trainable_parameters(), cfg.optim, cfg.steps)
    ckpt = latest_checkpoint(out)
    start, best = load_checkpoint(ckpt, draft, opt, sched) if ckpt else (0, _empty_best())
    train_ids, heldout_ids = heldout_split(data.n_seqs, holdout_size(cfg, data.n_seqs), cfg.seed)
    if rank == 0:
        trim_history(out / HISTORY, start)
        sync_best(out, best)
    model = _ddp(TTTModule(draft, cfg.ttt), world, device)
    amp = autocast_dtype(cfg.autocast, device.type)
    if rank == 0 and amp is not None and device.type == "cpu":
        print("train: bf16 autocast on this CPU's bf16 units (train.autocast auto)", flush=True)
    if rank == 0 and start == 0 and args.init_head_dir and cfg.eval_every:
        _warm_start_figures(out, _heldout(cfg, data, heldout_ids, draft, amp, target))
    t0, seen, real = time.perf_counter(), 0, 0
    sizes = (data.offsets[1:] - data.offsets[:-1]).tolist()
    lengths = [sizes[i] for i in train_ids] if cfg.bucket_by_length else None
    cache = TeacherCache(cfg.teacher_cache_mib << 20) if cfg.teacher_cache_mib and target is None else None
    with kept_heap(device.type == "cpu"):  # eagle/heap.py: no page faults for each step's freed tensors
        for step, pos in batches(len(train_ids), cfg.batch_size, cfg.seed, start, rank, world, lengths):
            if step >= cfg.steps:
                break
            ids = [train_ids[i] for i in pos]
            batch = ttt_batch(data, ids, draft.draft_ids(), device, target, every_token=cfg.loss_on == "all",
                              teacher_cache=cache)
            try:
                res = train_step(model, draft, batch, cfg.ttt, opt, sched, cfg.optim.grad_clip, amp)
            except FloatingPointError as e:  # before the optimiser step: the checkpoints stay clean
                raise FloatingPointError(f"{args.extract_dir}, step {step + 1}: {e}") from None
            seen += int(batch.input_ids_BS.numel())
            real += sum(sizes[i] for i in ids)
            done = step + 1
            if rank == 0:
                t = time.perf_counter()
                held = _heldout(cfg, data, heldout_ids, draft, amp, target, cache) \
                    if cfg.eval_every and _due(done, cfg.eval_every, cfg.steps) else {}
                t0 += time.perf_counter() - t  # tokens/s counts training time only
                if held and best.record(done, held["heldout_tau"], held["heldout_loss"], draft):
                    write_best(out, best)
                if held or _due(done, cfg.log_every, cfg.steps):
                    _log(args, done, {**res.metrics(), "lr": sched.get_last_lr()[0],
                                      "tokens_per_s": seen * world / max(time.perf_counter() - t0, 1e-9),
                                      "seq_tokens_per_s": real * world / max(time.perf_counter() - t0, 1e-9), **held})
            if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                path = save_checkpoint(out, done, draft, opt, sched, cfg.keep_checkpoints, best) if rank == 0 else None
                if cfg.ray.num_workers:  # in the driver (0 workers) there is no Ray to report to, nor imported
                    _report(done, path)  # every rank reports (a barrier in Ray Train); rank 0 attaches the checkpoint
    if rank == 0:
        _export(args, draft, best, start, len(heldout_ids))


def _warm_start_figures(out: Path, held: dict[str, float]) -> None:
    """The warm-start head's held-out figures before any step: printed and kept for the lineage."""
    from components.data.atomic import atomic_write_text

    print(f"train: the warm-start head on these features, before any step: held-out tau {held['heldout_tau']:.2f} "
          f"loss {held['heldout_loss']:.3f}", flush=True)
    atomic_write_text(out / WARM_START_FILE, json.dumps({"heldout_tau": held["heldout_tau"],
                                                          "heldout_loss": held["heldout_loss"]}) + "\n")


def _due(done: int, every: int, steps: int) -> bool:
    return done % every == 0 or done == steps


def _heldout(cfg: TrainConfig, data, heldout_ids: list[int], draft, amp, target, cache=None) -> dict[str, float]:
    """`eagle.train.heldout_metrics` of `draft` on the held-out sequences, `cfg.batch_size` at a time."""
    from components.train.data import ttt_batch
    from eagle.train import heldout_metrics

    device, b = next(draft.parameters()).device, cfg.batch_size
    chunks = (heldout_ids[i:i + b] for i in range(0, len(heldout_ids), b))
    return heldout_metrics(draft, (ttt_batch(data, c, draft.draft_ids(), device, target, teacher_cache=cache)
                                   for c in chunks),
                           cfg.ttt, amp)


def _ddp(model, world: int, device):
    """`model` wrapped in DistributedDataParallel when there are several ranks."""
    import torch

    if world == 1:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def _empty_best() -> BestSoFar:
    from eagle.train import BestSoFar

    return BestSoFar()


def _log(args: LoopArgs, step: int, m: dict[str, float]) -> None:
    """One row to every sink and a progress line (held-out figures when the step has them)."""
    k = args.cfg.ttt.ttt_steps - 1
    for s in args.sinks:
        s.log(step, m)
    held = f" heldout tau {m['heldout_tau']:.2f} loss {m['heldout_loss']:.3f}" if "heldout_tau" in m else ""
    print(f"train: step {step}/{args.cfg.steps} loss {m['loss']:.3f} acc_0 {m['acc_0']:.3f} "
          f"acc_{k} {m[f'acc_{k}']:.3f} tau(sim) {m['tau']:.2f}{held} {m['tokens_per_s']:.0f} tok/s", flush=True)


def _export(args: LoopArgs, draft, best: BestSoFar, start: int, n_heldout: int) -> None:
    """Export the weights the rule selects (the best held-out tau's, or the last) with the choice in the lineage."""
    from eagle.export import export_head

    cfg = args.cfg
    choice = best.selection.lineage(cfg.select, cfg.steps)
    if best.weights is not None and choice["selected_step"] == best.selection.best_step:
        draft.load_state_dict(best.weights, strict=False)
    warm = Path(args.out_dir) / WARM_START_FILE
    warm_tau = json.loads(warm.read_text())["heldout_tau"] if args.init_head_dir and warm.is_file() else None
    export_head(draft, Path(args.out_dir) / "head", lineage={**args.lineage, "train_config": asdict(cfg),
                                                            "resumed_from_step": start, **choice,
                                                            "heldout_seqs": n_heldout,
                                                            "warm_start_heldout_tau": warm_tau})


def holdout_size(cfg: TrainConfig, n_seqs: int) -> int:
    """Sequences held out of training: `holdout_seqs`, at most a quarter of them and at least one; none when
    `eval_every` is 0. Data too small to hold one out is refused."""
    if not cfg.eval_every:
        return 0
    if n_seqs < 2:
        raise ValueError(f"held-out evaluation needs at least 2 sequences, the features hold {n_seqs}: extract more "
                         "traffic, or train with eval_every 0 and select 'last'")
    return min(cfg.holdout_seqs, max(1, n_seqs // 4))


def new_head(args: LoopArgs, data):
    """A fresh head of `cfg.variant` for the features' target and layers, or the warm-start head as that variant."""
    from eagle.train import as_variant, head_from_tensors

    layer_ids, tcfg = data.manifest["layer_ids"], data.target_config(args.trust_remote_code)
    if args.init_head_dir:
        return as_variant(warm_start_head(args.init_head_dir, tcfg, data.embed_tokens, layer_ids), args.cfg.variant,
                          default_mask_token_id(tcfg))
    return head_from_tensors(tcfg, data.token_counts, data.embed_tokens, data.lm_head, args.cfg.draft_vocab_size,
                             aux_layer_ids=layer_ids, variant=args.cfg.variant)


def warm_start_head(head_dir: str, target_config, embed_VH, aux_layer_ids):
    """The exported head in `head_dir` as the starting point for this target: its weights and draft vocabulary,
    this target's (frozen) embedding. Refuses a head whose shapes do not fit the target, or that fuses other
    layers than `aux_layer_ids` (those of the features), naming both."""
    from eagle.export import HeadMismatchError, check_head_fits, load_head

    draft = load_head(head_dir)
    check_head_fits(draft.cfg, target_config, where=f"warm-start head {head_dir}")
    if list(draft.cfg.aux_layer_ids) != list(aux_layer_ids):
        raise HeadMismatchError(f"warm-start head {head_dir} fuses layers {list(draft.cfg.aux_layer_ids)}, but the "
                                f"features are of layers {list(aux_layer_ids)}: extract with aux_layer_ids "
                                f"{list(draft.cfg.aux_layer_ids)} or train without the warm start")
    draft.embed_tokens.weight.data.copy_(embed_VH.float())
    return draft


def _dist_context(cfg: TrainConfig):
    """(rank, world size, device). In the driver (`ray.num_workers` 0) Ray is not imported: one process, on the
    current CUDA device when `ray.use_gpu` and CUDA is there, else the CPU."""
    import torch

    if cfg.ray.num_workers == 0:
        cuda = cfg.ray.use_gpu and torch.cuda.is_available()
        return 0, 1, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        import ray.train

        ctx = ray.train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
    except Exception:  # not inside a Ray Train worker (num_workers == 0 path)
        rank, world = 0, 1
    if cfg.ray.use_gpu and torch.cuda.is_available():
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
          lineage: dict[str, Any] | None = None, sinks: tuple = (), setup: TrainSetup = TrainSetup()) -> TrainResult:
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
        print(f"train: holding out {n_heldout} of {n_seqs} sequences (holdout_seqs {cfg.holdout_seqs}: at most a "
              "quarter of them)", flush=True)
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
    args = LoopArgs(cfg, extract_dir, str(out), target_dir, dict(lineage or {}),
                    (JsonlSink(str(history)), *sinks), trust_remote_code, init_head_dir)
    t0 = time.perf_counter()
    if cfg.ray.num_workers == 0:
        train_loop(args)
    else:
        from components.train.ray_train import fit_with_ray

        fit_with_ray(train_loop, args, setup.storage_dir or str(out / "ray"))
    from eagle.export import read_head_meta

    rows = history_rows(history)
    lineage = read_head_meta(out / "head")["lineage"]
    return TrainResult(str(out / "head"), cfg.steps, resumed, rows[-1] if rows else {}, str(history),
                       time.perf_counter() - t0, **{k: lineage.get(k) for k in CHOICE_KEYS})


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
