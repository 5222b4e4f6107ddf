"""Which way the target's passes run on the machine at hand, chosen by timing them on the target itself.

Purpose: the speed layer (`eagle.fastpath`: oneDNN products over packed weights, the lean decoder) was tuned on one
kind of CPU; on another it can lose to HF's own forward and torch's own kernels (an Intel Xeon with AMX ran
transformers `generate` at 1.15x our plain decoding). A path is a decoder and a kernel choice:
- decoder "lean" (`fastpath.LeanDecoder`, Llama-family targets only) or "hf" (the model's own forward);
- kernels "packed" (`fastpath.linear`, oneDNN over packed weights, CPU without autograd) or "torch" (`F.linear`).
`PATHS` are the four; `DEFAULT` is the speed layer. All four compute the same thing up to rounding.
`resolve(target, "auto", role)` times every path that applies on two synthetic passes after a 48-token prefix
(rounds interleaved across paths, about a second in all; each path's fastest round counts) once per target,
device, dtype and thread count in a process, and picks per `ROLES`: "decode" (a 1-token pass: plain decoding, a
draft model) and "verify" (an 8-token pass: the speculative step's verification). The two differ: on an AMD EPYC
the packed kernels verified fastest while torch's decoded up to 25% faster in some processes, and one choice for
both made a process's plain-decoding baseline, hence its speedup, depend on which way that process's mixed timing
fell (1.1x or 1.5x for the same head, bench/README.md). Per role it keeps `DEFAULT` unless another path is faster
by more than `MARGIN`, and among the others prefers the earlier in `PATHS` the same way (so close timings give the
same choice in every process). A large target on CPU spends ~40 passes on this
once: pin a path there. `EAGLE_TARGET_PATH` pins one path for every "auto"; `SpecConfig.path` pins it per call.
Kept across processes: when `EAGLE_TARGET_PATH_TIMINGS` names a JSON file (the CLI sets
`<state dir>/target_paths.json`), each measurement is merged into it per machine (host, CPU model, cores), target
shape, device, dtype, threads and torch version, keeping each path's fastest pass ever seen, and the pick is made
from those kept minima. One process's timing is a second of passes on whatever else the machine was doing then; on
an AMD EPYC under load the decode pick still differed between processes (1.19x vs 1.43x for the same head,
bench/README.md); the kept minima converge to each path's own cost, so every later process of the machine takes
the same path. A file that cannot be read is started afresh; one that cannot be written leaves this process's pick
as measured.
`timing(target)` is the last measurement, `record(target, path)` what result files keep of it. `cpu_threads(n)`
runs a block with n torch threads (the thread count is part of every timing's key).
How to run: `TargetRunner(target, capacity, path="auto")` (eagle/runners.py) resolves its path here, handing in
its own timing (`eagle.runners.time_paths`: this module times runners it is handed and imports none).
Not here: the head's kernels (`eagle.draft`, always `fastpath.linear`), GPU kernels, torch.compile.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from eagle.run_config import TARGET_PATHS

PATHS = TARGET_PATHS
DEFAULT = "lean-packed"
AUTO = "auto"
MARGIN = 0.05  # another path must be this much faster than the default to be picked
ENV = "EAGLE_TARGET_PATH"
STORE_ENV = "EAGLE_TARGET_PATH_TIMINGS"  # a JSON file keeping each path's fastest pass across processes
STORE_VERSION = 1  # bump when the timed passes change (PREFIX, WIDTH, ROLES): older minima no longer compare
# rounds: at least MIN_ROUNDS, then more until BUDGET_S has passed or MAX_ROUNDS; each path's fastest round counts
# (other work on the machine only adds time, so the minimum is the steadiest estimate of a path's own cost)
MIN_ROUNDS, MAX_ROUNDS, BUDGET_S, WARMUP, PREFIX, WIDTH = 5, 40, 1.0, 2, 48, 8
ROLES = {"decode": 1, "verify": WIDTH}  # role -> tokens per timed pass

# (target, paths) -> role -> path -> the fastest pass in seconds: `eagle.runners.time_paths` (handed in by the runner)
Timer = Callable[[nn.Module, list[str]], dict[str, dict[str, float]]]
_TIMINGS: "weakref.WeakKeyDictionary[nn.Module, dict[tuple, PathTiming]]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class PathTiming:
    """One measurement: per role, the path picked, each path's fastest pass in seconds and why it was picked.
    `chosen`, `seconds`, `reason` are the "verify" role's (the speculative step's)."""

    by_role: dict[str, "PathTiming"] = field(default_factory=dict, compare=False)
    chosen: str = ""
    seconds: dict[str, float] = field(default_factory=dict)  # the kept minima when a store is used, else this process's
    reason: str = ""
    measured: dict[str, float] = field(default_factory=dict)  # this process's own fastest pass per path
    kept: int = 0  # measurements merged into `seconds` (this one included); 0: no store

    def pick(self, role: str) -> str:
        return self.by_role[role].chosen if role in self.by_role else self.chosen

    def as_dict(self) -> dict:
        def one(t: "PathTiming") -> dict:
            base = t.seconds.get(DEFAULT)
            out = {
                "chosen": t.chosen,
                "reason": t.reason,
                "ms_per_pass": {p: round(s * 1e3, 3) for p, s in t.seconds.items()},
                "x_default": {p: round(base / s, 3) for p, s in t.seconds.items()} if base else {},
            }
            if t.kept:
                out |= {
                    "measurements_kept": t.kept,
                    "ms_this_process": {p: round(s * 1e3, 3) for p, s in t.measured.items()},
                }
            return out

        return {**one(self), **{role: one(t) for role, t in self.by_role.items()}}


def check(path: str) -> str:
    """`path` if it names a path or "auto"; a clear error otherwise."""
    if path != AUTO and path not in PATHS:
        raise ValueError(f"unknown target path {path!r}: use one of {(AUTO,) + PATHS}")
    return path


def decoder_of(path: str) -> str:
    return path.split("-")[0]


def kernels_of(path: str) -> str:
    return path.split("-")[1]


def choose(seconds: dict[str, float], default: str = DEFAULT, margin: float = MARGIN) -> str:
    """The first path in the order `default`, then `PATHS`, that is within `margin` of the fastest: a path is only
    left for one that is clearly faster, so close timings give the same choice every time."""
    best = min(seconds.values())
    order = [default] + [p for p in PATHS if p != default]
    return next(p for p in order if p in seconds and seconds[p] * (1 - margin) <= best)


def pinned() -> str | None:
    """The path `EAGLE_TARGET_PATH` pins (None: unset or "auto")."""
    env = os.environ.get(ENV, "").strip()
    if not env or env == AUTO:
        return None
    try:
        return check(env)
    except ValueError as e:
        raise ValueError(f"{ENV}={env!r}: {e}") from None


def resolve(target: nn.Module, path: str, role: str, timer: Timer) -> str:
    """The path a runner of `target` in `role` (`ROLES`) uses: `path` itself unless "auto"; then
    `EAGLE_TARGET_PATH`, else the one measured fastest for that role (`measure` with `timer`)."""
    if check(path) != AUTO:
        return path
    if role not in ROLES:
        raise ValueError(f"role {role!r}: expected one of {sorted(ROLES)}")
    return pinned() or measure(target, timer).pick(role)


def timing(target: nn.Module) -> PathTiming | None:
    """The last measurement made for `target` in this process (None: never measured, e.g. a pinned path)."""
    got = _TIMINGS.get(target)
    return next(reversed(got.values())) if got else None


def record(target: nn.Module, path: str = AUTO) -> dict:
    """For a result file: how runners of `target` with `path` ran it (the measurement when auto measured one:
    the "verify" role's at the top level, each role's under its name)."""
    timed = timing(target)
    if timed is not None and path == AUTO and pinned() is None:
        return timed.as_dict()
    if path == AUTO and pinned() is None:
        return {"chosen": "", "reason": "not measured in this process"}
    return {"chosen": pinned() if path == AUTO else check(path), "reason": "pinned"}


def _key(target: nn.Module) -> tuple:
    p = next(target.parameters())
    return (str(p.device), p.dtype, torch.get_num_threads())


def measure(target: nn.Module, timer: Timer) -> PathTiming:
    """Time the paths that apply to `target` with `timer` (`eagle.runners.time_paths`; cached per target, device,
    dtype and thread count), merged into the kept timings when a store is set."""
    from eagle.fastpath import LeanDecoder

    key = _key(target)
    got = _TIMINGS.setdefault(target, {})
    if key in got:
        return got[key]
    lean = LeanDecoder.of(target) is not None
    timed = timer(target, [p for p in PATHS if lean or decoder_of(p) == "hf"])
    kept, n_kept = _keep(target, timed)
    by_role = {}
    for role, measured in timed.items():
        seconds = kept.get(role, measured)
        default = DEFAULT if DEFAULT in seconds else "hf-packed"
        chosen = choose(seconds, default)
        if not lean:
            reason = "no lean decoder for this target (family, attention or forward hooks); "
        elif DEFAULT not in seconds:
            reason = "the lean decoder did not reproduce HF's forward; "
        else:
            reason = ""
        reason += (
            f"no path faster than {default} by more than {MARGIN:.0%}"
            if chosen == default
            else f"{seconds[default] / seconds[chosen]:.2f}x as fast as {default}"
        )
        if n_kept > 1:
            reason += f" (fastest passes kept over {n_kept} measurements on this machine)"
        by_role[role] = PathTiming(chosen=chosen, seconds=seconds, reason=reason, measured=measured, kept=n_kept)
    v = by_role["verify"]
    got[key] = PathTiming(by_role, v.chosen, v.seconds, v.reason, v.measured, v.kept)
    return got[key]


def _store_key(target: nn.Module) -> str:
    """What a kept timing is valid for: the machine, the target's shape, device, dtype, threads, torch, protocol."""
    cfg = getattr(target, "config", None)
    shape = {
        k: getattr(cfg, k, None)
        for k in (
            "model_type",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        )
    }
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    device, dtype, threads = _key(target)
    return json.dumps(
        {
            "v": STORE_VERSION,
            "host": platform.node(),
            "cpu": cpu,
            "cores": os.cpu_count(),
            "shape": shape,
            "device": device,
            "dtype": str(dtype),
            "threads": threads,
            "torch": torch.__version__,
        },
        sort_keys=True,
    )


