"""Where a command's CPU time goes, by kind of process: `python bench/cpu_by_process.py [--out F] -- CMD ...`.

Purpose: the suite and the demo are CPU-bound on 2 cores, so what makes them slow is CPU-seconds, and most of those
are spent in processes the command starts (vLLM's API server and engine core, Ray workers, Prefect servers, CLI
subprocesses). This runs CMD, reads every process's CPU ticks from /proc every `--every` seconds until CMD exits,
and prints CPU-seconds and process counts by kind (`KINDS`: the first pattern of the command line that matches),
the processes already running when it started left out. A process that lives shorter than one sample is missed
and one's last `--every` seconds may be; both are small beside the totals that matter. `--out` writes every process
seen (command line, parent, CPU-seconds, first and last seen) as JSON, for a closer look. Linux only.
Not here: wall-clock profiles of one process (`python -X importtime`, py-spy), GPU time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

KINDS = (  # (kind, regex on the command line), first match wins
    # vLLM titles its engine core and workers (`VLLM::EngineCore`, `VLLM::Worker`) once they run: forked from a
    # zygote's server (infra/vllm_zygote.py) the core shows the zygote's command line until then, a spawned one
    # `python -c ... multiprocessing ...`
    ("vLLM engine core and worker", r"^VLLM::|venv-vllm\S*python\S* .*multiprocessing"),
    ("vLLM API server forked by a zygote, and the zygote", r"vllm_zygote\.py"),  # infra/vllm_zygote.py
    ("vLLM API server", r"vllm\.entrypoints\.openai\.api_server"),
    ("vLLM load client", r"venv-vllm\S*python\S* -c"),
    ("vLLM, other", r"venv-vllm"),
    ("Ray worker", r"default_worker\.py"),
    ("Ray, other", r"raylet|gcs_server|ray/_private|ray/dashboard|log_monitor|runtime_env/agent|ray::"),
    ("pytest (xdist worker or main)", r"-c import sys;exec\(eval\(sys\.stdin|-m pytest|bin/pytest"),
    ("Prefect server", r"prefect server start|prefect\.server\.api\.server|uvicorn"),
    ("Prefect, other", r"prefect"),
    ("MLflow server", r"mlflow"),
    ("eagle-heads CLI", r"flows\.cli|eagle-heads"),
    ("benchmark script", r"bench/\w+\.py"),
    ("pip", r"\bpip\b"),
)


def kind_of(cmdline: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, cmdline):
            return kind
    return "other: " + (cmdline.split(" ")[0] or "(no command line)")[-40:]


def _processes() -> dict[str, tuple[int, str, float]]:
    """`pid:starttime` -> (parent pid, command line, CPU-seconds so far) of every process readable now."""
    hz = os.sysconf("SC_CLK_TCK")
    seen = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError):
            continue  # gone between listing and reading
        seen[f"{pid}:{fields[19]}"] = (int(fields[1]), cmdline, (int(fields[11]) + int(fields[12])) / hz)
    return seen


def profile(cmd: list[str], every: float = 0.5) -> tuple[int, float, dict[str, dict]]:
    """Run `cmd` and sample; (its exit code, its wall seconds, every new process by `pid:starttime`)."""
    before = set(_processes())
    rows: dict[str, dict] = {}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    while True:
        done = proc.poll() is not None
        now = time.monotonic() - t0
        for key, (ppid, cmdline, cpu) in _processes().items():
            if key in before:
                continue
            row = rows.setdefault(key, {"pid": int(key.split(":")[0]), "ppid": ppid, "cmdline": cmdline[:400],
                                        "first_s": round(now, 1)})
            if cmdline and (not row["cmdline"] or cmdline.startswith("VLLM::")):  # seen before its exec or title
                row["cmdline"] = cmdline[:400]
            row["cpu_s"], row["last_s"] = cpu, round(now, 1)
        if done:
            return proc.returncode, time.monotonic() - t0, rows
        time.sleep(every)


def table(rows: dict[str, dict], wall_s: float) -> str:
    cpu, count = collections.Counter(), collections.Counter()
    for row in rows.values():
        kind = kind_of(row["cmdline"])
        cpu[kind] += row["cpu_s"]
        count[kind] += 1
    total = sum(cpu.values())
    lines = [f"{'CPU-s':>8} {'share':>6} {'procs':>6}  kind",
             *(f"{s:8.0f} {s / total:6.1%} {count[k]:6d}  {k}" for k, s in cpu.most_common())]
    lines.append(f"{total:8.0f} {'':>6} {sum(count.values()):6d}  in all, over {wall_s:.0f} s of wall time "
                 f"({total / wall_s:.2f} cores busy on average)" if wall_s else "")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    p.add_argument("--out", help="write every process seen as JSON here")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("give the command to profile after --")
    if not a.every > 0:  # 0 would sample in a busy loop, beside the command it measures
        p.error(f"--every must be > 0 seconds, got {a.every}")
    if not os.path.isdir("/proc/self"):
        p.error("reads /proc: Linux only")
    rc, wall, rows = profile(cmd, a.every)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cmd": cmd, "exit_code": rc, "wall_s": round(wall, 1), "processes": list(rows.values())}, f)
    print(table(rows, wall), file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
