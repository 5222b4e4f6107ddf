"""Per-step costs of speculative decoding, measured side by side: target passes, head steps, whole steps.

Run: `python bench/spec_profile.py [--threads 1] [--batch 1] [--depth 5] [--topk 8] [--budget 48] [--rounds 12]`
The target has the embedded default's shape (Llama, 6 layers, hidden 256, vocab 8192, ~9M parameters) and the
head a 2048-token draft vocabulary, both randomly initialised: costs do not depend on the weights. Every row runs in
the same state as inside `generate_*` (inference mode, the target runner's session: CPU kernels, lean decoder).
Rows are interleaved round by round and each reports its minimum over all rounds: this machine is shared, and the
minimum is the least disturbed figure. With one thread the time is the thread's CPU time (immune to being
descheduled by other jobs), else wall time. Prints one table (milliseconds, and ratio to one plain decoding step)
and writes bench/results/spec_profile.json (`spec_profile-depth<d>.json` for another `--depth`).
"plain step" is one step of the plain loop (target pass over 1 token, lm_head, argmax) and "whole step" one
`draft -> verify -> accept -> roll back -> head extend` cycle, each repeated on the same state: every repetition
streams the same weights as the real loop does (target and head weights evict each other from the CPU caches, so a
whole step exceeds the sum of the isolated rows), and both are short, so the minimum finds undisturbed runs of each.
"plain step in generate_plain" is one token of a whole `generate_plain` run, its prefill subtracted: long runs
cannot dodge the other jobs, so it reads higher on a busy machine. The projected speedup is
tau * (plain step) / (whole step): a random head accepts nothing, so tau has to come from an evaluation run of a
trained head (`bench/spec_speedup_cpu.py` measures it end to end with an oracle drafter).
"in cycle: <phase>" rows split whole chain cycles into their phases, timed inside each cycle (median of
20 x rounds cycles): a phase there pays for the cache misses the previous phase caused, which the isolated rows
(warm caches) do not show.
Not measured here: acceptance, end-to-end wall time of a trained pair, GPU timings unless --device cuda.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from eagle.config import DraftConfig  # noqa: E402
from eagle.draft import Eagle3Draft  # noqa: E402
from eagle.drafters import HeadDrafter, commit_head  # noqa: E402
from eagle.speculative import SpecConfig, generate_plain  # noqa: E402
from eagle.runners import Prefix, TargetRunner  # noqa: E402
from eagle.tree import draft_chain, draft_tree  # noqa: E402
from eagle.verify import DraftSetup, Proposal, Verifier  # noqa: E402


def clock(device: str) -> Callable[[], float]:
    """Seconds: the thread's CPU time with one CPU thread, else wall time (synchronised on CUDA)."""
    if device == "cuda":
        return lambda: (torch.cuda.synchronize(), time.perf_counter())[1]
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def interleaved(rows: dict[str, tuple[Callable[[], object], int]], rounds: int, device: str) -> dict[str, float]:
    """Minimum milliseconds per row over `rounds` rounds of (1 warm-up + `reps` timed calls) of every row in turn."""
    now, best = clock(device), {name: float("inf") for name in rows}
    for _ in range(rounds):
        for name, (fn, reps) in rows.items():
            fn()
            for _ in range(reps):
                t0 = now()
                fn()
                best[name] = min(best[name], (now() - t0) * 1e3)
    return best


def build(device: str) -> tuple[torch.nn.Module, Eagle3Draft]:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=8192, max_position_embeddings=2048)
    target = LlamaForCausalLM(cfg).eval().to(device)
    draft = Eagle3Draft(DraftConfig.from_target(cfg, draft_vocab_size=2048)).eval().to(device)
    return target, draft


class Spec:
    """One generation's pieces as `generate_speculative` builds them: the verifier (target runner) and the head's
    drafter; `use(cfg)` switches the config both see."""

    def __init__(self, target, draft, cfg: SpecConfig, prompt_len: int):
        self.drafter = HeadDrafter(draft)
        capacity = prompt_len + cfg.max_new_tokens + self.drafter.reach(cfg) + 2
        self.target = TargetRunner(target, capacity, draft.cfg.aux_layer_ids, cfg.path)
        self.verify = Verifier(self.target, DraftSetup(capacity, self.target.lm_head.weight.shape[0], cfg, None))
        self.drafter.session(self.verify.setup)
        self.head, self.draft = self.drafter.head, draft

    def use(self, cfg: SpecConfig) -> None:
        self.verify.setup = self.drafter.setup = dataclasses.replace(self.verify.setup, cfg=cfg)

    def head_extend(self, prefix: Prefix, tokens_BA, aux_BA3H, n_B):
        return commit_head(self.head, self.draft, prefix, tokens_BA, aux_BA3H, n_B)


