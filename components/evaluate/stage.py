"""Stage 4, evaluate: acceptance and real speedup of a head on held-out traffic, outputs checked identical.

Purpose: `evaluate(cfg, head) -> EvaluateResult` (`head`: a `HeadEval`, the head on its target, the held-out traffic,
the output folder). For every held-out conversation (its first user turn, with the target's chat template) it decodes
with plain decoding and with the head, interleaved sample by sample so that both see the same machine state, and
reports
- tau (mean tokens emitted per target verification step, the bonus token included; tokens accepted past EOS or
  the length limit do not count), acceptance per draft position both conditional (alpha_k = emitted draft k /
  reached depth k) and cumulative (P[the step emitted draft k]), and beside them `tau_raw` / `acceptance_raw`,
  which count what the acceptance rule accepted, as vLLM's counters do (`eagle.stats.SpecStats`),
- a per-segment breakdown (`complete`, `continue`, `explain`, ...),
- tau and alpha_1 by output position (`by_position`: buckets `cfg.position_edges`, default 0-128, 128-512,
  512-2048; a verification step belongs to the bucket of the output position where it starts; emitted counts, and
  `by_position_raw` in evaluation.json with raw counts, as the engine's per-request metrics give them),
- wall-clock speedup (plain seconds / speculative seconds over the same prompts) measured in rounds, plain and
  speculative interleaved prompt by prompt (components/evaluate/speed.py, `cfg.speed`): the median of the rounds'
  ratios, its interval `speedup_lo`..`speedup_hi`, and whether it is reliable (with the reason when not); tokens/s of
  each, both on the target path (`eagle.target_path`, `spec.path`) measured fastest here, recorded as `target_path`;
  with `cfg.time_local` false each prompt is decoded once each way, untimed, and the speedup fields are nan (where
  vLLM measures the head, `engine: vllm`, its figure is the one that counts),
- at temperature 0, whether every output equals the plain greedy output; any difference raises
  `NotLosslessError` after the report is written (the run fails loudly).
Each prompt is decoded to its sample's `max_new_tokens` when the traffic gives one (components/data/traffic_io.py; the
long traffic does), else to `cfg.spec.max_new_tokens`; with `cfg.ignore_eos` every prompt runs to that limit, past
the end-of-sequence token (plain and speculative alike, so outputs still compare token for token): what a
measurement of acceptance at long output positions needs from a target that ends its answers early.
`head.baseline_dir` (e.g. the current champion) is measured on the same prompts in the same run for the
promotion gate. Writes `evaluation.json` and PNG plots (acceptance by position; training curves of `head.history_file`
if given) under `head.out_dir`.
Not here: registration and the gate's decision (components/registry/register.py).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, NamedTuple

from components.data.atomic import atomic_write_text, remove_stale_temps
from components.evaluate.load_config import DepthPickConfig, LoadConfig
from components.evaluate.speed import SpeedupConfig, SpeedupEstimate, measure_speedup
from components.targets.runtime import STAGE_ENGINES
from eagle.config_checks import FieldError, at_least, one_of
from eagle.run_config import SpecConfig
from eagle.stats import POSITION_EDGES


class NotLosslessError(AssertionError):
    """Greedy speculative output differed from plain greedy output."""


@dataclass(frozen=True)
class EvaluateConfig:
    """`spec` is how the head drafts and verifies (method, depth, temperature, ...; `evaluate.spec.depth` in a
    pipeline config); its `eos_token_id`, when unset, is the target's. The rest says what is measured, and where."""

    spec: SpecConfig = field(default_factory=lambda: SpecConfig(max_new_tokens=96))
    limit: int | None = 24  # held-out prompts measured (None: all)
    max_prompt_tokens: int = 384
    device: str = "cpu"
    seed: int = 0
    engine: str = "local"  # "vllm": also serve the head in vLLM and measure it there (components/evaluate/engine.py)
    speed: SpeedupConfig = field(default_factory=SpeedupConfig)  # how long the speedup is measured, in both engines
    # throughput by concurrency in vLLM (components/evaluate/load_sweep.py)
    load: LoadConfig = field(default_factory=LoadConfig)
    # the K at batch size 1, measured in vLLM before anything else (components/evaluate/depth_pick.py)
    pick: DepthPickConfig = field(default_factory=DepthPickConfig)
    position_edges: tuple[int, ...] = POSITION_EDGES  # output-position buckets of tau/alpha_1 (ascending, >= 0)
    # decode every prompt to its length limit, past EOS (for measuring acceptance at long output positions; vLLM's
    # `ignore_eos` in the engine evaluation)
    ignore_eos: bool = False
    # torch CPU threads while our decoder runs and is timed (0: torch's default, one per core). One thread: batch-1
    # passes of a small target lose more to the threads' synchronisation than they gain, the speculative step's many
    # small ones most, so torch's default hides the head's speedup (bench/README.md, "Figures moved from code
    # comments"). vLLM's CPU worker there decodes on one core as well.
    threads: int = 1
    # time our own decoder against plain (`speed`'s rounds); false: each prompt is decoded once each way, untimed (tau,
    # acceptance and identity as before) and our speedup is not measured: where vLLM measures the head
    # (`engine: vllm`), its figure is the one registered and served, and our rounds cost the demo ~1 min
    time_local: bool = True
    # vLLM on the CPU compiled (its default) in every engine the evaluation times and in `serve` (tag `compiled`);
    # false: eager, which starts in seconds (ARCHITECTURE.md's knob row; regeneration and extraction stay eager)
    compiled: bool = False

    def __post_init__(self) -> None:
        one_of(self, "engine", STAGE_ENGINES)
        for name in ("time_local", "compiled"):
            if not isinstance(getattr(self, name), bool):
                raise FieldError(self, name, f"must be true or false, got {getattr(self, name)!r}")
        at_least(self, {"max_prompt_tokens": 1, "seed": 0, "threads": 0})
        if self.limit is not None:
            at_least(self, {"limit": 1})
        if not isinstance(self.spec, SpecConfig):
            raise FieldError(self, "spec", f"must be a SpecConfig, got {self.spec!r}")
        if not isinstance(self.speed, SpeedupConfig):
            raise FieldError(self, "speed", f"must be a SpeedupConfig, got {self.speed!r}")
        if not isinstance(self.load, LoadConfig):
            raise FieldError(self, "load", f"must be a LoadConfig, got {self.load!r}")
        if not isinstance(self.pick, DepthPickConfig):
            raise FieldError(self, "pick", f"must be a DepthPickConfig, got {self.pick!r}")
        if not isinstance(self.ignore_eos, bool):
            raise FieldError(self, "ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        e = self.position_edges
        if (
            not isinstance(e, tuple)
            or len(e) < 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in e)
            or e[0] < 0
            or any(a >= b for a, b in zip(e, e[1:]))
        ):
            raise FieldError(self, "position_edges", f"must be >= 2 ascending integers >= 0, got {e!r}")

    def engine_conflict(self, in_engine: bool) -> tuple[str, str] | None:
        """Nothing of this section depends on where the target runs (components/targets/runtime.py asks every
        stage that runs it): the engine serves the head, this process measures it when it loads the target."""
        return None

    @classmethod
    def tiny(cls) -> "EvaluateConfig":
        return cls(spec=SpecConfig(depth=3, max_new_tokens=12), limit=3, speed=SpeedupConfig.tiny())

    def spec_for(self, target) -> SpecConfig:
        """`spec` with the target's end-of-sequence ids where the config sets none; none at all with `ignore_eos`."""
        if self.ignore_eos:
            return replace(self.spec, eos_token_id=None)
        if self.spec.eos_token_id is not None:
            return self.spec
        # a list: SpecConfig makes a tuple
        return replace(self.spec, eos_token_id=target.generation_config.eos_token_id)


