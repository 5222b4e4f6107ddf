"""Stage 4, evaluate: acceptance and real speedup of a head on held-out traffic, outputs checked identical.

Purpose: `evaluate(cfg, target_dir, head_dir, traffic_path, out_dir) -> EvaluateResult`. For every held-out
conversation (its first user turn, with the target's chat template) it decodes with plain decoding and with the
head, interleaved sample by sample so that both see the same machine state, and reports
- tau (mean tokens per target verification step, the bonus token included), acceptance per draft position both
  conditional (alpha_k = accepted at depth k / reached depth k) and cumulative (P[accept length >= k]),
- a per-segment breakdown (`complete`, `continue`, `explain`, ...),
- wall-clock speedup = plain seconds / speculative seconds over the same tokens, and tokens/s of each,
- at temperature 0, whether every output equals the plain greedy output; any difference raises
  `NotLosslessError` after the report is written (the run fails loudly).
`baseline_head_dir` (e.g. the current champion) is measured on the same prompts in the same run for the
promotion gate. Writes `evaluation.json` and PNG plots (acceptance by position; training curves if given).
Not here: registration and the gate's decision (components/register.py).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from components.atomic import atomic_write_text, remove_stale_temps


class NotLosslessError(AssertionError):
    """Greedy speculative output differed from plain greedy output."""


@dataclass(frozen=True)
class EvaluateConfig:
    method: str = "chain"  # "chain" | "tree"
    depth: int = 5
    topk: int = 4
    budget: int = 16
    temperature: float = 0.0
    max_new_tokens: int = 96
    limit: int | None = 24
    max_prompt_tokens: int = 384
    device: str = "cpu"
    seed: int = 0
    engine: str = "local"  # "vllm": also serve the head in vLLM and measure it there (components/engine_eval.py)

    def __post_init__(self) -> None:
        if self.engine not in ("local", "vllm"):
            raise ValueError(f"evaluate engine must be 'local' or 'vllm', got {self.engine!r}")

    @classmethod
    def tiny(cls) -> "EvaluateConfig":
        return cls(depth=3, max_new_tokens=12, limit=3)


@dataclass(frozen=True)
class EvaluateResult:
    tau: float
    speedup: float
    identical: bool | None  # None when sampling (T > 0): outputs are random, not comparable
    acceptance: list[float]  # conditional alpha_k
    acceptance_cumulative: list[float]
    per_segment: dict[str, dict[str, float]]
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    n_samples: int
    n_tokens: int
    baseline_tau: float | None
    report_file: str
    plots: tuple[str, ...] = field(default_factory=tuple)

    def metrics(self) -> dict[str, float]:
        m = {"tau": self.tau, "speedup": self.speedup, "plain_tokens_per_s": self.plain_tokens_per_s,
             "spec_tokens_per_s": self.spec_tokens_per_s}
        if self.identical is not None:  # sampled runs are not comparable token for token
            m["identical"] = float(self.identical)
        m.update({f"alpha_{k + 1}": a for k, a in enumerate(self.acceptance)})
        if self.baseline_tau is not None:
            m["baseline_tau"] = self.baseline_tau
        return m


def held_out_prompts(tokenizer, traffic_path: str, cfg: EvaluateConfig) -> list[tuple[str, list[int]]]:
    """(segment, prompt token ids) of the first user turn of each held-out conversation, with the chat template."""
    from components.chat import prompt_ids
    from components.traffic_io import load_traffic

    out = []
    for conv in load_traffic(traffic_path).conversations:
        first_user = next(i for i, m in enumerate(conv.messages) if m.role == "user")
        msgs = [{"role": m.role, "content": m.content} for m in conv.messages[: first_user + 1]]
        ids = prompt_ids(tokenizer, msgs)
        if len(ids) <= cfg.max_prompt_tokens:
            out.append((conv.segment or "default", ids))
        if cfg.limit and len(out) >= cfg.limit:
            break
    if not out:
        raise ValueError(f"{traffic_path}: no held-out prompt fits in {cfg.max_prompt_tokens} tokens")
    return out


def evaluate(cfg: EvaluateConfig, target_dir: str, head_dir: str, traffic_path: str, out_dir: str,
             baseline_head_dir: str | None = None, history_file: str | None = None,
             progress: Callable[[str], None] = print, trust_remote_code: bool = False) -> EvaluateResult:
    import torch

    from components.targets import load_target
    from eagle.export import load_head
    from eagle.speculative import SpecConfig, generate_plain, generate_speculative

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)  # left by a run killed mid-write
    target, tokenizer = load_target(target_dir, cfg.device, trust_remote_code=trust_remote_code)
    draft = load_head(head_dir, target, device=cfg.device).eval()
    baseline = load_head(baseline_head_dir, target, device=cfg.device).eval() if baseline_head_dir else None
    eos = target.generation_config.eos_token_id
    spec = SpecConfig(method=cfg.method, depth=cfg.depth, topk=cfg.topk, budget=cfg.budget,
                      temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                      eos_token_id=tuple(eos) if isinstance(eos, list) else eos)
    prompts = held_out_prompts(tokenizer, traffic_path, cfg)
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    t_plain = t_spec = 0.0
    n_tokens, identical, samples = 0, True, []
    base_acc: list[torch.Tensor] = []
    with torch.no_grad():
        ids0 = torch.tensor([prompts[0][1]], device=cfg.device)  # warm-up: first-call costs out of the timing
        generate_plain(target, ids0, None, spec, generator=gen)
        generate_speculative(target, draft, ids0, None, spec, generator=gen)
        for i, (segment, ids) in enumerate(prompts):
            x = torch.tensor([ids], device=cfg.device)
            t0 = time.perf_counter()
            plain = generate_plain(target, x, None, spec, generator=gen)
            t1 = time.perf_counter()
            sp = generate_speculative(target, draft, x, None, spec, generator=gen)
            t2 = time.perf_counter()
            t_plain, t_spec = t_plain + t1 - t0, t_spec + t2 - t1
            same = bool(torch.equal(plain.sequences, sp.sequences))
            identical &= same
            n_tokens += int(sp.lengths.sum())
            acc = sp.stats.accept_lengths[sp.stats.accept_lengths >= 0]
            samples.append({"segment": segment, "accept_lengths": acc.tolist(), "identical": same,
                            "plain_s": t1 - t0, "spec_s": t2 - t1, "tokens": int(sp.lengths.sum()),
                            "output_ids": sp.sequences[0, :int(sp.lengths[0])].tolist()})
            if baseline is not None:
                b = generate_speculative(target, baseline, x, None, spec, generator=gen).stats.accept_lengths
                base_acc.append(b[b >= 0])
            progress(f"evaluate: {i + 1}/{len(prompts)} [{segment}] tau {float(acc.float().mean() + 1):.2f} "
                     f"{'identical' if same else 'DIFFERENT'}")
    return _finish(cfg, out, samples, t_plain, t_spec, n_tokens, identical, base_acc, history_file)


def _finish(cfg, out: Path, samples, t_plain, t_spec, n_tokens, identical, base_acc, history_file):
    import torch

    from components.plots import plot_acceptance, plot_training

    all_acc = torch.tensor([a for s in samples for a in s["accept_lengths"]], dtype=torch.float)
    tau = float(all_acc.mean() + 1) if all_acc.numel() else 1.0
    cond = [float((all_acc >= k).sum() / (all_acc >= k - 1).sum().clamp_min(1)) for k in range(1, cfg.depth + 1)]
    cum = [float((all_acc >= k).float().mean()) for k in range(1, cfg.depth + 1)]
    seg: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        seg[s["segment"]].extend(s["accept_lengths"])
    per_segment = {k: {"tau": sum(v) / max(len(v), 1) + 1, "verify_steps": len(v)} for k, v in sorted(seg.items())}
    baseline_tau = float(torch.cat(base_acc).float().mean() + 1) if base_acc else None
    plots = [str(plot_acceptance(cond, cum, tau, out / "acceptance_by_position.png"))]
    if history_file and Path(history_file).is_file():
        plots.append(str(plot_training(history_file, out / "training_curves.png")))
    greedy = cfg.temperature == 0
    res = EvaluateResult(tau=tau, speedup=t_plain / max(t_spec, 1e-9), identical=identical if greedy else None,
                         acceptance=cond, acceptance_cumulative=cum, per_segment=per_segment,
                         plain_tokens_per_s=n_tokens / max(t_plain, 1e-9),
                         spec_tokens_per_s=n_tokens / max(t_spec, 1e-9), n_samples=len(samples),
                         n_tokens=n_tokens, baseline_tau=baseline_tau, report_file=str(out / "evaluation.json"),
                         plots=tuple(plots))
    atomic_write_text(out / "evaluation.json", json.dumps({"config": asdict(cfg), "result": asdict(res),
                                                           "samples": samples}, indent=2) + "\n")
    if greedy and not identical:
        bad = sum(not s["identical"] for s in samples)
        raise NotLosslessError(f"{bad}/{len(samples)} greedy speculative outputs differ from plain greedy decoding; "
                               f"see {out / 'evaluation.json'}. This is a bug: the head must never change outputs.")
    return res
