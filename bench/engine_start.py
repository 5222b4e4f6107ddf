"""What forking vLLM's servers from a zygote saves per engine start (infra/vllm_zygote.py), side by side.

Run: `python bench/engine_start.py [--rounds 5] [--starts 3] [--target DIR]` (~8 min on 2 cores with the defaults;
default target: the embedded default's, built or reused as every benchmark does). Each round runs two fresh
processes, one per mode, their order alternating by round: `zygote` (servers forked from a zygote, the default) and
`fresh` (`EAGLE_VLLM_ZYGOTE=0`: each server its own interpreter). Each process starts `--starts` plain servers of
the target one after the other (the default preset's evaluation sizes: fp32, eager, a context of 512), sends each
the same greedy request, stops it, and reports the wall seconds from start to healthy for each and the CPU-seconds of
everything it started (its children's rusage once all are reaped: a zygote's children count in the zygote's, and
orphans are adopted and reaped, so vLLM's worker counts too: before 2026-12-05 06:50 it did not). Prints
the medians and minima over rounds of CPU-s per start and of seconds to healthy (first start, later starts), and the
mismatches (a greedy output that differs from the first process's). Writes `bench/results/engine_start.json`.
Not here: the GPU (a zygote is used on the CPU only), engines with an environment of their own (started directly).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

from infra import vllm_zygote
from infra.settings import Settings
from infra.vllm_server import EngineSpec, VllmServer

MODES = ("zygote", "fresh")
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
PROMPT = [1, 5, 17, 42, 99, 7, 12, 3]  # ids every vocabulary here has (tiny targets: 2,048); outputs only compared


def _adopt_orphans() -> None:
    """Processes orphaned below us come to us, not to init: vLLM's worker can outlive its engine core by a moment at
    shutdown, and its CPU time reaches our RUSAGE_CHILDREN only if we reap it (PR_SET_CHILD_SUBREAPER)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)


def _reap_all(timeout_s: float = 60.0) -> None:
    """Reap every child, adopted orphans included, until none is left (or `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.1)


def child(mode: str, target: str, starts: int, out: Path) -> None:
    _adopt_orphans()
    settings = Settings.local(out.parent / f"home-{mode}", vllm_zygote=(mode == "zygote"))
    ready, outputs, kinds = [], [], []
    for _ in range(starts):
        t0 = time.perf_counter()
        with VllmServer(EngineSpec(target, None, method=None, max_model_len=512), settings) as srv:
            ready.append(round(time.perf_counter() - t0, 2))
            kinds.append(type(srv.proc).__name__)
            outputs.append(srv.complete(PROMPT, 16).token_ids)
    vllm_zygote.close_all()  # its children's CPU reaches our rusage once it has reaped them and exited
    _reap_all()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    out.write_text(json.dumps({"mode": mode, "ready_s": ready, "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
                               "outputs": outputs, "kinds": kinds}))


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--rounds", type=int, default=5)
    a.add_argument("--starts", type=int, default=3)
    a.add_argument("--target", default="")
    a.add_argument("--child", default="", help=argparse.SUPPRESS)
    a.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = a.parse_args()
    if args.rounds < 1 or args.starts < 1:
        a.error("--rounds and --starts must be at least 1")
    if args.child:
        return child(args.child, args.target, args.starts, Path(args.out))
    if args.target and not Path(args.target, "config.json").is_file():
        a.error(f"--target {args.target}: not a model directory (no config.json)")
    load_before = list(os.getloadavg())
    target = args.target or str(common.embedded(common.Preset.get(False)).target_dir)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                out = Path(tmp) / f"{mode}-{r}.json"
                subprocess.run([sys.executable, __file__, "--child", mode, "--target", target, "--starts",
                                str(args.starts), "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
                runs[mode].append(json.loads(out.read_text()))
                got = runs[mode][-1]
                print(f"round {r + 1} {mode}: {got['cpu_s'] / args.starts:.1f} CPU-s per start, ready after "
                      f"{got['ready_s']} s ({', '.join(sorted(set(got['kinds'])))})", flush=True)
    first = runs[MODES[0]][0]["outputs"][0]
    mismatches = sum(o != first for rs in runs.values() for run in rs for o in run["outputs"])
    rows = []
    for mode in MODES:
        per_start = [run["cpu_s"] / args.starts for run in runs[mode]]
        first_ready = [run["ready_s"][0] for run in runs[mode]]
        later = [s for run in runs[mode] for s in run["ready_s"][1:]]
        rows.append({"mode": mode, "cpu_s_per_start_median": round(statistics.median(per_start), 2),
                     "cpu_s_per_start_min": round(min(per_start), 2),
                     "first_ready_s_median": round(statistics.median(first_ready), 2),
                     "later_ready_s_median": round(statistics.median(later), 2) if later else None,
                     "later_ready_s_min": round(min(later), 2) if later else None})
    print(f"\n{'mode':8} {'CPU-s/start (median, min)':>26} {'first ready s':>14} {'later ready s (median, min)':>28}")
    for row in rows:
        print(f"{row['mode']:8} {row['cpu_s_per_start_median']:>17.1f}, {row['cpu_s_per_start_min']:>6.1f} "
              f"{row['first_ready_s_median']:>14.1f} {row['later_ready_s_median'] or 0:>19.1f}, "
              f"{row['later_ready_s_min'] or 0:>6.1f}")
    z, f = rows
    print(f"zygote / fresh CPU-s per start: {z['cpu_s_per_start_median'] / f['cpu_s_per_start_median']:.2f} "
          f"(medians over {args.rounds} rounds of {args.starts} starts); mismatches: {mismatches}")
    common.write_results("engine_start", False, {"target": target, "rounds": args.rounds, "starts": args.starts,
                                                 "rows": rows, "runs": runs, "mismatches": mismatches},
                         load_before)


if __name__ == "__main__":
    main()
