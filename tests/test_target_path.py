"""The target's path (decoder and kernels) is chosen by measurement, pinned on request, and never changes outputs."""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle import fastpath, target_path
from eagle.config_checks import FieldError
from eagle.drafters import PromptLookupDrafter
from eagle.runners import TargetRunner, time_paths
from eagle.speculative import SpecConfig, generate_plain, generate_speculative
from eagle.verify import generate_drafted
from tests.test_speculative import SHAPE, _prompts, _same, llama_pair  # noqa: F401  (the shared fixture)


def _llama(seed: int = 5) -> torch.nn.Module:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()


@pytest.fixture(autouse=True)
def _no_pin(monkeypatch):
    monkeypatch.delenv(target_path.ENV, raising=False)
    monkeypatch.delenv(target_path.STORE_ENV, raising=False)


def test_choose_keeps_the_default_unless_another_is_clearly_faster():
    assert target_path.choose({"lean-packed": 1.0, "hf-torch": 0.97}) == "lean-packed"
    assert target_path.choose({"lean-packed": 1.0, "hf-torch": 0.9, "lean-torch": 0.96}) == "hf-torch"
    assert target_path.choose({"lean-packed": 1.0, "hf-torch": 0.9, "lean-torch": 0.93}) == "lean-torch"  # close
    assert target_path.choose({"hf-packed": 2.0, "hf-torch": 1.0}, default="hf-packed") == "hf-torch"


def test_auto_measures_once_per_target_and_records_why():
    target = _llama()
    assert target_path.timing(target) is None
    runner = TargetRunner(target, 64)
    t = target_path.timing(target)
    assert t is not None and runner.path == t.chosen and set(t.seconds) == set(target_path.PATHS)
    assert all(s > 0 for s in t.seconds.values()) and t.reason
    d = t.as_dict()
    assert d["chosen"] == t.chosen and d["x_default"]["lean-packed"] == 1.0
    TargetRunner(target, 64)
    assert target_path.timing(target) is t  # cached: no second measurement


def test_each_role_gets_its_own_fastest_path(monkeypatch):
    """Plain decoding (1-token passes) and the speculative step (wider passes) each run on the path measured
    fastest for their own pass width, so a process's plain baseline never rides on the verify pass's timing."""
    timed = {
        "decode": {"lean-packed": 1.0, "lean-torch": 0.8, "hf-packed": 1.2, "hf-torch": 1.1},
        "verify": {"lean-packed": 1.0, "lean-torch": 1.3, "hf-packed": 1.2, "hf-torch": 1.1},
    }
    monkeypatch.setattr("eagle.runners.time_paths", lambda target, paths: timed)
    target = _llama(6)
    assert TargetRunner(target, 64, role="decode").path == "lean-torch"
    assert TargetRunner(target, 64).path == "lean-packed"  # "verify" by default
    d = target_path.record(target)
    assert d["decode"]["chosen"] == "lean-torch" and d["verify"]["chosen"] == d["chosen"] == "lean-packed"
    with pytest.raises(ValueError, match="role"):
        TargetRunner(target, 64, role="prefill")
    cfg = SpecConfig(max_new_tokens=4)
    x = torch.tensor([[3, 4, 5]])
    used = []
    real_init = TargetRunner.__init__

    def spy(self, *a, **k):
        real_init(self, *a, **k)
        used.append(self.path)

    monkeypatch.setattr(TargetRunner, "__init__", spy)
    generate_plain(target, x, None, cfg)
    assert used == ["lean-torch"]


def test_auto_picks_hf_when_the_lean_decoder_is_slow(monkeypatch):
    slow = fastpath.LeanDecoder.__call__

    def sleepy(self, *a, **kw):
        time.sleep(0.025)  # well above an HF pass of the tiny target, even on busy cores
        return slow(self, *a, **kw)

    monkeypatch.setattr(fastpath.LeanDecoder, "__call__", sleepy)
    target = _llama()
    runner = TargetRunner(target, 64)
    assert runner.path.startswith("hf-") and runner.decoder == "hf", target_path.timing(target)


def test_auto_picks_torch_kernels_when_packed_ones_are_slow(monkeypatch):
    fast = fastpath.linear

    def sleepy(x, layer):
        time.sleep(0.0005)
        return fast(x, layer)

    monkeypatch.setattr(fastpath, "linear", sleepy)
    target = _llama()
    runner = TargetRunner(target, 64)
    assert runner.path.endswith("-torch") and not runner.packed, target_path.timing(target)


def test_targets_without_a_lean_decoder_time_only_hf_paths():
    torch.manual_seed(0)
    eager = LlamaForCausalLM(LlamaConfig(**SHAPE, attn_implementation="eager")).eval()  # the lean decoder runs sdpa
    t = target_path.measure(eager, time_paths)
    assert set(t.seconds) == {"hf-packed", "hf-torch"} and "no lean decoder" in t.reason
    assert TargetRunner(eager, 64).decoder == "hf"


