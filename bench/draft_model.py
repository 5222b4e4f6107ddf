"""The small draft model the benchmarks set against the EAGLE-3 head, sized and trained as a user would.

A Llama of the target's tokenizer with tied embeddings, half the target's width, 2 layers (the default preset:
hidden 128, 2 heads of 64, MLP 384: about 0.2x the target's per-token matrix work, under the 1/4 a user would
aim for), trained on the same regenerated conversations as the head (the target's own answers, from the extract
directory's `tokens.safetensors`) for the same wall time as the head's training at the same torch threads, with
AdamW and a warmup + cosine schedule over that time. Or beside the head (`speedup.py --side-by-side`, this file's
`main`): both at once in two processes, half the cores each, the draft model from the head's first step until the
head is done, so the same CPU-minutes in the time of one training. Cached per (shape, data, budget) under the
setup's shared directory. Used by `bench/speedup.py` both in our loop (`eagle.drafters.ModelDrafter`) and as
transformers' `assistant_model`.
How to run: `lm_dir, info = draft_model.ensure(setup, head_seconds)`; `per_token_macs(config)` for the sizing;
`python bench/draft_model.py --beside HEAD_DIR --head-steps N` trains beside a head (speedup.py starts it).
Not here: distillation against the target's logits (a user with only a chat dataset trains on tokens), a
pretrained small model (none exists for the embedded tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)
import torch

from common import Setup

SEQ_LEN, BATCH, LR, WARMUP_STEPS, SEED = 256, 8, 3e-3, 20, 11


def shape_for(target_cfg):
    """The draft's `TargetConfig`: half the target's width (head_dim kept), 2 layers, MLP 3x, tied embeddings."""
    hidden = target_cfg.hidden_size // 2
    head_dim = target_cfg.hidden_size // target_cfg.num_heads
    heads = max(1, hidden // head_dim)
    return dataclasses.replace(
        target_cfg,
        num_layers=2,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_heads=heads,
        num_kv_heads=heads,
        tie_word_embeddings=True,
    )


def per_token_macs(config) -> int:
    """Multiply-accumulates of the linear layers per token of a Llama `config` (attention over the context and
    norms left out: they are the same order for both models at these lengths)."""
    h, inter, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return L * (h * (q + 2 * kv) + q * h + 3 * h * inter) + config.vocab_size * h


def head_macs(draft_cfg) -> int:
    """The EAGLE-3 head's per-drafted-token work: its decoder layer on the 2H input and its lm_head over the draft
    vocabulary (the 3H->H fusion runs once per committed token, not per draft)."""
    h, inter = draft_cfg.hidden_size, draft_cfg.intermediate_size
    q, kv = draft_cfg.num_attention_heads * draft_cfg.head_dim, draft_cfg.num_key_value_heads * draft_cfg.head_dim
    return 2 * h * (q + 2 * kv) + q * h + 3 * h * inter + draft_cfg.draft_vocab_size * h


def _windows(ext_dir: Path) -> torch.Tensor:
    """The extracted conversations' token ids, concatenated and cut into windows of SEQ_LEN tokens (fewer when
    the data holds under 2 batches of them) [N, seq_len]."""
    from safetensors.torch import load_file

    ids = load_file(str(ext_dir / "tokens.safetensors"))["input_ids"].long()
    seq_len = min(SEQ_LEN, ids.numel() // (2 * BATCH))  # the quick preset's data holds ~1,400 tokens
    if seq_len < 16:
        raise ValueError(f"{ext_dir}: {ids.numel()} tokens, too few to train a draft model on")
    n = ids.numel() // seq_len
    return ids[: n * seq_len].view(n, seq_len)


@dataclass
class Beside:
    """The head that a draft model trains beside, in another process (`speedup.py --side-by-side`): the draft model
    stops when the head's `bench_train.json` appears, and spans its learning-rate schedule over the head's projected
    time (its elapsed time x steps / steps logged in `history.jsonl`, re-read every `every_s`)."""

    head_dir: Path
    steps: int
    every_s: float = 5.0
    _last: float = field(default=-1e9, init=False)
    _projected: float = field(default=0.0, init=False)

    @property
    def ready_file(self) -> Path:
        """Written when the draft model starts its first step: the head waits for it, so both start together."""
        return self.head_dir.with_name(self.head_dir.name + ".draft-model-ready")

    def done(self) -> bool:
        return (self.head_dir / "bench_train.json").is_file()

    def projected_s(self, elapsed: float, guess_s: float) -> float:
        if elapsed - self._last >= self.every_s:
            self._last = elapsed
            logged = _last_step(self.head_dir / "history.jsonl")
            if logged >= max(1, self.steps // 50):  # a rate from a few logged steps, not the first one
                self._projected = elapsed * self.steps / logged
        return max(self._projected or guess_s, elapsed + 1.0)


def _last_step(history: Path) -> int:
    try:
        lines = history.read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):  # a line being written
            continue
    return 0


def _lr(elapsed: float, budget: float, step: int) -> float:
    if step < WARMUP_STEPS:
        return LR * (step + 1) / WARMUP_STEPS
    return LR * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, elapsed / budget))))


def train_for(model, windows_NT: torch.Tensor, budget_s: float, beside: Beside | None = None) -> dict:
    """AdamW over shuffled windows until `budget_s` seconds of training have passed, or with `beside` until the
    head trained beside it is done (its schedule then spans the head's projected time)."""
    g = torch.Generator().manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    order = torch.randperm(len(windows_NT), generator=g)
    if beside is not None:
        beside.ready_file.parent.mkdir(parents=True, exist_ok=True)
        beside.ready_file.write_text(f"{time.time()}\n")
    t0, step, losses = time.perf_counter(), 0, []
    while (elapsed := time.perf_counter() - t0) < budget_s or beside is not None:
        if beside is not None:
            if beside.done():
                break
            budget_s = beside.projected_s(elapsed, budget_s)
        for group in opt.param_groups:
            group["lr"] = _lr(elapsed, budget_s, step)
        at = (step * BATCH) % max(1, len(order) - BATCH + 1)
        x = windows_NT[order[at : at + BATCH]]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
    model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "steps": step,
        "seconds": round(time.perf_counter() - t0, 1),
        "tokens": step * x.numel() if step else 0,
        "loss_first": losses[0] if losses else None,
        "loss_last": sum(tail) / len(tail) if tail else None,
        "epochs": round(step * BATCH / len(windows_NT), 2),
        "torch_threads": torch.get_num_threads(),
    }


