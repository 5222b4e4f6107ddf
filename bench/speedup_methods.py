"""The methods bench/speedup.py measures, their table and its goals.

Purpose: `methods(...)` builds one decoding function per method (plain, our head's chain and tree, prompt lookup and
the small draft model in our loop; transformers' `generate` plain, with prompt lookup and assisted), each returning
its tokens and the target passes it took (`CallCounter` counts transformers' passes); `summarize(...)` turns the
interleaved runs into the table's rows (tokens/s, each ratio, tokens per pass, tau, mismatches with plain);
`goals(...)` checks the T=0 goals on them (met only with 0 mismatches in our lossless methods, `ours_method`).
Run: imported by bench/speedup.py.
Not here: the setup, the runs and the result files (bench/speedup.py).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import common  # noqa: F401  (puts the repo root on sys.path)
import torch

from common import eos_of, goal_line, spec_figures, until_eos
from timing import tokens_per_s


class CallCounter:
    """Counts forward calls of the target's HF decoder in transformers' `generate` (prefill, decoding steps,
    verification passes) while `counting()`. Our loops' passes are counted from their outputs.

    The hook exists only inside `counting()`: a forward hook anywhere on the target makes our loops leave their
    lean decoder for HF's forward (`eagle.fastpath.LeanDecoder.of`), which would slow plain decoding and our head
    alike and skew the ratio between them (it did, in runs before 2026-11-30 06:30)."""

    def __init__(self, target):
        self.n = 0
        self.decoder = target.get_decoder()

    @contextmanager
    def counting(self):
        handle = self.decoder.register_forward_hook(self._hook)
        try:
            yield
        finally:
            handle.remove()

    def _hook(self, *_):
        self.n += 1


def methods(target, draft, assistant, temperature: float, args, max_new: int, counter: CallCounter):
    from eagle.drafters import ModelDrafter, PromptLookupDrafter
    from eagle.speculative import SpecConfig, generate_plain, generate_speculative
    from eagle.verify import generate_drafted

    eos, greedy = eos_of(target), temperature == 0
    depth, topk, budget = (int(x) for x in args.tree.split(","))
    chain = SpecConfig(
        method="chain", depth=args.depth, temperature=temperature, max_new_tokens=max_new, eos_token_id=eos
    )
    tree = dataclasses.replace(chain, method="tree", depth=depth, topk=topk, budget=budget)
    gen = torch.Generator().manual_seed(0)
    pad = target.generation_config.pad_token_id or 0
    sample = {} if greedy else {"temperature": temperature, "top_k": 0, "top_p": 1.0}

    def ours(fn, *a):
        def run(ids):  # target passes: prefill + one per further token (plain) or per verification (ours)
            out = fn(target, *a[:-1], torch.tensor([ids]), None, a[-1], generator=gen)
            n = int(out.lengths[0])
            if out.stats is None:
                return out.sequences[0, :n].tolist(), {"calls": n}
            steps = int((out.stats.accept_lengths >= 0).sum())
            return out.sequences[0, :n].tolist(), {"calls": 1 + steps, "stats": out.stats}

        return run

    def hf(**kw):
        def run(ids):
            c0 = counter.n
            x = torch.tensor([ids])
            with counter.counting():
                out = target.generate(
                    input_ids=x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=max_new,
                    do_sample=not greedy,
                    eos_token_id=eos,
                    pad_token_id=pad,
                    **sample,
                    **kw,
                )
            return until_eos(out[0, x.shape[1] :].tolist(), eos), {"calls": counter.n - c0}

        return run

    ms = {
        "plain": ours(generate_plain, chain),
        "eagle-chain": ours(generate_speculative, draft, chain),
        "eagle-tree": ours(generate_speculative, draft, tree),
    }
    if args.min_draft_prob:  # the chain with early exit, side by side with the full-depth chain
        exit_cfg = dataclasses.replace(chain, min_draft_prob=args.min_draft_prob)
        ms["eagle-chain-exit"] = ours(generate_speculative, draft, exit_cfg)
    lookup_cfg = dataclasses.replace(chain, depth=args.lookup)
    model_cfg = dataclasses.replace(chain, min_draft_prob=args.assistant_threshold)
    ms["lookup"] = ours(generate_drafted, PromptLookupDrafter(max_ngram=args.lookup_ngram), lookup_cfg)
    ms["draft-model"] = ours(generate_drafted, ModelDrafter(assistant), model_cfg)
    return {
        **ms,
        "hf-plain": hf(),
        "hf-lookup": hf(prompt_lookup_num_tokens=args.lookup, max_matching_ngram_size=args.lookup_ngram),
        "hf-assisted": hf(assistant_model=assistant),
    }


def ours_method(name: str) -> bool:
    """Every method but transformers' (hf-*) runs in our lossless loop: its greedy output must equal plain's."""
    return not name.startswith("hf-")


def summarize(runs: dict, greedy: bool) -> list[dict]:
    rows, plain = [], runs["plain"]
    base, hf_base = tokens_per_s(plain), tokens_per_s(runs["hf-plain"])
    for name, rs in runs.items():
        tps = tokens_per_s(rs)
        toks, calls = sum(len(r.tokens) for r in rs), sum(r.extra["calls"] for r in rs)
        stats = [r.extra["stats"] for r in rs if "stats" in r.extra]
        fig = spec_figures(stats) if stats else {}
        own = hf_base if name.startswith("hf-") else base
        rows.append(
            {
                "method": name,
                "tok_s": tps,
                "x_plain": tps / base,
                "x_own": tps / own,
                "x_hf_plain": tps / hf_base,
                "tok_per_call": toks / max(calls, 1),
                "tau": fig.get("tau"),
                "tau_raw": fig.get("tau_raw"),
                "alpha": fig.get("alpha"),
                "tokens": toks,
                "mismatch": sum(r.tokens != p.tokens for r, p in zip(rs, plain)) if greedy else None,
            }
        )
    return rows


def goals(rows: list[dict], draft_x_head: float = 1.0) -> dict:
    """The T=0 goals (printed, see `common.goal_line`): met only with 0 mismatches in all of our lossless methods
    (plain, eagle-*, lookup, draft-model): one that changed the output makes every figure of the table meaningless.
    With `--runs` the rows hold medians (the best method is the one of the best median) and their minimum."""
    by = {r["method"]: r for r in rows}
    ours = [r for r in rows if r["method"].startswith("eagle-")]
    best = max(ours, key=lambda r: r["tok_s"])  # our fastest method
    top_tau = max(ours, key=lambda r: r["tau"])
    bad = sum(r["mismatch"] for r in rows if ours_method(r["method"]))
    out = {
        "best_ours": best["method"],
        "mismatches_ours": bad,
        "tau >= 4": goal_line("tau >= 4", top_tau["tau"], 4.0, bad, method=top_tau["method"]),
        "tau >= 5.5 (best head)": goal_line(
            "tau >= 5.5 (best head)", top_tau["tau"], 5.5, bad, method=top_tau["method"]
        ),
        "speedup vs plain >= 2.0": goal_line(
            "speedup vs plain >= 2.0", best["x_plain"], 2.0, bad, method=best["method"]
        ),
    }
    if "x_plain_min" in best:  # --runs: the ratios are medians; the minimum has a goal of its own
        out["minimum speedup vs plain >= 1.9"] = goal_line(
            "minimum speedup vs plain >= 1.9", best["x_plain_min"], 1.9, bad, method=best["method"]
        )
    for alt in ("hf-plain", "hf-lookup", "hf-assisted"):
        name = f"vs {alt} >= 1.5"
        out[name] = goal_line(name, best["tok_s"] / by[alt]["tok_s"], 1.5, bad, method=best["method"])
    for alt in ("lookup", "draft-model"):  # speculation gain over speculation gain, both in our loop
        name = f"gain vs {alt} (our loop) >= 1.5"
        # --draft-model-seconds: say it is not like for like
        if alt == "draft-model" and abs(draft_x_head - 1.0) > 0.01:
            name = f"gain vs draft-model (our loop, trained {draft_x_head:.2f}x the head's time) >= 1.5"
        out[name] = goal_line(name, best["x_own"] / by[alt]["x_own"], 1.5, bad, method=best["method"])
    return out
