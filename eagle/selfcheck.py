"""Self-check of the EAGLE-3 core on a tiny random target, on any machine with torch + transformers.

Run: `python -m eagle.selfcheck [--device cpu|cuda] [--out DIR] [--steps N]`.
It builds a tiny random Llama target (its lm_head sharpened so that it has something to predict), lets it
answer random prompts (its own outputs are the training data, as in the pipeline), trains a head with TTT,
exports the head with its probe to DIR/head and the target to DIR/target (HF format), reloads both, checks
that the probe reproduces, that greedy speculative decoding (chain and tree) is token-for-token identical to
plain greedy decoding, and prints a short report (also written to DIR/report.json).
Not a quality benchmark: the target is random; see bench/ for measurements on the embedded default.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from eagle.export import export_head, load_head, verify_probe
from eagle.train import OptimConfig, init_head, make_optimizer, online_batch, train_step
from eagle.ttt import TTTConfig
from eagle.vocab import count_tokens


def tiny_target(device: str, vocab: int = 512, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=vocab - 1,
        bos_token_id=0,
        pad_token_id=0,
    )
    target = LlamaForCausalLM(cfg)
    with torch.no_grad():
        target.lm_head.weight.mul_(12.0)  # a confident target: low-entropy next-token distributions
    return target.to(device).eval()


@torch.no_grad()
def self_generated_data(target, n: int, prompt_len: int, new_tokens: int, seed: int):
    """Random prompts answered by the target itself (sampled at T=0.8); loss mask on the answers."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    device = next(target.parameters()).device
    prompts = torch.randint(1, target.config.vocab_size - 1, (n, prompt_len), generator=g).to(device)
    out = target.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=True,
        temperature=0.8,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        top_k=0,
    )
    mask = torch.zeros_like(out)
    mask[:, prompt_len:] = 1
    return out, mask


def train_online_head(target, ids, mask, steps: int, batch_size: int, device: str, log_every: int = 50):
    """A fresh head trained with TTT on `ids` (features computed from the target at each step); (head, history)."""
    counts = count_tokens(torch.zeros(target.config.vocab_size, dtype=torch.long), ids.cpu(), mask.cpu())
    draft = init_head(target, counts, draft_vocab_size=256).to(device)
    ttt = TTTConfig(ttt_steps=5)
    opt, sched = make_optimizer(draft.trainable_parameters(), OptimConfig(lr=3e-3, warmup_steps=20), steps)
    g = torch.Generator().manual_seed(0)
    history = []
    for step in range(steps):
        idx = torch.randint(0, ids.shape[0], (batch_size,), generator=g)
        batch = online_batch(target, draft, ids[idx], mask[idx])
        out = train_step(draft, draft, batch, ttt, opt, sched, grad_clip=0.5)
        if step % log_every == 0 or step == steps - 1:
            m = out.metrics()
            history.append({"step": step, **m})
            print(
                f"  step {step:4d}  loss {m['loss']:.3f}  acc_0 {m['acc_0']:.2f}  acc_4 {m['acc_4']:.2f}  "
                f"tau(sim) {m['tau']:.2f}",
                flush=True,
            )
    return draft, history


def lossless_check(target, draft, prompts, max_new_tokens: int) -> dict:
    from eagle.speculative import SpecConfig, generate_plain, generate_speculative

    eos = target.config.eos_token_id
    attn = torch.ones_like(prompts)
    report = {}
    base = SpecConfig(max_new_tokens=max_new_tokens, eos_token_id=eos)
    t0 = time.perf_counter()
    plain = generate_plain(target, prompts, attn, base)
    report["plain_seconds"] = time.perf_counter() - t0
    for method in ("chain", "tree"):
        cfg = SpecConfig(method=method, depth=5, topk=4, budget=16, max_new_tokens=max_new_tokens, eos_token_id=eos)
        t0 = time.perf_counter()
        spec = generate_speculative(target, draft, prompts, attn, cfg)
        report[method] = {
            "identical": bool(torch.equal(spec.sequences, plain.sequences)),
            "tau": spec.stats.tau,
            "seconds": time.perf_counter() - t0,
            "per_position_acceptance": [round(a, 3) for a in spec.stats.per_position_acceptance],
        }
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle.selfcheck", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=".eagle/selfcheck")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--samples", type=int, default=256, help="target-answered prompts used as training data")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt in the lossless check")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device")
    out = Path(a.out)
    t_start = time.perf_counter()
    print(f"[1/5] tiny random target on {a.device}", flush=True)
    target = tiny_target(a.device)
    print("[2/5] target answers random prompts (training data)", flush=True)
    ids, mask = self_generated_data(target, n=a.samples, prompt_len=8, new_tokens=56, seed=1)
    print(f"[3/5] training the head with TTT for {a.steps} steps", flush=True)
    t0 = time.perf_counter()
    draft, history = train_online_head(target, ids, mask, a.steps, batch_size=8, device=a.device)
    train_s = time.perf_counter() - t0
    print(f"[4/5] export to {out / 'head'} and {out / 'target'}, reload, probe", flush=True)
    target.save_pretrained(out / "target")
    export_head(draft, out / "head", lineage={"target": str(out / "target"), "source": "eagle.selfcheck"})
    from transformers import AutoModelForCausalLM

    target2 = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).to(a.device).eval()
    draft2 = load_head(out / "head", target2, device=a.device).eval()
    probe_err = verify_probe(draft2, out / "head")
    print("[5/5] lossless check: speculative vs plain greedy", flush=True)
    held_out, _ = self_generated_data(target2, n=4, prompt_len=8, new_tokens=1, seed=99)
    check = lossless_check(target2, draft2, held_out[:, :8], max_new_tokens=a.new_tokens)
    report = {
        "device": a.device,
        "train_steps": a.steps,
        "train_seconds": round(train_s, 1),
        "final_metrics": history[-1],
        "probe_max_abs_diff": probe_err,
        **check,
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    ok = probe_err < 1e-4 and check["chain"]["identical"] and check["tree"]["identical"]
    print(json.dumps(report, indent=2))
    print(
        f"selfcheck: {'PASS' if ok else 'FAIL'} tau(chain)={check['chain']['tau']:.2f} "
        f"tau(tree)={check['tree']['tau']:.2f} probe_diff={probe_err:.2e}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
