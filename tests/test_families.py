"""Families: tiny Mistral, Qwen2, Qwen3, Qwen3-MoE and tied Llama targets go through the whole pipeline.

Purpose: each family's target is built from its transformers config (hidden 64, 2 heads so head_dim 32 as vLLM's
CPU attention needs, 8 layers so the fused ids (2, 4, 5) are distinct, the tiny embedded default's tokenizer and
chat template, fp32 safetensors; Qwen3 and Llama with tied embeddings, as most small real chat models: no
`lm_head.weight` in their safetensors), its residual branches scaled down and its `lm_head` up (tied: branches up,
final norm up) so that a head trained for a few steps on the target's greedy answers gets mixed acceptance (some
drafts accepted, some not). Then
- local path (fast): regenerate a few conversations, extract, train a few TTT steps, export, and check that our
  greedy speculative decoding equals plain greedy (`evaluate(...).identical`) with some drafts accepted;
- engine path (`engine`, `slow`): the same head served by vLLM (its CPU build) next to vLLM's plain decoding:
  outputs identical to vLLM plain and to ours, vLLM's counters (drafts, accepted per position) equal to ours;
- engine features (`engine`, `slow`): on Qwen3 (its target, traffic and local extraction reused), features vLLM
  extracted (`ExtractConfig(engine="vllm")`) equal local extraction's within 1e-5 relative, and a head trained on
  them is served by vLLM the same way, beside the same plain engine as the local-features Qwen3 head.
Run: `python -m pytest tests/test_families.py -m "not engine"` (local path, about 30 s on 2 cores);
`python -m pytest tests/test_families.py` for all (twelve vLLM starts: each family's evaluation starts a plain and a
head server, Qwen3 a second head server, engine extraction one more). Needs vLLM's venv for the engine tests
(`make vllm`).
Not here: untied Llama (tests/test_vllm.py, tests/test_extract_engine.py), sampling, trees, registration.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from components.evaluate.stage import EvaluateConfig, HeadEval, evaluate
from components.extract.stage import ExtractConfig, extract
from components.regenerate.stage import RegenerateConfig, regenerate
from components.targets.runtime import StageContext
from components.train.stage import TrainConfig, train
from tests.helpers import our_counts

QUIET = dict(progress=lambda s: None)
FAMILIES = ("mistral", "qwen2", "qwen3", "qwen3_moe", "llama")
TIED = {"qwen3", "llama"}  # lm_head is the embedding (tie_word_embeddings), as in Qwen3-0.6B or SmolLM2
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
FAMILY_ARGS = {
    "mistral": dict(sliding_window=None),
    "qwen2": dict(use_sliding_window=False),
    "qwen3": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "llama": {},
}
# greedy answers: what the evaluation's (greedy) prompts will see, so few training steps give some acceptance
REGENERATE = RegenerateConfig(max_new_tokens=32, temperature=0.0, batch_size=8, shard_size=8, limit=16)
EVAL = dataclasses.replace(EvaluateConfig.tiny(), limit=4)
EXTRACT = ExtractConfig(max_len=192, dtype="float32", seqs_per_shard=8)
TRAIN = dataclasses.replace(TrainConfig.tiny(), steps=80, checkpoint_every=80)


def build_target(family: str, tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    """A random `family` target with the tokenizer of `tokenizer_dir`, saved to `out`: its attention output and MLP
    down projections scaled by 0.3 (the next token then depends mostly, not only, on the current one) and its
    `lm_head` by 30 (a peaked next-token distribution, as a trained model's: the head has a teacher to learn)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    shape = {**SHAPE, "tie_word_embeddings": family in TIED}
    config = AutoConfig.for_model(family, vocab_size=len(tok), **shape, **FAMILY_ARGS[family], **special)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        if family in TIED:  # lm_head is the embedding: scaling it scales the input too, and a random tied model
            for name, p in model.named_parameters():  # repeats its last token: strong branches move it on
                if "mlp" in name or "v_proj" in name or "o_proj" in name:
                    p.mul_(5.0)
            model.model.norm.weight.mul_(10.0)  # the peaked distribution, through the final norm
        else:
            for name, p in model.named_parameters():
                if name.endswith("o_proj.weight") or "down_proj" in name:  # MoE experts: one fused down_proj
                    p.mul_(0.3)
            model.lm_head.weight.mul_(30.0)
    model.generation_config = GenerationConfig(**special)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    from components.targets.target import weight_names

    assert ("lm_head.weight" in weight_names(out)) is (family not in TIED), family
    return out


def train_head(target_dir: Path, regen_dir: str, root: Path, extract_cfg: ExtractConfig = EXTRACT, **extract_kw) -> str:
    """Extract `regen_dir` with `extract_cfg` and train a head on it; returns the exported head's directory."""
    ext = root / f"extract-{extract_cfg.engine}"
    extract(extract_cfg, str(target_dir), regen_dir, str(ext), **QUIET, **extract_kw)
    return train(TRAIN, str(ext), str(root / f"train-{extract_cfg.engine}"), str(target_dir)).head_dir


def target_and_traffic(family: str, tiny_embedded, root: Path) -> tuple[Path, str]:
    """`family`'s target under `root` and (the directory of) its own answers to a few of the embedded default's
    training chats."""
    target = build_target(family, Path(tiny_embedded.target_dir), root / "target")
    regen = root / "regen"
    regenerate(REGENERATE, str(target), str(tiny_embedded.target_traffic.train), str(regen), **QUIET)
    return target, str(regen)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    target_dir: Path
    head_dir: str
    root: Path  # regen/, extract-local/ (and extract-vllm/ once the engine extracted), train-*/


@pytest.fixture(scope="module")
def built(tiny_embedded, tmp_path_factory):
    """`built(name)`: one family's target, its regenerated training traffic and a head trained on local features,
    made on first use and kept for the module (the engine-features test reuses Qwen3's)."""
    made: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in made:
            root = tmp_path_factory.mktemp(f"family-{name}")
            target, regen = target_and_traffic(name, tiny_embedded, root)
            made[name] = Family(name, target, train_head(target, regen, root), root)
        return made[name]

    return get


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, built) -> Family:
    return built(request.param)


