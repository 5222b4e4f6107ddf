"""Readers of the extract stage's output, turning it into TTT batches for training, offline or online.

Purpose: `TrainingData.open(extract_dir)` reads the tokens, trained-token counts and target embedding/lm_head;
`heldout_split(...)` sets a seeded slice of the sequences aside for held-out evaluation;
`batches(...)` yields padded index batches in a seeded order from a given position (so a resumed run continues
exactly); `ttt_batch(...)` builds the `TTTBatch` either from stored feature shards (offline) or by running the
target (online). Both paths round the features to the same dtype, so training sees the same tensors.
Features stored as fp8 (`dtype` float8_e4m3fn, the manifest's `scales` naming one float32 scale tensor per feature
tensor, one scale per row) are dequantised on read (`eagle.fp8`) to float32; online training quantises and
dequantises the target's features the same way. Manifests from before fp8 (no `scales` key) read as before.
Feature shards are checked against the manifest's sha256 when opened, and fp8 shards' headers for their scales: a
corrupted or truncated shard, or one whose scales are missing or of the wrong shape, is refused with the file name
and what to do.
Not here: the training loop (components/train/loop.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from components.data.atomic import file_sha256
from eagle import fp8
from eagle.errors import BadInput
from eagle.features import Teacher, teacher_targets
from eagle.ttt import TTTBatch


class FeatureStoreError(BadInput):
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
    # the target's decoder layer the highest fused state enters ({part: tensor}, eagle/train.py TARGET_LAYER_PARTS)
    # and its final norm, saved by the extract stage (empty / None in an extract made before it saved them)
    target_layer: dict = field(default_factory=dict)
    final_norm: torch.Tensor | None = None

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
            raise FeatureStoreError(
                f"{mpath}: not a readable extract manifest ({type(e).__name__}: {e}); delete it and re-run extract"
            ) from None
        _check_scale_layout(manifest, mpath)
        try:
            tok = load_file(str(root / "tokens.safetensors"))
            heads = load_file(str(root / "target_heads.safetensors"))
        except Exception as e:  # safetensors raises several types for truncated files
            raise FeatureStoreError(f"{root}: unreadable tokens/target_heads file ({e}); re-run extract") from None
        data = cls(
            root,
            manifest,
            tok["input_ids"],
            tok["loss_mask"],
            tok["offsets"],
            tok["token_counts"],
            heads["embed_tokens"],
            heads.get("lm_head", heads["embed_tokens"]),  # tied: stored once
        )
        data.take_target_layer(heads)
        if manifest["mode"] == "offline":
            data._shards = data._open_shards(verify)
        return data

    def take_target_layer(self, saved: dict) -> None:
        """The target layer and final norm from tensors named as the extract stage saves them (`layer.<part>`,
        `norm`: components/extract/stage.py `target_layer_tensors`); other names are ignored."""
        self.target_layer = {k.removeprefix("layer."): v for k, v in saved.items() if k.startswith("layer.")}
        self.final_norm = saved.get("norm")

    def target_config(self, trust_remote_code: bool = False):
        """The target's HF config, saved beside the features by the extract stage."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.root / "target_config", trust_remote_code=trust_remote_code)

    @property
    def scales(self) -> dict[str, str]:
        """Feature tensor -> its per-row scale tensor (empty: the features are stored unscaled)."""
        return dict((self.manifest.get("scales") or {}).get("tensors", {}))

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
                raise FeatureStoreError(
                    f"{path}: sha256 does not match the manifest (corrupted or truncated); delete it and re-run extract"
                )
            if self.scales:
                _check_fp8_shard(path, self.scales, s["n_tokens"])
            shards.append((start, start + s["n_seqs"], path))
            start += s["n_seqs"]
        if start != self.n_seqs:
            raise FeatureStoreError(
                f"{self.root}: shards hold {start} sequences, tokens hold {self.n_seqs}; re-run extract"
            )
        return shards

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b].long(), self.loss_mask[a:b].long()

    def features(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [T, 3H], last [T, H]) of sequence i from its shard: in the stored dtype, or dequantised to float32
        when stored as fp8."""
        scales = self.scales
        for start, end, path in self._shards or []:
            if start <= i < end:
                with safe_open(str(path), "pt") as f:
                    offs = f.get_slice("offsets")
                    a, b = int(offs[i - start]), int(offs[i - start + 1])

                    def read(name: str) -> torch.Tensor:
                        x = f.get_slice(name)[a:b]
                        return fp8.dequantize_rows(x, f.get_slice(scales[name])[a:b]) if name in scales else x

                    return read("aux_hidden_states"), read("last_hidden_state")
        raise FeatureStoreError(f"sequence {i} is in no feature shard (online extract?)")


def _check_scale_layout(manifest: dict, mpath: Path) -> None:
    """An fp8 manifest must say how its features are scaled (one float32 scale per row, a tensor per feature)."""
    scales, want = manifest.get("scales"), {"aux_hidden_states", "last_hidden_state"}
    if manifest["dtype"] != fp8.DTYPE_NAME:
        if scales:
            raise FeatureStoreError(f"{mpath}: scales {scales} given for {manifest['dtype']} features; re-run extract")
        return
    ok = (
        isinstance(scales, dict)
        and scales.get("layout") == "per_row"
        and scales.get("dtype") == "float32"
        and isinstance(scales.get("tensors"), dict)
        and set(scales["tensors"]) == want
    )
    if not ok:
        raise FeatureStoreError(
            f"{mpath}: {fp8.DTYPE_NAME} features need `scales` with layout per_row, dtype float32 "
            f"and a scale tensor for each of {sorted(want)}, got {scales!r}; re-run extract"
        )


def _check_fp8_shard(path: Path, scales: dict[str, str], n_tokens: int) -> None:
    """Each fp8 feature tensor of the shard and its per-row scales are there, of the right dtype and shape."""
    try:
        with safe_open(str(path), "pt") as f:
            names = set(f.keys())
            header = {n: (f.get_slice(n).get_shape(), f.get_slice(n).get_dtype()) for n in names}
    except Exception as e:  # safetensors raises several types for truncated files
        raise FeatureStoreError(f"{path}: unreadable feature shard ({e}); delete it and re-run extract") from None
    for name, scale in scales.items():
        shape, dtype = header.get(name, (None, None))
        if dtype != "F8_E4M3" or not shape or shape[0] != n_tokens:
            raise FeatureStoreError(
                f"{path}: {name} is {dtype} {shape}, expected F8_E4M3 [{n_tokens}, ...] as the "
                "manifest says; delete the shard and re-run extract"
            )
        problem = fp8.check_scale(*header.get(scale, (None, None)), n_tokens)
        if problem:
            raise FeatureStoreError(
                f"{path}: the per-row scales of {name} ({scale}) {problem}; the shard cannot be "
                "dequantised: delete it and re-run extract"
            )


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


BUCKET_STEPS = 16  # steps whose sequences are sorted by length together when `lengths` are given


def batches(
    n_seqs: int,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    rank: int = 0,
    world: int = 1,
    lengths: list[int] | None = None,
) -> Iterator[tuple[int, list[int]]]:
    """Endless (step, sequence indices) for this rank, in a seeded order, starting at `start_step`.

    With `lengths` (each sequence's token count), every run of `BUCKET_STEPS` steps of an epoch's order is sorted by
    length, cut into its steps, and those steps are shuffled again: sequences of like length train together, so a
    right-padded batch is mostly tokens, not padding (the real model's chats of 60-320 tokens padded to the longest of
    8 were 44% padding). Every sequence still trains once an epoch; the order is still a function of the seed, the
    epoch and the step alone, so a resumed run continues exactly."""
    per_step = batch_size * world
    steps_per_epoch = max(1, n_seqs // per_step)
    step = start_step
    while True:
        epoch, k = divmod(step, steps_per_epoch)
        order = epoch_order(n_seqs, epoch, seed)
        if n_seqs < per_step:
            order = (order * (per_step // max(n_seqs, 1) + 1))[:per_step]
        if lengths is not None:
            order = _bucketed(order, lengths, per_step, steps_per_epoch, seed * 100003 + epoch)
        chunk = order[k * per_step : (k + 1) * per_step]
        yield step, chunk[rank::world]
        step += 1


def _bucketed(order: list[int], lengths: list[int], per_step: int, steps: int, seed: int) -> list[int]:
    """`order`'s first `steps` steps, each window of `BUCKET_STEPS` of them sorted by length (ties by position) and
    its steps put in a seeded order."""
    out: list[int] = []
    g = torch.Generator().manual_seed(seed)
    for w in range(0, steps, BUCKET_STEPS):
        n = min(BUCKET_STEPS, steps - w)
        window = sorted(order[w * per_step : (w + n) * per_step], key=lambda i: lengths[i])
        for j in torch.randperm(n, generator=g).tolist():
            out.extend(window[j * per_step : (j + 1) * per_step])
    return out


class TeacherCache:
    """The teacher signal of each sequence, computed once and kept (up to `max_bytes`) for the epochs after.

    The teacher is the target's full-vocabulary `lm_head` over each position's stored final hidden state: a
    quarter of a training step's arithmetic on a 49k-vocabulary target (bench/README.md), the same in every epoch.
    Kept in float32, as computed, so a cached batch is the batch recomputed; past `max_bytes`, the sequences that do
    not fit are recomputed each time. One cache per draft vocabulary (the signal is restricted to it)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes, self.hits, self.misses = max_bytes, 0, 0, 0
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._vocab: torch.Tensor | None = None

    def get(
        self, lm_head: torch.Tensor, idx: list[int], last: dict[int, torch.Tensor], draft_ids: torch.Tensor, device
    ) -> list[tuple]:
        """(probs [T, Vd], in_vocab [T], argmax [T]) of each sequence of `idx`, computed for those not kept from
        `last[i]`, its final hidden states as the batch read them."""
        if self._vocab is None or not torch.equal(self._vocab, draft_ids.cpu()):
            self._kept, self.bytes, self._vocab = {}, 0, draft_ids.cpu().clone()
        missing = [i for i in dict.fromkeys(idx) if i not in self._kept]
        self.hits += len(idx) - len(missing)
        self.misses += len(missing)
        fresh = {}
        if missing:
            t = teacher_targets(
                torch.cat([last[i] for i in missing]).to(device).float()[None], lm_head.to(device), draft_ids.to(device)
            )
            at = 0
            for i in missing:
                n = last[i].shape[0]
                fresh[i] = tuple(x[0, at : at + n].cpu() for x in (t.probs_BTVd, t.in_vocab_BT, t.argmax_BT))
                at += n
                size = sum(x.numel() * x.element_size() for x in fresh[i])
                if self.bytes + size <= self.max_bytes:
                    self._kept[i], self.bytes = fresh[i], self.bytes + size
        return [self._kept.get(i) or fresh[i] for i in idx]


def ttt_batch(
    data: TrainingData,
    idx: list[int],
    draft_ids: torch.Tensor,
    device: str | torch.device,
    target: torch.nn.Module | None = None,
    every_token: bool = False,
    teacher_cache: TeacherCache | None = None,
) -> TTTBatch:
    """Right-padded TTT batch of sequences `idx`: stored features (offline) or the target's (online). Its loss mask
    marks the assistant tokens, or with `every_token` every token of the sequences (prompts too: the teacher is the
    target's distribution wherever it reads, so the prompt's positions are training signal the features already
    hold). Offline, a `teacher_cache` computes each sequence's teacher once (over its tokens, not the padding)."""
    stored = data.manifest["dtype"]
    dtype = torch.float32 if stored == fp8.DTYPE_NAME else getattr(torch, stored)  # what `features` returns
    seqs = [data.sequence(i) for i in idx]
    width = max(len(s) for s, _ in seqs)
    ids = torch.zeros(len(idx), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (s, m) in enumerate(seqs):
        ids[r, : len(s)], mask[r, : len(s)] = s, (1 if every_token else m)
    if target is None:
        H = data.embed_tokens.shape[1]
        aux = torch.zeros(len(idx), width, 3 * H, dtype=dtype)
        last = torch.zeros(len(idx), width, H, dtype=dtype)
        for r, i in enumerate(idx):
            a, b = data.features(i)
            aux[r, : a.shape[0]], last[r, : b.shape[0]] = a, b
    else:
        from eagle.features import target_forward

        att = (torch.arange(width)[None] < torch.tensor([len(s) for s, _ in seqs])[:, None]).long()
        layer_ids = data.manifest["layer_ids"]
        with torch.no_grad():
            step = target_forward(target, ids.to(device), layer_ids, attention_mask=att.to(device))
        aux, last = _as_stored(step.aux_BT3H, stored), _as_stored(step.last_hidden_BTH, stored)
    if target is None and teacher_cache is not None:
        rows = {i: last[r, : len(seqs[r][0])] for r, i in enumerate(idx)}  # read once above, not again
        return TTTBatch(
            ids.to(device),
            aux.to(device).float(),
            mask.to(device),
            _padded_teacher(teacher_cache.get(data.lm_head, idx, rows, draft_ids, device), width, device),
        )
    aux, last = aux.to(device).float(), last.to(device).float()
    teacher = teacher_targets(last, data.lm_head.to(device), draft_ids.to(device))
    return TTTBatch(ids.to(device), aux, mask.to(device), teacher)


def _padded_teacher(rows: list[tuple], width: int, device) -> Teacher:
    """Per-sequence teacher rows right-padded to `width` (padding: zero probabilities, out of vocabulary; its loss
    mask is 0)."""
    probs = torch.zeros(len(rows), width, rows[0][0].shape[-1])
    in_vocab = torch.zeros(len(rows), width, dtype=torch.bool)
    argmax = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (p, v, a) in enumerate(rows):
        probs[r, : len(p)], in_vocab[r, : len(v)], argmax[r, : len(a)] = p, v, a
    return Teacher(probs.to(device), in_vocab.to(device), argmax.to(device))


def _as_stored(x: torch.Tensor, stored: str) -> torch.Tensor:
    """`x` as it would read back from a shard of dtype `stored` (fp8: quantised and dequantised per row)."""
    return fp8.round_rows(x) if stored == fp8.DTYPE_NAME else x.to(getattr(torch, stored))
