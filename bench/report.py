"""Reporting for the benchmarks: run metadata, result files that keep their history, goal lines, acceptance figures.

Purpose (re-exported by bench/common.py, import them from there):
- `run_metadata()`: what ran where: the commit (`git rev-parse HEAD`), whether the work tree was clean
  (`git status --porcelain` empty; the changed paths when not), the CPU model, its L1/L2/L3 cache sizes, torch and
  Python versions, the date. `write_results` attaches it to every result file as `metadata`.
- `write_results(name, quick, payload, load_before)`: writes `<name>.json` with this run's record at the top level
  (what readers of the file have always read) and every earlier run of the same name under `earlier_runs` (oldest
  first, each with its own metadata and date), plus `history` (date, commit, clean flag of every run, this one
  last). Nothing is overwritten silently: it prints which file it wrote, which run of that name this is, and the
  dates of the earlier runs it kept. An existing file it cannot read is moved aside to `<name>.unreadable-<date>.json`.
- `goal_line(name, measured, goal, mismatches)`: a goal is met only when the figure reaches it AND the greedy outputs
  of our lossless methods had 0 mismatches (None: not checked, never met). Prints one line, returns the record.
- `spec_figures(stats)`: tau and alpha_k of several runs' `SpecStats` (emitted tokens only: what reached the output,
  after EOS and `max_new_tokens`), the raw figures beside them (what the acceptance rule accepted, as an engine's
  counters count), and the verification steps that reached each depth.
Not here: the benchmark setup (bench/common.py), any figure's meaning (bench/README.md).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]


# ---- run metadata ----------------------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    """Output of a read-only git command in the repository, None when git or the repository is not there.
    `--no-optional-locks`: `status` must not take the index lock of a checkout others commit from."""
    try:
        p = subprocess.run(["git", "--no-optional-locks", *args], cwd=ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def cpu_info() -> dict[str, Any]:
    """The CPU's model name and the cache sizes of cpu0 (sysfs; `lscpu` when sysfs has none): speed ratios moved a
    lot between the kinds of machine seen here."""
    name, caches = "unknown", {}
    try:
        name = next(
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind = (d / "level").read_text().strip(), (d / "type").read_text().strip()
            size = (d / "size").read_text().strip()
        except OSError:
            continue
        caches[f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")] = size
    if not caches or name == "unknown":
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        from_lscpu = not caches
        for key, _, value in (ln.partition(":") for ln in out.splitlines()):
            if key.strip() == "Model name" and name == "unknown":
                name = value.strip()
            elif from_lscpu and key.strip().endswith(" cache"):
                caches[key.split()[0]] = value.strip()
    return {"model": name, "caches": caches}


def run_metadata() -> dict[str, Any]:
    """Commit, clean flag, CPU and caches, versions and date of this run (see the module docstring)."""
    commit = (_git("rev-parse", "HEAD") or "").strip()
    status = _git("status", "--porcelain") if commit else None
    changed = [ln for ln in (status or "").splitlines() if ln.strip()]
    cpu = cpu_info()
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": commit or "unknown",
        "tree_clean": None if status is None else not changed,
        "changed_paths": changed[:30],
        "n_changed_paths": len(changed),
        "cpu_model": cpu["model"],
        "cpu_caches": cpu["caches"],
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def machine(load_before: list[float]) -> dict[str, Any]:
    """The machine's state around the run: it is shared, so only ratios measured side by side compare."""
    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_before": load_before,
        "loadavg": list(os.getloadavg()),
        "note": "shared machine: other engineers' jobs ran at the same time; compare ratios within one run",
    }


# ---- result files ----------------------------------------------------------------------------------------------


def _run_date(record: dict) -> str:
    """A record's date: `metadata.date`, or `machine.date` in files written before the metadata existed."""
    return str(record.get("metadata", {}).get("date") or record.get("machine", {}).get("date") or "undated")


