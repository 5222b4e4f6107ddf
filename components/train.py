"""Stage 3, train: the draft head with training-time test, distributed with Ray Train (DDP), resumable.

Purpose: `train(cfg, extract_dir, out_dir, ...) -> TrainResult`. A Ray `TorchTrainer` runs `train_loop` on
`cfg.ray.num_workers` workers (0 = in the driver process, for tiny runs; components/train_ray.py); each worker
reads the extract stage's output (offline feature shards, or tokens + the target itself in online mode), rank 0
streams per-step TTT metrics to a `MetricsSink` (MLflow in the pipeline) and prints progress. AdamW with warm-up
and cosine decay, gradient clipping, bf16 autocast on a GPU, and with `autocast: auto` on a CPU with bf16 matrix
units too (Intel AMX; eagle/train.py `autocast_dtype`): the demo's head 1.34-1.45x a step there, its held-out tau
that of fp32 (bench/cpu_autocast.py).
Checkpoints (`out_dir/checkpoints/step-XXXXXXX/`, components/train_state.py: head, optimiser, scheduler, step,
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

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from components.atomic import remove_stale_temps
from eagle.config import PARALLEL_VARIANTS, VARIANTS, default_mask_token_id
from eagle.config_checks import FieldError, at_least, one_of
from eagle.run_config import OptimConfig, TTTConfig
from components.train_state import (HISTORY, check_checkpoint, history_rows, latest_checkpoint, load_checkpoint,
                                    save_checkpoint, sync_best, trim_history, write_best)

# what the exported head's lineage and the TrainResult say of the selection (eagle.train.Selection.lineage)
CHOICE_KEYS = ("selected_step", "selection_rule", "selected_heldout_tau", "last_heldout_tau", "best_step",
               "best_heldout_tau", "heldout_seqs")

if TYPE_CHECKING:
    from eagle.train import BestSoFar

__all__ = ["LoopArgs", "RayConfig", "TrainConfig", "TrainResult", "holdout_size", "latest_checkpoint", "train",
           "train_loop", "warm_start_head"]


@dataclass(frozen=True)
class RayConfig:
    """Where training runs: Ray Train workers (DDP), their resources, and how often Ray restarts a failed one."""

    num_workers: int = 1  # 0: run in the driver process
    use_gpu: bool = False
    cpus_per_worker: int = 1
    max_failures: int = 2  # worker restarts before the run fails (-1: no limit)

    def __post_init__(self) -> None:
        at_least(self, {"num_workers": 0, "cpus_per_worker": 1, "max_failures": -1})
        if not isinstance(self.use_gpu, bool):
            raise FieldError(self, "use_gpu", f"must be true or false, got {self.use_gpu!r}")


@dataclass(frozen=True)
class TrainConfig:
    """The head's training run: its length, data and checkpoints here; the TTT loss (`ttt`), the optimiser
    (`optim`) and the workers (`ray`) in their own sections (`train.ttt.ttt_steps` in a pipeline config)."""

    steps: int = 400
    batch_size: int = 8
    draft_vocab_size: int = 2048
    seed: int = 0
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    warm_start: bool = True  # a fine-tune's head starts from its base target's champion head when there is one
    warm_start_steps: int = 0  # steps of a warm-started run (0: `steps`)
    eval_every: int = 50  # held-out loss and simulated tau every N steps and at the last (0: none, nothing held out)
    holdout_seqs: int = 32  # sequences set aside for it (at most a quarter of the data, at least one)
    select: Literal["best_tau", "last"] = "best_tau"  # the exported weights: best held-out tau, or the last step's
    # which tokens the loss scores: the answers ("assistant"), or every token ("all": the prompts' positions too,
    # where the teacher is the target's distribution as well; more signal from the same features, no extra compute).
    # The held-out figures score the answers either way.
    loss_on: Literal["assistant", "all"] = "assistant"
    # the head's architecture (eagle/config.py): eagle3, eagle3.1, parallel (P-EAGLE: drafts K tokens in one pass;
    # TTT's steps 1..K-1 become its masked slots, eagle/ttt.py) or eagle3.1-parallel (both); TTT trains each
    variant: str = "eagle3"
    # two or more variants: train each on the same features (in place of `variant`), evaluate each, register the one
    # with the best served speedup (components/variant_choice.py); empty: off
    variants: tuple[str, ...] = ()
    # bf16 autocast (weights and optimiser stay fp32): "gpu" on a GPU only, "auto" also on a CPU with bf16 matrix
    # units (Intel AMX; elsewhere a CPU's bf16 is slower than fp32), "off" never
    autocast: str = "gpu"
    ttt: TTTConfig = field(default_factory=TTTConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=20))
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        _check_config(self)

    @classmethod
    def tiny(cls) -> "TrainConfig":
        return cls(steps=12, batch_size=4, draft_vocab_size=128, checkpoint_every=5, log_every=2, warm_start_steps=6,
                   eval_every=4, holdout_seqs=2, ttt=TTTConfig(ttt_steps=3), optim=OptimConfig(lr=3e-3, warmup_steps=2),
                   ray=RayConfig(num_workers=0))


def _check_config(cfg: TrainConfig) -> None:
    """Refuse out-of-range values, naming the field (a pipeline config file then fails at load)."""
    at_least(cfg, {"steps": 1, "batch_size": 1, "draft_vocab_size": 1, "seed": 0, "checkpoint_every": 1,
                   "keep_checkpoints": 1, "log_every": 1, "warm_start_steps": 0, "eval_every": 0, "holdout_seqs": 0})
    one_of(cfg, "select", ("best_tau", "last"))
    one_of(cfg, "loss_on", ("assistant", "all"))
    one_of(cfg, "autocast", ("gpu", "auto", "off"))
    one_of(cfg, "variant", VARIANTS)
    _check_variants(cfg)
    for name, kind in (("ttt", TTTConfig), ("optim", OptimConfig), ("ray", RayConfig)):
        if not isinstance(getattr(cfg, name), kind):
            raise FieldError(cfg, name, f"must be a {kind.__name__}, got {getattr(cfg, name)!r}")
    if (par := [v for v in (cfg.variant, *cfg.variants) if v in PARALLEL_VARIANTS]) and cfg.ttt.ttt_steps < 2:
        raise FieldError(cfg, "variant", f"{par[0]!r} needs ttt.ttt_steps >= 2 (its masked slots are TTT's steps "
                         f"1..K-1), got ttt_steps {cfg.ttt.ttt_steps}")
    if cfg.select == "best_tau" and cfg.eval_every == 0:
        raise FieldError(cfg, "select", "'best_tau' needs the held-out evaluation: set eval_every >= 1, or select "
                         "'last'")
    if cfg.eval_every and cfg.holdout_seqs == 0:
        raise FieldError(cfg, "holdout_seqs", "must be >= 1 when eval_every >= 1 (eval_every 0 turns the held-out "
                         "evaluation off)")


def _check_variants(cfg: TrainConfig) -> None:
    """`variants`: empty, or two or more distinct names of eagle.config.VARIANTS."""
    vs = cfg.variants
    bad = ("must be a list of variant names" if not isinstance(vs, tuple) or not all(isinstance(v, str) for v in vs)
           else f"names an unknown variant; known: {', '.join(VARIANTS)}" if set(vs) - set(VARIANTS)
           else "names a variant twice" if len(set(vs)) < len(vs)
           else "must list two or more variants (for one, set train.variant), or none" if len(vs) == 1 else "")
    if bad:
        raise FieldError(cfg, "variants", f"{bad}, got {list(vs) if isinstance(vs, tuple) else vs!r}")


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


def train_loop(args: LoopArgs) -> None:
    """Runs on every Ray worker (or in the driver when num_workers == 0); only rank 0 evaluates on held-out data
    (no collective op in it: the other ranks wait at the next gradient all-reduce)."""
    import torch

    from components.train_data import TrainingData, batches, heldout_split, ttt_batch
    from eagle.heap import kept_heap
    from eagle.train import TTTModule, autocast_dtype, make_optimizer, train_step

    cfg, out = args.cfg, Path(args.out_dir)
    rank, world, device = _dist_context(cfg)
    torch.manual_seed(cfg.seed + rank)
    data = TrainingData.open(args.extract_dir)
    target = None
    if data.manifest["mode"] == "online":
        from components.targets import load_target

        target = load_target(args.target_dir, str(device), trust_remote_code=args.trust_remote_code)[0]
    draft = _new_head(args, data).to(device)
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
        print("train: bf16 autocast on this CPU's AMX units (train.autocast auto)", flush=True)
    t0, seen = time.perf_counter(), 0
    with kept_heap(device.type == "cpu"):  # eagle/heap.py: no page faults for each step's freed tensors
        for step, pos in batches(len(train_ids), cfg.batch_size, cfg.seed, start, rank, world):
            if step >= cfg.steps:
                break
            batch = ttt_batch(data, [train_ids[i] for i in pos], draft.draft_ids(), device, target,
                              every_token=cfg.loss_on == "all")
            try:
                res = train_step(model, draft, batch, cfg.ttt, opt, sched, cfg.optim.grad_clip, amp)
            except FloatingPointError as e:  # before the optimiser step: the checkpoints stay clean
                raise FloatingPointError(f"{args.extract_dir}, step {step + 1}: {e}") from None
            seen += int(batch.input_ids_BS.numel())
            done = step + 1
            if rank == 0:
                t = time.perf_counter()
                held = _heldout(cfg, data, heldout_ids, draft, amp, target) \
                    if cfg.eval_every and _due(done, cfg.eval_every, cfg.steps) else {}
                t0 += time.perf_counter() - t  # tokens/s counts training time only
                if held and best.record(done, held["heldout_tau"], held["heldout_loss"], draft):
                    write_best(out, best)
                if held or _due(done, cfg.log_every, cfg.steps):
                    _log(args, done, {**res.metrics(), "lr": sched.get_last_lr()[0],
                                      "tokens_per_s": seen * world / max(time.perf_counter() - t0, 1e-9), **held})
            if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                path = save_checkpoint(out, done, draft, opt, sched, cfg.keep_checkpoints, best) if rank == 0 else None
                if cfg.ray.num_workers:  # in the driver (0 workers) there is no Ray to report to, nor imported
                    _report(done, path)  # every rank reports (a barrier in Ray Train); rank 0 attaches the checkpoint
    if rank == 0:
        _export(args, draft, best, start, len(heldout_ids))


def _due(done: int, every: int, steps: int) -> bool:
    return done % every == 0 or done == steps


def _heldout(cfg: TrainConfig, data, heldout_ids: list[int], draft, amp, target) -> dict[str, float]:
    """`eagle.train.heldout_metrics` of `draft` on the held-out sequences, `cfg.batch_size` at a time."""
    from components.train_data import ttt_batch
    from eagle.train import heldout_metrics

    device, b = next(draft.parameters()).device, cfg.batch_size
    chunks = (heldout_ids[i:i + b] for i in range(0, len(heldout_ids), b))
    return heldout_metrics(draft, (ttt_batch(data, c, draft.draft_ids(), device, target) for c in chunks),
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
    export_head(draft, Path(args.out_dir) / "head", lineage={**args.lineage, "train_config": asdict(cfg),
                                                            "resumed_from_step": start, **choice,
                                                            "heldout_seqs": n_heldout})


def holdout_size(cfg: TrainConfig, n_seqs: int) -> int:
    """Sequences held out of training: `holdout_seqs`, at most a quarter of them and at least one; none when
    `eval_every` is 0. Data too small to hold one out is refused."""
    if not cfg.eval_every:
        return 0
    if n_seqs < 2:
        raise ValueError(f"held-out evaluation needs at least 2 sequences, the features hold {n_seqs}: extract more "
                         "traffic, or train with eval_every 0 and select 'last'")
    return min(cfg.holdout_seqs, max(1, n_seqs // 4))


def _new_head(args: LoopArgs, data):
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
    if init_head_dir:
        init_head_dir = str(Path(init_head_dir).resolve())
    args = LoopArgs(cfg, extract_dir, str(out), target_dir, dict(lineage or {}),
                    (JsonlSink(str(history)), *sinks), trust_remote_code, init_head_dir)
    t0 = time.perf_counter()
    if cfg.ray.num_workers == 0:
        train_loop(args)
    else:
        from components.train_ray import fit_with_ray

        fit_with_ray(train_loop, args, storage_dir or str(out / "ray"))
    from eagle.export import read_head_meta

    rows = history_rows(history)
    lineage = read_head_meta(out / "head")["lineage"]
    return TrainResult(str(out / "head"), cfg.steps, resumed, rows[-1] if rows else {}, str(history),
                       time.perf_counter() - t0, **{k: lineage[k] for k in CHOICE_KEYS})


def _check_extract(extract_dir: str, target_dir: str | None, trust_remote_code: bool) -> tuple[list[int], int, int]:
    """Shards that match their manifest, the target for online features, layer ids a head can fuse; returns
    (the manifest's layer ids, the target's depth, the number of sequences)."""
    from components.train_data import TrainingData
    from eagle.config import check_aux_layer_ids

    data = TrainingData.open(extract_dir, verify=True)
    if data.manifest["mode"] == "online" and not target_dir:
        raise ValueError("online features need the target: pass target_dir")
    n = data.target_config(trust_remote_code).num_hidden_layers
    try:
        return list(check_aux_layer_ids(data.manifest.get("layer_ids") or (), n)), n, data.n_seqs
    except ValueError as e:
        raise ValueError(f"{data.root / 'manifest.json'}: {e}; re-run the extract stage") from None