def _cache_dir(setup: Setup, shape, budget_s: float) -> tuple[Path, float]:
    budget_s = max(10.0, round(budget_s))
    return setup.work / f"draft-model-{common.fingerprint(shape, budget_s, SEQ_LEN, BATCH, LR, SEED)}", budget_s


def ensure(setup: Setup, budget_s: float, beside: Beside | None = None) -> tuple[Path, dict]:
    """The draft model for this setup and time budget (trained once, cached): its directory and its record.

    With `beside` (a head training in another process) `budget_s` is only the first guess of the head's time: the
    draft model trains until the head is done and is cached under the head's recorded training time, where
    `ensure(setup, head.seconds)` finds it."""
    from transformers import AutoConfig, AutoTokenizer

    from embedded import lm_train

    shape = shape_for(setup.emb.config.target)
    out, budget_s = _cache_dir(setup, shape, budget_s)
    info_path = out / "bench_train.json"
    if beside is None and (out / "config.json").is_file() and info_path.is_file():
        return out, json.loads(info_path.read_text())
    tokenizer = AutoTokenizer.from_pretrained(setup.emb.tokenizer_dir)
    model = lm_train.make_target(shape, tokenizer, SEED)
    until = f"beside the head in {beside.head_dir}, until it is done" if beside else f"for {budget_s:.0f} s"
    common._say(
        f"bench: training the draft model ({shape.num_layers} layers, hidden {shape.hidden_size}, tied) "
        f"{until} on {setup.extract_dir}"
    )
    with common.setup_threads():
        stats = train_for(model, _windows(setup.extract_dir), budget_s, beside)
    extra = {}
    if beside:
        head_s = json.loads((beside.head_dir / "bench_train.json").read_text())["seconds"]
        out, budget_s = _cache_dir(setup, shape, head_s)
        info_path = out / "bench_train.json"
        extra = {"side_by_side": {"head_dir": str(beside.head_dir), "head_seconds": round(head_s, 1)}}
    lm_train.save_target(model, tokenizer, out)
    target_cfg = AutoConfig.from_pretrained(setup.target_dir)
    info = {
        **stats,
        **extra,
        "shape": dataclasses.asdict(shape),
        "budget_s": budget_s,
        "parameters": sum(p.numel() for p in model.parameters()),
        "macs_per_token": per_token_macs(model.config),
        "target_macs_per_token": per_token_macs(target_cfg),
        "x_target_compute": round(per_token_macs(model.config) / per_token_macs(target_cfg), 3),
        "data": str(setup.extract_dir),
    }
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    return out, info


def main(argv: list[str] | None = None) -> None:
    """`python bench/draft_model.py --beside HEAD_DIR --head-steps N [--quick --cache C --conversations K
    --setup-threads T --guess S]`: the draft model trained beside that head (speedup.py --side-by-side runs it)."""
    p = common.base_args("the draft model, trained beside a head that trains in another process")
    p.add_argument("--beside", required=True, help="the head's work directory (common.head_work_dir)")
    p.add_argument("--head-steps", type=int, required=True, help="the head's training steps")
    p.add_argument("--guess", type=float, default=600.0, help="the head's time (s) until its rate is known")
    args = p.parse_args(argv)
    common.start(args)
    setup = common.prepare(args.quick, conversations=args.conversations)
    out, info = ensure(setup, args.guess, Beside(Path(args.beside), args.head_steps))
    print(
        f"draft model {out}: {info['seconds']:.0f} s beside the head's {info['side_by_side']['head_seconds']:.0f} s, "
        f"{info['steps']} steps",
        flush=True,
    )


if __name__ == "__main__":
    main()
