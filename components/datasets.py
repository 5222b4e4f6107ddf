"""Readers of the extract stage's output, turning it into TTT batches for training, offline or online.

Purpose: `TrainingData.open(extract_dir)` reads the tokens, trained-token counts and target embedding/lm_head;
`heldout_split(...)` sets a seeded slice of the sequences aside for held-out evaluation;
`batches(...)` yields padded index batches in a seeded order from a given position (so a resumed run continues
exactly); `ttt_batch(...)` builds the `TTTBatch` either from stored feature shards (offline) or by running the
target (online). Both paths round the features to the same dtype, so training sees the same tensors.
Feature shards are checked against the manifest's sha256 when opened: a corrupted or truncated shard is refused
with the file name and what to do.
Not here: the training loop (components/train.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from components.atomic import file_sha256
from eagle.features import teacher_targets
from eagle.ttt import TTTBatch


class FeatureStoreError(ValueError):
    """Feature shards that are missing, corrupted or do not match their manifest."""


@dataclass
class TrainingData:
    root: Path
    manifest: dict
    input_ids: torch.Tensor  # int32 [N]
    loss_mask: torch.Tensor  # uint8 [N]
    offsets: torch.Tensor  # int64 [n_seqs + 1]
    token_counts: torch.Tensor  # [V]
    embed_tokens: torch.Tensor
    lm_head: torch.Tensor
    _shards: list | None = None

    @classmethod
    def open(cls, extract_dir: str | Path, verify: bool = True) -> "TrainingData":
        root = Path(extract_dir)
        mpath = root / "manifest.json"
        if not mpath.is_file():
            raise FeatureStoreError(f"{root}: no manifest.json; run the extract stage first")
        try:
            manifest = json.loads(mpath.read_text())
            manifest["mode"], manifest["shards"], manifest["dtype"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise FeatureStoreError(f"{mpath}: not a readable extract manifest ({type(e).__name__}: {e}); "
                                    "delete it and re-run extract") from None
        try:
            tok = load_file(str(root / "tokens.safetensors"))
            heads = load_file(str(root / "target_heads.safetensors"))
        except Exception as e:  # safetensors raises several types for truncated files
            raise FeatureStoreError(f"{root}: unreadable tokens/target_heads file ({e}); re-run extract") from None
        data = cls(root, manifest, tok["input_ids"], tok["loss_mask"], tok["offsets"], tok["token_counts"],
                   heads["embed_tokens"], heads["lm_head"])
        if manifest["mode"] == "offline":
            data._shards = data._open_shards(verify)
        return data

    def target_config(self, trust_remote_code: bool = False):
        """The target's HF config, saved beside the features by the extract stage."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.root / "target_config", trust_remote_code=trust_remote_code)

    @property
    def n_seqs(self) -> int:
        return self.offsets.numel() - 1

    def _open_shards(self, verify: bool) -> list:
        shards, start = [], 0
        for s in self.manifest["shards"]:
            path = self.root / s["file"]
            if not path.is_file():
                raise FeatureStoreError(f"{path}: feature shard missing; re-run extract (it resumes)")
            if verify and file_sha256(path) != s["sha256"]:
                raise FeatureStoreError(f"{path}: sha256 does not match the manifest (corrupted or truncated); "
                                        "delete it and re-run extract")
            shards.append((start, start + s["n_seqs"], path))
            start += s["n_seqs"]
        if start != self.n_seqs:
            raise FeatureStoreError(f"{self.root}: shards hold {start} sequences, tokens hold {self.n_seqs}; "
                                    "re-run extract")
        return shards

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b].long(), self.loss_mask[a:b].long()

    def features(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [T, 3H], last [T, H]) of sequence i from its shard."""
        for start, end, path in self._shards or []:
            if start <= i < end:
                with safe_open(str(path), "pt") as f:
                    offs = f.get_slice("offsets")
                    a, b = int(offs[i - start]), int(offs[i - start + 1])
                    return f.get_slice("aux_hidden_states")[a:b], f.get_slice("last_hidden_state")[a:b]
        raise FeatureStoreError(f"sequence {i} is in no feature shard (online extract?)")


def epoch_order(n: int, epoch: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def heldout_split(n_seqs: int, n_heldout: int, seed: int) -> tuple[list[int], list[int]]:
    """(training, held-out) sequence indices, each ascending: `n_heldout` of the `n_seqs` drawn with `seed`, from a
    random stream of its own (not the epochs' orders), so the same seed always holds out the same sequences."""
    if not 0 <= n_heldout < n_seqs:
        raise ValueError(f"cannot hold out {n_heldout} of {n_seqs} sequences and still train on one")
    g = torch.Generator().manual_seed(0x5EED_0000_0000 + seed)
    heldout = set(torch.randperm(n_seqs, generator=g)[:n_heldout].tolist())
    return [i for i in range(n_seqs) if i not in heldout], sorted(heldout)


def batches(n_seqs: int, batch_size: int, seed: int, start_step: int = 0, rank: int = 0,
            world: int = 1) -> Iterator[tuple[int, list[int]]]:
    """Endless (step, sequence indices) for this rank, in a seeded order, starting at `start_step`."""
    per_step = batch_size * world
    steps_per_epoch = max(1, n_seqs // per_step)
    step = start_step
    while True:
        epoch, k = divmod(step, steps_per_epoch)
        order = epoch_order(n_seqs, epoch, seed)
        if n_seqs < per_step:
            order = (order * (per_step // max(n_seqs, 1) + 1))[:per_step]
        chunk = order[k * per_step:(k + 1) * per_step]
        yield step, chunk[rank::world]
        step += 1


def ttt_batch(data: TrainingData, idx: list[int], draft_ids: torch.Tensor, device: str | torch.device,
              target: torch.nn.Module | None = None) -> TTTBatch:
    """Right-padded TTT batch of sequences `idx`: stored features (offline) or the target's (online)."""
    dtype = getattr(torch, data.manifest["dtype"])
    seqs = [data.sequence(i) for i in idx]
    width = max(len(s) for s, _ in seqs)
    ids = torch.zeros(len(idx), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (s, m) in enumerate(seqs):
        ids[r, :len(s)], mask[r, :len(s)] = s, m
    if target is None:
        H = data.embed_tokens.shape[1]
        aux = torch.zeros(len(idx), width, 3 * H, dtype=dtype)
        last = torch.zeros(len(idx), width, H, dtype=dtype)
        for r, i in enumerate(idx):
            a, b = data.features(i)
            aux[r, :a.shape[0]], last[r, :b.shape[0]] = a, b
    else:
        from eagle.features import target_forward

        att = (torch.arange(width)[None] < torch.tensor([len(s) for s, _ in seqs])[:, None]).long()
        layer_ids = data.manifest["layer_ids"]
        with torch.no_grad():
            step = target_forward(target, ids.to(device), layer_ids, attention_mask=att.to(device))
        aux, last = step.aux_BT3H.to(dtype), step.last_hidden_BTH.to(dtype)
    aux, last = aux.to(device).float(), last.to(device).float()
    teacher = teacher_targets(last, data.lm_head.to(device), draft_ids.to(device))
    return TTTBatch(ids.to(device), aux, mask.to(device), teacher)
