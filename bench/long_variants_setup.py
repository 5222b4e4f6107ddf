"""What bench/long_variants.py runs on: its sizes, the long traffic, the long-context target and the heads' features.

Purpose: `SIZES` (the `Sizes` of a `--quick` and of a default run); `long_traffic(...)` (the `long` kind's train and
held-out files for a target's tokenizer and context); `long_target(...)` (the embedded target trained on 2,048-token
windows, with its held-out loss by position before and after: `loss_by_position`); `prepare_long(args, sizes)` (the
target, traffic and features the heads train on, cached, as a `common.Setup`).
Run: imported by bench/long_variants.py.
Not here: the heads, their measurements and goals (bench/long_variants.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import common
import torch

from common import Preset, Setup, embedded, fingerprint

LOSS_EDGES = (0, 256, 512, 1024, 2048)  # held-out loss buckets of the long-context target


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What differs between the quick and the full run."""

    min_new: int  # long traffic: answers of at least this many tokens
    prompt_lines: int
    train_convs: int  # long train conversations whose features train the heads
    prompts: int
    depth: int
    runs: int
    steps: int
    batch: int


SIZES = {
    "quick": Sizes(min_new=96, prompt_lines=6, train_convs=16, prompts=2, depth=3, runs=1, steps=8, batch=2),
    "default": Sizes(min_new=1000, prompt_lines=24, train_convs=48, prompts=4, depth=5, runs=3, steps=150, batch=2),
}


def long_traffic(emb, target_dir: Path, context: int, sizes: Sizes, out: Path) -> tuple[Path, Path]:
    """The long kind's train and held-out files for this target's tokenizer and context (cached in `out`)."""
    from transformers import AutoTokenizer

    from components.data.traffic_io import write_openai_jsonl
    from embedded.build import load_domains
    from embedded.config import TrafficConfig
    from embedded.long_traffic import long_conversations

    paths = out / "long-train.jsonl", out / "long-heldout.jsonl"
    if all(p.is_file() for p in paths):
        return paths
    tok = AutoTokenizer.from_pretrained(target_dir)
    base, _ = load_domains(emb.config)
    t = TrafficConfig(kind="long", long_prompt_lines=sizes.prompt_lines, long_min_new_tokens=sizes.min_new)
    out.mkdir(parents=True, exist_ok=True)
    for path, files in zip(paths, (base.train, base.heldout)):
        convs = long_conversations(files, base.name, tok, t, context, seed=0)
        if not convs:
            raise ValueError(f"no long conversation of >= {sizes.min_new} tokens fits a context of {context}")
        write_openai_jsonl(path, convs)
    return paths


def loss_by_position(model, windows_NT: torch.Tensor, edges=LOSS_EDGES) -> dict[str, float]:
    """Mean next-token loss per position bucket of held-out windows (the buckets that start inside them)."""
    import torch.nn.functional as F

    edges = [e for e in edges if e < windows_NT.shape[1] - 1] + [windows_NT.shape[1] - 1]
    sums = torch.zeros(len(edges) - 1)
    model.eval()
    with torch.no_grad():
        for x in windows_NT.split(1):
            logits = model(input_ids=x).logits[0, :-1].float()
            nll = F.cross_entropy(logits, x[0, 1:], reduction="none")
            for b in range(len(edges) - 1):
                sums[b] += nll[edges[b] : edges[b + 1]].mean()
    return {f"{edges[b]}-{edges[b + 1]}": float(sums[b] / windows_NT.shape[0]) for b in range(len(edges) - 1)}


