"""End-to-end speculative speedup on CPU at batch 1, with a drafter whose acceptance rate is set: depth sweep.

Run: `python bench/spec_speedup_cpu.py [--threads 1] [--depths 3 4 5 6 7 8] [--alphas 0.6 0.7 0.8 0.9] [--rounds 3]`
Target and head have the embedded default's shapes (Llama, 6 layers, hidden 256, vocab 8192; head with a 2048-token
draft vocabulary), randomly initialised: costs do not depend on the weights, acceptance does, so the head's choice
is replaced by an oracle (`OracleDrafter`): after the head has computed its logits in full, each drafted token is
the target's own next greedy token with probability alpha, another draft-vocabulary token otherwise. Every drafting
and verification cost is paid as in `generate_speculative`; only the argmax is overridden. Expected tokens per
verification: tau(d) = (1 - alpha^(d+1)) / (1 - alpha); every round repeats the same draws (`--seed`), so rounds
differ only in timing noise.
Each configuration runs `generate_speculative` (greedy, `--new` tokens after a `--prompt`-token prompt) side by side
with `generate_plain` in interleaved rounds, timed by its minimum over the rounds (thread CPU time with one thread,
else wall time). A perfect drafter (alpha = 1, tau = depth + 1) gives the cost of one whole cycle at each depth,
prefill and loop included; from it, projected speedups tau * plain / cycle at tau 3, 4, 5 and at the expected tau
of each alpha. At `--check-depth` the drafter runs at each alpha with `--seeds` acceptance patterns, for measured
speedups to hold the projection against. Also checked: outputs identical to plain. Writes
bench/results/spec_speedup_cpu.json.
Not measured here: a trained head's acceptance (see `components/evaluate.py`), sampling, batches, trees.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from eagle import speculative  # noqa: E402
from eagle.drafters import HeadDrafter  # noqa: E402
from eagle.speculative import SpecConfig, generate_plain, generate_speculative  # noqa: E402
from spec_profile import build, clock  # noqa: E402


class OracleDrafter(HeadDrafter):
    """Drafts the reference continuation's tokens with probability `alpha` each, a wrong draft token otherwise
    (plain Python bookkeeping, so that the oracle adds next to nothing to the measured cost)."""

    reference_draft_idx: list[int]  # draft index of each token of prompt + the target's greedy continuation
    alpha: float = 1.0
    seed: int = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rng = random.Random(self.seed)  # every generation draws the same acceptance pattern

    def propose(self, prefix, root_B, history):
        self._next = int(prefix.lengths_B[0]) + 1  # sequence index of the first draft
        return super().propose(prefix, root_B, history)

    def pick(self, logits_BVd):
        head_idx, q = super().pick(logits_BVd)  # the head's own pick, computed and discarded
        ref = self.reference_draft_idx
        idx = ref[min(self._next, len(ref) - 1)]
        self._next += 1
        if self.rng.random() >= self.alpha:
            idx = (idx + 1) % self.draft.cfg.draft_vocab_size
        return head_idx.fill_(idx), q


def setup(args: argparse.Namespace):
    target, draft = build("cpu")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8192, (1, args.prompt), generator=g)
    ref = generate_plain(target, ids, None, SpecConfig(max_new_tokens=args.new))
    seq = torch.cat([ids, ref.sequences], 1)
    vocab = torch.unique(ref.sequences)  # the draft vocabulary holds every reference token
    others = torch.ones(8192, dtype=torch.bool)
    others[vocab] = False
    fill = others.nonzero()[:, 0][torch.randperm(int(others.sum()), generator=g)[:2048 - vocab.numel()]]
    draft.set_draft_vocab(torch.cat([vocab, fill]).sort().values)
    return target, draft, ids, seq, ref.sequences


def run(args: argparse.Namespace) -> dict:
    """Minimum ms of every configuration's generation, tau and verification steps of each speculative one,
    whether all outputs were identical to plain."""
    target, draft, ids, seq, ref_out = setup(args)
    now = clock("cpu")
    best: dict[str, float] = {}
    taus: dict[str, float] = {}
    steps: dict[str, int] = {}
    identical = True
    speculative.HeadDrafter = OracleDrafter
    to_draft = torch.cumsum(draft.t2d.long(), 0) - 1  # target id -> draft index (for ids in the draft vocabulary)
    OracleDrafter.reference_draft_idx = to_draft[seq[0]].tolist()
    try:
        for _ in range(args.rounds):
            for key, fn in _configs(args, target, draft, ids):
                t0 = now()
                out = fn()
                best[key] = min(best.get(key, float("inf")), (now() - t0) * 1e3)
                if not key.endswith("1 token"):
                    identical &= torch.equal(out.sequences, ref_out)
                if out.stats is not None:
                    taus[key], steps[key] = out.stats.tau, out.stats.n_verify_steps  # the draws repeat each round
    finally:
        speculative.HeadDrafter = HeadDrafter
    return {"ms": best, "tau": taus, "verify_steps": steps, "identical": identical}


def _configs(args, target, draft, ids):
    """plain; every depth with a perfect drafter (tau = depth + 1: the cost of a cycle); the check depth at each
    alpha with `--seeds` acceptance patterns (measured speedups to hold the cost model against)."""
    yield "plain", lambda: generate_plain(target, ids, None, SpecConfig(max_new_tokens=args.new))
    yield "plain 1 token", lambda: generate_plain(target, ids, None, SpecConfig(max_new_tokens=1))
    yield "spec 1 token", lambda: generate_speculative(target, draft, ids, None, SpecConfig(max_new_tokens=1))
    runs = [(1.0, depth, 0) for depth in args.depths]
    runs += [(alpha, args.check_depth, seed) for alpha in args.alphas for seed in range(args.seeds)]
    for alpha, depth, seed in runs:
        cfg = SpecConfig(method="chain", depth=depth, max_new_tokens=args.new)

        def spec(cfg=cfg, alpha=alpha, seed=seed):
            OracleDrafter.alpha, OracleDrafter.seed = alpha, seed
            return generate_speculative(target, draft, ids, None, cfg)
        yield f"alpha {alpha} depth {depth} seed {seed}", spec


def expected_tau(alpha: float, depth: int) -> float:
    return float(depth + 1) if alpha >= 1 else (1 - alpha ** (depth + 1)) / (1 - alpha)


def report(args: argparse.Namespace, res: dict) -> dict:
    """Prints the cycle costs and the projected and measured speedups; returns the cycle costs."""
    ms, n = res["ms"], args.new
    plain = (ms["plain"] - ms["plain 1 token"]) / (n - 1)  # one decoding step, prefill excluded
    cycle = {d: (ms[f"alpha 1.0 depth {d} seed 0"] - ms["spec 1 token"]) / res["verify_steps"][
        f"alpha 1.0 depth {d} seed 0"] for d in args.depths}
    print(f"plain step: {plain:.3f} ms; prefill: plain {ms['plain 1 token']:.2f} ms, speculative "
          f"{ms['spec 1 token']:.2f} ms; outputs identical to plain: {res['identical']}")
    print("cycle = one draft-verify-accept-extend step of the loop, prefill excluded (from a perfect drafter)")
    print(f"{'depth':>5s} {'cycle ms':>9s} {'x plain':>8s} | projected speedup at tau 3 / 4 / 5 | "
          + " ".join(f"alpha {a}" for a in args.alphas))
    for d in args.depths:
        at_tau = " ".join(f"{t * plain / cycle[d]:5.2f}x" if t <= d + 1 else "   -  " for t in (3, 4, 5))
        by_alpha = " ".join(f"{expected_tau(a, d) * plain / cycle[d]:8.2f}x" for a in args.alphas)
        print(f"{d:5d} {cycle[d]:9.3f} {cycle[d] / plain:8.3f} | {at_tau:>34s} | {by_alpha}")
    print(f"measured end to end at depth {args.check_depth}, {n} tokens after a {args.prompt}-token prompt, "
          f"prefill included (mean over {args.seeds} acceptance patterns):")
    for a in args.alphas:
        keys = [f"alpha {a} depth {args.check_depth} seed {s}" for s in range(args.seeds)]
        tau = sum(res["tau"][k] for k in keys) / len(keys)
        speed = sum(ms["plain"] / ms[k] for k in keys) / len(keys)
        model = tau * plain / cycle[args.check_depth] if args.check_depth in cycle else float("nan")
        print(f"  alpha {a}: tau {tau:.2f}, speedup {speed:.2f}x (steady-state projection at this tau: {model:.2f}x)")
    return cycle


def main() -> None:
    load0 = list(os.getloadavg())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--depths", type=int, nargs="+", default=[3, 4, 5, 6, 7, 8])
    p.add_argument("--alphas", type=float, nargs="+", default=[0.6, 0.7, 0.8, 0.9])
    p.add_argument("--check-depth", type=int, default=5)
    p.add_argument("--seeds", type=int, default=3, help="acceptance patterns per alpha at the check depth")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(args)
    cycle = report(args, res)
    from report import write_results  # metadata, earlier runs kept (bench/report.py)

    write_results("spec_speedup_cpu", False, {"args": vars(args), "cycle_ms": cycle, **res}, load0,
                  ROOT / "bench" / "results")


if __name__ == "__main__":
    main()
