"""Head-training throughput and memory: offline vs online features, 1 vs 2 Ray workers.

Run: `python bench/train_throughput.py [--quick] [--steps 30] [--workers 1,2]`
Four runs of `components.train.train` (TTT, the preset's head config) on one local Ray (2 CPUs), each worker
with one CPU: features read from the offline shards of the extract stage, or computed online by the target in
the worker (`ExtractConfig(mode="online")`), on 1 and 2 workers (DDP). Reports per run:
  tok_s_total     trained tokens per second over all workers, in steady state (from the run's history: the
                  tokens and time between the first logged step and the last, so start-up and the first step's
                  one-off costs are out)
  tok_s_worker    tok_s_total / workers;  scaling = tok_s_total(2 workers) / tok_s_total(1 worker)
  peak_rss_mib    largest peak resident memory of a Ray Train worker process (VmHWM from /proc, polled)
  wall_s          the whole fit, Ray's worker start-up included
Writes train_throughput.json and .png. On a 2-core machine shared with others, 2 workers can scale at most 2x and
usually less; read the ratios of one run.
Not measured here: GPUs, multi-node, the driver's memory.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)

from common import Setup, base_args, prepare, print_table, pyplot, results_dir, start, write_results
from components.extract import extract
from components.train import RayConfig, TrainConfig, train


class WorkerMemory:
    """Polls /proc for Ray Train worker processes and keeps each one's peak resident memory (VmHWM)."""

    def __init__(self, every_s: float = 0.5):
        self.peak_kib: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)

    def __enter__(self) -> "WorkerMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            for proc in Path("/proc").glob("[0-9]*"):
                try:
                    if b"RayTrainWorker" not in (proc / "cmdline").read_bytes():
                        continue
                    for line in (proc / "status").read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            kib = int(line.split()[1])
                            pid = int(proc.name)
                            self.peak_kib[pid] = max(self.peak_kib.get(pid, 0), kib)
                except (OSError, ValueError):
                    continue
            self._stop.wait(every_s)

    def peak_mib(self) -> float:
        return max(self.peak_kib.values(), default=0) / 1024


def steady_rate(history: Path, extract_dir: Path, cfg: TrainConfig) -> float:
    """Tokens/s between the first and last logged steps, from the cumulative rates the trainer logs."""
    from components.train_data import TrainingData, batches

    rows = [json.loads(x) for x in history.read_text().splitlines() if x.strip()]
    data = TrainingData.open(extract_dir, verify=False)
    lengths = (data.offsets[1:] - data.offsets[:-1]).tolist()
    world = cfg.ray.num_workers or 1
    seen, cum = 0, {}
    for step, idx in batches(data.n_seqs, cfg.batch_size, cfg.seed, 0, 0, world):  # rank 0's tokens, as logged
        if step >= cfg.steps:
            break
        seen += len(idx) * max(lengths[i] for i in idx)
        cum[step + 1] = seen * world
    (s0, r0), (s1, r1) = (rows[0]["step"], rows[0]["tokens_per_s"]), (rows[-1]["step"], rows[-1]["tokens_per_s"])
    t0, t1 = cum[s0] / r0, cum[s1] / r1
    return (cum[s1] - cum[s0]) / max(t1 - t0, 1e-9) if s1 > s0 else r1


def online_extract(setup: Setup) -> Path:
    out = setup.work / "extract-online"
    if not (out / "manifest.json").is_file():
        extract(dataclasses.replace(setup.preset.extract, mode="online"), str(setup.target_dir), str(setup.regen_dir),
                str(out), progress=lambda _m: None)
    return out


def run_one(setup: Setup, cfg: TrainConfig, ext: Path, name: str, storage: Path) -> dict:
    out = common.CACHE / "train-throughput" / f"{name}-{time.strftime('%H%M%S')}"
    with WorkerMemory() as mem:
        t0 = time.perf_counter()
        res = train(cfg, str(ext), str(out), target_dir=str(setup.target_dir), storage_dir=str(storage))
        wall = time.perf_counter() - t0
    total = steady_rate(Path(res.history_file), ext, cfg)
    workers = cfg.ray.num_workers
    return {"run": name, "workers": workers, "tok_s_total": total, "tok_s_worker": total / workers,
            "peak_rss_mib": mem.peak_mib(), "wall_s": wall, "final_loss": res.final_metrics.get("loss")}


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = [r["run"] for r in rows]
    a.bar(names, [r["tok_s_worker"] for r in rows], color="#3a7")
    a.bar(names, [r["tok_s_total"] - r["tok_s_worker"] for r in rows], bottom=[r["tok_s_worker"] for r in rows],
          color="#9c9", label="other workers")
    a.set_ylabel("trained tokens/s (per worker, stacked to total)")
    a.tick_params(axis="x", rotation=20)
    a.legend(fontsize=8)
    b.bar(names, [r["peak_rss_mib"] for r in rows], color="#c84")
    b.set_ylabel("peak RSS of a worker (MiB)")
    b.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=0, help="training steps per run (0: 30, quick: 6)")
    p.add_argument("--workers", default="1,2")
    args = p.parse_args()
    load0 = start(args)
    setup = prepare(args.quick, conversations=args.conversations)
    steps = args.steps or (6 if args.quick else 30)
    base = dataclasses.replace(setup.preset.train, steps=steps, log_every=max(1, steps // 6), checkpoint_every=steps,
                               ray=RayConfig(cpus_per_worker=1, max_failures=0))
    exts = {"offline": setup.extract_dir, "online": online_extract(setup)}

    from infra.ray_cluster import ray_session
    from infra.settings import Settings

    settings = Settings.local(common.CACHE / "ray-state", ray_auth_mode="disabled")
    rows = []
    with ray_session(settings, num_cpus=2):
        for mode, ext in exts.items():
            for w in (int(x) for x in args.workers.split(",")):
                cfg = dataclasses.replace(base, ray=dataclasses.replace(base.ray, num_workers=w))
                rows.append(run_one(setup, cfg, ext, f"{mode}-{w}w", settings.ray_storage_dir))
                print(f"{rows[-1]['run']}: {rows[-1]['tok_s_total']:.0f} tok/s", flush=True)
    by = {r["run"]: r for r in rows}
    for r in rows:
        one = by.get(r["run"].rsplit("-", 1)[0] + "-1w")
        r["scaling"] = r["tok_s_total"] / one["tok_s_total"] if one else None
    table = print_table(rows, ["run", "workers", "tok_s_total", "tok_s_worker", "scaling", "peak_rss_mib", "wall_s"],
                        f"TTT head training (K={base.ttt.ttt_steps}, batch {base.batch_size} per worker, {steps} steps),"
                        " "
                        "local Ray, 1 CPU per worker")
    png = results_dir(args.quick) / "train_throughput.png"
    plot(rows, png)
    write_results("train_throughput", args.quick, {"train_config": dataclasses.asdict(base), "rows": rows,
                                                   "table": table, "plot": str(png)}, load0)


if __name__ == "__main__":
    main()
