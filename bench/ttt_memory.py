"""Peak memory of one TTT training step (forward + backward), ours against a naive implementation.

Run: `python bench/ttt_memory.py [--lengths 512 1024 2048 4096 8192] [--device cpu|cuda]`
(or `make bench-ttt-memory`). Each (implementation, length) runs in a fresh subprocess so peaks do not mix;
on CPU the figure is the growth of the process's peak RSS during the step, on CUDA `max_memory_allocated`.
The naive side (bench/reference_ttt.py) materialises [S, (k+1)S] scores at every step and full-vocabulary fp32
teacher logits; it is skipped where its estimate exceeds --max-naive-gb. Writes bench/results/ttt_memory.json
and bench/results/ttt_memory.png, and prints a table with the growth exponent between successive lengths
(1.0 = linear, 2.0 = quadratic).
Not measured here: speed (bench/train_step.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden=256, heads=4, kv_heads=4, head_dim=64, vocab=8192, draft_vocab=2048, layers=6, K=7)


def _current_rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (resource.getpagesize() // 1024)


def run_one(impl: str, S: int, device: str) -> dict:
    import torch

    from eagle.config import DraftConfig
    from eagle.draft import Eagle3Draft
    from eagle.features import teacher_targets
    from eagle.ttt import TTTBatch, TTTConfig, ttt_loss
    from bench.reference_ttt import naive_ttt

    torch.manual_seed(0)
    s = SHAPE
    cfg = DraftConfig(
        hidden_size=s["hidden"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        intermediate_size=3 * s["hidden"],
        vocab_size=s["vocab"],
        draft_vocab_size=s["draft_vocab"],
        target_num_layers=s["layers"],
        max_position_embeddings=16384,
    )
    draft = Eagle3Draft(cfg).to(device)
    ids = torch.randint(0, s["vocab"], (1, S), device=device)
    aux = torch.randn(1, S, 3 * s["hidden"], device=device)
    last = torch.randn(1, S, s["hidden"], device=device)
    lm_w = torch.randn(s["vocab"], s["hidden"], device=device) * 0.05
    mask = torch.ones(1, S, dtype=torch.long, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _current_rss_kb() * 1024
    t0 = time.perf_counter()
    if impl == "ours":
        teacher = teacher_targets(last, lm_w, draft.draft_ids())
        loss = ttt_loss(draft, TTTBatch(ids, aux, mask, teacher), TTTConfig(ttt_steps=s["K"])).loss
    else:
        loss = naive_ttt(draft, ids, aux, mask, last, lm_w, s["K"], 0.8)[0]
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"impl": impl, "seq_len": S, "peak_bytes": int(peak), "seconds": time.perf_counter() - t0}


def naive_estimate_gb(S: int) -> float:
    """Dominant naive terms: per step k, ~3 saved [h, S, (k+1)S] fp32 tensors, plus [S, V] fp32 teacher logits."""
    K, h = SHAPE["K"], SHAPE["heads"]
    return (3 * h * S * S * 4 * K * (K + 1) / 2 + 2 * S * SHAPE["vocab"] * 4) / 1e9


def main() -> None:
    load0 = list(os.getloadavg())
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--max-naive-gb", type=float, default=10.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ttt_memory.json"))
    ap.add_argument("--one", nargs=2, metavar=("IMPL", "S"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one[0], int(a.one[1]), a.device)))
        return
    rows = []
    for S in a.lengths:
        for impl in ("ours", "naive"):
            if impl == "naive" and naive_estimate_gb(S) > a.max_naive_gb:
                rows.append(
                    {
                        "impl": impl,
                        "seq_len": S,
                        "peak_bytes": None,
                        "skipped": f"estimated {naive_estimate_gb(S):.0f} GB > --max-naive-gb",
                    }
                )
                print(f"{impl:5s} S={S:5d}  skipped (estimated {naive_estimate_gb(S):.0f} GB)", flush=True)
                continue
            cmd = [sys.executable, __file__, "--device", a.device, "--one", impl, str(S)]
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if res.returncode != 0:
                rows.append({"impl": impl, "seq_len": S, "peak_bytes": None, "error": res.stderr[-500:]})
                print(f"{impl:5s} S={S:5d}  failed: {res.stderr[-200:]}", flush=True)
                continue
            row = json.loads(res.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{impl:5s} S={S:5d}  peak {row['peak_bytes'] / 2**20:9.1f} MiB  {row['seconds']:.1f} s", flush=True)
    report(rows, a, load0)


def _exponents(rows: list[dict], impl: str) -> dict[int, float]:
    pts = [(r["seq_len"], r["peak_bytes"]) for r in rows if r["impl"] == impl and r.get("peak_bytes")]
    return {s2: math.log(b2 / b1) / math.log(s2 / s1) for (s1, b1), (s2, b2) in zip(pts, pts[1:]) if b1 > 0}


def report(rows: list[dict], a, load0: list[float]) -> None:
    exps = {impl: _exponents(rows, impl) for impl in ("ours", "naive")}
    print("\nseq_len | ours MiB | naive MiB | naive/ours | growth exp ours | growth exp naive")
    by = {(r["impl"], r["seq_len"]): r for r in rows}
    for S in a.lengths:
        o, n = by.get(("ours", S), {}).get("peak_bytes"), by.get(("naive", S), {}).get("peak_bytes")
        fmt = lambda b: f"{b / 2**20:9.1f}" if b else "        -"  # noqa: E731
        ratio = f"{n / o:10.1f}" if (o and n) else "         -"
        eo, en = exps["ours"].get(S), exps["naive"].get(S)
        print(
            f"{S:7d} | {fmt(o)} | {fmt(n)} | {ratio} | {eo if eo is None else round(eo, 2)!s:>15} | "
            f"{en if en is None else round(en, 2)!s:>16}"
        )
    import platform

    import torch

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "device": a.device,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "shape": SHAPE,
        "growth_exponents": exps,
    }
    if a.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    from report import write_results  # metadata, earlier runs kept (bench/report.py); torch is loaded by now

    write_results(out.stem, False, {"meta": meta, "rows": rows}, load0, out.parent)
    _plot(rows, out.with_suffix(".png"), meta)
    print(f"wrote {out.with_suffix('.png')}")


def _plot(rows: list[dict], path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for impl, style in (("ours", "o-"), ("naive", "s--")):
        pts = [(r["seq_len"], r["peak_bytes"] / 2**20) for r in rows if r["impl"] == impl and r.get("peak_bytes")]
        if pts:
            ax.plot(*zip(*pts), style, label=impl)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("peak memory of one TTT step (MiB)")
    ax.set_title(f"TTT step memory, K={SHAPE['K']}, {meta['device']} ({meta['date']})")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