@dataclass(frozen=True)
class HeadEval:
    """What an evaluation of a head measures: the head on its target, on held-out traffic, its reports under `out_dir`
    (flows/evaluate_head.py hands vLLM's evaluation `vllm/` of it, the load sweep `load/`), beside `baseline_dir`
    (e.g. the champion, on the same prompts; None: none), with the training curves of `history_file` plotted (None:
    none). Taken by `evaluate`, components/evaluate/engine.py `evaluate_in_vllm` (no curves there),
    components/evaluate/load_sweep.py `load_sweep` (the head alone: no baseline, no curves) and
    components/evaluate/shadow.py `shadow_test`."""

    target_dir: str
    head_dir: str
    heldout: str
    out_dir: str
    baseline_dir: str | None = None
    history_file: str | None = None


@dataclass(frozen=True)
class EvaluateResult:
    tau: float
    speedup: float
    identical: bool | None  # None when sampling (T > 0): outputs are random, not comparable
    acceptance: list[float]  # conditional alpha_k, emitted drafts
    acceptance_cumulative: list[float]
    per_segment: dict[str, dict[str, float]]
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    n_samples: int
    n_tokens: int
    baseline_tau: float | None
    report_file: str
    plots: tuple[str, ...] = field(default_factory=tuple)
    # what the acceptance rule accepted, also past EOS and the length limit (as vLLM's counters count): for
    # comparisons with an engine; `tau` and `acceptance` count emitted tokens only
    tau_raw: float | None = None
    acceptance_raw: list[float] = field(default_factory=list)
    # `speedup` is the median of the rounds' ratios; the interval of that median, and whether it can be trusted
    speedup_lo: float | None = None
    speedup_hi: float | None = None
    speedup_reliable: bool = True
    speedup_note: str = ""  # why the speedup is unreliable; "" when it is not
    speedup_rounds: int = 1
    by_position: list[dict] = field(default_factory=list)  # eagle.stats.acceptance_by_position, emitted counts

    @property
    def timed(self) -> bool:
        """Whether our speedup was measured (`EvaluateConfig.time_local`); nan fields when it was not."""
        return self.speedup == self.speedup

    def metrics(self) -> dict[str, float]:
        m = {"tau": self.tau}
        if self.timed:
            m.update(
                {
                    "speedup": self.speedup,
                    "plain_tokens_per_s": self.plain_tokens_per_s,
                    "spec_tokens_per_s": self.spec_tokens_per_s,
                    "speedup_reliable": float(self.speedup_reliable),
                    "speedup_rounds": float(self.speedup_rounds),
                }
            )
            m.update(
                {k: v for k, v in (("speedup_lo", self.speedup_lo), ("speedup_hi", self.speedup_hi)) if v is not None}
            )
        if self.tau_raw is not None:
            m["tau_raw"] = self.tau_raw
        if self.identical is not None:  # sampled runs are not comparable token for token
            m["identical"] = float(self.identical)
        m.update({f"alpha_{k + 1}": a for k, a in enumerate(self.acceptance)})
        m.update({f"alpha_raw_{k + 1}": a for k, a in enumerate(self.acceptance_raw)})
        if self.baseline_tau is not None:
            m["baseline_tau"] = self.baseline_tau
        m.update(position_metrics(self.by_position))
        return m