def long_target(emb, train_traffic: Path, steps: int, batch: int, out: Path) -> tuple[Path, dict]:
    """The embedded target trained `steps` more steps on 2,048-token windows (cached): (target dir, report)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from components.data.traffic_io import load_traffic
    from embedded import lm_train
    from embedded.build import load_domains
    from embedded.config import LMTrainConfig
    from embedded.tokenizer import render_chat

    report_file = out / "long_target.json"
    if report_file.is_file() and (out / "target" / "config.json").is_file():
        return out / "target", json.loads(report_file.read_text())
    tok = AutoTokenizer.from_pretrained(emb.target_dir)
    model = LlamaForCausalLM.from_pretrained(emb.target_dir)
    S = int(model.config.max_position_embeddings)
    base, _ = load_domains(emb.config)
    doc = lambda text: [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    raw = [doc(f.text) for f in base.train]
    chat = [
        tok(render_chat([{"role": m.role, "content": m.content} for m in c.messages]), add_special_tokens=False)[
            "input_ids"
        ]
        for c in load_traffic(train_traffic).conversations
    ]
    cfg = LMTrainConfig(
        steps=steps,
        batch_size=batch,
        seq_len=S,
        lr=1e-3,
        warmup_steps=max(1, steps // 10),
        num_threads=common.SETUP_THREADS,
    )
    windows = lm_train.pack_windows(chat, raw, steps * batch, S, 0.5, seed=1)
    held = lm_train.pack_windows([], [doc(f.text) for f in base.heldout], 4, S, 1.0, seed=2)
    t0 = time.perf_counter()
    before = loss_by_position(model, held)
    stats = lm_train.train(model, windows, cfg, seed=1, desc="long-context target", progress=False)
    after = loss_by_position(model, held)
    lm_train.save_target(model, tok, out / "target")
    model.generation_config.save_pretrained(out / "target")
    report = {
        "steps": steps,
        "batch": batch,
        "seq_len": S,
        "train_seconds": round(stats.seconds, 1),
        "tokens_per_s": round(stats.tokens_per_second, 1),
        "first_loss": stats.first_loss,
        "last_loss": stats.last_loss,
        "heldout_loss_before": before,
        "heldout_loss_after": after,
        "seconds_total": round(time.perf_counter() - t0, 1),
        "torch_threads": torch.get_num_threads(),
    }
    report_file.write_text(json.dumps(report, indent=2) + "\n")
    return out / "target", report


def prepare_long(args, sizes: Sizes) -> tuple[Setup, str, dict]:
    """Target, long traffic and features, cached: (setup for `train_or_reuse_head`, target label, long report)."""
    from components.extract.stage import extract
    from components.targets.target import target_context

    preset = Preset.get(args.quick)
    emb = embedded(preset)
    work = common.CACHE / f"{emb.build_hash[:12]}-long-{preset.name}"
    target_dir, label, report = Path(emb.target_dir), "base+ignore_eos", {}
    traffic = long_traffic(emb, target_dir, target_context(target_dir), sizes, work)
    if args.target == "long":
        out = common.CACHE / f"long-target-{emb.build_hash[:12]}-{fingerprint(args.long_steps, args.long_batch)}"
        with common.setup_threads():
            target_dir, report = long_target(emb, traffic[0], args.long_steps, args.long_batch, out)
        label, work = "long-context+ignore_eos", out
    regen, ext = work / "reference", work / "extract"
    if not (ext / "done.json").is_file():  # the reference answers, as a regenerated shard: what the heads learn
        from components.data.traffic_io import load_traffic, write_openai_jsonl

        regen.mkdir(parents=True, exist_ok=True)
        write_openai_jsonl(regen / "shard-00000.jsonl", load_traffic(traffic[0]).conversations[: sizes.train_convs])
        ecfg = dataclasses.replace(preset.extract, max_len=target_context(target_dir), seqs_per_shard=16)
        with common.setup_threads():
            res = extract(ecfg, str(target_dir), str(regen), str(ext), progress=lambda s: None)
        (ext / "done.json").write_text(json.dumps({"n_seqs": res.n_seqs, "n_tokens": res.n_tokens}) + "\n")
    setup = Setup(preset, emb, target_dir, traffic[0], traffic[1], work, regen, ext, work)
    return setup, label, report
