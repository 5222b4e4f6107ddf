"""Shared setup of the benchmarks: the embedded target, its traffic regenerated and extracted once, heads trained
once per config, held-out prompts, tables and result files (the interleaved timing: bench/timing.py).

Purpose: every benchmark starts with `setup = prepare(quick)`:
- the embedded default (`EmbeddedConfig.default()`), reused from `.eagle/embedded` when a finished build with that
  config exists there (whatever its hash), else built; `--quick` uses `EmbeddedConfig.tiny()` under `.eagle/bench`;
- the target's training traffic regenerated and extracted (offline features) once into
  `.eagle/bench/<build>-<role>-<preset>/` (the stage components resume and are skipped when done);
- `train_or_reuse_head(setup, name, TrainConfig)` trains a head with `components.train.stage.train` once per (config,
  data) and returns its directory; every benchmark that asks for the same config gets the same head.
Results of a full run go to `bench/results/<name>.json` + `.png`; of a `--quick` run to `.eagle/bench/results-quick/`
so a test never overwrites the committed figures. Every result file carries the run's metadata (commit, clean tree,
CPU model and caches, torch, date) and the machine state (cores, load average before and after, torch threads), and
keeps the earlier runs of its name (bench/report.py, which also holds `goal_line` and `spec_figures`; import them
from here). The machine is shared, so read ratios measured side by side, not absolute speeds.
Torch runs one thread by default (`--threads`): on 2 busy cores a second thread made matrix products 5x slower.
Run: `python bench/common.py [--quick]` prepares the cache and prints where it is.
Not here: what a benchmark measures (bench/*.py), any change to the stages themselves.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "bench"):  # the repository (eagle/, components/) and bench/ (report.py)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

import report  # noqa: E402
from report import cpu_info, goal_line, print_table, run_metadata, spec_figures  # noqa: E402,F401  (re-exported)
from components.extract.stage import ExtractConfig, extract  # noqa: E402
from components.regenerate.stage import RegenerateConfig, regenerate  # noqa: E402
from components.train.stage import RayConfig, TrainConfig, train  # noqa: E402
from eagle.run_config import OptimConfig, TTTConfig  # noqa: E402
from embedded import EmbeddedConfig, build_embedded, load_result  # noqa: E402
from embedded.result import EmbeddedResult  # noqa: E402

DEFAULT_CACHE = ROOT / ".eagle" / "bench"
CACHE = DEFAULT_CACHE  # `--cache DIR` moves it (set by `start`); read it as `common.CACHE`
SETUP_THREADS = 0  # torch threads for the cached setup (regenerate, extract, head training); 0: as --threads
EMBEDDED_ROOT = ROOT / ".eagle" / "embedded"
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Preset:
    """Sizes of one benchmark setting: the embedded build, how much traffic, the base head-training config."""

    name: str
    embedded: EmbeddedConfig
    regenerate: RegenerateConfig
    extract: ExtractConfig
    train: TrainConfig  # in-process (num_workers=0); benchmarks vary ttt_steps / data, never silently the budget
    eval_prompts: int  # held-out prompts per evaluation
    max_new_tokens: int

    @classmethod
    def quick(cls) -> "Preset":
        return cls(
            "quick",
            EmbeddedConfig.tiny(),
            RegenerateConfig(max_new_tokens=24, batch_size=8, shard_size=16, limit=24),
            ExtractConfig(max_len=128, seqs_per_shard=16),
            TrainConfig(
                steps=8,
                batch_size=4,
                draft_vocab_size=128,
                checkpoint_every=1000,
                log_every=4,
                ttt=TTTConfig(ttt_steps=3),
                optim=OptimConfig(lr=3e-3, warmup_steps=2),
                ray=RayConfig(num_workers=0),
            ),
            eval_prompts=3,
            max_new_tokens=16,
        )

    @classmethod
    def default(cls) -> "Preset":
        return cls(
            "default",
            EmbeddedConfig.default(),
            RegenerateConfig(max_new_tokens=96, batch_size=32, shard_size=64, limit=512),
            ExtractConfig(max_len=320, seqs_per_shard=128),
            TrainConfig(
                steps=150,
                batch_size=8,
                draft_vocab_size=2048,
                checkpoint_every=1000,
                log_every=25,
                ttt=TTTConfig(ttt_steps=7),
                optim=OptimConfig(lr=2e-3, warmup_steps=15),
                ray=RayConfig(num_workers=0),
            ),
            eval_prompts=24,
            max_new_tokens=96,
        )

    @classmethod
    def get(cls, quick: bool) -> "Preset":
        return cls.quick() if quick else cls.default()


@dataclass(frozen=True)
class Setup:
    preset: Preset
    emb: EmbeddedResult
    target_dir: Path
    train_traffic: Path
    heldout_traffic: Path
    work: Path  # this (build, role, preset, conversations)'s cache directory
    regen_dir: Path
    extract_dir: Path
    shared: Path  # the (build, role, preset)'s cache directory: what does not depend on the traffic (draft LMs)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def find_embedded(cfg: EmbeddedConfig, root: Path) -> EmbeddedResult | None:
    """The newest finished build under `root` made with `cfg` (its hash may differ when the code moved on)."""
    found = []
    for report_file in root.glob("*/report.json"):
        try:
            res = load_result(report_file.parent)
        except Exception:  # a report of an older format: not ours to reuse
            continue
        if res.config == cfg:
            found.append((report_file.stat().st_mtime, res))
    return max(found, key=lambda x: x[0])[1] if found else None


def _live_partial_builds(root: Path) -> list[Path]:
    """`<hash>.partial-<pid>` directories whose building process is still running."""
    live = []
    for d in root.glob("*.partial-*"):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and Path(f"/proc/{pid}").exists():
            live.append(d)
    return live


def embedded(preset: Preset, wait_s: float = 3600) -> EmbeddedResult:
    """The finished build of the preset's config; waits for one in progress (another process) before building."""
    root = EMBEDDED_ROOT if preset.name == "default" else CACHE / "embedded"
    deadline = time.time() + wait_s
    while (
        (res := find_embedded(preset.embedded, root)) is None and _live_partial_builds(root) and time.time() < deadline
    ):
        _say(f"bench: waiting for the embedded build in progress ({_live_partial_builds(root)[0].name})")
        time.sleep(30)
    if res is None:
        _say(f"bench: building the embedded {preset.name} target under {root} (once)")
        res = build_embedded(preset.embedded, root, progress=False)
    return res