def position_metrics(buckets: list[dict], engine: str = "") -> dict[str, float]:
    """`tau<engine>_pos_<lo>_<hi>` and `alpha_1<engine>_pos_<lo>_<hi>` of each non-empty output-position bucket
    (`engine` "" for ours, "_vllm" for the engine's): what components/registry/register.py tags as `tau_by_position`."""
    m = {}
    for b in buckets:
        if b["steps"]:
            m[f"tau{engine}_pos_{b['lo']}_{b['hi']}"] = b["tau"]
            m[f"alpha_1{engine}_pos_{b['lo']}_{b['hi']}"] = b["alpha_1"]
    return m


def held_out_messages(traffic_path: str, with_limits: bool = False):
    """(segment, messages up to and including the first user turn) of each held-out conversation, in file order;
    `with_limits`: (segment, messages, the sample's `max_new_tokens` or None)."""
    from components.data.traffic_io import load_traffic

    for conv in load_traffic(traffic_path).conversations:
        first_user = next(i for i, m in enumerate(conv.messages) if m.role == "user")
        msgs = [{"role": m.role, "content": m.content} for m in conv.messages[: first_user + 1]]
        yield (conv.segment or "default", msgs) + ((conv.max_new_tokens,) if with_limits else ())


class HeldOut(NamedTuple):
    """One held-out prompt: its segment, token ids (chat template) and new tokens to decode (the sample's
    `max_new_tokens` when the traffic gives one, else `evaluate.spec.max_new_tokens`)."""

    segment: str
    ids: list[int]
    max_new_tokens: int


def held_out_samples(tokenizer, traffic_path: str, cfg: EvaluateConfig) -> list[HeldOut]:
    """The first user turn of each held-out conversation that fits in `cfg.max_prompt_tokens`, up to `cfg.limit`."""
    from components.data.chat import prompt_ids

    out = []
    for segment, msgs, limit in held_out_messages(traffic_path, with_limits=True):
        ids = prompt_ids(tokenizer, msgs)
        if len(ids) <= cfg.max_prompt_tokens:
            out.append(HeldOut(segment, ids, limit or cfg.spec.max_new_tokens))
        if cfg.limit and len(out) >= cfg.limit:
            break
    if not out:
        raise ValueError(f"{traffic_path}: no held-out prompt fits in {cfg.max_prompt_tokens} tokens")
    return out