def _earlier_runs(path: Path) -> list[dict]:
    """The runs already in `path`, oldest first (a file of an older format is one run); an unreadable file is moved
    aside, never overwritten."""
    if not path.is_file():
        return []
    try:
        old = json.loads(path.read_text())
        if not isinstance(old, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        aside = path.with_name(f"{path.stem}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}.json")
        path.rename(aside)
        print(f"write_results: could not read {path} ({e}); moved it to {aside}", flush=True)
        return []
    earlier = old.pop("earlier_runs", [])
    old.pop("history", None)
    return [*earlier, old]


def write_results(name: str, quick: bool, payload: dict[str, Any], load_before: list[float], directory: Path) -> Path:
    """Write this run's record to `<directory>/<name>.json`, keeping the earlier runs of that name (module docstring).
    bench/common.py's `write_results` passes the quick or the committed results directory."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = Path(directory) / f"{name}.json"
    meta = run_metadata()
    record = {
        "benchmark": name,
        "preset": "quick" if quick else "default",
        "metadata": meta,
        "machine": machine(load_before),
        **payload,
    }
    earlier = _earlier_runs(path)
    history = [
        {
            "date": _run_date(r),
            "commit": r.get("metadata", {}).get("commit", r.get("machine", {}).get("commit")),
            "tree_clean": r.get("metadata", {}).get("tree_clean"),
        }
        for r in [*earlier, record]
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**record, "history": history, "earlier_runs": earlier}, indent=2, default=str) + "\n")
    tmp.replace(path)
    clean = {True: "clean tree", False: f"{meta['n_changed_paths']} changed paths", None: "tree state unknown"}
    kept = (
        f"; kept the {len(earlier)} earlier run(s) of {', '.join(_run_date(r) for r in earlier)} under earlier_runs"
        if earlier
        else "; no earlier run of that name"
    )
    print(
        f"wrote {path}: run {len(earlier) + 1} of {name} ({meta['date']}, commit {meta['commit'][:12]}, "
        f"{clean[meta['tree_clean']]}){kept}",
        flush=True,
    )
    if earlier and payload.get("plot"):
        print(
            f"the plot {payload['plot']} now shows this run (it showed the one of {_run_date(earlier[-1])})", flush=True
        )
    return path


# ---- goals and acceptance figures ------------------------------------------------------------------------------


def goal_line(
    name: str,
    measured: float | None,
    goal: float,
    mismatches: int | None,
    *,
    below: bool = False,
    method: str = "",
    label: str = "goal",
) -> dict[str, Any]:
    """Goal `name` (measured >= goal; measured < goal with `below`) is met only when the figure reaches it and
    `mismatches` (greedy outputs of our lossless methods that differ from plain decoding) is 0: a method that changes
    the output measured nothing. Prints `<label> <name>: ... -> met | MISSED by x | NOT MET: n mismatches`."""
    reached = measured is not None and (measured < goal if below else measured >= goal)
    met = reached and mismatches == 0
    if met:
        verdict = "met"
    elif mismatches != 0:
        verdict = f"NOT MET: {'mismatches not checked' if mismatches is None else f'{mismatches} mismatches'}" + (
            " (the figure alone would reach the goal)" if reached else ""
        )
    else:
        verdict = f"MISSED by {abs(goal - measured):.2f}" if measured is not None else "MISSED (not measured)"
    shown = "n/a" if measured is None else f"{measured:.2f}"
    print(
        f"{label} {name}: measured {shown}{f' ({method})' if method else ''}, {mismatches} mismatches -> {verdict}",
        flush=True,
    )
    return {
        "measured": measured,
        "goal": goal,
        "below": below,
        "method": method or None,
        "mismatches": mismatches,
        "reached": reached,
        "met": met,
        "shortfall": 0.0 if reached or measured is None else abs(goal - measured),
        "verdict": verdict,
    }


def spec_figures(parts: Sequence) -> dict[str, Any]:
    """tau, alpha_k (emitted: `SpecStats.tau`, `per_position_acceptance`) of the runs' `SpecStats` joined
    (`SpecStats.cat`: same depth and batch size), the raw ones beside them (`tau_raw`, `alpha_raw`), the cumulative
    acceptance, the live (row, step) pairs (`verify_steps`) and per depth k the steps that reached it (`reached`:
    drafted depth k and emitted at least k tokens, the denominator of the emitted alpha_k)."""
    from eagle.stats import SpecStats

    s = SpecStats.cat(list(parts))
    live = s.accept_lengths >= 0
    emitted = s.emitted_lengths if s.emitted_lengths is not None else s.accept_lengths + 1
    drafted = (
        s.drafted[:, None].expand_as(live) if s.drafted is not None else torch.full_like(s.accept_lengths, s.depth)
    )
    reached = [int(((emitted >= k) & (drafted >= k) & live).sum()) for k in range(1, s.depth + 1)]
    return {
        "tau": s.tau,
        "alpha": s.per_position_acceptance,
        "tau_raw": s.tau_raw,
        "alpha_raw": s.per_position_acceptance_raw,
        "cumulative": s.cumulative_acceptance,
        "verify_steps": int(live.sum()),
        "reached": reached,
    }


def print_table(rows: list[dict[str, Any]], cols: list[str], title: str = "") -> str:
    """Print rows as an aligned text table (floats with 3 significant decimals) and return it."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
        return "" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    width = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = ([title] if title else []) + [
        "  ".join(c.rjust(w) for c, w in zip(cols, width)),
        "  ".join("-" * w for w in width),
    ]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, width)) for row in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text
