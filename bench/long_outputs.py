"""Peak memory of extraction and of one TTT training step on long outputs, by sequence length, on a real target.

Run: `python bench/long_outputs.py [--target DIR] [--lengths 256 512 1024 2048] [--ttt-steps 7]`. The target is a
HF Llama directory; by default the newest `.eagle/embedded/*/target` (an embedded default build). The tokens are
the embedded default's `long` traffic (embedded/long_traffic.py): held-out stdlib modules and classes
continued from their first lines, rendered with the chat template and concatenated, the first S tokens taken.
Each (stage, S) runs in a fresh subprocess: after loading the target (and, for training, computing the features
and making the head) the kernel's peak-RSS counter is reset (`/proc/self/clear_refs` 5), the stage runs, and the
figure is VmHWM minus the RSS before it: what the stage adds at that length. Stages:
  extract  `components.extract.stage.shard_bytes`: one sequence through the target, fused features captured, the shard
           file packed in bfloat16 (what the offline extraction does per sequence);
  train    `eagle.features.teacher_targets` + `eagle.ttt.ttt_loss` forward and backward of a head made as
           training makes it (`eagle.train.head_from_tensors`), K = --ttt-steps.
Each stage runs once on 16 tokens first, unmeasured. Prints a table with MiB, the bytes per extra token between
successive lengths (constant: linear in S; doubling per doubling of S: quadratic), the growth exponent between
successive lengths (1.0 = proportional, 2.0 = quadratic; below 1 where a fixed part dominates), and the process's
whole peak (VmHWM, target and head included); writes
bench/results/long_outputs.json (bench/report.py: metadata, earlier runs kept).
Not measured here: speed or acceptance on long outputs (bench/long_variants.py), the engine's memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WARMUP = 16  # tokens of one unmeasured run of the stage first (lazy initialisation, the allocator's first pools)


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS; returns the RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS") * 1024


def long_tokens(target_dir: Path, n: int) -> list[int]:
    """The first `n` tokens of held-out long conversations of the stdlib, rendered and concatenated."""
    from transformers import AutoTokenizer

    from embedded.build import load_domains
    from embedded.config import EmbeddedConfig, TrafficConfig
    from embedded.long_traffic import long_conversations
    from embedded.tokenizer import render_chat

    tok = AutoTokenizer.from_pretrained(target_dir)
    base, _ = load_domains(EmbeddedConfig.default())
    ids: list[int] = []
    for f in base.heldout:
        for c in long_conversations([f], base.name, tok, TrafficConfig(kind="long"), 2048, seed=0):
            text = render_chat([{"role": m.role, "content": m.content} for m in c.messages])
            ids += tok(text, add_special_tokens=False)["input_ids"]
            if len(ids) >= n:
                return ids[:n]
    raise ValueError(f"the held-out long traffic has only {len(ids)} tokens; asked for {n}")


def run_one(stage: str, S: int, target_dir: Path, tokens: list[int], ttt_steps: int) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from components.extract.stage import ExtractConfig, shard_bytes
    from eagle.config import default_aux_layer_ids
    from eagle.features import target_forward, teacher_targets
    from eagle.train import head_from_tensors
    from eagle.ttt import TTTBatch, TTTConfig, ttt_loss

    torch.manual_seed(0)
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    layer_ids = list(default_aux_layer_ids(target.config.num_hidden_layers))
    ids = tokens[:S]
    if stage == "extract":

        def extract(n: int) -> int:
            return len(shard_bytes(target, layer_ids, [(ids[:n], [1] * n)], ExtractConfig(max_len=n, batch_size=1)))

        extract(WARMUP)
        base = _reset_peak()
        t0 = time.perf_counter()
        nbytes = extract(S)
        extra = {"shard_bytes": nbytes}
    else:
        ids_BS = torch.tensor([ids])
        with torch.no_grad():
            step = target_forward(target, ids_BS, layer_ids)
        counts = torch.bincount(ids_BS[0], minlength=target.config.vocab_size).float()
        lm_w = target.get_output_embeddings().weight.detach()
        draft = head_from_tensors(
            target.config, counts, target.get_input_embeddings().weight, lm_w, 2048, aux_layer_ids=layer_ids
        )
        aux, last = step.aux_BT3H.detach(), step.last_hidden_BTH.detach()
        del step

        def train_step(n: int):
            teacher = teacher_targets(last[:, :n], lm_w, draft.draft_ids())
            out = ttt_loss(
                draft,
                TTTBatch(ids_BS[:, :n], aux[:, :n], torch.ones_like(ids_BS[:, :n]), teacher),
                TTTConfig(ttt_steps=ttt_steps),
            )
            out.loss.backward()
            return out

        train_step(WARMUP)
        draft.zero_grad(set_to_none=False)  # the gradients' memory is allocated before the measured step
        base = _reset_peak()
        t0 = time.perf_counter()
        out = train_step(S)
        extra = {"ttt_steps": ttt_steps, "loss": float(out.loss)}
    seconds = time.perf_counter() - t0
    hwm = _status_kb("VmHWM") * 1024
    return {
        "stage": stage,
        "seq_len": S,
        "peak_bytes": hwm - base,
        "process_peak_bytes": hwm,
        "seconds": round(seconds, 3),
        **extra,
    }


def _default_target() -> Path:
    builds = sorted((ROOT / ".eagle" / "embedded").glob("*/target/config.json"), key=lambda p: p.stat().st_mtime)
    if not builds:
        raise SystemExit("no embedded build under .eagle/embedded: run `python -m embedded` or pass --target")
    return builds[-1].parent


def _exponents(rows: list[dict], stage: str) -> dict[int, float]:
    pts = [(r["seq_len"], r["peak_bytes"]) for r in rows if r["stage"] == stage and r.get("peak_bytes")]
    return {s2: round(math.log(b2 / b1) / math.log(s2 / s1), 2) for (s1, b1), (s2, b2) in zip(pts, pts[1:]) if b1 > 0}


def _slopes(rows: list[dict], stage: str) -> dict[int, float]:
    """Bytes per extra token between successive lengths: constant when memory is linear (a + b*S), doubling with
    each doubling of S when it is quadratic."""
    pts = [(r["seq_len"], r["peak_bytes"]) for r in rows if r["stage"] == stage and r.get("peak_bytes")]
    return {s2: round((b2 - b1) / (s2 - s1)) for (s1, b1), (s2, b2) in zip(pts, pts[1:])}


def main() -> None:
    load0 = list(os.getloadavg())
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, default=None, help="HF target dir (default: newest embedded build)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per subprocess")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "long_outputs.json"))
    ap.add_argument("--one", nargs=3, metavar=("STAGE", "S", "TOKENS_JSON"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    target = a.target or _default_target()
    if a.one:
        import torch

        torch.set_num_threads(a.threads)
        tokens = json.loads(Path(a.one[2]).read_text())
        print(json.dumps(run_one(a.one[0], int(a.one[1]), target, tokens, a.ttt_steps)))
        return
    tokens_path = Path(a.out).with_suffix(".tokens.tmp.json")
    tokens_path.parent.mkdir(parents=True, exist_ok=True)
    tokens_path.write_text(json.dumps(long_tokens(target, max(a.lengths))))
    rows = []
    try:
        for stage in ("extract", "train"):
            for S in a.lengths:
                cmd = [
                    sys.executable,
                    __file__,
                    "--target",
                    str(target),
                    "--ttt-steps",
                    str(a.ttt_steps),
                    "--threads",
                    str(a.threads),
                    "--one",
                    stage,
                    str(S),
                    str(tokens_path),
                ]
                res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                if res.returncode != 0:
                    rows.append({"stage": stage, "seq_len": S, "peak_bytes": None, "error": res.stderr[-500:]})
                    print(f"{stage:7s} S={S:5d}  failed: {res.stderr[-300:]}", flush=True)
                    continue
                rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
                r = rows[-1]
                print(
                    f"{stage:7s} S={S:5d}  +{r['peak_bytes'] / 2**20:8.1f} MiB  process peak "
                    f"{r['process_peak_bytes'] / 2**20:8.1f} MiB  {r['seconds']:.2f} s",
                    flush=True,
                )
    finally:
        tokens_path.unlink(missing_ok=True)
    report(rows, a, target, load0)


def report(rows: list[dict], a, target: Path, load0: list[float]) -> None:
    exps = {stage: _exponents(rows, stage) for stage in ("extract", "train")}
    slopes = {stage: _slopes(rows, stage) for stage in ("extract", "train")}
    by = {(r["stage"], r["seq_len"]): r for r in rows}
    print(
        "\nseq_len | extract MiB | KiB/extra token |  exp | train MiB | KiB/extra token |  exp | process peak MiB "
        "(train)"
    )
    for S in a.lengths:
        cells = []
        for stage in ("extract", "train"):
            b = by.get((stage, S), {}).get("peak_bytes")
            e, d = exps[stage].get(S), slopes[stage].get(S)
            cells.append(
                f"{b / 2**20:11.1f} | {d / 1024 if d is not None else float('nan'):15.1f} | "
                f"{e if e is not None else '-':>4}"
                if b
                else "          - |               - |    -"
            )
        peak = by.get(("train", S), {}).get("process_peak_bytes")
        print(f"{S:7d} | {cells[0]} | {cells[1]} | {peak / 2**20 if peak else float('nan'):8.1f}")
    import platform

    import torch
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(target)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "target": str(target),
        "threads": a.threads,
        "ttt_steps": a.ttt_steps,
        "target_shape": {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "vocab": c.vocab_size},
        "growth_exponents": exps,
        "bytes_per_extra_token": slopes,
    }
    from report import write_results  # metadata, earlier runs kept (bench/report.py)

    out = Path(a.out)
    write_results(out.stem, False, {"meta": meta, "rows": rows}, load0, out.parent)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