def rows_of(args: argparse.Namespace, target, draft, spec: Spec, ids: torch.Tensor):
    """The measured rows: name -> (function, timed calls per round)."""
    dev, B = args.device, args.batch
    chain = SpecConfig(method="chain", depth=args.depth, max_new_tokens=args.new)
    tree = SpecConfig(method="tree", depth=args.depth, topk=args.topk, budget=args.budget, max_new_tokens=args.new)
    n_B = torch.full((B,), args.prompt, device=dev)
    logits, aux = spec.target.prefill(ids, n_B)
    prefix, root = Prefix.of(n_B), logits.argmax(-1)
    hidden, dlogits = spec.head_extend(Prefix(torch.zeros_like(n_B), 0), ids, aux, n_B)
    r: dict[str, tuple[Callable[[], object], int]] = {
        "plain step": (lambda: spec.target.logits(spec.target(prefix, root[:, None], prefix.lengths_B[:, None],
                                                              None)[0][:, 0]).argmax(-1), 10),
        "plain, N+1 tokens": (lambda: generate_plain(target, ids, None, chain), 1),
        "plain, 1 token": (lambda: generate_plain(target, ids, None, SpecConfig(max_new_tokens=1)), 2)}
    for width in (1, args.depth + 1, args.budget + 1):
        toks = ids[:, :width] if width <= args.prompt else ids[:, :1].expand(-1, width)
        pos = prefix.lengths_B[:, None] + torch.arange(width, device=dev)
        r[f"target pass, {width} tok"] = (lambda t=toks, p=pos: spec.target(prefix, t, p, None), 5)
        r[f"target lm_head, {width} rows"] = (lambda h=hidden[:, None].expand(B, width, -1): spec.target.logits(h), 5)
    r["head step (1 tok)"] = (lambda: spec.head.extend(prefix, root[:, None], hidden[:, None],
                                                       prefix.lengths_B[:, None]), 10)
    r["head extend (3 tok)"] = (lambda: spec.head_extend(prefix, ids[:, :3], aux[:, :3], torch.full_like(n_B, 3)), 5)
    r[f"draft chain d={args.depth}"] = (lambda: draft_chain(spec.head, prefix, hidden, dlogits, args.depth,
                                                            spec.drafter.pick), 5)
    shape = (args.depth, args.topk, args.budget)
    r[f"draft tree {shape}"] = (lambda: draft_tree(spec.head, prefix, root, hidden, dlogits, shape), 3)
    for name, cfg in (("chain", chain), ("tree", tree)):
        r[f"whole step, {name}"] = (lambda c=cfg: _whole_step(spec, c, prefix, root, hidden, dlogits), 5)
    return r


def _whole_step(spec: Spec, cfg: SpecConfig, prefix: Prefix, root, hidden, dlogits) -> None:
    spec.use(cfg)
    spec.drafter.hidden_BH, spec.drafter.logits_BVd = hidden, dlogits
    n_B, kept_BA, aux_BA3H = spec.verify(prefix, root, spec.drafter.propose(prefix, root, None))
    A = int(n_B.max()) + 1
    spec.head_extend(prefix, kept_BA[:, :A], aux_BA3H[:, :A], n_B + 1)


PHASES = ("draft chain", "target pass", "target lm_head", "accept", "keep path", "head extend")


