"""The accelerator run through the real pipeline: build, regenerate, extract, train, evaluate with the components.

Run: on the device `bash bench/gpu.sh` (bench/README.md, "GPU run"); `python bench/gpu_pipeline.py --quick --device
cpu` runs the same stages on the tiny embedded target and the `tiny` preset's sections in about a minute
(tests/test_bench_gpu_quick.py, with Ray, MLflow, Prefect, matplotlib and datasets unimportable).
What it does, each stage timed, `gpu_pipeline.json` (--more: `gpu_pipeline_more.json`) rewritten after each (a run
cut short keeps what it measured, `status` "partial"):
  build       embedded: `EmbeddedConfig.gpu()` (--quick: `tiny()`), its training on the device
  regenerate  components.regenerate.stage with the `gpu` preset's section (components/config/presets.py `gpu_stages`)
  extract     components.extract.stage (fused features, draft vocabulary)
  train       components.train.stage in-process (`train.ray.num_workers` 0: no Ray), on the device (`ray.use_gpu`)
  evaluate    components.evaluate.stage: tau, acceptance per position, speedup against plain decoding, outputs identical
              (--more: `evaluate_tree`, `evaluate_sampled` (`more_evaluations`) and `batch` (`batch_throughput`:
              tokens/s of the chain against plain at batch 1, 8, 32, 64) instead: a second device call that re-uses
              the first one's stage outputs on a warm machine)
Imports only torch, transformers, safetensors, tokenizers, eagle/ and components/ (no infra/ or flows/): the device
has no Ray, MLflow or Prefect. Without matplotlib the evaluation's PNG plots are skipped (`_without_plots`).
Not here: registration or serving (they need MLflow and vLLM), MFU (see git history of bench/gpu.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):  # the project's packages; bench/batch.py's measurement (--more)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

from components.config.presets import gpu_stages, tiny_stages  # noqa: E402
from components.evaluate.stage import HeadEval, evaluate  # noqa: E402
from components.extract.stage import extract  # noqa: E402
from components.regenerate.stage import regenerate  # noqa: E402
from components.train.stage import train  # noqa: E402
from embedded import EmbeddedConfig, build_embedded  # noqa: E402


def _without_plots() -> None:
    """No matplotlib (the device): the evaluation's plot functions write nothing and return their path."""
    import components.evaluate.plots as plots

    for name in ("plot_acceptance", "plot_by_output_position", "plot_training"):
        setattr(plots, name, lambda *args: Path(args[-1]))


def stage_configs(quick: bool, device: str) -> dict[str, Any]:
    """The preset's stage sections (`tiny` with --quick, else `gpu`), each on `device`."""
    s = tiny_stages() if quick else gpu_stages()
    rep = dataclasses.replace
    return {
        "regenerate": rep(s["regenerate"], device=device),
        "extract": rep(s["extract"], device=device),
        "train": rep(s["train"], ray=rep(s["train"].ray, num_workers=0, use_gpu=device == "cuda")),
        "evaluate": rep(s["evaluate"], device=device),
    }


def embedded_config(quick: bool, device: str, target_steps: int) -> EmbeddedConfig:
    cfg = EmbeddedConfig.tiny() if quick else EmbeddedConfig.gpu()
    train_cfg = dataclasses.replace(cfg.train, device=device, steps=target_steps or cfg.train.steps)
    return dataclasses.replace(cfg, train=train_cfg, finetune=dataclasses.replace(cfg.finetune, device=device))


class Record:
    """gpu_pipeline.json: the environment, the config, and each stage's seconds and result, rewritten per stage."""

    def __init__(self, path: Path, data: dict[str, Any]):
        self.path, self.data, self.t0 = path, {**data, "stages": {}, "status": "running"}, time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)

    def stage(self, name: str, fn: Callable[[], Any]) -> Any:
        print(f"gpu_pipeline: {name} ({time.perf_counter() - self.t0:.0f} s in)", flush=True)
        t = time.perf_counter()
        res = fn()
        self.data["stages"][name] = {
            "seconds": round(time.perf_counter() - t, 2),
            "result": dataclasses.asdict(res) if dataclasses.is_dataclass(res) else res,
        }
        self.write()
        return res