def held_out_prompts(tokenizer, traffic_path: str, cfg: EvaluateConfig) -> list[tuple[str, list[int]]]:
    """(segment, prompt token ids) of `held_out_samples`."""
    return [(s.segment, s.ids) for s in held_out_samples(tokenizer, traffic_path, cfg)]


def evaluate(
    cfg: EvaluateConfig, head: HeadEval, progress: Callable[[str], None] = print, trust_remote_code: bool = False
) -> EvaluateResult:
    """Decode the held-out prompts (`head.heldout`) plainly and with the head (and the baseline head), on
    `cfg.threads` torch threads, into `head.out_dir`; see the module doc."""
    from eagle import target_path

    with target_path.cpu_threads(cfg.threads if cfg.device == "cpu" else 0):
        return _evaluate(cfg, head, progress, trust_remote_code)


def _evaluate(
    cfg: EvaluateConfig, head: HeadEval, progress: Callable[[str], None], trust_remote_code: bool
) -> EvaluateResult:
    import torch

    from components.targets.target import load_target
    from eagle import target_path
    from eagle.export import load_head
    from eagle.speculative import generate_plain, generate_speculative

    out = Path(head.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)  # left by a run killed mid-write
    target, tokenizer = load_target(head.target_dir, cfg.device, trust_remote_code=trust_remote_code)
    draft = load_head(head.head_dir, target, device=cfg.device).eval()
    baseline = load_head(head.baseline_dir, target, device=cfg.device).eval() if head.baseline_dir else None
    spec = cfg.spec_for(target)
    prompts = held_out_samples(tokenizer, head.heldout, cfg)
    specs = [replace(spec, max_new_tokens=p.max_new_tokens) for p in prompts]  # each sample's own length limit
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    xs = [torch.tensor([p.ids], device=cfg.device) for p in prompts]
    plains: dict[int, object] = {}
    samples: list[dict] = []
    stats: list = []

    def plain(i: int, r: int) -> int:
        out = generate_plain(target, xs[i], None, specs[i], generator=gen)
        if r == 0:
            plains[i] = out
        return int(out.lengths.sum())

    def speculative(i: int, r: int) -> int:
        sp = generate_speculative(target, draft, xs[i], None, specs[i], generator=gen)
        if r == 0:
            samples.append(
                {
                    "segment": prompts[i].segment,
                    "max_new_tokens": prompts[i].max_new_tokens,
                    **_sample_counts(sp.stats),
                    "tokens": int(sp.lengths.sum()),
                    "output_ids": sp.sequences[0, : int(sp.lengths[0])].tolist(),
                    "_seq": sp.sequences,
                }
            )
            stats.append(sp.stats)
            progress(f"evaluate: {i + 1}/{len(prompts)} [{prompts[i].segment}] tau {sp.stats.tau:.2f}")
        return int(sp.lengths.sum())

    with torch.no_grad():
        if cfg.time_local:
            warm = replace(spec, max_new_tokens=min(spec.max_new_tokens, specs[0].max_new_tokens))
            generate_plain(target, xs[0], None, warm, generator=gen)  # warm-up: first-call costs out of the timing
            generate_speculative(target, draft, xs[0], None, warm, generator=gen)
            speed = measure_speedup(len(prompts), plain, speculative, cfg.speed, progress)
        else:  # once each way, untimed: what the figures below need
            speed = None
            for i in range(len(prompts)):
                plain(i, 0)
                speculative(i, 0)
        base_stats = (
            [generate_speculative(target, baseline, x, None, sp, generator=gen).stats for x, sp in zip(xs, specs)]
            if baseline is not None
            else []
        )
    for i, s in enumerate(samples):  # round 0's outputs, in prompt order
        s["identical"] = bool(torch.equal(plains[i].sequences, s.pop("_seq")))
        if speed is not None:
            s["plain_s"], s["spec_s"] = speed.plain_s[0][i], speed.spec_s[0][i]
    identical = all(s["identical"] for s in samples)
    said = "identical" if identical else "DIFFERENT" if spec.greedy else "sampled (not compared token for token)"
    timed = f"speedup {speed.describe()}" if speed is not None else "speedup not timed (evaluate.time_local false)"
    progress(f"evaluate: {timed}; outputs {said}")
    return _finish(cfg, head, samples, speed, identical, (stats, base_stats), target_path.record(target, spec.path))