def cycle_breakdown(spec: Spec, cfg: SpecConfig, prefix: Prefix, root, hidden, dlogits, n: int,
                    device: str) -> dict[str, float]:
    """Median milliseconds of each phase of `n` whole chain cycles, timed inside the cycle (the same calls as
    `Verifier` + the head's commit): unlike the isolated rows, each phase here starts with the caches as the
    previous phase left them (the target's 28 MB of weights and the head's 7 MB evict each other from L3)."""
    now, dev = clock(device), root.device
    spec.use(cfg)
    times: dict[str, list[float]] = {k: [] for k in PHASES}
    for _ in range(n):
        t = [now()]
        drafts_BK, q = draft_chain(spec.head, prefix, hidden, dlogits, cfg.depth, spec.drafter.pick)
        tokens_BN = torch.cat([root[:, None], drafts_BK], 1)
        pos_BN = prefix.lengths_B[:, None] + torch.arange(cfg.depth + 1, device=dev)
        t.append(now())
        hidden_BNH, aux_BN3H = spec.target(prefix, tokens_BN, pos_BN, None)
        t.append(now())
        logits_BNV = spec.target.logits(hidden_BNH)
        t.append(now())
        n_B, nxt_B = spec.verify.accept_chain(logits_BNV, drafts_BK, Proposal(drafts_BK, q=q))
        t.append(now())
        path_BA = torch.arange(cfg.depth + 1, device=dev).expand(len(n_B), -1)
        kept_BA = torch.cat([tokens_BN.gather(1, path_BA[:, 1:]), torch.zeros_like(n_B)[:, None]], 1)
        kept_BA.scatter_(1, n_B[:, None], nxt_B[:, None])
        aux_BA3H = aux_BN3H.gather(1, path_BA[..., None].expand(-1, -1, aux_BN3H.shape[-1]))
        t.append(now())
        A = int(n_B.max()) + 1
        spec.head_extend(prefix, kept_BA[:, :A], aux_BA3H[:, :A], n_B + 1)
        t.append(now())
        for k, name in enumerate(PHASES):
            times[name].append((t[k + 1] - t[k]) * 1e3)
    out = {name: float(torch.tensor(v).median()) for name, v in times.items()}
    out["sum of phases"] = sum(out.values())
    return out


def measure(args: argparse.Namespace) -> dict[str, float]:
    target, draft = build(args.device)
    ids = torch.randint(0, 8192, (args.batch, args.prompt), device=args.device)
    tree = SpecConfig(method="tree", depth=args.depth, topk=args.topk, budget=args.budget, max_new_tokens=args.new)
    with torch.inference_mode():
        spec = Spec(target, draft, tree, args.prompt)  # the larger cache; `spec.use` switches the config per row
        with spec.target.session():
            r = interleaved(rows_of(args, target, draft, spec, ids), args.rounds, args.device)
            n_B = torch.full((args.batch,), args.prompt, device=args.device)
            logits, aux = spec.target.prefill(ids, n_B)
            prefix = Prefix.of(n_B)
            hidden, dlogits = spec.head_extend(Prefix(torch.zeros_like(n_B), 0), ids, aux, n_B)
            chain = SpecConfig(method="chain", depth=args.depth, max_new_tokens=args.new)
            cycle = cycle_breakdown(spec, chain, prefix, logits.argmax(-1), hidden, dlogits, 20 * args.rounds,
                                    args.device)
    r["plain step in generate_plain"] = (r.pop("plain, N+1 tokens") - r.pop("plain, 1 token")) / (args.new - 1)
    r.update({f"in cycle: {k}": v for k, v in cycle.items()})
    return r


def main() -> None:
    load0 = list(os.getloadavg())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave the default)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=65)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--budget", type=int, default=48)
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    r = measure(args)
    plain = r["plain step"]
    clock_name = "thread CPU time" if args.device == "cpu" and torch.get_num_threads() == 1 else "wall time"
    print(f"{'what (min ' + clock_name + ')':32s} {'ms':>8s} {'x plain step':>13s}")
    for k in ["plain step"] + [k for k in r if k != "plain step"]:
        print(f"{k:32s} {r[k]:8.3f} {r[k] / plain:13.3f}")
    for name in ("chain", "tree"):
        step = r[f"whole step, {name}"]
        print(f"projected speedup, {name}: " + ", ".join(f"tau {t}: {t * plain / step:.2f}x" for t in (3, 4, 5)))
    name = "spec_profile" + (f"-depth{args.depth}" if args.depth != 5 else "")
    from report import write_results  # metadata, earlier runs kept (bench/report.py)

    write_results(name, False, {"args": vars(args), "clock": clock_name, "ms": r}, load0, ROOT / "bench" / "results")


if __name__ == "__main__":
    main()
