"""FP8 (e4m3) storage of hidden states: one float8_e4m3fn value per element, one float32 scale per row.

Purpose: `quantize_rows(x_NC) -> (q_NC, scale_N)` maps each row onto the whole e4m3 range: scale = amax(|row|) / 448
(448 is e4m3fn's largest finite value), q = x / scale rounded to e4m3, clamped to +-448 (so no cast can overflow to
NaN); a row of zeros gets scale 0 and dequantises to zeros. `dequantize_rows(q_NC, scale_N, dtype)` is q * scale.
`round_rows(x)` is the round trip, what a stored-and-read feature equals: online training uses it so that it sees
the tensors offline training reads. `check_scale` says what is wrong with a stored scale tensor (None when right).
Precision: e4m3 keeps 3 mantissa bits, so for |q| >= 2^-6 (normal numbers) rounding moves a value by at most half an
ulp, 2^-4 of itself; below that, subnormals are spaced 2^-9 apart, so by at most 2^-10 (in units of the scale). After
dequantisation every element x of a row with scale s obeys |x_hat - x| <= max(2^-4 |x|, 2^-10 s) (plus float32
rounding), hence |x_hat - x| <= 2^-4 amax(|row|) always (`max_abs_error`).
Not here: file layout and manifests (components/extract/stage.py writes them, components/train/data.py reads them).

Shape legend: N rows (token positions), C columns (the hidden width: 3H for fused features, H for the last state).
"""

from __future__ import annotations

import torch

DTYPE_NAME = "float8_e4m3fn"
DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite e4m3fn value
SCALE_DTYPE = torch.float32
REL_STEP = 2.0**-4  # half an ulp of a normal e4m3 number, relative to it
SUBNORMAL_STEP = 2.0**-10  # half the subnormal spacing, in units of the row scale


def quantize_rows(x_NC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_NC float8_e4m3fn, scale_N float32) with x ~= q * scale[:, None]; zero rows get scale 0."""
    x = x_NC.float()
    scale_N = x.abs().amax(dim=-1) / E4M3_MAX
    safe_N1 = torch.where(scale_N > 0, scale_N, torch.ones_like(scale_N))[:, None]
    q_NC = (x / safe_N1).clamp(-E4M3_MAX, E4M3_MAX).to(DTYPE)
    return q_NC, scale_N.to(SCALE_DTYPE)


def dequantize_rows(q_NC: torch.Tensor, scale_N: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale per row, in `dtype` (computed in float32)."""
    return (q_NC.float() * scale_N.float()[:, None]).to(dtype)


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` (any leading shape, rows along the last dim) as it reads back after fp8 storage, in float32."""
    q, s = quantize_rows(x.reshape(-1, x.shape[-1]))
    return dequantize_rows(q, s).view(x.shape)


def max_abs_error(x_NC: torch.Tensor, scale_N: torch.Tensor) -> torch.Tensor:
    """The per-element bound of the round trip's error: max(2^-4 |x|, 2^-10 scale), plus 2^-20 |x| for the float32
    division and product around the rounding."""
    x = x_NC.float().abs()
    bound = torch.maximum(REL_STEP * x, SUBNORMAL_STEP * scale_N.float()[:, None])
    return bound + 2.0**-20 * x + torch.finfo(torch.float32).tiny


def check_scale(shape: tuple[int, ...] | list[int] | None, dtype: str | None, n_rows: int) -> str | None:
    """What is wrong with a stored scale tensor of `shape` and safetensors `dtype` for `n_rows` rows, or None."""
    if shape is None:
        return "is missing"
    if list(shape) != [n_rows]:
        return f"has shape {list(shape)}, expected [{n_rows}] (one scale per row)"
    if dtype != "F32":
        return f"has dtype {dtype}, expected F32"
    return None
