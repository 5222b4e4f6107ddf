"""Per-step costs of speculative decoding, measured side by side: target passes, head steps, whole steps.

Run: `python bench/spec_profile.py [--threads 1] [--batch 1] [--depth 5] [--topk 8] [--budget 48]`
The target has the embedded default's shape (Llama, 6 layers, hidden 256, vocab 8192, ~9M parameters) and the
head a 2048-token draft vocabulary, both randomly initialised: costs do not depend on the weights. Prints one table
(milliseconds, and ratio to one plain decoding step) and writes bench/results/spec_profile.json.
"plain step" is one token of `generate_plain`, its prefill subtracted. Whole-step rows time `draft -> verify ->
accept -> roll back -> head extend` in the real loop, where target and head weights evict each other from the CPU
caches, so they exceed the sum of the isolated rows. The projected speedup is tau * (plain step) / (whole step):
a random head accepts nothing, so tau has to come from an evaluation run of a trained head.
Not measured here: acceptance, end-to-end wall time of a trained pair, GPU timings unless --device cuda.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from eagle.config import DraftConfig  # noqa: E402
from eagle.draft import Eagle3Draft  # noqa: E402
from eagle.kvcache import causal_region  # noqa: E402
from eagle.speculative import SpecConfig, Speculator, generate_plain  # noqa: E402
from eagle.tree import Prefix, draft_chain, draft_tree  # noqa: E402


def timed(fn, repeats: int, device: str) -> float:
    """Fastest of `repeats` runs of `fn()` after 3 warm-up runs, in milliseconds (the machine is shared: the
    minimum is the least disturbed figure)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def build(device: str) -> tuple[torch.nn.Module, Eagle3Draft]:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=8192, max_position_embeddings=2048)
    target = LlamaForCausalLM(cfg).eval().to(device)
    draft = Eagle3Draft(DraftConfig.from_target(cfg, draft_vocab_size=2048)).eval().to(device)
    return target, draft


def measure(args: argparse.Namespace) -> dict[str, float]:
    dev = args.device
    target, draft = build(dev)
    ids = torch.randint(0, 8192, (args.batch, args.prompt), device=dev)
    chain = SpecConfig(method="chain", depth=args.depth, max_new_tokens=args.new)
    tree = SpecConfig(method="tree", depth=args.depth, topk=args.topk, budget=args.budget, max_new_tokens=args.new)
    r: dict[str, float] = {}
    one = SpecConfig(max_new_tokens=1)
    reps = max(5, args.repeats // 2)
    r["plain step"] = (timed(lambda: generate_plain(target, ids, None, chain), reps, dev)
                       - timed(lambda: generate_plain(target, ids, None, one), reps, dev)) / (args.new - 1)
    spec = Speculator(target, draft, tree, args.prompt, None)  # the larger cache; `spec.cfg` switches below
    n_B = torch.full((args.batch,), args.prompt, device=dev)
    logits, aux = spec.target.prefill(ids, n_B)
    prefix, root = Prefix.of(n_B), logits.argmax(-1)
    hidden, dlogits = spec.head_extend(Prefix(torch.zeros_like(n_B), 0), ids, aux, n_B)
    R = args.repeats
    for width in (1, args.depth + 1, args.budget + 1):
        toks = ids[:, :width] if width <= args.prompt else ids[:, :1].expand(-1, width)
        pos = prefix.lengths_B[:, None] + torch.arange(width, device=dev)
        region = causal_region(width, dev)
        r[f"target pass, {width} tok"] = timed(lambda: spec.target(prefix, toks, pos, region), R, dev)
    r["head step (1 tok)"] = timed(lambda: spec.head(prefix, root[:, None], hidden[:, None], prefix.lengths_B[:, None], 1),
                                   R, dev)
    r["head extend (3 tok)"] = timed(lambda: spec.head_extend(prefix, ids[:, :3], aux[:, :3],
                                                              torch.full_like(n_B, 3)), R, dev)
    r[f"draft chain d={args.depth}"] = timed(lambda: draft_chain(spec.head, prefix, hidden, dlogits, args.depth,
                                                                 spec.draft_pick), R, dev)
    shape = (args.depth, args.topk, args.budget)
    r[f"draft tree {shape}"] = timed(lambda: draft_tree(spec.head, prefix, root, hidden, dlogits, shape),
                                     R, dev)
    for name, cfg in (("chain", chain), ("tree", tree)):
        spec.cfg = cfg
        r[f"whole step, {name}"] = timed(lambda: _whole_step(spec, prefix, root, hidden, dlogits), R, dev)
    return r


def _whole_step(spec: Speculator, prefix: Prefix, root, hidden, dlogits) -> None:
    n_B, kept_BA, aux_BA3H = spec.step(prefix, root, hidden, dlogits)
    A = int(n_B.max()) + 1
    spec.head_extend(prefix, kept_BA[:, :A], aux_BA3H[:, :A], n_B + 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave the default)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--budget", type=int, default=48)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with torch.no_grad():
        r = measure(args)
    plain = r["plain step"]
    print(f"{'what':32s} {'ms':>8s} {'x plain step':>13s}")
    for k, v in r.items():
        print(f"{k:32s} {v:8.3f} {v / plain:13.3f}")
    for name in ("chain", "tree"):
        step = r[f"whole step, {name}"]
        print(f"projected speedup, {name}: " + ", ".join(f"tau {t}: {t * plain / step:.2f}x" for t in (2, 3, 4)))
    out = ROOT / "bench" / "results" / "spec_profile.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "ms": r}, indent=2))


if __name__ == "__main__":
    main()
