"""FP8 feature storage on the tiny embedded default: e4m3 hidden states with one float32 scale per row.

Purpose: an fp8 extraction writes both hidden-state tensors as float8_e4m3fn beside their per-row scales, the
manifest says the dtype and the scale layout, and its bytes per token are about half of bfloat16's; the reader
dequantises within the e4m3 bound (|x_hat - x| <= max(2^-4 |x|, 2^-10 scale), derived in eagle/fp8.py) and bit for
bit as `eagle.fp8` quantises the float32 features; online training rounds the target's features the same way; a
head trains from fp8 features end to end; a re-run keeps the fp8 shards (one deleted: only it is rewritten, the same
bytes); a shard whose scales are missing or of the wrong shape, or a manifest without the scale layout, is refused by
name; a manifest from before fp8 (no `scales` key) still reads.
Run: `python -m pytest tests/test_fp8_features.py` (about 30 s on 2 busy cores).
Not here: the effect on tau of a real-sized head (bench/feature_dtype.py), mocks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from components.data.atomic import file_sha256
from components.extract.feature_shards import FP8, FP8_SCALES
from components.extract.stage import ExtractConfig, extract
from components.regenerate.stage import RegenerateConfig, regenerate
from components.targets.target import load_target
from components.train.data import FeatureStoreError, TrainingData, ttt_batch
from components.train.stage import TrainConfig, train
from eagle import fp8

QUIET = dict(progress=lambda s: None)
SHARDING = dict(max_len=160, seqs_per_shard=4, batch_size=3)


@pytest.fixture(scope="module")
def regen_dir(tiny_embedded, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("fp8") / "regen"
    cfg = RegenerateConfig(max_new_tokens=16, temperature=1.0, batch_size=8, shard_size=8, limit=12, seed=0)
    assert regenerate(cfg, tiny_embedded.target_dir, str(tiny_embedded.target_traffic.train), str(out), **QUIET).ok >= 8
    return str(out)


@pytest.fixture(scope="module")
def extracted(tiny_embedded, regen_dir, tmp_path_factory) -> dict[str, Path]:
    """The same sequences extracted in float32, bfloat16 and fp8 (same batches, so the same float32 forward)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for dtype in ("float32", "bfloat16", FP8):
        out[dtype] = root / dtype
        extract(ExtractConfig(dtype=dtype, **SHARDING), tiny_embedded.target_dir, regen_dir, str(out[dtype]), **QUIET)
    return out


@pytest.fixture(scope="module")
def target(tiny_embedded):
    return load_target(tiny_embedded.target_dir)[0]


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_shard(d: Path, name: str, edit) -> Path:
    """Apply `edit` to the tensors of shard `name` and record its new sha256 (so only the content is wrong)."""
    path = d / name
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    m = _manifest(d)
    next(s for s in m["shards"] if s["file"] == name)["sha256"] = file_sha256(path)
    (d / "manifest.json").write_text(json.dumps(m))
    return path


# ---- the format -------------------------------------------------------------------------------------------------


def test_fp8_shards_hold_e4m3_and_per_row_scales_in_about_half_the_bytes(extracted, target):
    H = target.config.hidden_size
    m8, m16 = _manifest(extracted[FP8]), _manifest(extracted["bfloat16"])
    assert m8["dtype"] == "float8_e4m3fn" == fp8.DTYPE_NAME and m8["scales"] == FP8_SCALES
    assert m8["scales"]["tensors"] == {
        "aux_hidden_states": "aux_hidden_states_scale",
        "last_hidden_state": "last_hidden_state_scale",
    }
    assert m16["scales"] is None and [s["n_tokens"] for s in m8["shards"]] == [s["n_tokens"] for s in m16["shards"]]
    for s8, s16 in zip(m8["shards"], m16["shards"]):
        t, ref = load_file(str(extracted[FP8] / s8["file"])), load_file(str(extracted["bfloat16"] / s16["file"]))
        n = s8["n_tokens"]
        assert set(t) == set(ref) | {"aux_hidden_states_scale", "last_hidden_state_scale"}
        for name, width in (("aux_hidden_states", 3 * H), ("last_hidden_state", H)):
            assert t[name].dtype == torch.float8_e4m3fn and t[name].shape == (n, width)
            assert t[f"{name}_scale"].dtype == torch.float32 and t[f"{name}_scale"].shape == (n,)
            assert (t[f"{name}_scale"] > 0).all()
        for name in ("input_ids", "loss_mask", "offsets"):  # the rest of the shard is as it was
            assert torch.equal(t[name], ref[name])
    for m, d in ((m8, extracted[FP8]), (m16, extracted["bfloat16"])):
        assert m["bytes_per_token"] == sum((d / s["file"]).stat().st_size for s in m["shards"]) / m["n_tokens"]
    assert m16["bytes_per_token"] > 2 * 4 * H  # 3H + H bf16 values per token
    assert 4 * H + 8 < m8["bytes_per_token"] < 4 * H + 8 + 40  # 4H e4m3 values and two float32 scales per token
    assert 0.45 < m8["bytes_per_token"] / m16["bytes_per_token"] < 0.56, (m8["bytes_per_token"], m16["bytes_per_token"])