def run(args: argparse.Namespace, cfgs: dict[str, Any], rec: Record) -> None:
    work = Path(args.work)
    emb_cfg = embedded_config(args.quick, args.device, args.target_steps)
    emb = rec.stage("build", lambda: build_embedded(emb_cfg, work / "embedded", progress=not args.quick))
    target, traffic = str(emb.target_dir), emb.target_traffic
    run_dir = work / "runs" / ("quick" if args.quick else "gpu")
    dirs = {s: str(run_dir / s) for s in ("regenerate", "extract", "train", "evaluate")}
    rec.stage("regenerate", lambda: regenerate(cfgs["regenerate"], target, str(traffic.train), dirs["regenerate"]))
    rec.stage("extract", lambda: extract(cfgs["extract"], target, dirs["regenerate"], dirs["extract"]))
    tr = rec.stage(
        "train",
        lambda: train(
            cfgs["train"],
            dirs["extract"],
            dirs["train"],
            target,
            {"target_name": "embedded-gpu", "bench": "gpu_pipeline"},
        ),
    )
    if args.more:  # the same head drafting a tree, and sampling (T = 1), instead of the greedy chain
        summary = {}
        for name, ev_cfg in more_evaluations(cfgs["evaluate"]).items():
            head = HeadEval(target, tr.head_dir, str(traffic.heldout), str(run_dir / name))
            ev = rec.stage(name, lambda c=ev_cfg, h=head: evaluate(c, h))
            summary[name] = {
                "tau": ev.tau,
                "speedup": ev.speedup,
                "speedup_lo": ev.speedup_lo,
                "speedup_hi": ev.speedup_hi,
                "identical": ev.identical,
                "acceptance": ev.acceptance,
            }
        batches = (1, 4) if args.quick else (1, 8, 32, 64)
        rec.stage(
            "batch", lambda: batch_throughput(cfgs["evaluate"], target, tr.head_dir, str(traffic.heldout), batches)
        )
        summary["batch"] = rec.data["stages"]["batch"]["result"]
        rec.data["summary"] = summary
        return
    head = HeadEval(target, tr.head_dir, str(traffic.heldout), dirs["evaluate"], history_file=tr.history_file)
    ev = rec.stage("evaluate", lambda: evaluate(cfgs["evaluate"], head))
    rec.data["summary"] = {
        "tau": ev.tau,
        "speedup": ev.speedup,
        "speedup_lo": ev.speedup_lo,
        "speedup_hi": ev.speedup_hi,
        "identical": ev.identical,
        "acceptance": ev.acceptance,
        "train_tokens_per_s": tr.final_metrics.get("tokens_per_s"),
    }


