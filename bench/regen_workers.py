"""Regeneration throughput: conversations/s and tokens/s with 1 vs 2 Ray workers (and in this process), same bytes.

Run: `python bench/regen_workers.py [--quick] [--conversations N] [--workers 0,1,2] [--runs R]`
`components.regenerate.stage.regenerate` answers the first N training conversations of the embedded default's traffic
(`common.prepare`; default N = 64, quick 24) with the preset's regeneration settings (sampling at its temperature,
seeded per shard) in 8 shards, once per worker count: 0 = in this process (torch at `--threads`), 1 and 2 = Ray
actors of one CPU each (torch one thread each) on one local Ray of 2 CPUs started before the timing. Per run:
  wall_s     the regenerate call: worker start and target load included (the in-process run loads it too)
  conv_s     conversations / wall_s;  tok_s  tokens of the regenerated answers (re-tokenised) / wall_s
  first_shard_s  until the first shard was written (worker start, target load, one shard)
  steady_conv_s  conversations/s once every worker returned its first shard (shards finished after the first
                 `workers` ones, over the time since): the rate without the start-up
  vs_1w, steady_vs_1w  conv_s and steady_conv_s over the 1-worker run's
  identical  every shard file's sha256 equal to the first run's
With R runs per count (order rotated) the table keeps each count's fastest. Writes regen_workers.json. On 2 cores
shared with other jobs, 2 workers scale by at most 2x; read the ratios of one run.
Not measured here: an endpoint (vLLM's own batching decides there), GPUs, multi-node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shutil
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)

from common import base_args, prepare, print_table, start, write_results
from components.data.regenerated import read_regenerated
from components.regenerate.stage import RegenerateConfig, regenerate
from components.targets.runtime import StageContext


def digests(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("shard-*"))}


def answer_tokens(out: Path, target_dir: Path) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    return sum(
        len(tok.encode(m.content, add_special_tokens=False))
        for c in read_regenerated(str(out))
        for m in c.messages
        if m.role == "assistant"
    )


SHARD_LINE = re.compile(r"regenerate: shard \d+/\d+: (\d+) ok, (\d+) failed")


def steady_rate(done: list[tuple[float, int]], workers: int) -> float | None:
    """Conversations/s once every worker has returned its first shard: the shards finished after the first
    `workers` ones, over the time since (worker start and target load out)."""
    k = max(1, workers)
    if len(done) <= k:
        return None
    rest = sum(n for _, n in done[k:])
    return rest / max(done[-1][0] - done[k - 1][0], 1e-9)


def run_one(cfg: RegenerateConfig, workers: int, target_dir: Path, traffic: Path, root: Path, settings) -> dict:
    out = root / f"w{workers}-{time.strftime('%H%M%S')}-{time.perf_counter_ns() % 10**6}"
    done: list[tuple[float, int]] = []  # (seconds since the start, conversations) per shard, as they finish

    def on_line(line: str) -> None:
        if m := SHARD_LINE.match(line):
            done.append((time.perf_counter() - t0, int(m[1]) + int(m[2])))

    t0 = time.perf_counter()
    res = regenerate(
        dataclasses.replace(cfg, num_workers=workers),
        str(target_dir),
        str(traffic),
        str(out),
        progress=on_line,
        context=StageContext(settings=settings),
    )
    wall = time.perf_counter() - t0
    return {
        "workers": workers,
        "where": "in process" if workers == 0 else f"{workers} Ray worker(s)",
        "wall_s": wall,
        "first_shard_s": done[0][0] if done else None,
        "steady_conv_s": steady_rate(done, workers),
        "ok": res.ok,
        "failed": res.failed,
        "digests": digests(out),
        "out": out,
    }


def main() -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--workers", default="0,1,2", help="worker counts to compare (0: in this process)")
    p.add_argument("--runs", type=int, default=1, help="runs per worker count (the fastest is kept)")
    p.add_argument("--shards", type=int, default=8, help="shards the conversations are split into")
    args = p.parse_args()
    load0 = start(args)
    n = args.conversations or (24 if args.quick else 64)
    setup = prepare(args.quick, conversations=n)
    base = setup.preset.regenerate
    shard = -(-n // args.shards)
    cfg = dataclasses.replace(
        base, limit=n, shard_size=shard, batch_size=min(base.batch_size, shard), cpus_per_worker=1
    )
    counts = [int(x) for x in args.workers.split(",")]

    from infra.ray_cluster import ray_session
    from infra.settings import Settings

    settings = Settings.local(common.CACHE / "ray-state", ray_auth_mode="disabled")
    root = common.CACHE / "regen-workers"
    runs: list[dict] = []
    with ray_session(settings, num_cpus=2):  # Ray's own start stays out of the timing; actors start in each run
        for r in range(args.runs):
            order = counts[r % len(counts) :] + counts[: r % len(counts)]
            for w in order:
                runs.append(run_one(cfg, w, setup.target_dir, setup.train_traffic, root, settings))
                print(f"{runs[-1]['where']}: {runs[-1]['wall_s']:.1f} s", flush=True)
    reference = runs[0]["digests"]
    tokens = answer_tokens(runs[0]["out"], setup.target_dir)
    rows = []
    for w in counts:
        best = min((x for x in runs if x["workers"] == w), key=lambda x: x["wall_s"])
        rows.append(
            {
                **{k: v for k, v in best.items() if k not in ("digests", "out")},
                "conv_s": n / best["wall_s"],
                "tok_s": tokens / best["wall_s"],
                "identical": all(x["digests"] == reference for x in runs if x["workers"] == w),
            }
        )
    one = next((r for r in rows if r["workers"] == 1), None)
    for r in rows:
        r["vs_1w"] = r["conv_s"] / one["conv_s"] if one else None
        r["steady_vs_1w"] = (
            r["steady_conv_s"] / one["steady_conv_s"] if one and one["steady_conv_s"] and r["steady_conv_s"] else None
        )
    for x in runs:
        shutil.rmtree(x["out"], ignore_errors=True)
    table = print_table(
        rows,
        [
            "where",
            "wall_s",
            "first_shard_s",
            "conv_s",
            "tok_s",
            "vs_1w",
            "steady_conv_s",
            "steady_vs_1w",
            "ok",
            "identical",
        ],
        f"regenerate {n} conversations ({setup.preset.name} target, {cfg.shard_size} per shard, "
        f"{cfg.max_new_tokens} new tokens, T={cfg.temperature}; {tokens} answer tokens), "
        "1 CPU per Ray worker",
    )
    write_results(
        "regen_workers",
        args.quick,
        {
            "regenerate_config": dataclasses.asdict(cfg),
            "conversations": n,
            "answer_tokens": tokens,
            "runs": [{k: v for k, v in x.items() if k not in ("digests", "out")} for x in runs],
            "rows": rows,
            "table": table,
        },
        load0,
    )
    if not all(r["identical"] for r in rows):
        raise SystemExit("regen_workers: the shard files differ between worker counts")


if __name__ == "__main__":
    main()