def _sample_counts(stats) -> dict[str, list[int]]:
    """Per verification step of one prompt (batch 1): drafts the rule accepted (raw, as vLLM counts them), tokens
    that reached the output, and tokens drafted."""
    acc, emitted, drafted = (t.cpu() for t in (stats.accept_lengths, stats.emitted_lengths, stats.drafted))
    live = acc[:, 0] >= 0  # the counts live on the target's device, `drafted` on the CPU
    return {
        "accept_lengths": acc[live, 0].tolist(),
        "emitted_lengths": emitted[live, 0].tolist(),
        "drafted": drafted[live].tolist(),
    }


def _finish(cfg, head: HeadEval, samples, speed: SpeedupEstimate | None, identical, runs, path_record: dict):
    """The report over all prompts: emitted tau and alpha_k (the raw ones beside them), per segment, the baseline
    head's tau on the same prompts, plots; writes `evaluation.json` under `head.out_dir`."""
    from components.evaluate.plots import plot_acceptance, plot_by_output_position, plot_training
    from eagle.stats import SpecStats, acceptance_by_position, raw_steps

    stats, base_stats, out, history_file = *runs, Path(head.out_dir), head.history_file
    n_tokens = sum(s["tokens"] for s in samples)
    every = SpecStats.cat(stats)
    tau, cond, cum = every.tau, every.per_position_acceptance, every.cumulative_acceptance
    seg: dict[str, list] = defaultdict(list)
    for s, st in zip(samples, stats):
        seg[s["segment"]].append(st)
    per_segment = {
        k: {"tau": SpecStats.cat(v).tau, "verify_steps": sum(x.n_verify_steps for x in v)}
        for k, v in sorted(seg.items())
    }
    baseline_tau = SpecStats.cat(base_stats).tau if base_stats else None
    by_position = acceptance_by_position(
        [(s["accept_lengths"], s["emitted_lengths"]) for s in samples], cfg.position_edges
    )
    by_position_raw = acceptance_by_position([raw_steps(s["accept_lengths"]) for s in samples], cfg.position_edges)
    plots = [
        str(plot_acceptance(cond, cum, tau, out / "acceptance_by_position.png")),
        str(plot_by_output_position(by_position, out / "acceptance_by_output_position.png")),
    ]
    if history_file and Path(history_file).is_file():
        plots.append(str(plot_training(history_file, out / "training_curves.png")))
    greedy = cfg.spec.greedy
    nan = float("nan")
    timing = (
        dict(
            speedup=speed.speedup,
            plain_tokens_per_s=speed.plain_tokens_per_s,
            spec_tokens_per_s=speed.spec_tokens_per_s,
            speedup_lo=speed.lo,
            speedup_hi=speed.hi,
            speedup_reliable=speed.reliable,
            speedup_note=speed.reason,
            speedup_rounds=speed.rounds,
        )
        if speed is not None
        else dict(
            speedup=nan,
            plain_tokens_per_s=nan,
            spec_tokens_per_s=nan,
            speedup_rounds=0,
            speedup_reliable=False,
            speedup_note="not timed (evaluate.time_local false)",
        )
    )
    res = EvaluateResult(
        tau=tau,
        identical=identical if greedy else None,
        acceptance=cond,
        acceptance_cumulative=cum,
        per_segment=per_segment,
        n_samples=len(samples),
        n_tokens=n_tokens,
        baseline_tau=baseline_tau,
        report_file=str(out / "evaluation.json"),
        plots=tuple(plots),
        tau_raw=every.tau_raw,
        acceptance_raw=every.per_position_acceptance_raw,
        by_position=by_position,
        **timing,
    )
    atomic_write_text(
        out / "evaluation.json",
        json.dumps(
            {
                "config": asdict(cfg),
                "result": asdict(res),
                "by_position_raw": by_position_raw,
                "speed": asdict(speed) if speed else None,
                "target_path": path_record,
                "samples": samples,
            },
            indent=2,
        )
        + "\n",
    )
    if greedy and not identical:
        bad = sum(not s["identical"] for s in samples)
        raise NotLosslessError(
            f"{bad}/{len(samples)} greedy speculative outputs differ from plain greedy decoding; "
            f"see {out / 'evaluation.json'}. This is a bug: the head must never change outputs."
        )
    return res