def _keep(target: nn.Module, timed: dict[str, dict[str, float]]) -> tuple[dict[str, dict[str, float]], int]:
    """Merge this process's `timed` (role -> path -> seconds) into the store `STORE_ENV` names and return the
    kept minima for the paths timed here, and how many measurements they span; ({}, 0) without a store.
    Read, merge and write happen under an exclusive lock on `<file>.lock`, the write through a temporary file."""
    store = os.environ.get(STORE_ENV, "").strip()
    if not store:
        return {}, 0
    key = _store_key(target)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(store)), exist_ok=True)
        lock = open(store + ".lock", "a")
    except OSError:
        return {}, 0
    with lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass  # no POSIX locks here: a concurrent writer may drop one merge, never corrupt the file
        try:
            with open(store) as f:
                data = json.load(f)
            entries = data["entries"] if isinstance(data, dict) and isinstance(data.get("entries"), dict) else {}
        except (OSError, ValueError):
            entries = {}
        entry = entries.get(key) if isinstance(entries.get(key), dict) else {}
        old = entry.get("seconds") if isinstance(entry.get("seconds"), dict) else {}
        kept = {}
        for role, seconds in timed.items():
            before = old.get(role) if isinstance(old.get(role), dict) else {}
            kept[role] = {
                p: min(s, float(before[p])) if isinstance(before.get(p), (int, float)) and before[p] > 0 else s
                for p, s in seconds.items()
            }
        merged = {
            role: {**(old.get(role) if isinstance(old.get(role), dict) else {}), **kept.get(role, {})}
            for role in set(old) | set(kept)
        }
        n = int(entry.get("measurements", 0)) + 1 if isinstance(entry.get("measurements", 0), int) else 1
        entries[key] = {"seconds": merged, "measurements": n, "updated": time.strftime("%Y-%m-%dT%H:%M:%S")}
        tmp = f"{store}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(
                    {
                        "what": "eagle/target_path.py: each target path's fastest pass (s) per role, kept "
                        "across processes",
                        "entries": entries,
                    },
                    f,
                    indent=1,
                    sort_keys=True,
                )
            os.replace(tmp, store)
        except OSError:
            if os.path.exists(tmp):
                os.unlink(tmp)
            return kept, n  # unwritable: this process still picks from what it read and measured
    return kept, n


@contextlib.contextmanager
def cpu_threads(n: int):
    """Run the block with `n` torch CPU threads (0: leave the current setting), then restore it."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
