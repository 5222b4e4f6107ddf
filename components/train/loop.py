"""The training loop every worker runs (stage 3, train): its arguments, the head it starts from, held-out selection.

Purpose: `train_loop(LoopArgs)` runs on every Ray Train worker, or in the driver when `train.ray.num_workers` is 0
(Ray is then not imported): it opens the extract stage's output (components/train/data.py), builds the head
(`new_head`: a fresh one of `train.variant`, or `warm_start_head`, an exported head of a related target refused when
its shapes or fused layers do not fit), resumes from the newest checkpoint, and steps through the seeded batches
(DDP across ranks, bf16 autocast where `train.autocast` says); rank 0 measures the held-out TTT loss and simulated tau
on the `holdout_size` sequences every `eval_every` steps, keeps the best weights, logs to the sinks, writes the
checkpoints (components/train/state.py) and at the end exports the selected weights with the choice in the lineage.
The warm-start head's held-out figures before any step go to `WARM_START_FILE`.
Run: through `components.train.stage.train` (in the driver, or by components/train/ray_train.py `fit_with_ray`).
Not here: the stage's checks, its result and where Ray keeps its checkpoints (components/train/stage.py), the
step itself and the selection rule (eagle/train.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from components.train.config import TrainConfig
from components.train.state import (
    HISTORY,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    sync_best,
    trim_history,
    write_best,
)
from eagle.config import default_mask_token_id

WARM_START_FILE = "warm_start.json"  # the warm-start head's held-out figures before any step (kept across a resume)

if TYPE_CHECKING:
    from eagle.train import BestSoFar


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
    shallow = replace(cfg.ttt, ttt_steps=cfg.ttt.shallow_steps, shallow_fraction=0.0)  # the shallow phase's loss
    with kept_heap(device.type == "cpu"):  # eagle/heap.py: no page faults for each step's freed tensors
        for step, pos in batches(len(train_ids), cfg.batch_size, cfg.seed, start, rank, world, lengths):
            if step >= cfg.steps:
                break
            ids = [train_ids[i] for i in pos]
            batch = ttt_batch(
                data, ids, draft.draft_ids(), device, target, every_token=cfg.loss_on == "all", teacher_cache=cache
            )
            depth = cfg.ttt.depth_at(step, cfg.steps)
            ttt = cfg.ttt if depth == cfg.ttt.ttt_steps else shallow
            try:
                res = train_step(model, draft, batch, ttt, opt, sched, cfg.optim.grad_clip, amp)
            except FloatingPointError as e:  # before the optimiser step: the checkpoints stay clean
                raise FloatingPointError(f"{args.extract_dir}, step {step + 1}: {e}") from None
            seen += int(batch.input_ids_BS.numel())
            real += sum(sizes[i] for i in ids)
            done = step + 1
            if rank == 0:
                t = time.perf_counter()
                held = (
                    _heldout(cfg, data, heldout_ids, draft, amp, target, cache)
                    if cfg.eval_every and _due(done, cfg.eval_every, cfg.steps)
                    else {}
                )
                t0 += time.perf_counter() - t  # tokens/s counts training time only
                if held and best.record(done, held["heldout_tau"], held["heldout_loss"], draft):
                    write_best(out, best)
                if held or _due(done, cfg.log_every, cfg.steps):
                    _log(
                        args,
                        done,
                        {
                            **res.metrics(),
                            "ttt_depth": depth,
                            "lr": sched.get_last_lr()[0],
                            "tokens_per_s": seen * world / max(time.perf_counter() - t0, 1e-9),
                            "seq_tokens_per_s": real * world / max(time.perf_counter() - t0, 1e-9),
                            **held,
                        },
                    )
            if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                path = save_checkpoint(out, done, draft, opt, sched, cfg.keep_checkpoints, best) if rank == 0 else None
                if cfg.ray.num_workers:  # in the driver (0 workers) there is no Ray to report to, nor imported
                    _report(done, path)  # every rank reports (a barrier in Ray Train); rank 0 attaches the checkpoint
    if rank == 0:
        _export(args, draft, best, start, len(heldout_ids))


def _warm_start_figures(out: Path, held: dict[str, float]) -> None:
    """The warm-start head's held-out figures before any step: printed and kept for the lineage."""
    from components.data.atomic import atomic_write_text

    print(
        f"train: the warm-start head on these features, before any step: held-out tau {held['heldout_tau']:.2f} "
        f"loss {held['heldout_loss']:.3f}",
        flush=True,
    )
    atomic_write_text(
        out / WARM_START_FILE,
        json.dumps({"heldout_tau": held["heldout_tau"], "heldout_loss": held["heldout_loss"]}) + "\n",
    )


def _due(done: int, every: int, steps: int) -> bool:
    return done % every == 0 or done == steps


