"""The target's path (decoder and kernels) is chosen by measurement, pinned on request, and never changes outputs."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle import fastpath, target_path
from eagle.config_checks import FieldError
from eagle.drafters import PromptLookupDrafter, generate_drafted
from eagle.speculative import SpecConfig, TargetRunner, generate_plain, generate_speculative
from tests.test_speculative import SHAPE, _prompts, _same, llama_pair  # noqa: F401  (the shared fixture)


def _llama(seed: int = 5) -> torch.nn.Module:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()


@pytest.fixture(autouse=True)
def _no_pin(monkeypatch):
    monkeypatch.delenv(target_path.ENV, raising=False)


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
    timed = {"decode": {"lean-packed": 1.0, "lean-torch": 0.8, "hf-packed": 1.2, "hf-torch": 1.1},
             "verify": {"lean-packed": 1.0, "lean-torch": 1.3, "hf-packed": 1.2, "hf-torch": 1.1}}
    monkeypatch.setattr(target_path, "_time_paths", lambda target, paths: timed)
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
        time.sleep(0.004)
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
    t = target_path.measure(eager)
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
        spec = generate_speculative(target, draft, ids, mask, SpecConfig(method=method, max_new_tokens=16,
                                                                         path=path))
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