@pytest.mark.parametrize("path", target_path.PATHS)
def test_every_path_decodes_the_same_tokens(llama_pair, path):  # noqa: F811
    target, draft = llama_pair
    ids, mask = _prompts(3)
    ref = generate_plain(target, ids, mask, SpecConfig(max_new_tokens=16, path="lean-packed"))
    plain = generate_plain(target, ids, mask, SpecConfig(max_new_tokens=16, path=path))
    _same(plain, ref)
    for method in ("chain", "tree"):
        spec = generate_speculative(target, draft, ids, mask, SpecConfig(method=method, max_new_tokens=16, path=path))
        _same(spec, ref)
    _same(generate_drafted(target, PromptLookupDrafter(), ids, mask, SpecConfig(max_new_tokens=16, path=path)), ref)


def test_pinned_paths_skip_the_measurement(monkeypatch):
    target = _llama()
    assert TargetRunner(target, 64, path="hf-torch").decoder == "hf"
    monkeypatch.setenv(target_path.ENV, "lean-torch")
    runner = TargetRunner(target, 64)
    assert (runner.path, runner.decoder, runner.packed) == ("lean-torch", "lean", False)
    assert target_path.timing(target) is None
    assert TargetRunner(target, 64, path="hf-packed").path == "hf-packed"  # a call's own pin wins over the env


def test_bad_paths_are_refused_clearly(monkeypatch):
    with pytest.raises(FieldError, match="path"):
        SpecConfig(path="fast")
    with pytest.raises(ValueError, match="unknown target path 'fast'"):
        TargetRunner(_llama(), 64, path="fast")
    monkeypatch.setenv(target_path.ENV, "quick")
    with pytest.raises(ValueError, match=f"{target_path.ENV}='quick'"):
        TargetRunner(_llama(), 64)


def test_kept_timings_give_every_later_process_the_same_pick(monkeypatch, tmp_path):
    """With a store, each measurement is merged into the machine's kept minima and the pick comes from them: a
    second process whose own timing (taken under load) would pick another path takes the first one's, and a target
    of another shape, or another thread count, keeps its own entry. An unreadable store is started afresh."""
    store = tmp_path / "target_paths.json"
    monkeypatch.setenv(target_path.STORE_ENV, str(store))
    quiet = {
        "decode": {"lean-packed": 1.0, "lean-torch": 0.8, "hf-packed": 1.2, "hf-torch": 1.1},
        "verify": {"lean-packed": 1.0, "lean-torch": 1.3, "hf-packed": 1.2, "hf-torch": 1.1},
    }
    loaded = {
        "decode": {"lean-packed": 0.9, "lean-torch": 1.2, "hf-packed": 1.5, "hf-torch": 1.4},
        "verify": {"lean-packed": 1.4, "lean-torch": 1.3, "hf-packed": 1.6, "hf-torch": 1.5},
    }
    first = target_path.measure(_llama(7), lambda target, paths: quiet)
    assert first.pick("decode") == "lean-torch" and first.kept == 1
    assert target_path.choose(loaded["decode"]) == "lean-packed"  # alone, the loaded process would flip
    second = target_path.measure(_llama(7), lambda target, paths: loaded)  # a new module: what a fresh process sees
    assert second.pick("decode") == "lean-torch" and second.pick("verify") == "lean-packed"
    assert second.kept == 2 and second.by_role["decode"].measured == loaded["decode"]
    assert second.by_role["decode"].seconds == {
        "lean-packed": 0.9,
        "lean-torch": 0.8,
        "hf-packed": 1.2,
        "hf-torch": 1.1,
    }
    d = second.as_dict()
    assert d["decode"]["measurements_kept"] == 2 and d["decode"]["ms_this_process"]["lean-torch"] == 1200.0
    assert "kept over 2 measurements" in second.by_role["decode"].reason
    data = json.loads(store.read_text())
    assert len(data["entries"]) == 1
    other = _llama(7)
    other.config.hidden_size = 48  # another shape: its own entry, not the kept one
    assert target_path.measure(other, lambda target, paths: quiet).kept == 1
    assert len(json.loads(store.read_text())["entries"]) == 2
    store.write_text("{not json")
    assert target_path.measure(_llama(7), lambda target, paths: quiet).kept == 1  # started afresh
    assert json.loads(store.read_text())["entries"]


def test_without_a_store_nothing_is_written(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    t = target_path.measure(_llama(8), time_paths)
    assert t.kept == 0 and t.seconds == t.by_role["verify"].measured and not list(tmp_path.iterdir())