def more_evaluations(ev_cfg: Any) -> dict[str, Any]:
    """--more: the evaluation's section for a tree (top-4, 16 drafted nodes, the chain's depth; greedy, so outputs
    are still checked identical) and for sampling at T = 1 (a chain; outputs random, so no identity check), each on
    half the prompts (at least 2) to fit the device call beside a rebuild."""
    rep = dataclasses.replace
    limit = max(2, (ev_cfg.limit or 32) // 2)
    return {
        "evaluate_tree": rep(ev_cfg, limit=limit, spec=rep(ev_cfg.spec, method="tree", topk=4, budget=16)),
        "evaluate_sampled": rep(ev_cfg, limit=limit, spec=rep(ev_cfg.spec, temperature=1.0)),
    }


def batch_throughput(
    ev_cfg: Any, target_dir: str, head_dir: str, traffic: str, batches: tuple[int, ...], runs: int = 3
) -> dict[str, Any]:
    """--more: the greedy chain against plain decoding at each batch size B on the device, as bench/batch.py measures
    it (`padded`, `measure_batch`: B held-out prompts cycled and left-padded, a warm-up, then `runs` blocks plain,
    spec, spec, plain): per B tokens/s of each, their ratio (median, min, max), τ, rows differing from plain."""
    from batch import measure_batch, padded
    from components.evaluate.stage import held_out_samples
    from components.targets.target import load_target
    from eagle.export import load_head

    target, tokenizer = load_target(target_dir, ev_cfg.device)
    draft = load_head(head_dir, target, device=ev_cfg.device).eval()
    spec = ev_cfg.spec_for(target)
    prompts = [p.ids for p in held_out_samples(tokenizer, traffic, dataclasses.replace(ev_cfg, limit=max(batches)))]
    result: dict[str, Any] = {}
    for B in batches:
        ids, mask = (t.to(ev_cfg.device) for t in padded(prompts, B, spec.pad_token_id))
        with torch.no_grad():
            r = result[str(B)] = measure_batch(target, draft, ids, mask, spec, runs)
        print(
            f"gpu_pipeline: batch {B}: plain {r['plain_tok_s']:.0f} tok/s, speculative {r['spec_tok_s']:.0f} "
            f"tok/s, ratio {r['ratio']:.2f} [{r['ratio_min']:.2f}, {r['ratio_max']:.2f}], tau {r['tau']:.2f}, "
            f"{r['mismatch_rows']} rows differ",
            flush=True,
        )
    return result


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny embedded target, `tiny` preset sections (tests)")
    p.add_argument("--device", default="", help="cuda or cpu (default: cuda when available); cpu runs 1 thread")
    p.add_argument(
        "--out", default="", help="gpu_pipeline.json's directory (bench/results; quick: .eagle/bench/results-quick)"
    )
    p.add_argument("--work", default=str(ROOT / ".eagle" / "gpu-pipeline"), help="builds and stage outputs")
    p.add_argument(
        "--more",
        action="store_true",
        help="after training, evaluate a tree, sampling (T = 1) and "
        "batches instead of the greedy chain (stage outputs re-used)",
    )
    p.add_argument("--target-steps", type=int, default=0, help="the embedded target's training steps (0: its preset's)")
    a = p.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.out = a.out or str(ROOT / ".eagle" / "bench" / "results-quick" if a.quick else ROOT / "bench" / "results")
    return a


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.device == "cpu":  # a shared machine: a second thread on busy cores slows everything down
        torch.set_num_threads(1)
    if importlib.util.find_spec("matplotlib") is None:
        _without_plots()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` TERMs first: keep what was measured
    cfgs = stage_configs(args.quick, args.device)
    env = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    rec = Record(
        Path(args.out) / ("gpu_pipeline_more.json" if args.more else "gpu_pipeline.json"),
        {
            "benchmark": "gpu_pipeline",
            "preset": "tiny" if args.quick else "gpu",
            "environment": env,
            "config": {k: dataclasses.asdict(v) for k, v in cfgs.items()},
            "args": vars(args),
        },
    )
    try:
        run(args, cfgs, rec)
        rec.data["status"] = "complete"
    except BaseException as e:  # KeyboardInterrupt (SIGTERM) too: keep what was measured
        rec.data["status"] = "partial" if rec.data["stages"] else "failed"
        rec.data["error"] = f"{type(e).__name__}: {e or 'interrupted (SIGTERM of a time limit, or Ctrl-C)'}"
        rec.data["traceback"] = traceback.format_exc()[-4000:]
    rec.write()
    s = rec.data.get("summary", {})
    runs = {k: v for k, v in s.items() if k.startswith("evaluate")} if args.more else {"evaluate": s}
    said = "; ".join(
        f"{k}: tau={v.get('tau')} speedup={v.get('speedup')} identical={v.get('identical')}" for k, v in runs.items()
    )
    print(
        f"gpu_pipeline: {rec.data['status']} in {rec.data['elapsed_s']} s; {said}; wrote {rec.path}"
        + (f"\n{rec.data['error']}" if "error" in rec.data else ""),
        flush=True,
    )
    return 0 if rec.data["status"] == "complete" else 1


if __name__ == "__main__":
    raise SystemExit(main())