def _heldout(cfg: TrainConfig, data, heldout_ids: list[int], draft, amp, target, cache=None) -> dict[str, float]:
    """`eagle.train.heldout_metrics` of `draft` on the held-out sequences, `cfg.batch_size` at a time."""
    from components.train.data import ttt_batch
    from eagle.train import heldout_metrics

    device, b = next(draft.parameters()).device, cfg.batch_size
    chunks = (heldout_ids[i : i + b] for i in range(0, len(heldout_ids), b))
    return heldout_metrics(
        draft,
        (ttt_batch(data, c, draft.draft_ids(), device, target, teacher_cache=cache) for c in chunks),
        cfg.ttt,
        amp,
    )


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
    k = max(int(key[4:]) for key in m if key.startswith("acc_"))  # the step's depth - 1 (shallow phase: less)
    for s in args.sinks:
        s.log(step, m)
    held = f" heldout tau {m['heldout_tau']:.2f} loss {m['heldout_loss']:.3f}" if "heldout_tau" in m else ""
    print(
        f"train: step {step}/{args.cfg.steps} loss {m['loss']:.3f} acc_0 {m['acc_0']:.3f} "
        + (f"acc_{k} {m[f'acc_{k}']:.3f} " if k else "")
        + f"tau(sim) {m['tau']:.2f}{held} {m['tokens_per_s']:.0f} tok/s",
        flush=True,
    )


def _export(args: LoopArgs, draft, best: BestSoFar, start: int, n_heldout: int) -> None:
    """Export the weights the rule selects (the best held-out tau's, or the last) with the choice in the lineage."""
    from eagle.export import export_head

    cfg = args.cfg
    choice = best.selection.lineage(cfg.select, cfg.steps)
    if best.weights is not None and choice["selected_step"] == best.selection.best_step:
        draft.load_state_dict(best.weights, strict=False)
    warm = Path(args.out_dir) / WARM_START_FILE
    warm_tau = json.loads(warm.read_text())["heldout_tau"] if args.init_head_dir and warm.is_file() else None
    export_head(
        draft,
        Path(args.out_dir) / "head",
        lineage={
            **args.lineage,
            "train_config": asdict(cfg),
            "resumed_from_step": start,
            **choice,
            "heldout_seqs": n_heldout,
            "warm_start_heldout_tau": warm_tau,
        },
    )


def holdout_size(cfg: TrainConfig, n_seqs: int) -> int:
    """Sequences held out of training: `holdout_seqs`, at most a quarter of them and at least one; none when
    `eval_every` is 0. Data too small to hold one out is refused."""
    if not cfg.eval_every:
        return 0
    if n_seqs < 2:
        raise ValueError(
            f"held-out evaluation needs at least 2 sequences, the features hold {n_seqs}: extract more "
            "traffic, or train with eval_every 0 and select 'last'"
        )
    return min(cfg.holdout_seqs, max(1, n_seqs // 4))


def new_head(args: LoopArgs, data):
    """A fresh head of `cfg.variant` for the features' target and layers, or the warm-start head as that variant."""
    from eagle.train import as_variant, head_from_tensors

    layer_ids, tcfg = data.manifest["layer_ids"], data.target_config(args.trust_remote_code)
    if args.init_head_dir:
        return as_variant(
            warm_start_head(args.init_head_dir, tcfg, data.embed_tokens, layer_ids),
            args.cfg.variant,
            default_mask_token_id(tcfg),
        )
    head = head_from_tensors(
        tcfg,
        data.token_counts,
        data.embed_tokens,
        data.lm_head,
        args.cfg.draft_vocab_size,
        aux_layer_ids=layer_ids,
        variant=args.cfg.variant,
    )
    if args.cfg.head_init == "target-layer":
        start_from_layer(head, data)
    return head


def start_from_layer(head, data) -> None:
    """`train.head_init: target-layer`: the fresh head starts as the target's layer that its highest fused state
    enters (eagle/train.py `start_from_target_layer`); refused, by name, when the features' directory holds no
    such layer (extracted before the extract stage saved it) or none of it fits the head."""
    from components.train.data import FeatureStoreError
    from eagle.train import start_from_target_layer

    if not data.target_layer:
        raise FeatureStoreError(
            f"{data.root}: train.head_init 'target-layer' needs the target's layer beside the features, and this "
            "extract has none (made before the extract stage saved it): re-run extract (it resumes, keeping its "
            "shards) or set train.head_init 'random'"
        )
    if not start_from_target_layer(head, data.target_layer, data.final_norm):
        raise FeatureStoreError(
            f"{data.root}: train.head_init 'target-layer': none of the target layer's tensors "
            f"({sorted(data.target_layer)}) fits the head; set train.head_init 'random'"
        )


def warm_start_head(head_dir: str, target_config, embed_VH, aux_layer_ids):
    """The exported head in `head_dir` as the starting point for this target: its weights and draft vocabulary,
    this target's (frozen) embedding. Refuses a head whose shapes do not fit the target, or that fuses other
    layers than `aux_layer_ids` (those of the features), naming both."""
    from eagle.export import HeadMismatchError, check_head_fits, load_head

    draft = load_head(head_dir)
    check_head_fits(draft.cfg, target_config, where=f"warm-start head {head_dir}")
    if list(draft.cfg.aux_layer_ids) != list(aux_layer_ids):
        raise HeadMismatchError(
            f"warm-start head {head_dir} fuses layers {list(draft.cfg.aux_layer_ids)}, but the "
            f"features are of layers {list(aux_layer_ids)}: extract with aux_layer_ids "
            f"{list(draft.cfg.aux_layer_ids)} or train without the warm start"
        )
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
