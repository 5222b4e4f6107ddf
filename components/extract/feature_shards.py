"""The feature shard file: the one format extraction writes, whoever computed the hidden states.

Purpose: `pack_shard(seqs, features, dtype)` -> the safetensors bytes of one shard: input_ids int32, loss_mask uint8,
offsets int64 and the `FEATURES` hidden states in `dtype`, or as e4m3 with one float32 scale per row (`FP8`:
`FP8_SCALES`, what the manifest's `scales` says, `scale_layout(dtype)`). Its callers: components/extract/stage.py (this
process and its Ray workers) and components/extract/engine.py (vLLM's hidden states); both import it from here, so
neither imports the other's module for it.
Run: through `components.extract.stage.extract`; tests/test_extract_train.py, tests/test_fp8_features.py.
Not here: the manifest, the resume rule (components/extract/stage.py) or reading shards (components/train/data.py).
This module imports torch and safetensors only when a shard is packed.
"""

from __future__ import annotations

import copy

FEATURES = ("aux_hidden_states", "last_hidden_state")  # the hidden-state tensors of a shard
FP8 = "float8_e4m3fn"  # eagle.fp8.DTYPE_NAME (eagle.fp8 imports torch: not at import time here)
FP8_SCALES = {
    "layout": "per_row",
    "dtype": "float32",
    "rule": "amax(|row|) / 448",
    "tensors": {name: f"{name}_scale" for name in FEATURES},
}  # the manifest's `scales` of fp8 features


def scale_layout(dtype: str) -> dict | None:
    """The manifest's `scales` entry for features stored in `dtype` (None: stored as they are, no scales)."""
    return copy.deepcopy(FP8_SCALES) if dtype == FP8 else None


def pack_shard(seqs, features, dtype: str) -> bytes:
    """The shard file of `seqs` ((input_ids, loss_mask) each) given `features`, an iterable of (aux_hidden_states
    [T, 3H], last_hidden_state [T, H]) per sequence in the same order, stored in `dtype`: the one shard format,
    whoever computed the features (this process, a Ray actor, the engine)."""
    import torch
    from safetensors.torch import save

    parts = [
        {**_stored(FEATURES[0], aux_TC, dtype), **_stored(FEATURES[1], last_TH, dtype)} for aux_TC, last_TH in features
    ]
    tensors = {
        "input_ids": torch.tensor([i for s, _ in seqs for i in s], dtype=torch.int32),
        "loss_mask": torch.tensor([m for _, ms in seqs for m in ms], dtype=torch.uint8),
        "offsets": torch.tensor([0] + [len(s) for s, _ in seqs]).cumsum(0),
        **{k: torch.cat([p[k] for p in parts]) for k in parts[0]},
    }
    del parts
    return save(tensors)


def _stored(name: str, x_TC, dtype: str) -> dict:
    """The shard tensors holding hidden states `x_TC` as `name`: in `dtype`, or e4m3 plus `name`_scale (per row)."""
    import torch

    from eagle import fp8

    if dtype != FP8:
        return {name: x_TC.to(getattr(torch, dtype)).cpu()}
    q_TC, scale_T = fp8.quantize_rows(x_TC)
    return {name: q_TC.cpu(), FP8_SCALES["tensors"][name]: scale_T.cpu()}