def test_dequantised_features_are_within_the_e4m3_bound(extracted):
    f8, f32, bf16 = (TrainingData.open(extracted[d]) for d in (FP8, "float32", "bfloat16"))
    worst = 0.0
    for i in range(f8.n_seqs):
        for got, want, ref16 in zip(f8.features(i), f32.features(i), bf16.features(i)):
            assert got.dtype == torch.float32 and got.shape == want.shape
            q, scale = fp8.quantize_rows(want)  # the stored tensors are exactly the float32 features quantised
            torch.testing.assert_close(got, fp8.dequantize_rows(q, scale), atol=0, rtol=0)
            bound = fp8.max_abs_error(want, scale)
            err = (got - want).abs()
            assert (err <= bound).all(), float((err / bound).max())
            worst = max(worst, float((err / bound).max()))
            # hence within 2^-4 of the row's amax, and within that plus bf16's own rounding of the bf16 features
            assert (err <= 2.0**-4 * want.abs().amax(-1, keepdim=True)).all()
            assert ((got - ref16.float()).abs() <= bound + 2.0**-8 * want.abs()).all()
            torch.testing.assert_close(got.abs().amax(-1), want.abs().amax(-1), atol=0, rtol=1e-6)  # amax kept
    assert worst > 0.5  # the bound is tight, not vacuous: some element is rounded by more than half of it


def test_quantize_rows_handles_zero_rows_and_saturates():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [3e-8, -1e-9, 0.0], [1e30, 1.0, -1e30]])
    q, s = fp8.quantize_rows(x)
    assert s.dtype == torch.float32 and s.shape == (4,) and s[0] == 0
    back = fp8.dequantize_rows(q, s)
    assert torch.isfinite(back).all() and torch.equal(back[0], torch.zeros(3))
    assert ((back - x).abs() <= fp8.max_abs_error(x, s)).all()
    assert torch.equal(back[1], x[1]) and back[3, 0] == 1e30 and back[3, 2] == -1e30
    y = torch.randn(2, 5, 12)
    assert torch.equal(fp8.round_rows(y), fp8.dequantize_rows(*fp8.quantize_rows(y.view(10, 12))).view(2, 5, 12))
    assert fp8.check_scale([7], "F32", 7) is None and "missing" in fp8.check_scale(None, None, 7)
    assert "shape [7, 1]" in fp8.check_scale([7, 1], "F32", 7) and "BF16" in fp8.check_scale([7], "BF16", 7)


def test_online_fp8_rounds_like_offline(extracted, tiny_embedded, regen_dir, target, tmp_path):
    online = tmp_path / "online"
    extract(
        ExtractConfig(mode="online", dtype=FP8, max_len=160), tiny_embedded.target_dir, regen_dir, str(online), **QUIET
    )
    assert _manifest(online)["scales"] == FP8_SCALES and not list(online.glob("features-*"))
    off, on = TrainingData.open(extracted[FP8]), TrainingData.open(online)
    idx, draft_ids = [0, 3, off.n_seqs - 1], torch.arange(64)  # other padding than the extraction's batches
    a = ttt_batch(off, idx, draft_ids, "cpu")
    b = ttt_batch(on, idx, draft_ids, "cpu", target=target)
    m = a.loss_mask_BS.bool()
    x, y = a.aux_BS3H[m], b.aux_BS3H[m]
    assert torch.equal(a.input_ids_BS, b.input_ids_BS) and m.sum() > 10
    # the same rounding; a forward that differs by float noise may land a value on the next e4m3 step
    assert ((x - y).abs() <= 1e-6).float().mean() > 0.999
    assert ((x - y).abs() <= 2 * fp8.max_abs_error(x, x.abs().amax(-1) / fp8.E4M3_MAX) + 1e-6).all()
    torch.testing.assert_close(a.teacher.probs_BTVd[m], b.teacher.probs_BTVd[m], atol=1e-3, rtol=0)


# ---- training and resuming ---------------------------------------------------------------------------------------


def test_a_head_trains_from_fp8_features(extracted, target, tmp_path):
    from eagle.export import load_head, verify_probe

    res = train(TrainConfig.tiny(), str(extracted[FP8]), str(tmp_path / "fp8"))
    assert res.final_metrics["step"] == TrainConfig.tiny().steps
    assert all(torch.isfinite(torch.tensor(v)) for v in res.final_metrics.values())
    draft = load_head(res.head_dir, target)
    assert verify_probe(draft, res.head_dir) < 1e-5 and 1.0 <= res.selected_heldout_tau <= 4.0
    ref = train(TrainConfig.tiny(), str(extracted["bfloat16"]), str(tmp_path / "bf16"))
    first = [json.loads(Path(r.history_file).read_text().splitlines()[0])["loss"] for r in (res, ref)]
    assert first[0] == pytest.approx(first[1], rel=0.05)  # same batches and init, nearly the same features


