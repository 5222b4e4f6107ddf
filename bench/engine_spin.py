"""Does an idle vLLM server beside the measured one move the engine evaluation's speedup? (issue 27, a diagnostic)

Run: `python bench/engine_spin.py --target DIR --head DIR --heldout FILE [--prompts 12]` (~8 min on 2 cores; e.g.
the demo's registered base target and head under `.eagle/models/<id>/stdlib-llama/1` and
`.../stdlib-llama-v1-eagle3/1`, and the embedded default's `traffic/target-heldout.jsonl`). Starts the engine
evaluation's pair (a plain and a speculative server side by side, the default preset's evaluation config: K 5, 96
new tokens), then prints (1) the plain server's CPU time (its process group) in the second after a request and in
the two seconds after that, (2) round ratios (plain seconds / speculative seconds over the held-out prompts,
interleaved prompt by prompt, order alternating) with no pause between requests and with a 1.5 s pause before
each, twice each. Writes `.eagle/bench/engine_spin.json`.
Found with it on 2026-12-03 (bench/README.md): an idle vLLM worker busy-polls a core for 1 s after each request, so
the request timed next on the other server shares the cores with it; components/evaluate_engine.py `SwitchPause`
now waits that out. Not here: GPU builds (the spin takes a host core there, not the GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)

from components.evaluate_engine import engine_samples, eval_spec
from components.pipeline_config import PipelineConfig
from infra.cpu_load import own_busy_s
from infra.settings import Settings
from infra.vllm_server import VllmServer

MODES = (("interleaved, no pause", 0.0), ("interleaved, 1.5 s pause", 1.5),
         ("interleaved, no pause (again)", 0.0), ("interleaved, 1.5 s pause (again)", 1.5))


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of every live process in process group `pgid` (infra/cpu_load.py's reading,
    less this process's own)."""
    return own_busy_s([pgid]) - own_busy_s([])


def timed(srv: VllmServer, p) -> float:
    t0 = time.perf_counter()
    srv.complete(p.ids, p.max_new_tokens, 0.0, False)
    return time.perf_counter() - t0


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--target", required=True)
    a.add_argument("--head", required=True)
    a.add_argument("--heldout", required=True)
    a.add_argument("--prompts", type=int, default=12)
    args = a.parse_args()
    cfg, s = PipelineConfig.preset("default").evaluate, Settings.from_env()
    prompts = engine_samples(cfg, args.target, args.heldout, s)[:args.prompts]
    longest = max(p.max_new_tokens for p in prompts)
    with VllmServer(eval_spec(cfg, args.target, max_new_tokens=longest), s) as plain, \
            VllmServer(eval_spec(cfg, args.target, args.head, max_new_tokens=longest), s) as spec:
        for srv in (plain, spec):
            srv.complete(prompts[0].ids, 4)
        timed(plain, prompts[0])
        c0 = group_cpu_s(plain.proc.pid)
        time.sleep(1.0)
        c1 = group_cpu_s(plain.proc.pid)
        time.sleep(2.0)
        c2 = group_cpu_s(plain.proc.pid)
        out = {"idle_cpu_s": {"first_1s": c1 - c0, "next_2s": c2 - c1}}
        print(f"plain server CPU after a request: first 1 s {c1 - c0:.2f} core-s, next 2 s {c2 - c1:.2f} core-s")
        for mode, pause in MODES:
            ratios = []
            for r in range(3):
                secs = {"plain": 0.0, "spec": 0.0}
                for i, p in enumerate(prompts):
                    pair = (("plain", plain), ("spec", spec))
                    order = pair if (i + r) % 2 == 0 else pair[::-1]
                    for key, srv in order:
                        time.sleep(pause)
                        secs[key] += timed(srv, p)
                ratios.append(secs["plain"] / secs["spec"])
            out[mode] = ratios
            print(f"{mode}: rounds {[round(x, 3) for x in ratios]} median {statistics.median(ratios):.3f}", flush=True)
    dest = Path(s.state_dir) / "bench" / "engine_spin.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
