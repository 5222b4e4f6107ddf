"""Acceptance by output position on long answers of the real model served by vLLM, with a long context.

Run: `python bench/long_answers.py --target DIR --head DIR [--role target|finetune] [--prompts 3]
      [--prompt-tokens 4096] [--max-new 2048] [--context 8192] [--depth 5] [--runs 1]`
(the demo's targets and heads: `.eagle/models/<hash>/smollm2-135m/<version>` and a run's `train/head`).
Prompts: held-out files of the embedded corpus (`--role target`: the standard library's modules, the base target's
domain; `finetune`: its test suite), the longest first, each cut to `--prompt-tokens` tokens of source and sent in
the target's chat template asking to continue the file. The model answers as it would in service: greedy, up to
`--max-new` tokens, its end token ends the answer (no `ignore_eos`: every position measured is one the served model
reaches). The head was trained on 512-token windows; the long positions are outside them, which is what this asks.
Each round starts fresh servers, plain and the head side by side (fp32, per-request metrics), and sends each prompt
to both in turn, one request at a time: speedup = plain seconds / head seconds; mismatches = answers of the head
that differ from plain's (greedy: must be 0); τ from the engine's counters; τ and α1 by output-position bucket
from the per-request metrics (`eagle.stats.acceptance_by_position`, raw as the engine counts).
Writes bench/results/long_answers.json and .png (τ by output position, one line per round).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)

from common import pyplot, results_dir, write_results

EDGES = (0, 128, 512, 1024, 2048, 4096)
ASK = "Continue this file from where it stops, in the same style."


def long_prompts(tokenizer, role: str, n: int, prompt_tokens: int) -> list[dict]:
    """The `n` longest held-out files of `role`'s domain, each cut to `prompt_tokens` tokens of its source (at a
    line end) and rendered as one user turn in the chat template."""
    from components.data.chat import prompt_ids
    from embedded.build import load_domains
    from embedded.config import EmbeddedConfig

    base, tuned = load_domains(EmbeddedConfig.default())
    files = sorted((base if role == "target" else tuned).heldout, key=lambda f: -len(f.text))[:n]
    out = []
    for f in files:
        ids = tokenizer(f.text, add_special_tokens=False)["input_ids"][:prompt_tokens]
        code = tokenizer.decode(ids)
        code = code[: code.rfind("\n") + 1] or code
        messages = [{"role": "user", "content": f"{ASK}\n\n# {f.rel_path}\n```python\n{code}"}]
        out.append({"file": f.rel_path, "ids": prompt_ids(tokenizer, messages)})
    return out


def one_round(args, prompts: list[dict], order: list[str], settings) -> dict:
    from components.evaluate.engine import SwitchPause
    from eagle.stats import acceptance_by_position, raw_steps
    from infra.vllm_engine_spec import EngineSpec
    from infra.vllm_server import PER_REQUEST_METRICS, VllmServer, running

    share = 0.08
    specs = {
        "plain": EngineSpec(
            args.target,
            None,
            method=None,
            max_model_len=args.context,
            served_model_name="plain",
            cpu_memory_share=share,
        ),
        "head": EngineSpec(
            args.target,
            args.head,
            num_speculative_tokens=args.depth,
            max_model_len=args.context,
            served_model_name="head",
            extra_args=PER_REQUEST_METRICS,
            cpu_memory_share=share,
        ),
    }
    servers = {m: VllmServer(specs[m], settings) for m in order}
    pause = SwitchPause.between(servers[order[0]].spec, last=order[-1])
    rows = {m: {"outputs": [], "seconds": [], "steps": []} for m in order}
    with running(*servers.values()):
        for srv in servers.values():
            srv.complete(prompts[0]["ids"][:64], 4)  # warm-up, before the counters
        before = servers["head"].spec_counters()
        for i, p in enumerate(prompts):
            for m in order[i % 2 :] + order[: i % 2]:
                pause(m)
                t0 = time.perf_counter()
                c = servers[m].complete(p["ids"], args.max_new, 0.0)
                rows[m]["seconds"].append(time.perf_counter() - t0)
                rows[m]["outputs"].append(c.token_ids)
                rows[m]["steps"].append(c.accepted_per_step)
                common._say(
                    f"bench: {p['file']} ({len(p['ids'])} prompt tokens) {m}: {len(c.token_ids)} tokens in "
                    f"{rows[m]['seconds'][-1]:.0f} s"
                )
        tau = (servers["head"].spec_counters() - before).tau
    steps = rows["head"]["steps"]
    buckets = acceptance_by_position([raw_steps(s) for s in steps], EDGES) if all(s is not None for s in steps) else []
    plain_s, head_s = sum(rows["plain"]["seconds"]), sum(rows["head"]["seconds"])
    return {
        "tau": tau,
        "by_position": buckets,
        "speedup": plain_s / head_s,
        "plain_tokens_per_s": sum(map(len, rows["plain"]["outputs"])) / plain_s,
        "head_tokens_per_s": sum(map(len, rows["head"]["outputs"])) / head_s,
        "answer_tokens": [len(o) for o in rows["plain"]["outputs"]],
        "mismatches": sum(a != b for a, b in zip(rows["plain"]["outputs"], rows["head"]["outputs"])),
    }


def plot(rounds: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(rounds):
        pts = [((b["lo"] + b["hi"]) / 2, b["tau"]) for b in r["by_position"] if b["steps"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"round {i + 1}: {r['speedup']:.2f}x plain")
    ax.set_xscale("log")
    ax.set_ylim(bottom=1.0)
    ax.set_xlabel("output position (bucket middle)")
    ax.set_ylabel("tau (vLLM, per-request metrics)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="the target's HF directory (as registered)")
    p.add_argument("--head", required=True, help="the head's directory (a run's train/head or an export)")
    p.add_argument(
        "--role",
        choices=("target", "finetune"),
        default="target",
        help="whose held-out files make the prompts (default target: the standard library's modules)",
    )
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--max-new", type=int, default=2048)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--runs", type=int, default=1)
    args = p.parse_args(argv)
    import os

    from transformers import AutoTokenizer

    from infra.settings import Settings

    if args.prompt_tokens + args.max_new + 64 > args.context:
        p.error(
            f"--prompt-tokens {args.prompt_tokens} + --max-new {args.max_new} leave no room in --context "
            f"{args.context} for the chat template"
        )
    load_before = list(os.getloadavg())
    tok = AutoTokenizer.from_pretrained(args.target)
    prompts = long_prompts(tok, args.role, args.prompts, args.prompt_tokens)
    settings, rounds = Settings.from_env(), []
    for r in range(args.runs):
        order = ["plain", "head"] if r % 2 == 0 else ["head", "plain"]
        rounds.append(one_round(args, prompts, order, settings))
        common._say(
            f"bench: round {r + 1}/{args.runs}: {rounds[-1]['speedup']:.2f}x plain, "
            f"tau {rounds[-1]['tau']:.2f}, "
            f"mismatches {rounds[-1]['mismatches']}"
        )
    speedups = [r["speedup"] for r in rounds]
    print(f"{'bucket':>12} {'steps':>6} {'tau':>6} {'alpha_1':>8}   (round 1)")
    for b in rounds[0]["by_position"]:
        tau = "-" if b["tau"] is None else f"{b['tau']:.2f}"
        a1 = "-" if b["alpha_1"] is None else f"{b['alpha_1']:.2f}"
        print(f"{b['lo']:>5}-{b['hi']:<6} {b['steps']:>6} {tau:>6} {a1:>8}")
    print(
        f"speedup over vLLM plain at batch 1: median {statistics.median(speedups):.2f}x [{min(speedups):.2f}, "
        f"{max(speedups):.2f}] over {len(rounds)} round(s); answers {rounds[0]['answer_tokens']} tokens; "
        f"mismatches {sum(r['mismatches'] for r in rounds)}"
    )
    payload = {
        "args": vars(args),
        "files": [q["file"] for q in prompts],
        "prompt_tokens": [len(q["ids"]) for q in prompts],
        "edges": list(EDGES),
        "rounds": rounds,
        "speedup_median": statistics.median(speedups),
    }
    write_results("long_answers", False, payload, load_before)
    plot(
        rounds,
        results_dir(False) / "long_answers.png",
        f"head {'/'.join(Path(args.head).parts[-4:-2])} on {'/'.join(Path(args.target).parts[-2:])}: tau by output "
        f"position, prompts of {args.prompt_tokens} tokens, context {args.context}",
    )


if __name__ == "__main__":
    main()