def _mtimes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(d.glob("features-*.safetensors"))}


def test_a_rerun_keeps_fp8_shards_and_rewrites_only_a_missing_one(extracted, tiny_embedded, regen_dir, tmp_path):
    out = _copy(extracted[FP8], tmp_path / "ext")
    before, shards = _mtimes(out), _manifest(out)["shards"]
    written: list[str] = []
    cfg = ExtractConfig(dtype=FP8, **SHARDING)
    extract(cfg, tiny_embedded.target_dir, regen_dir, str(out), progress=written.append)
    assert written == [] and _mtimes(out) == before and _manifest(out)["shards"] == shards
    (out / "features-00001.safetensors").unlink()
    extract(cfg, tiny_embedded.target_dir, regen_dir, str(out), progress=written.append)
    assert len(written) == 1 and "shard 2/" in written[0]
    assert _manifest(out)["shards"] == shards  # the same bytes again
    assert {k: v for k, v in _mtimes(out).items() if k != "features-00001.safetensors"} == {
        k: v for k, v in before.items() if k != "features-00001.safetensors"
    }
    extract(
        ExtractConfig(dtype="bfloat16", **SHARDING),
        tiny_embedded.target_dir,
        regen_dir,
        str(out),
        progress=written.append,
    )
    assert len(written) == 1 + len(before) and _manifest(out)["scales"] is None  # bf16 shards are not fp8 shards
    assert all("aux_hidden_states_scale" not in load_file(str(p)) for p in out.glob("features-*"))
    TrainingData.open(out)


# ---- refusals ----------------------------------------------------------------------------------------------------


def test_a_shard_with_missing_or_misshapen_scales_is_refused_by_name(extracted, tmp_path):
    out = _copy(extracted[FP8], tmp_path / "ext")
    name = "features-00001.safetensors"
    _rewrite_shard(out, name, lambda t: t.pop("aux_hidden_states_scale"))
    with pytest.raises(
        FeatureStoreError,
        match=rf"{name}: the per-row scales of aux_hidden_states "
        r"\(aux_hidden_states_scale\) is missing",
    ):
        TrainingData.open(out)
    with pytest.raises(FeatureStoreError, match=name):  # training fails fast, in the driver
        train(TrainConfig.tiny(), str(out), str(tmp_path / "train"))
    with pytest.raises(FeatureStoreError, match=name):  # also without hashing the shards
        TrainingData.open(out, verify=False)

    out = _copy(extracted[FP8], tmp_path / "ext2")
    _rewrite_shard(out, name, lambda t: t.update(last_hidden_state_scale=t["last_hidden_state_scale"][:-1]))
    with pytest.raises(FeatureStoreError, match=rf"{name}: the per-row scales of last_hidden_state .* has shape"):
        TrainingData.open(out)
    _rewrite_shard(out, name, lambda t: t.update(last_hidden_state_scale=t["last_hidden_state_scale"][:, None]))
    with pytest.raises(FeatureStoreError, match=rf"{name}: .* has shape \[\d+, 1\], expected \[\d+\]"):
        TrainingData.open(out)
    _rewrite_shard(
        out,
        name,
        lambda t: t.update(
            last_hidden_state=t["last_hidden_state"].float(), last_hidden_state_scale=t["last_hidden_state_scale"][:, 0]
        ),
    )
    with pytest.raises(FeatureStoreError, match=rf"{name}: last_hidden_state is F32 .* expected F8_E4M3"):
        TrainingData.open(out)


def test_an_fp8_manifest_without_its_scale_layout_is_refused(extracted, tmp_path):
    out = _copy(extracted[FP8], tmp_path / "ext")
    m = _manifest(out)
    for bad in (None, {**FP8_SCALES, "layout": "per_tensor"}, {**FP8_SCALES, "tensors": {}}):
        (out / "manifest.json").write_text(json.dumps({**m, "scales": bad}))
        with pytest.raises(FeatureStoreError, match=r"manifest.json: float8_e4m3fn features need `scales`"):
            TrainingData.open(out)


def test_a_manifest_from_before_fp8_still_reads(extracted, tmp_path):
    out = _copy(extracted["bfloat16"], tmp_path / "ext")
    m = _manifest(out)
    del m["scales"]  # as extract wrote it before fp8
    (out / "manifest.json").write_text(json.dumps(m))
    old, new = TrainingData.open(out), TrainingData.open(extracted["bfloat16"])
    assert old.scales == {} and all(torch.equal(a, b) for a, b in zip(old.features(2), new.features(2)))
    assert old.features(2)[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"ExtractConfig.dtype must be one of .*'float8_e4m3fn', got 'float8'"):
        ExtractConfig(dtype="float8")