def _quiet(_msg: str) -> None:
    pass


def prepare(quick: bool, role: str = "target", conversations: int = 0) -> Setup:
    """Build or reuse the embedded target and regenerate + extract its training traffic once (cached).

    `conversations` > 0 regenerates that many training conversations instead of the preset's `limit` (its own cache
    directory, suffix `-c<N>`); more than the traffic file holds means all of them.
    """
    preset = Preset.get(quick)
    suffix = ""
    if conversations and conversations != preset.regenerate.limit:
        preset = dataclasses.replace(preset, regenerate=dataclasses.replace(preset.regenerate, limit=conversations))
        suffix = f"-c{conversations}"
    emb = embedded(preset)
    target_dir = emb.target_dir if role == "target" else emb.finetune_dir
    traffic = emb.target_traffic if role == "target" else emb.finetune_traffic
    shared = CACHE / f"{emb.build_hash[:12]}-{role}-{preset.name}"
    work = shared.with_name(shared.name + suffix)
    regen_dir, ext_dir = work / "regenerate", work / "extract"
    done = work / "prepared.json"
    key = fingerprint(preset.regenerate, preset.extract, str(traffic.train))
    if not done.is_file() or json.loads(done.read_text()).get("key") != key:
        t0 = time.perf_counter()
        _say(f"bench: regenerating {preset.regenerate.limit} conversations and extracting features into {work}")
        with setup_threads():
            regenerate(preset.regenerate, str(target_dir), str(traffic.train), str(regen_dir), progress=_quiet)
            ext = extract(preset.extract, str(target_dir), str(regen_dir), str(ext_dir), progress=_quiet)
        done.write_text(
            json.dumps(
                {
                    "key": key,
                    "n_seqs": ext.n_seqs,
                    "n_tokens": ext.n_tokens,
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            )
            + "\n"
        )
    return Setup(
        preset, emb, Path(target_dir), Path(traffic.train), Path(traffic.heldout), work, regen_dir, ext_dir, shared
    )


def setup_threads():
    """Torch threads for setup work (`--setup-threads`): it is not measured, so it may use every core."""
    from eagle.target_path import cpu_threads

    return cpu_threads(SETUP_THREADS)


def fingerprint(*parts: Any) -> str:
    norm = [dataclasses.asdict(p) if dataclasses.is_dataclass(p) else p for p in parts]
    return hashlib.sha256(json.dumps(norm, sort_keys=True, default=str).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class TrainedHead:
    head_dir: Path
    seconds: float  # wall time of the training run (0 when it was found in the cache... see `cached`)
    final_metrics: dict
    cached: bool


def with_ttt_steps(cfg: TrainConfig, k: int) -> TrainConfig:
    """`cfg` training over K = `k` TTT steps."""
    return dataclasses.replace(cfg, ttt=dataclasses.replace(cfg.ttt, ttt_steps=k))


def head_work_dir(setup: Setup, name: str, cfg: TrainConfig, extract_dir: Path | None = None) -> Path:
    """Where `train_or_reuse_head` trains (and caches) the head of this name, config and data; its
    `bench_train.json` appears when the training is done."""
    ext = Path(extract_dir or setup.extract_dir)
    return setup.work / "heads" / f"{name}-{fingerprint(cfg, str(ext))}"


def train_or_reuse_head(setup: Setup, name: str, cfg: TrainConfig, extract_dir: Path | None = None) -> TrainedHead:
    """Train a head with `components.train.stage.train` (or reuse the one trained with the same config and data)."""
    ext = Path(extract_dir or setup.extract_dir)
    out = head_work_dir(setup, name, cfg, ext)
    info = out / "bench_train.json"
    if info.is_file() and (out / "head" / "model.safetensors").is_file():
        d = json.loads(info.read_text())
        return TrainedHead(out / "head", d["seconds"], d["final_metrics"], True)
    _say(f"bench: training head {name} ({cfg.steps} steps, ttt_steps {cfg.ttt.ttt_steps}) into {out}")
    with setup_threads():
        res = train(cfg, str(ext), str(out), target_dir=str(setup.target_dir))
        threads = torch.get_num_threads()
    info.write_text(
        json.dumps({"seconds": res.seconds, "final_metrics": res.final_metrics, "torch_threads": threads}) + "\n"
    )
    return TrainedHead(Path(res.head_dir), res.seconds, res.final_metrics, False)


def speed_head_config(setup: Setup, head_steps: int) -> TrainConfig:
    """The training config of `speed_head`'s head (`head_steps` 0: the preset's steps)."""
    return dataclasses.replace(with_ttt_steps(setup.preset.train, 7), steps=head_steps or setup.preset.train.steps)


def speed_head(setup: Setup, head_steps: int, conversations: int) -> tuple[TrainedHead, str]:
    """The TTT (K=7) head that `speedup.py` and `chain_depth.py` measure (`head_steps` 0: the preset's steps), and
    the suffix that names their result files after it (`-head<N>`, `-conv<N>`; empty for the preset's head)."""
    cfg = speed_head_config(setup, head_steps)
    steps = cfg.steps
    head = train_or_reuse_head(setup, "eagle3-ttt7", cfg)
    suffix = (f"-head{steps}" if steps != setup.preset.train.steps else "") + (
        f"-conv{conversations}" if conversations else ""
    )
    return head, suffix


def heldout_prompts(tokenizer, path: Path, limit: int, max_prompt_tokens: int = 256) -> list[list[int]]:
    """Token ids of the first user turn (chat template, generation prompt) of the first `limit` conversations."""
    from components.data.chat import prompt_ids
    from components.data.traffic_io import load_traffic

    out = []
    for conv in load_traffic(path).conversations:
        first = next(i for i, m in enumerate(conv.messages) if m.role == "user")
        ids = prompt_ids(tokenizer, [{"role": m.role, "content": m.content} for m in conv.messages[: first + 1]])
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
        if len(out) >= limit:
            break
    return out


def until_eos(tokens: list[int], eos: int | tuple[int, ...] | None) -> list[int]:
    """`tokens` up to and including the first end-of-sequence id (transformers pads after it)."""
    ends = eos if isinstance(eos, tuple) else (eos,)
    return tokens[: next((i + 1 for i, t in enumerate(tokens) if t in ends), len(tokens))]


def eos_of(target) -> int | tuple[int, ...] | None:
    eos = target.generation_config.eos_token_id
    return tuple(eos) if isinstance(eos, list) else eos


# ---- reporting (bench/report.py) -------------------------------------------------------------------------------


def results_dir(quick: bool) -> Path:
    d = CACHE / "results-quick" if quick else RESULTS
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_results(name: str, quick: bool, payload: dict[str, Any], load_before: list[float]) -> Path:
    """`report.write_results` into `results_dir(quick)`: this run's record with its metadata (commit, clean tree, CPU
    and caches, torch, date), the earlier runs of that name kept under `earlier_runs`; prints what it wrote."""
    return report.write_results(name, quick, payload, load_before, results_dir(quick))


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_plot(path: Path, lines: dict[str, tuple[list, list]], xlabel: str, ylabel: str, title: str) -> None:
    """One marked line per label (`lines`: label -> (xs, ys)) on one axis, saved as `path` (a .png)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (xs, ys) in lines.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def base_args(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny embedded preset, under 2 minutes (for tests)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared 2-core machine two threads oversubscribe the "
        "cores and every op runs several times slower; 0 keeps torch's default)",
    )
    p.add_argument(
        "--setup-threads",
        type=int,
        default=0,
        help="torch threads for the cached setup (regenerate, extract, training heads): not measured, so "
        "2 halves the first run on a quiet 2-core machine (default 0: as --threads)",
    )
    p.add_argument(
        "--conversations",
        type=int,
        default=0,
        help="training conversations to regenerate (0: the preset's 512; the embedded traffic has 2,000)",
    )
    p.add_argument(
        "--cache",
        default="",
        help=f"cache directory (default {DEFAULT_CACHE.relative_to(ROOT)}; the embedded "
        "default is still looked for in .eagle/embedded)",
    )
    return p


def start(args: argparse.Namespace) -> list[float]:
    """Apply common arguments; returns the load average at the start."""
    global CACHE, SETUP_THREADS
    SETUP_THREADS = args.setup_threads
    if args.cache:
        CACHE = Path(args.cache).resolve()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return list(os.getloadavg())


def argv_without(argv: list[str], flag: str) -> list[str]:
    """`argv` less `flag` and its value (`--flag V` or `--flag=V`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


if __name__ == "__main__":
    a = base_args(__doc__.splitlines()[0]).parse_args()
    start(a)
    s = prepare(a.quick, conversations=a.conversations)
    print(
        json.dumps(
            {"build": str(s.emb.build_dir), "work": str(s.work), **json.loads((s.work / "prepared.json").read_text())},
            indent=2,
        )
    )
