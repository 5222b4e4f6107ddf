"""The train stage's state on disk: checkpoints, the best held-out weights so far, the per-step history.

Purpose: `save_checkpoint` / `load_checkpoint` (`out_dir/checkpoints/step-XXXXXXX/`: head, optimiser, scheduler,
step, RNG, fused layer ids, the held-out `Selection` as of that step and its best weights, written as a temp
directory renamed into place; the newest `keep` are kept); `write_best` / `read_best` / `sync_best`
(`out_dir/best/`: `best.json` naming a `head-XXXXXXX.safetensors` beside it, replaced last, so a reader or a kill
sees one whole best; a resumed run makes it its checkpoint's best again); `trim_history` drops the history rows
logged past a checkpoint. Every function here runs on rank 0 (or the driver).
Run: through `components.train.stage.train`.
Not here: the training loop and which weights to export (components/train/loop.py), the rule (eagle/train.py
`Selection`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from components.data.atomic import atomic_path, atomic_write_text, remove_stale_temps

if TYPE_CHECKING:
    from eagle.train import BestSoFar

HISTORY = "history.jsonl"
BEST = "best"  # out_dir/BEST: the best held-out weights so far
BEST_WEIGHTS = "best.safetensors"  # in a checkpoint: the best weights as of its step


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    done = sorted(p for p in (Path(out_dir) / "checkpoints").glob("step-*") if (p / "DONE").is_file())
    return done[-1] if done else None


def save_checkpoint(out_dir: Path, step: int, draft, opt, sched, keep: int, best: BestSoFar) -> Path:
    """Head weights, optimiser, scheduler, step, RNG, the head's layer ids and the held-out selection so far (the
    best weights beside it), written atomically."""
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
        if best.weights is not None:
            save_file(best.weights, str(tmp / BEST_WEIGHTS))
        torch.save(
            {
                "opt": opt.state_dict(),
                "sched": sched.state_dict(),
                "step": step,
                "rng": torch.get_rng_state(),
                "aux_layer_ids": list(draft.cfg.aux_layer_ids),
                "selection": asdict(best.selection),
            },
            tmp / "state.pt",
        )
        (tmp / "DONE").write_text(str(step))
    except BaseException as err:  # a full disk: leave no half checkpoint, say where
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise OSError(
                err.errno,
                f"cannot write checkpoint {final}: {err.strerror or err}; the previous "
                "checkpoint is intact: free space and re-run (training resumes)",
            ) from err
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(p for p in root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, draft, opt, sched) -> tuple[int, BestSoFar]:
    """Restore a checkpoint into `draft`, `opt`, `sched` and the RNG; refuse one made for other layer ids. Returns
    its step and the held-out selection as of that step."""
    import torch
    from safetensors.torch import load_file

    from eagle.train import BestSoFar, Selection

    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    check_checkpoint(path, state, draft.cfg.aux_layer_ids, draft.cfg.target_num_layers)
    draft.load_state_dict(load_file(str(path / "head.safetensors")), strict=False)
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    torch.set_rng_state(state["rng"])
    best = BestSoFar(Selection(**state.get("selection", {})))
    if (path / BEST_WEIGHTS).is_file():
        best.weights = load_file(str(path / BEST_WEIGHTS))
    return int(state["step"]), best


def write_best(out_dir: Path, best: BestSoFar) -> None:
    """`out_dir/best/`: the best weights and `best.json` (their step, held-out tau and loss, and file name). The
    weights file is named by its step and `best.json` replaced last: a reader, or a kill, sees one whole best."""
    from safetensors.torch import save_file

    root, sel = out_dir / BEST, best.selection
    if best.weights is None:
        shutil.rmtree(root, ignore_errors=True)
        return
    name = f"head-{sel.best_step:07d}.safetensors"
    with atomic_path(root / name) as tmp:
        save_file(best.weights, str(tmp))
    atomic_write_text(
        root / "best.json",
        json.dumps({"step": sel.best_step, "heldout_tau": sel.best_tau, "heldout_loss": sel.best_loss, "weights": name})
        + "\n",
    )
    for old in root.glob("head-*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)


def read_best(out_dir: str | Path) -> tuple[dict, Path] | None:
    """(`best.json`, the weights file) of a training output directory, or None before its first evaluation."""
    path = Path(out_dir) / BEST / "best.json"
    if not path.is_file():
        return None
    info = json.loads(path.read_text())
    return info, path.parent / info["weights"]


def sync_best(out_dir: Path, best: BestSoFar) -> None:
    """Make `out_dir/best/` the best as of the checkpoint a run starts from (`best`; none for a fresh start): one
    recorded past that checkpoint is dropped, and the same evaluations will find it again."""
    remove_stale_temps(out_dir / BEST)
    write_best(out_dir, best)


def check_checkpoint(path: Path, state: dict, layer_ids, num_layers: int) -> None:
    """Refuse a checkpoint (its `state.pt` dict) trained on other fused layers than `layer_ids`."""
    n = num_layers
    theirs = list(state.get("aux_layer_ids") or (2, n // 2, n - 3))  # a checkpoint without ids used (2, N//2, N-3)
    if theirs != list(layer_ids):
        raise ValueError(
            f"checkpoint {path} was trained on features of layers {theirs}, but the features are of "
            f"layers {list(layer_ids)}: delete {path.parent} to train afresh, or extract with "
            f"aux_layer_ids {theirs}"
        )


def history_rows(path: Path) -> list[dict]:
    """The rows of a history file; a last line torn by a killed writer is dropped."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def trim_history(path: Path, step: int) -> None:
    """Drop the rows logged after checkpoint `step` (and torn lines): the resumed run logs those steps again."""
    if path.is_file():
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in history_rows(path) if r["step"] <= step))
