"""Sampled drafts in vLLM against our loop: acceptance and the outputs' likelihood, greedy and at T > 0 (a diagnostic).

Run: `python bench/vllm_sampled.py --target DIR --head DIR --heldout FILE [--prompts 8] [--repeats 4]
[--temperatures 0,0.7,1] [--depth 3] [--max-new 48]` (~3 min on 2 cores; e.g. the demo's registered base target and
head under `.eagle/models/<id>/stdlib-llama/1` and `.../stdlib-llama-v1-eagle3/1`, and the embedded default's
`traffic/target-heldout.jsonl`).
For each temperature, on the same held-out prompts (`--repeats` requests each), chain drafting at `--depth`:
- vLLM with the head: drafted and accepted tokens from its `/metrics` counters; vLLM plain (no head) beside it;
- our loop (eagle.speculative.generate_speculative, exact speculative sampling, tests/test_sampling.py): drafted
  and accepted tokens from its stats;
- every output's mean negative log-likelihood per token under the target (computed here, fp32): outputs sampled
  from the target's distribution have about the same mean whoever drafted, so a head's outputs far above plain's
  were not sampled from the target's distribution.
Prints a table and writes `.eagle/bench/vllm_sampled.json`. Found with it on 2026-12-05 (bench/README.md, "vLLM's CPU
build and sampled drafts"): vLLM 0.32's CPU build verifies sampled drafts against an unset per-token temperature
(infra/vllm_sampling.py). Not here: GPU builds (their Triton kernels are another code path), trees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)
import torch

from components.evaluate.engine import engine_samples, eval_spec
from components.evaluate.stage import EvaluateConfig
from components.targets.target import load_target
from eagle.export import load_head
from eagle.run_config import SpecConfig
from eagle.speculative import generate_speculative
from infra.settings import Settings
from infra.vllm_server import VllmServer


def nll_per_token(target, prompt: list[int], out: list[int]) -> list[float]:
    """-log p_target(token | prefix) of each output token, at temperature 1 (the model's own distribution)."""
    if not out:
        return []
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1)
    return (-lp[torch.arange(len(out)), torch.tensor(out)]).tolist()


def in_vllm(cfg: EvaluateConfig, args, prompts, temps, settings) -> dict:
    """Per temperature: the head server's counter deltas and both servers' outputs."""
    res: dict = {}
    with (
        VllmServer(eval_spec(cfg, args.target, max_new_tokens=args.max_new), settings) as plain,
        VllmServer(eval_spec(cfg, args.target, args.head, max_new_tokens=args.max_new), settings) as head,
    ):
        for t in temps:
            before = head.spec_counters()
            outs = {"plain": [], "head": []}
            for p in prompts:
                for _ in range(args.repeats):
                    outs["plain"].append((p.ids, plain.complete(p.ids, args.max_new, t).token_ids))
                    outs["head"].append((p.ids, head.complete(p.ids, args.max_new, t).token_ids))
            c = head.spec_counters() - before
            res[t] = {"drafted": c.drafts * args.depth, "accepted": int(sum(c.accepted_per_pos)), "outputs": outs}
    return res


def in_our_loop(target, draft, args, prompts, t: float) -> dict:
    eos = target.generation_config.eos_token_id  # each output stops at the end-of-turn token, as vLLM's do
    cfg = SpecConfig(
        method="chain",
        depth=args.depth,
        temperature=t,
        top_p=1.0,
        max_new_tokens=args.max_new,
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
    )
    drafted = accepted = 0
    outs = []
    for i, p in enumerate(prompts):
        for r in range(args.repeats):
            g = torch.Generator().manual_seed(1000 * i + r)
            o = generate_speculative(target, draft, torch.tensor([p.ids]), None, cfg, g)
            steps = o.stats.accept_lengths[o.stats.accept_lengths >= 0]
            accepted += int(steps.sum())
            drafted += int(o.stats.drafted.sum()) if o.stats.drafted is not None else steps.numel() * args.depth
            outs.append((p.ids, o.sequences[0, : int(o.lengths[0])].tolist()))
    return {"drafted": drafted, "accepted": accepted, "outputs": outs}


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--target", required=True)
    a.add_argument("--head", required=True)
    a.add_argument("--heldout", required=True)
    a.add_argument("--prompts", type=int, default=8)
    a.add_argument("--repeats", type=int, default=4)
    a.add_argument("--temperatures", default="0,0.7,1")
    a.add_argument("--depth", type=int, default=3)
    a.add_argument("--max-new", type=int, default=48)
    args = a.parse_args()
    if min(args.prompts, args.repeats, args.depth, args.max_new) < 1:
        a.error("--prompts, --repeats, --depth and --max-new must be at least 1")
    try:
        temps = [float(x) for x in args.temperatures.split(",")]
    except ValueError:
        a.error(f"--temperatures {args.temperatures!r}: comma-separated numbers, e.g. 0,0.7,1")
    if any(not 0 <= t < float("inf") for t in temps):
        a.error(f"--temperatures {args.temperatures!r}: each must be >= 0")
    for opt, d in (("--target", args.target), ("--head", args.head)):
        if not Path(d, "config.json").is_file():
            a.error(f"{opt} {d}: not a model directory (no config.json)")
    if not Path(args.heldout).is_file():
        a.error(f"--heldout {args.heldout}: no such file")
    settings = Settings.from_env()
    cfg = EvaluateConfig(spec=SpecConfig(method="chain", depth=args.depth, max_new_tokens=args.max_new))
    prompts = engine_samples(cfg, args.target, args.heldout, settings)[: args.prompts]
    t0 = time.time()
    engine = in_vllm(cfg, args, prompts, temps, settings)
    target = load_target(args.target)[0]
    draft = load_head(args.head, target)
    rows = []
    print(f"{'T':>4} {'who':<12} {'accepted/drafted':>17} {'alpha':>6} {'NLL/token':>9} {'tokens':>6}")
    for t in temps:
        ours = in_our_loop(target, draft, args, prompts, t)
        cells = {
            "vLLM plain": {"outputs": engine[t]["outputs"]["plain"]},
            "vLLM + head": {k: engine[t][k] for k in ("drafted", "accepted")}
            | {"outputs": engine[t]["outputs"]["head"]},
            "ours + head": ours,
        }
        for who, c in cells.items():
            nll = [x for p, o in c["outputs"] for x in nll_per_token(target, p, o)]
            row = {"temperature": t, "who": who, "tokens": len(nll), "nll_per_token": statistics.mean(nll)}
            if "drafted" in c:
                row |= {
                    "drafted": c["drafted"],
                    "accepted": c["accepted"],
                    "alpha": c["accepted"] / max(c["drafted"], 1),
                }
            rows.append(row)
            acc = f"{row['accepted']}/{row['drafted']}" if "drafted" in row else "-"
            alpha = f"{row['alpha']:.3f}" if "alpha" in row else "-"
            print(f"{t:>4g} {who:<12} {acc:>17} {alpha:>6} {row['nll_per_token']:>9.3f} {row['tokens']:>6}", flush=True)
    dest = Path(settings.state_dir) / "bench" / "vllm_sampled.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"args": vars(args), "seconds": time.time() - t0, "rows": rows}, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
