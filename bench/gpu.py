"""One prepared accelerator run: build a bigger embedded target, train its EAGLE-3 head, measure speedup and MFU.

Run: on the device `bash bench/gpu.sh` (bench/README.md, "GPU run"); `python bench/gpu.py --quick --device cpu` runs
the same code on the tiny preset in seconds. Phases, each timed; gpu.json is rewritten after each, so a run cut short
(error, budget, SIGTERM) keeps what it measured (`status` "partial"):
  build       `components.embedded` on the device: `EmbeddedConfig.gpu()` (12 layers, hidden 768, vocab 16k; --quick:
              `tiny()`); `--target-steps N` shortens the target's training if the build runs long
  regenerate  the target's greedy answers to its training traffic, turn by turn, batched (`components.regenerate`)
  extract     assistant-only loss masks (`components.chat`), draft vocabulary, fused features
              (`eagle.features.target_forward`) kept on the device in bf16, in length-sorted batches
  train       EAGLE-3 head, TTT, bf16 autocast, `eagle.train` primitives in a plain loop (no Ray), until its step count
              or its share of the budget; then the MFU of this step and of the build's target training
  measure     held-out prompts, greedy, plain vs chain vs tree at batch 1 (prompt by prompt, rotating order) and 64
              (left-padded rows; plain chain tree tree chain plain): tokens/s, x plain, tau, acceptance per depth,
              outputs that differ from plain decoding (must be 0)
MFU = model FLOPs / step time / peak dense bf16 FLOPs (`PEAK_BF16_TFLOPS` by device name, else None; the achieved
TFLOP/s and its ratio to a bf16 matmul timed on the device are always reported). Model FLOPs are analytic: matmuls,
training = 3 x forward, no activation-checkpoint recomputation, no padding.
  head TTT step  sum over sequences (length n) of 3 x [n*2*3H*H (fc) + sum_k<K (n*2*(2H*(dq+2dkv) + dq*H + 3H*I + H*Vd)
                 + 4*dq*(n(n+1)/2 + k*n))]: q/k/v read 2H; step k attends to the causal step-0 keys and k diagonal
                 keys; dq, dkv = heads x head_dim; the frozen embedding is a lookup
  target step    per token 6*N_linear + 6*L*dq*(T+1) (causal attention over windows of T), at the build's tokens/s
Imports only torch, transformers, tokenizers, safetensors, numpy, tqdm, eagle/ and components' embedded, regenerate,
chat, targets, traffic_io, atomic (tests/test_bench_gpu_quick.py runs it with Prefect, MLflow, Ray, matplotlib and
datasets unimportable). Not here: sampling (T > 0), transformers' generate, plots, sweeps of tree shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402

from components.embedded import EmbeddedConfig, build_embedded  # noqa: E402

PEAK_BF16_TFLOPS = (("H200 NVL", 835.0), ("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0),
                    ("A100", 312.0), ("L40S", 362.0))  # dense (no sparsity), vendor datasheets; first match wins


@dataclass(frozen=True)
class Preset:
    name: str
    embedded: EmbeddedConfig
    conversations: int  # training conversations the target answers (at most)
    regen_batch: int
    answer_tokens: int  # max new tokens per answer
    max_len: int  # tokens per training sequence
    draft_vocab: int
    ttt_steps: int
    batch_size: int  # sequences per head-training step
    head_steps: int
    lr: float
    eval_prompts: int
    eval_tokens: int  # new tokens per prompt (and per row) in the measurement
    batches: tuple[int, ...]
    chain_depth: int
    tree: tuple[int, int, int]  # depth, topk, budget
    budget_s: float
    measure_s: float  # reserved for the measurement

    @classmethod
    def get(cls, quick: bool) -> "Preset":
        if quick:
            return cls("quick", EmbeddedConfig.tiny(), conversations=24, regen_batch=8, answer_tokens=24, max_len=128,
                       draft_vocab=128, ttt_steps=3, batch_size=4, head_steps=12, lr=3e-3, eval_prompts=4,
                       eval_tokens=16, batches=(1, 64), chain_depth=3, tree=(4, 4, 12), budget_s=100, measure_s=20)
        return cls("gpu", EmbeddedConfig.gpu(), conversations=8000, regen_batch=256, answer_tokens=128, max_len=512,
                   draft_vocab=4096, ttt_steps=7, batch_size=64, head_steps=2000, lr=1e-3, eval_prompts=32,
                   eval_tokens=128, batches=(1, 64), chain_depth=5, tree=(6, 8, 48), budget_s=450, measure_s=100)


class Run:
    """The clock of the run (budget, device sync, timestamped progress) and gpu.json, rewritten after every phase."""

    def __init__(self, budget_s: float, device: torch.device, path: Path, head: dict[str, Any]):
        self.t0, self.budget_s, self.device, self.path = time.perf_counter(), budget_s, device, path
        self.data = {**head, "budget_s": budget_s, "status": "running", "phases_s": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def say(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{self.elapsed():6.1f}s] {msg}", flush=True)

    def write(self, name: str = "", seconds: float = 0.0, payload: Any = None) -> None:
        """Record phase `name` (its wall time and result, when given), then rewrite gpu.json atomically."""
        if name:
            self.data["phases_s"][name] = round(seconds, 2)
        if payload is not None:
            self.data[name] = payload
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def build(preset: Preset, work: Path, device: torch.device, target_steps: int, progress: bool):
    cfg = preset.embedded
    train = dataclasses.replace(cfg.train, device=device.type, steps=target_steps or cfg.train.steps)
    cfg = dataclasses.replace(cfg, train=train, finetune=dataclasses.replace(cfg.finetune, device=device.type))
    emb = build_embedded(cfg, work / "embedded", progress=progress)
    m = emb.metrics  # target_train: the build's training of the target, whose MFU is reported too
    return emb, {"build_dir": str(emb.build_dir), "cached": emb.cached, "build_seconds": m.build_seconds,
                 "target": dataclasses.asdict(cfg.target), "target_train": dataclasses.asdict(m.target_train),
                 "target_train_config": dataclasses.asdict(cfg.train), "heldout_loss": m.heldout_loss,
                 "train_conversations": emb.target_traffic.train_conversations}


def regenerate(target, tokenizer, traffic: Path, preset: Preset, device: torch.device, until: float, run: Run):
    """Greedy answers of the target to the first `preset.conversations` training conversations, as token sequences."""
    from components.chat import tokenize_conversation
    from components.regenerate import RegenerateConfig, answer_all, hf_answerer
    from components.traffic_io import load_traffic

    convs = list(load_traffic(traffic).conversations)[:preset.conversations]
    cfg = RegenerateConfig(max_new_tokens=preset.answer_tokens, temperature=0.0, batch_size=preset.regen_batch,
                           device=str(device))
    answer = hf_answerer(target, tokenizer, cfg)
    seqs, done, failed, chunk = [], 0, 0, preset.regen_batch * 4
    for start in range(0, len(convs), chunk):
        if start and time.perf_counter() > until:
            run.say(f"regenerate: stopping at {done} conversations (time reserved for the later phases)")
            break
        records = answer_all(convs[start:start + chunk], answer, preset.regen_batch)
        failed += sum("messages" not in r for r in records)
        tok = [tokenize_conversation(tokenizer, r["messages"], preset.max_len) for r in records if "messages" in r]
        seqs += [(t.input_ids, t.loss_mask) for t in tok if sum(t.loss_mask) > 1]
        done = min(start + chunk, len(convs))
        run.say(f"regenerate: {done}/{len(convs)} conversations answered")
    return seqs, {"conversations": done, "failed": failed, "sequences": len(seqs),
                  "trained_tokens": sum(sum(m) for _, m in seqs),
                  "tokens": sum(len(s) for s, _ in seqs), "stopped_early": done < len(convs)}


@torch.no_grad()
def extract(target, seqs: list, preset: Preset, device: torch.device) -> tuple[list[tuple], torch.Tensor]:
    """Length-sorted right-padded batches (ids_BS, loss mask_BS, fused features aux_BS3H and final hidden last_BSH
    in bf16, real lengths), all on the device, and the trained-token counts (for the draft vocabulary)."""
    from eagle.config import default_aux_layer_ids
    from eagle.features import target_forward

    layer_ids = default_aux_layer_ids(target.config.num_hidden_layers)
    counts = torch.zeros(target.config.vocab_size, dtype=torch.long)
    for s, m in seqs:
        counts += torch.bincount(torch.tensor(s)[torch.tensor(m).bool()], minlength=counts.numel())
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    out = []
    for b in range(0, len(order), preset.batch_size):
        rows = [seqs[i] for i in order[b:b + preset.batch_size]]
        lengths = [len(s) for s, _ in rows]
        ids, mask = (torch.zeros(len(rows), max(lengths), dtype=torch.long) for _ in range(2))
        for r, (s, m) in enumerate(rows):
            ids[r, :len(s)], mask[r, :len(s)] = torch.tensor(s), torch.tensor(m)
        att = (torch.arange(ids.shape[1])[None] < torch.tensor(lengths)[:, None]).long()
        step = target_forward(target, ids.to(device), layer_ids, attention_mask=att.to(device))
        out.append((ids.to(device), mask.to(device), step.aux_BT3H.to(torch.bfloat16),
                    step.last_hidden_BTH.to(torch.bfloat16), lengths))
    return out, counts


def head_step_flops(cfg, lengths: list[int], ttt_steps: int) -> float:
    """Model FLOPs of one TTT training step over sequences of these real lengths (formula in the module docstring)."""
    H, I, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    dq, dkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    dense = 2 * (2 * H * (dq + 2 * dkv) + dq * H + 3 * H * I + H * Vd)
    fwd = 0.0
    for n in lengths:
        fwd += n * 2 * 3 * H * H + sum(n * dense + 4 * dq * (n * (n + 1) / 2 + k * n) for k in range(ttt_steps))
    return 3 * fwd


def train(target, draft, batches: list[tuple], preset: Preset, until: float, run: Run) -> dict[str, Any]:
    from eagle.features import teacher_targets
    from eagle.train import OptimConfig, make_optimizer, train_step
    from eagle.ttt import TTTBatch, TTTConfig

    ttt = TTTConfig(ttt_steps=preset.ttt_steps)
    opt, sched = make_optimizer(draft.trainable_parameters(), OptimConfig(
        lr=preset.lr, warmup_steps=max(2, preset.head_steps // 40), grad_clip=0.5), preset.head_steps)
    lm_head, draft_ids = target.get_output_embeddings().weight.detach(), draft.draft_ids()
    g, order, times, flops, history, tokens = torch.Generator().manual_seed(0), [], [], [], [], 0
    draft.train()
    for step in range(preset.head_steps):
        if step >= 2 and time.perf_counter() > until:
            run.say(f"train: stopped at step {step} (the rest of the budget is the measurement's)")
            break
        if not order:
            order = torch.randperm(len(batches), generator=g).tolist()
        ids_BS, mask_BS, aux_BS3H, last_BSH, lengths = batches[order.pop()]
        batch = TTTBatch(ids_BS, aux_BS3H.float(), mask_BS, teacher_targets(last_BSH.float(), lm_head, draft_ids))
        t0 = run.sync()
        out = train_step(draft, draft, batch, ttt, opt, sched, 0.5, torch.bfloat16)
        times.append(run.sync() - t0)
        flops.append(head_step_flops(draft.cfg, lengths, preset.ttt_steps))
        tokens += sum(lengths)
        last = step + 1 == preset.head_steps or time.perf_counter() > until
        if step % max(1, preset.head_steps // 20) == 0 or last:
            m = out.metrics()
            history.append({"step": step + 1, "t": round(run.elapsed(), 1), **{k: round(v, 4) for k, v in m.items()}})
            run.say(f"train: step {step + 1} loss {m['loss']:.3f} acc_0 {m['acc_0']:.3f} tau(sim) {m['tau']:.2f} "
                      f"{times[-1] * 1e3:.1f} ms/step")
    draft.eval()
    skip = min(5, len(times) // 4)  # first steps: allocator and kernel warm-up
    steady_s, steady_flops = sum(times[skip:]), sum(flops[skip:])
    return {"steps": len(times), "planned_steps": preset.head_steps, "stopped_early": len(times) < preset.head_steps,
            "trained_tokens_seen": tokens, "batch_size": preset.batch_size, "ttt_steps": preset.ttt_steps,
            "step_s_median": sorted(times)[len(times) // 2], "steady_steps": len(times) - skip,
            "steady_seconds": steady_s, "flops_per_step_mean": steady_flops / max(1, len(times) - skip),
            "achieved_tflops": steady_flops / max(steady_s, 1e-9) / 1e12, "tokens_per_s": tokens / max(sum(times), 1e-9),
            "final_metrics": history[-1] if history else {}, "history": history}


def padded(prompts: list[list[int]], B: int, pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [prompts[i % len(prompts)] for i in range(B)]
    T = max(len(r) for r in rows)
    ids, mask = torch.full((B, T), pad, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):], mask[i, T - len(r):] = torch.tensor(r), 1
    return ids.to(device), mask.to(device)


def _summary(runs: dict[str, list]) -> dict[str, dict]:
    """runs[method] = [(seconds, sequences [B, N], lengths [B], SpecStats or None)] -> a row per method; tau and
    alpha count emitted tokens (`SpecStats.tau`, `per_position_acceptance`), `tau_raw` what the rule accepted."""
    from eagle.stats import SpecStats

    base_s, base_tok = sum(r[0] for r in runs["plain"]), sum(int(r[2].sum()) for r in runs["plain"])
    rows = {}
    for name, rs in runs.items():
        secs, toks = sum(r[0] for r in rs), sum(int(r[2].sum()) for r in rs)
        row = {"tok_s": toks / max(secs, 1e-9), "seconds": secs, "tokens": toks, "runs": len(rs),
               "mismatch": sum(int((r[1] != p[1]).any(1).sum()) for r, p in zip(rs, runs["plain"]))}
        row["x_plain"] = row["tok_s"] / max(base_tok / max(base_s, 1e-9), 1e-9)
        if name != "plain":
            st = SpecStats.cat([r[3] for r in rs])
            row["tau"], row["tau_raw"] = st.tau, st.tau_raw
            row["alpha"] = [round(a, 3) for a in st.per_position_acceptance]
            row["verify_steps"] = int((st.accept_lengths >= 0).sum())
        rows[name] = row
    return rows


def measure(target, draft, prompts: list[list[int]], preset: Preset, run: Run) -> dict:
    """Plain, chain and tree decoding per batch size; a speculative method that raises is reported and dropped."""
    from eagle.speculative import SpecConfig, generate_plain, generate_speculative

    eos, pad = target.generation_config.eos_token_id, target.generation_config.pad_token_id or 0
    base = SpecConfig(max_new_tokens=preset.eval_tokens, eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
                      pad_token_id=pad)
    d, k, n = preset.tree
    cfgs = {"plain": base, "chain": dataclasses.replace(base, depth=preset.chain_depth),
            "tree": dataclasses.replace(base, method="tree", depth=d, topk=k, budget=n)}
    names, errors = list(cfgs), {}
    out = run.data["measure"] = {"config": {m: dataclasses.asdict(c) for m, c in cfgs.items()}, "errors": errors}

    def gen(name: str, ids, mask, runs: dict | None):
        if name not in names:
            return
        try:
            t0 = run.sync()
            g = (generate_plain(target, ids, mask, cfgs[name]) if name == "plain"
                 else generate_speculative(target, draft, ids, mask, cfgs[name]))
            s = run.sync() - t0
        except Exception as e:  # noqa: BLE001 - plain decoding failing is fatal; a speculative method is dropped
            if name == "plain":
                raise
            errors[name] = f"{type(e).__name__}: {e}"
            names.remove(name)
            run.say(f"measure: {name} failed ({errors[name]}); going on without it")
            return
        if runs is not None:
            runs[name].append((s, g.sequences.cpu(), g.lengths.cpu(), g.stats))

    for j, B in enumerate(preset.batches):
        if run.left() < 10 and j:
            out[f"batch_{B}"] = {"skipped": "time budget spent"}
            continue
        runs: dict[str, list] = {m: [] for m in names}
        if B == 1:  # prompt by prompt, the first once untimed (warm-up), the order rotating
            keep = 10 + (0.4 * run.left() if j + 1 < len(preset.batches) else 0)  # for the larger batches
            for i, ids in enumerate([prompts[0]] + prompts):
                if i > 1 and run.left() < keep:
                    break
                for m in names[i % 3:] + names[:i % 3]:
                    gen(m, torch.tensor([ids], device=run.device), None, runs if i else None)
        else:
            ids, mask = padded(prompts, B, pad, run.device)
            for m in names:
                gen(m, ids, mask, None)  # warm-up at this batch size
            for m in names + names[::-1]:
                gen(m, ids, mask, runs)
        rows = _summary({m: r for m, r in runs.items() if r and m in names})
        out[f"batch_{B}"] = {"rows": rows, "prompts": len(runs["plain"]) if B == 1 else B}
        run.say(f"measure: batch {B}: " + ", ".join(f"{m} {r['tok_s']:.0f} tok/s x{r['x_plain']:.2f} tau "
                                                   f"{r.get('tau', 1):.2f} mismatches {r['mismatch']}"
                                                   for m, r in rows.items()))
        run.write()
    return out


def heldout_prompts(tokenizer, path: Path, limit: int, max_tokens: int = 256) -> list[list[int]]:
    """Token ids of the first user turn (with the generation prompt) of the first `limit` short enough conversations."""
    from components.chat import prompt_ids
    from components.traffic_io import load_traffic

    firsts = (c.messages[:1 + next(i for i, m in enumerate(c.messages) if m.role == "user")]
              for c in load_traffic(path).conversations)
    ids = (prompt_ids(tokenizer, [{"role": m.role, "content": m.content} for m in msgs]) for msgs in firsts)
    return list(itertools.islice((x for x in ids if len(x) <= max_tokens), limit))


def peak_tflops(device: torch.device) -> tuple[float | None, str]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    hit = next(((k, v) for k, v in PEAK_BF16_TFLOPS if device.type == "cuda" and k in name), None)
    return (hit[1], name) if hit else (None, name)


def matmul_tflops(device: torch.device, run: Run) -> float:
    """bf16 TFLOP/s of a square matmul measured now (n 8192 on CUDA, 1024 elsewhere): the reachable ceiling."""
    n = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    a @ b
    t0, reps = run.sync(), 20 if device.type == "cuda" else 3
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (run.sync() - t0) / 1e12


def mfu(train_info: dict, target: nn.Module, build_info: dict, run: Run) -> dict[str, Any]:
    peak, name = peak_tflops(run.device)
    ceiling = matmul_tflops(run.device, run)
    c, stats, T = target.config, build_info["target_train"], build_info["target_train_config"]["seq_len"]
    n_linear = sum(m.weight.numel() for m in target.modules() if isinstance(m, nn.Linear))
    per_token = 6 * n_linear + 6 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * (T + 1)
    head, tgt = train_info["achieved_tflops"], per_token * stats["tokens_per_second"] / 1e12
    return {"device_name": name, "peak_bf16_tflops": peak, "matmul_bf16_tflops_measured": ceiling,
            "head_ttt_step": {"achieved_tflops": head, "mfu": head / peak if peak else None,
                              "mfu_vs_matmul": head / ceiling, "flops_per_step": train_info["flops_per_step_mean"],
                              "step_s_median": train_info["step_s_median"]},
            "target_train_step": {"achieved_tflops": tgt, "mfu": tgt / peak if peak else None,
                                  "mfu_vs_matmul": tgt / ceiling, "flops_per_token": per_token,
                                  "n_linear_params": n_linear, "tokens_per_s": stats["tokens_per_second"],
                                  "note": "the build's whole training run: first steps and a sync per step included"}}


def phases(args: argparse.Namespace, preset: Preset, run: Run) -> None:
    from components.targets import load_target
    from eagle.train import head_from_tensors

    dev = run.device

    def timed(name: str, fn: Callable[[], Any]) -> tuple[Any, float]:
        t0 = time.perf_counter()
        run.say(f"{name}: start ({run.left():.0f} s of the budget left)")
        return fn(), time.perf_counter() - t0

    (emb, info), s = timed("build", lambda: build(preset, Path(args.work), dev, args.target_steps, not args.quick))
    run.write("build", s, info)
    target, tokenizer = load_target(emb.target_dir, str(dev))
    share = 0.3 * max(0.0, run.left() - preset.measure_s)  # regenerate's share; extract and train get the rest
    (seqs, data), s = timed("regenerate", lambda: regenerate(target, tokenizer, emb.target_traffic.train, preset, dev,
                                                             time.perf_counter() + share, run))
    run.write("regenerate", s, data)

    def features():
        batches, counts = extract(target, seqs, preset, dev)
        return batches, head_from_tensors(target.config, counts, target.get_input_embeddings().weight,
                                          target.get_output_embeddings().weight, preset.draft_vocab).to(dev)

    (batches, draft), s = timed("extract", features)
    run.write("extract", s, {"batches": len(batches), "draft_vocab": draft.cfg.draft_vocab_size,
                             "aux_layer_ids": list(draft.cfg.aux_layer_ids), "feature_dtype": "bfloat16"})
    tr, s = timed("train", lambda: train(target, draft, batches, preset,
                                         time.perf_counter() + run.left() - preset.measure_s, run))
    run.write("train", s, tr)
    del batches
    m, s = timed("mfu", lambda: mfu(tr, target, info, run))
    run.write("mfu", s, m)
    prompts = heldout_prompts(tokenizer, emb.target_traffic.heldout, preset.eval_prompts)
    _, s = timed("measure", lambda: measure(target, draft, prompts, preset, run))
    run.write("measure", s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny embedded preset (tests)")
    p.add_argument("--device", default="", help="cuda or cpu (default: cuda when available); cpu runs 1 thread")
    p.add_argument("--out", default="", help="gpu.json's directory (bench/results; quick: .eagle/bench/results-quick)")
    p.add_argument("--work", default=str(ROOT / ".eagle" / "gpu-bench"), help="builds and caches")
    p.add_argument("--budget-s", type=float, default=0.0, help="wall-time budget (default: the preset's)")
    p.add_argument("--target-steps", type=int, default=0, help="target training steps (0: the preset's)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":  # a shared machine: a second thread on busy cores slows every product down
        torch.set_num_threads(1)
    torch.manual_seed(0)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` TERMs first: keep what was measured
    preset = Preset.get(args.quick)
    out = Path(args.out or (ROOT / ".eagle" / "bench" / "results-quick" if args.quick else ROOT / "bench" / "results"))
    env = {"device": str(device), "device_name": peak_tflops(device)[1], "torch": torch.__version__,
           "cuda": torch.version.cuda, "transformers": transformers.__version__, "python": platform.python_version(),
           "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    config = {**dataclasses.asdict(preset), "embedded": preset.embedded.to_dict(), "args": vars(args)}
    run = Run(args.budget_s or preset.budget_s, device, out / "gpu.json",
              {"benchmark": "gpu", "preset": preset.name, "environment": env, "config": config})
    run.say(f"gpu bench: preset {preset.name} on {device} ({env['device_name']}), budget {run.budget_s:.0f} s, "
            f"writing {run.path}")
    try:
        phases(args, preset, run)
        run.data["status"] = "complete"
    except BaseException as e:  # KeyboardInterrupt (SIGTERM) too: keep what was measured
        run.data["status"] = "partial" if "build" in run.data["phases_s"] else "failed"
        run.data["error"] = f"{type(e).__name__}: {e or 'interrupted (SIGTERM of a time limit, or Ctrl-C)'}"
        run.data["traceback"] = traceback.format_exc()[-4000:]
        run.say(f"stopped: {run.data['error']}")
    run.data["elapsed_s"] = round(run.elapsed(), 1)
    run.write()
    run.say(f"wrote {run.path} (status {run.data['status']})")
    return 0 if run.data["status"] == "complete" else 1


if __name__ == "__main__":
    raise SystemExit(main())
