"""Feature storage: bytes per token and tau of heads trained from bfloat16 vs fp8 (e4m3, per-row scale) features.

Run: `python bench/feature_dtype.py [--quick] [--steps 0] [--ttt 0] [--depth 4] [--prompts 0]`
The embedded default's regenerated training traffic (bench/common.py) is extracted twice, the same sequences in the
same shards: in bfloat16 (the preset's extract dir) and in float8_e4m3fn with one float32 scale per token row
(`components.extract.stage`, `dtype="float8_e4m3fn"`; cached, resumes). The same head config (the preset's, `--steps`,
`--ttt` to change it) is trained on each (`train_or_reuse_head`, same seed, so the same batches, the same init and
the same held-out split) and both heads decode the same held-out prompts through the evaluate stage
(`components.evaluate.stage.evaluate`, local engine, chain of depth `--depth`, T=0, outputs checked identical to plain
greedy decoding).
Prints one table per dtype: bytes per token (shard files / tokens, from the manifest), feature GB per 1M tokens,
the RMS error of the fused features relative to the bf16 ones and how often the teacher's top-1 token agrees with the
bf16 teacher's (loss-masked tokens of the first sequences), the held-out simulated tau the training selected, the
decoded tau (emitted tokens; `tau_raw` beside it in the JSON), alpha_1, mismatches; then the ratios fp8/bf16 and
the bytes per token those layouts give a 4096-wide (8B-class) target. Writes feature_dtype.json.
Not measured here: extraction or training speed (both cached), fp16/fp32 storage, online training (stores nothing),
a real 8B target's tau.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)
import torch

from common import Setup, base_args, prepare, print_table, setup_threads, start, train_or_reuse_head, write_results
from components.extract.stage import FP8, extract

DTYPES = ("bfloat16", FP8)


def extract_dir(setup: Setup, dtype: str) -> tuple[Path, float | None]:
    """The extract dir of the setup's traffic in `dtype` (the preset's own when it is that dtype), and the seconds
    the call took when it wrote anything (None: every shard was already there)."""
    if setup.preset.extract.dtype == dtype:
        return setup.extract_dir, None
    out, written = setup.work / f"extract-{dtype}", []
    t0 = time.perf_counter()
    with setup_threads():
        extract(
            dataclasses.replace(setup.preset.extract, dtype=dtype),
            str(setup.target_dir),
            str(setup.regen_dir),
            str(out),
            progress=written.append,
        )
    return out, (round(time.perf_counter() - t0, 1) if written else None)


def fidelity(dirs: dict[str, Path], max_tokens: int = 4096) -> dict[str, dict]:
    """Per dtype, on the loss-masked tokens of the first sequences: RMS of (aux - aux_bf16) / RMS(aux_bf16), per-row
    max error over the row's amax, and the fraction of tokens whose teacher top-1 equals the bf16 teacher's."""
    from components.train.data import TrainingData

    data = {d: TrainingData.open(p, verify=False) for d, p in dirs.items()}
    ref = data["bfloat16"]
    lm_head = ref.lm_head.float()
    out = {}
    for dtype, dat in data.items():
        num = den = 0.0
        row_err, same, n = 0.0, 0, 0
        for i in range(dat.n_seqs):
            m = dat.sequence(i)[1].bool()
            (aux, last), (aux0, last0) = dat.features(i), ref.features(i)
            aux, last, aux0, last0 = (t.float()[m] for t in (aux, last, aux0, last0))
            num += float(((aux - aux0) ** 2).sum())
            den += float((aux0**2).sum())
            row_err = max(row_err, float(((aux - aux0).abs().amax(-1) / aux0.abs().amax(-1)).max()))
            same += int(((last @ lm_head.T).argmax(-1) == (last0 @ lm_head.T).argmax(-1)).sum())
            n += int(m.sum())
            if n >= max_tokens:
                break
        out[dtype] = {
            "feature_rel_rms": (num / den) ** 0.5,
            "feature_row_max_err": row_err,
            "teacher_top1_agree": same / n,
            "fidelity_tokens": n,
        }
    return out


def decode(setup: Setup, dtype: str, head_dir: Path, args: argparse.Namespace) -> dict:
    """The evaluate stage on the held-out prompts: emitted and raw tau, alpha_1, mismatches (counted, not raised)."""
    from components.evaluate.stage import EvaluateConfig, HeadEval, NotLosslessError, evaluate
    from eagle.speculative import SpecConfig

    cfg = EvaluateConfig(
        spec=SpecConfig(method="chain", depth=args.depth, max_new_tokens=setup.preset.max_new_tokens),
        limit=args.prompts or setup.preset.eval_prompts,
        engine="local",
    )
    out = setup.work / "feature_dtype" / f"eval-{dtype}-{head_dir.parent.name}-d{args.depth}-p{cfg.limit}"
    try:
        evaluate(
            cfg,
            HeadEval(str(setup.target_dir), str(head_dir), str(setup.heldout_traffic), str(out)),
            progress=lambda _m: None,
        )
    except NotLosslessError:  # the report is written first; the table shows the count
        pass
    report = json.loads((out / "evaluation.json").read_text())
    r = report["result"]
    return {
        "tau": r["tau"],
        "tau_raw": r["tau_raw"],
        "a1": r["acceptance"][0],
        "prompts": r["n_samples"],
        "tokens": r["n_tokens"],
        "mismatches": sum(not s["identical"] for s in report["samples"]),
    }


def projected_bytes_per_token(dtype: str, hidden: int) -> int:
    """Bytes per token of the feature layout for a target of width `hidden`: 3H + H hidden-state values (+ two
    float32 scales for fp8), int32 input id, uint8 loss mask; the file header and offsets left out."""
    per_value = 1 if dtype == FP8 else torch.finfo(getattr(torch, dtype)).bits // 8
    return 4 * hidden * per_value + (8 if dtype == FP8 else 0) + 5


def main(argv: list[str] | None = None) -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=0, help="training steps of both heads (0: the preset's)")
    p.add_argument("--ttt", type=int, default=0, help="TTT steps K of both heads (0: the preset's)")
    p.add_argument("--depth", type=int, default=4, help="chain depth of the decoding measurement")
    p.add_argument("--prompts", type=int, default=0, help="held-out prompts decoded per head (0: the preset's)")
    args = p.parse_args(argv)
    load0 = start(args)
    run(prepare(args.quick, conversations=args.conversations), args, load0)


def run(setup: Setup, args: argparse.Namespace, load0: list[float]) -> None:
    """The benchmark on a prepared setup (see bench/common.py); prints the table, writes the result file."""
    base = setup.preset.train
    cfg = dataclasses.replace(
        base,
        steps=args.steps or base.steps,
        ttt=dataclasses.replace(base.ttt, ttt_steps=args.ttt or base.ttt.ttt_steps),
    )
    dirs, rows = {}, []
    for dtype in DTYPES:
        dirs[dtype], extract_s = extract_dir(setup, dtype)
        manifest = json.loads((dirs[dtype] / "manifest.json").read_text())
        assert manifest["dtype"] == dtype, (dirs[dtype], manifest["dtype"])
        head = train_or_reuse_head(setup, f"eagle3-ttt{cfg.ttt.ttt_steps}", cfg, dirs[dtype])
        lineage = json.loads((head.head_dir / "eagle_head.json").read_text())["lineage"]
        rows.append(
            {
                "dtype": dtype,
                "bytes_per_token": manifest["bytes_per_token"],
                "gb_per_1m_tokens": manifest["bytes_per_token"] * 1e6 / 1e9,
                "n_tokens": manifest["n_tokens"],
                "shard_bytes": sum(s["bytes"] for s in manifest["shards"]),
                "extract_s": extract_s,
                "heldout_tau": lineage.get("selected_heldout_tau") or float("nan"),
                "selected_step": lineage["selected_step"],
                "train_s": head.seconds,
                "train_loss": head.final_metrics.get("loss"),
                **decode(setup, dtype, head.head_dir, args),
            }
        )
    for r, f in zip(rows, fidelity(dirs).values()):
        r.update(f)
    table = print_table(
        rows,
        [
            "dtype",
            "bytes_per_token",
            "gb_per_1m_tokens",
            "feature_rel_rms",
            "teacher_top1_agree",
            "heldout_tau",
            "tau",
            "a1",
            "mismatches",
        ],
        f"feature storage: same {rows[0]['n_tokens']} tokens, same head config ({cfg.steps} steps, "
        f"K={cfg.ttt.ttt_steps}); decoded on {rows[0]['prompts']} held-out prompts, chain depth "
        f"{args.depth}, T=0 (tau: emitted tokens; heldout_tau: simulated, the selected step)",
    )
    bf, f8 = rows
    hidden = int(json.loads((setup.target_dir / "config.json").read_text())["hidden_size"])
    proj = {d: projected_bytes_per_token(d, 4096) for d in DTYPES}
    answer = (
        f"fp8/bf16: bytes per token {f8['bytes_per_token'] / bf['bytes_per_token']:.3f} "
        f"({f8['bytes_per_token']:.0f} vs {bf['bytes_per_token']:.0f} at hidden {hidden}), decoded tau "
        f"{f8['tau'] / bf['tau']:.3f} ({f8['tau']:.3f} vs {bf['tau']:.3f}), held-out simulated tau "
        f"{f8['heldout_tau'] / bf['heldout_tau']:.3f}; mismatches {bf['mismatches'] + f8['mismatches']}. "
        f"At hidden 4096: {proj[FP8]} vs {proj['bfloat16']} bytes per token, "
        f"{proj[FP8] * 1e6 / 1e9:.1f} vs {proj['bfloat16'] * 1e6 / 1e9:.1f} GB per 1M tokens"
    )
    print(f"answer: {answer}", flush=True)
    name = "feature_dtype" + "".join(
        f"-{k}{v}"
        for k, v in (
            ("conv", args.conversations),
            ("steps", args.steps),
            ("ttt", args.ttt),
            ("depth", args.depth if args.depth != 4 else 0),
        )
        if v
    )
    write_results(
        name,
        args.quick,
        {
            "args": vars(args),
            "train_config": dataclasses.asdict(cfg),
            "rows": rows,
            "projected_bytes_per_token_h4096": proj,
            "answer": answer,
            "table": table,
        },
        load0,
    )


if __name__ == "__main__":
    main()
