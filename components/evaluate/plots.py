"""PNG plots a person reads faster than tables: acceptance by draft position, training curves.

Purpose: `plot_acceptance` (bars of conditional and cumulative acceptance per position, tau in the title),
`plot_by_output_position` (tau and alpha_1 per output-position bucket, ours and the engine's) and
`plot_training` (loss, per-step accuracy and simulated tau from a training history JSONL).
Not here: what to measure (components/evaluate/stage.py, components/train/stage.py). Uses matplotlib's Agg backend; a
plot file appears whole or not at all (written aside, then renamed).
"""

from __future__ import annotations

import json
from pathlib import Path

from components.data.atomic import atomic_path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str | Path) -> Path:
    """Write the figure atomically as PNG and release it."""
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(fig)
    return Path(path)


def plot_acceptance(conditional: list[float], cumulative: list[float], tau: float, path: str | Path) -> Path:
    plt = _plt()
    k = list(range(1, len(conditional) + 1))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    w = 0.38
    ax.bar([x - w / 2 for x in k], conditional, w, label="conditional α_k (accepted | reached)")
    ax.bar([x + w / 2 for x in k], cumulative, w, label="cumulative P(accept length ≥ k)")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(k)
    ax.set_title(f"Acceptance by draft position (τ = {tau:.2f})")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(plt, fig, path)


def plot_training(history_file: str | Path, path: str | Path) -> Path:
    plt = _plt()
    rows = []
    for x in Path(history_file).read_text().splitlines():
        try:
            rows.append(json.loads(x))
        except json.JSONDecodeError:  # a line torn by a killed writer
            continue
    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.plot(steps, [r["loss"] for r in rows])
    a.set_xlabel("step")
    a.set_ylabel("TTT loss")
    a.grid(True, alpha=0.3)
    # every depth any row has: a shallow phase (train.ttt.shallow_fraction) logs fewer steps first, gaps there
    accs = sorted({k for r in rows for k in r if k.startswith("acc_")}, key=lambda k: int(k.split("_")[1]))
    for k in accs:
        b.plot(steps, [r.get(k, float("nan")) for r in rows], label=k)
    if rows and "tau" in rows[0]:
        b2 = b.twinx()
        b2.plot(steps, [r["tau"] for r in rows], "k--", label="τ (simulated)")
        b2.set_ylabel("simulated τ")
    b.set_xlabel("step")
    b.set_ylabel("accuracy per TTT step")
    b.legend(fontsize=7, loc="lower right")
    b.grid(True, alpha=0.3)
    fig.suptitle("Head training")
    return _save(plt, fig, path)


def plot_load_sweep(cells: list[dict], schedule: list[list[int]], path: str | Path) -> Path:
    """Output tokens/s against concurrency (log scale): plain, each fixed K, the schedule
    (components/evaluate/load_sweep.py); each point the median over rounds, its bar the spread (min to max) where a
    cell has one."""
    import json

    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for k in sorted({c["k"] for c in cells}, key=lambda k: (k < 0, k)):
        rows = sorted((c for c in cells if c["k"] == k), key=lambda c: c["concurrency"])
        label = "plain" if k == 0 else ("schedule " + json.dumps(schedule) if k < 0 else f"K = {k}")
        style = dict(color="black", lw=2) if k == 0 else (dict(color="C3", lw=2, ls="--") if k < 0 else {})
        ys = [c["output_tokens_per_s"] for c in rows]
        err = [
            [y - c.get("output_tokens_per_s_min", y) for y, c in zip(ys, rows)],
            [c.get("output_tokens_per_s_max", y) - y for y, c in zip(ys, rows)],
        ]
        ax.errorbar([c["concurrency"] for c in rows], ys, yerr=err, marker="o", capsize=3, label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s (median, min–max)")
    ax.set_title("throughput by load (vLLM bench serve): where speculation pays", fontsize=10)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_by_output_position(
    buckets: list[dict], path: str | Path, engine: list[dict] | None = None, label: str = "ours"
) -> Path:
    """τ per output-position bucket (bars; the engine's beside them when given), α_1 as a line on a second axis;
    an empty bucket is drawn empty and labelled with its step count 0 (eagle.stats.acceptance_by_position).
    `label` names whose `buckets` they are."""
    plt = _plt()
    labels = [f"{b['lo']}–{b['hi']}\n({b['steps']} steps)" for b in buckets]
    x = list(range(len(buckets)))
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    w = 0.38 if engine else 0.6
    ax.bar([i - (w / 2 if engine else 0) for i in x], [b["tau"] or 0 for b in buckets], w, label=f"τ ({label})")
    if engine:
        ax.bar([i + w / 2 for i in x], [b["tau"] or 0 for b in engine], w, label="τ (vLLM)")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_xlabel("output position where the verification step starts")
    ax.set_ylabel("τ (tokens per verification step)")
    a2 = ax.twinx()
    a2.plot(x, [b["alpha_1"] for b in buckets], "k--o", label=f"α_1 ({label})")
    a2.set_ylim(0, 1.05)
    a2.set_ylabel("α_1")
    ax.set_title("Acceptance by output position")
    ax.legend(fontsize=8, loc="lower left")
    a2.legend(fontsize=8, loc="lower right")
    return _save(plt, fig, path)