def evaluate_locally(fam: Family, out: Path, traffic: str):
    """Our evaluation of the family's head on the held-out traffic: greedy speculative must equal plain."""
    res = evaluate(EVAL, HeadEval(str(fam.target_dir), fam.head_dir, traffic, str(out)), **QUIET)
    assert res.identical, f"{fam.name}: speculative output differs from plain"
    return res


def test_local_path_is_lossless_with_acceptance(family, tiny_embedded, tmp_path):
    cfg = json.loads((Path(family.head_dir) / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and cfg["head_dim"] == 32
    res = evaluate_locally(family, tmp_path, str(tiny_embedded.target_traffic.heldout))
    steps, per_pos = our_counts(res.report_file, EVAL.spec.depth)
    outputs = [s["output_ids"] for s in json.loads(Path(res.report_file).read_text())["samples"]]
    assert len({tuple(o) for o in outputs}) > 1, f"{family.name}: every prompt gave the same output"
    assert 0 < per_pos[0] < steps, f"{family.name}: acceptance {per_pos} of {steps} steps proves little"


def serve_and_compare(fams: list[Family], heldout: str, settings, out: Path) -> None:
    """Each head (all on one target) served by vLLM beside one vLLM plain: outputs identical to both, counters equal
    to ours."""
    from components.evaluate.engine import evaluate_in_vllm, our_outputs, plain_server

    ours = [evaluate_locally(fam, out / f"local-{i}", heldout) for i, fam in enumerate(fams)]
    with plain_server(EVAL, str(fams[0].target_dir), settings) as plain:
        for i, (fam, local) in enumerate(zip(fams, ours)):
            assert fam.target_dir == fams[0].target_dir
            res = evaluate_in_vllm(
                EVAL,
                HeadEval(str(fam.target_dir), fam.head_dir, heldout, str(out / f"vllm-{i}")),
                settings,
                ours=our_outputs(local.report_file),
                plain=plain,
                **QUIET,
            )
            assert res.identical_to_plain and res.identical_to_ours, fam.name
            steps, per_pos = our_counts(local.report_file, EVAL.spec.depth)
            assert (res.drafts, res.accepted_per_pos) == (steps, per_pos), fam.name
            assert res.tau == pytest.approx(local.tau_raw) and sum(per_pos) > 0, fam.name


@pytest.mark.engine
@pytest.mark.slow
def test_engine_serves_each_family_identically(family, request, tiny_embedded, engine_settings, tmp_path):
    """On Qwen3 the head trained on vLLM's features is served too, beside the same plain engine."""
    heads = [family]
    if family.name == "qwen3":
        heads.append(request.getfixturevalue("qwen3_on_engine_features")[0])
    serve_and_compare(heads, str(tiny_embedded.target_traffic.heldout), engine_settings, tmp_path)


def _max_rel_difference(a_dir: Path, b_dir: Path) -> dict[str, float]:
    """Max relative difference of the fused and last hidden states of two extractions of the same conversations
    (token ids and loss masks must be equal)."""
    import torch
    from safetensors.torch import load_file

    worst = {"aux_hidden_states": 0.0, "last_hidden_state": 0.0}
    pairs = list(zip(*(sorted(d.glob("features-*.safetensors")) for d in (a_dir, b_dir))))
    assert pairs
    for pa, pb in pairs:
        a, b = load_file(str(pa)), load_file(str(pb))
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "loss_mask", "offsets"))
        for k in worst:
            x, y = a[k].float(), b[k].float()
            worst[k] = max(worst[k], float((x - y).abs().max() / x.abs().max()))
    return worst


@pytest.fixture(scope="module")
def qwen3_on_engine_features(built, engine_settings) -> tuple[Family, dict[str, float]]:
    """Qwen3's regenerated traffic extracted by vLLM (`ExtractConfig(engine="vllm")`, one engine start) and a head
    trained on those features; with the max relative difference of the features to the local extraction's."""
    fam = built("qwen3")
    head = train_head(
        fam.target_dir,
        str(fam.root / "regen"),
        fam.root,
        dataclasses.replace(EXTRACT, engine="vllm"),
        context=StageContext(settings=engine_settings),
    )
    return (
        Family("qwen3 on engine features", fam.target_dir, head, fam.root),
        _max_rel_difference(fam.root / "extract-local", fam.root / "extract-vllm"),
    )


@pytest.mark.engine
@pytest.mark.slow
def test_engine_features_equal_local_features(qwen3_on_engine_features):
    """Qwen3 (not Llama): vLLM's features equal ours; the head trained on them is served by vLLM identically with our
    counters in test_engine_serves_each_family_identically[qwen3]."""
    fam, worst = qwen3_on_engine_features
    assert json.loads((fam.root / "extract-vllm" / "manifest.json").read_text())["engine"] == "vllm"
    assert all(v < 1e-5 for v in worst.values()), worst
    print(f"\nqwen3 engine vs local features, max relative difference: {worst}")
