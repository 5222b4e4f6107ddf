"""Stage 4b, evaluate in the engine: the head served by vLLM, measured the way production will see it.

Purpose: `evaluate_in_vllm(cfg, head, settings) -> EngineEvalResult` (`head`: components/evaluate/stage.py `HeadEval`).
On the same held-out prompts as the local evaluation (their token ids, sent to `/v1/completions`, so both see the
very same prompt), it runs two vLLM servers side by side, one without speculation and one with EAGLE-3 and the head
(`num_speculative_tokens` = the evaluation's depth), one request at a time, interleaved in rounds
(components/evaluate/speed.py, `cfg.speed`; on a CPU build each request that follows one on the other server waits out
that server's idle spin first, `SwitchPause`: a vLLM worker busy-polls a core for 1 s after each request, and timed
beside it the rounds' ratios ran from 0.61x to 2.37x on quiet cores, against 1.20x-1.35x with the wait; so there the
sides take the prompts in blocks of `SWITCH_BLOCK`, 4 waits a round of 16 prompts instead of 16), and,
given the champion's head, a third server with it after them. Each server
of the pair gets a smaller memory share (`PAIR_MEMORY_SHARE`) so that both fit. It reports
- tau and alpha_k from the deltas of vLLM's own `/metrics` counters (drafts, accepted tokens per position),
- tau and alpha_1 by output position (`by_position`, buckets `cfg.position_edges`) from vLLM's per-request
  speculative metrics (`--per-request-spec-decode-metrics detailed`: drafts accepted per verification step, in
  output order, in each response), counted raw as the counters count; each sample's steps are in the report, the
  buckets also in `acceptance_by_output_position_vllm.png`,
- the champion's tau on the same prompts (`baseline_tau`), for a promotion gate on the engine's figures,
- wall-clock speedup in the engine: the median over rounds of plain seconds / speculative seconds over the same
  requests, with its interval and whether it is reliable (`speedup_lo`, `speedup_hi`, `speedup_reliable`),
- whether vLLM's speculative output equals vLLM's plain output token for token, and (when `ours` gives this
  project's greedy outputs for the same prompts) whether it equals ours.
Each request asks for its sample's `max_new_tokens` (else `cfg.spec.max_new_tokens`), as the local evaluation
decodes it, and with `cfg.ignore_eos` vLLM's `ignore_eos` (both servers: the outputs run to that length).
Writes `engine_evaluation.json`. A greedy output that differs raises `NotLosslessError` after the report is written.
Sampled (`cfg.spec.temperature` > 0) on a vLLM CPU build whose sampled verification is wrong is refused before any
server starts (`refuse_sampled`, infra/vllm_sampling.py: vLLM 0.32's CPU build is one).
vLLM's counters count every accepted draft token, also those past an EOS or the token limit, so the per-position
counts to compare with are this project's raw `accept_lengths` (what `evaluate.json` stores per sample).
Not here: starting/stopping vLLM (infra/vllm_server.py), the local evaluation (components/evaluate/stage.py).
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from components.data.atomic import atomic_write_text
from components.evaluate.speed import SpeedupEstimate, Timing, measure_speedup, warm_up
from components.evaluate.stage import (
    EvaluateConfig,
    HeadEval,
    HeldOut,
    NotLosslessError,
    held_out_samples,
    position_metrics,
)
from components.targets.target import target_context
from eagle.stats import acceptance_by_position, raw_steps
from infra.settings import Settings
from infra.vllm_sampling import refuse_sampled_drafts
from infra.vllm_engine_spec import EngineSpec, host_device
from infra.vllm_server import IDLE_SPIN_S, PER_REQUEST_METRICS, SpecCounters, VllmServer, running

REPORT = "engine_evaluation.json"
SETTLE_MARGIN_S = 0.2  # past the idle spin, before the other server is timed
PAIR_MEMORY_SHARE = {"cpu": 0.12, "cuda": 0.45}  # each server of the plain/speculative pair, of host or GPU memory


@dataclass(frozen=True)
class EngineEvalResult:
    engine: str
    tau: float
    acceptance: list[float]  # conditional alpha_k from vLLM's per-position counters
    drafts: int
    accepted_per_pos: list[int]
    speedup: float
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    identical_to_plain: bool
    identical_to_ours: bool | None  # None when our outputs were not given
    n_samples: int
    n_tokens: int
    report_file: str
    baseline_tau: float | None = None  # the champion's τ in vLLM on the same prompts (None: not measured)
    # `speedup` is the median of the rounds' ratios; the interval of that median, and whether it can be trusted
    speedup_lo: float | None = None
    speedup_hi: float | None = None
    speedup_reliable: bool = True
    speedup_note: str = ""
    speedup_rounds: int = 1
    by_position: list[dict] = field(default_factory=list)  # eagle.stats.acceptance_by_position, raw ([]: not given)

    def metrics(self) -> dict[str, float]:
        m = {
            "tau_vllm": self.tau,
            "speedup_vllm": self.speedup,
            "identical_vllm": float(self.identical_to_plain),
            "spec_tokens_per_s_vllm": self.spec_tokens_per_s,
            "plain_tokens_per_s_vllm": self.plain_tokens_per_s,
            "speedup_vllm_reliable": float(self.speedup_reliable),
            "speedup_vllm_rounds": float(self.speedup_rounds),
        }
        m.update(
            {
                k: v
                for k, v in (("speedup_vllm_lo", self.speedup_lo), ("speedup_vllm_hi", self.speedup_hi))
                if v is not None
            }
        )
        m.update({f"alpha_vllm_{k + 1}": a for k, a in enumerate(self.acceptance)})
        m.update(position_metrics(self.by_position, "_vllm"))
        return m


def engine_max_len(target_dir: str | Path, cfg: EvaluateConfig, max_new_tokens: int | None = None) -> int:
    """What the evaluation needs (prompt + new tokens + one draft), within the target's context; `max_new_tokens`:
    the longest sample's limit (None: `cfg.spec.max_new_tokens`)."""
    need = cfg.max_prompt_tokens + (max_new_tokens or cfg.spec.max_new_tokens) + cfg.spec.depth + 8
    return min(target_context(target_dir), max(need, 256))


def our_outputs(report_file: str | Path) -> list[list[int]]:
    """This project's greedy outputs per held-out prompt, from the local evaluation's `evaluate.json`."""
    return [s["output_ids"] for s in json.loads(Path(report_file).read_text())["samples"]]


def time_requests(
    server: VllmServer,
    prompts: list[list[int]],
    max_tokens: int | list[int],
    temperature: float = 0.0,
    progress: Callable[[int], None] | None = None,
    ignore_eos: bool = False,
) -> tuple[list[list[int]], float]:
    """Each prompt in turn (batch 1): its output token ids and the summed request seconds. `max_tokens`: one limit
    for all, or one per prompt. Warm the server up first: every request is timed."""
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    outs, seconds = [], 0.0
    for i, ids in enumerate(prompts):
        t0 = time.perf_counter()
        outs.append(server.complete(ids, limits[i], temperature, ignore_eos).token_ids)
        seconds += time.perf_counter() - t0
        if progress:
            progress(i + 1)
    return outs, seconds


def engine_samples(cfg: EvaluateConfig, target_dir: str, traffic_path: str, settings: Settings) -> list[HeldOut]:
    """The held-out prompts of the local evaluation (`components.evaluate.stage.held_out_samples`), with their
    limits."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=settings.trust_remote_code)
    return held_out_samples(tokenizer, traffic_path, cfg)


def engine_prompts(cfg: EvaluateConfig, target_dir: str, traffic_path: str, settings: Settings):
    """(segment, prompt token ids) of `engine_samples`."""
    return [(s.segment, s.ids) for s in engine_samples(cfg, target_dir, traffic_path, settings)]


def eval_spec(
    cfg: EvaluateConfig,
    target_dir: str,
    head_dir: str | None = None,
    pair: bool = True,
    max_new_tokens: int | None = None,
) -> EngineSpec:
    """The engine the evaluation runs: plain (`head_dir` None) or EAGLE-3 with `head_dir` at `cfg.spec.depth`;
    `pair`: one of two servers up at once, each with `PAIR_MEMORY_SHARE` of the memory; `max_new_tokens`: the
    longest sample's limit (None: `cfg.spec.max_new_tokens`)."""
    spec = EngineSpec(
        str(target_dir),
        str(head_dir) if head_dir else None,
        method="eagle3" if head_dir else None,
        num_speculative_tokens=cfg.spec.depth,
        max_model_len=engine_max_len(target_dir, cfg, max_new_tokens),
        extra_args=PER_REQUEST_METRICS if head_dir else (),
    )
    if not pair:
        return spec
    if spec.resolved_device() == "cpu":
        return replace(spec, cpu_memory_share=PAIR_MEMORY_SHARE["cpu"])
    return replace(spec, extra_args=(*spec.extra_args, "--gpu-memory-utilization", str(PAIR_MEMORY_SHARE["cuda"])))


def refuse_sampled(cfg: EvaluateConfig, settings: Settings) -> None:
    """Sampled evaluation (`evaluate.spec.temperature` > 0) refused before any server starts where this vLLM's
    CPU build verifies sampled drafts wrongly (infra/vllm_sampling.py): its figures would be the defect's. The
    commands' preflight refuses it before any work (flows/preflight.py); this is for callers without one.
    The evaluation's servers run on the host's device (`eval_spec` leaves it "auto")."""
    refuse_sampled_drafts(host_device(), cfg.spec.temperature, settings, "evaluate.spec.temperature")


def plain_server(
    cfg: EvaluateConfig, target_dir: str, settings: Settings, max_new_tokens: int | None = None
) -> VllmServer:
    """vLLM without speculation for this target and config, not yet started (`with plain_server(...) as srv`); one
    running server can be handed to several `evaluate_in_vllm` calls of the same target and config (`max_new_tokens`:
    the longest sample's limit, when the traffic gives per-sample limits)."""
    return VllmServer(eval_spec(cfg, target_dir, max_new_tokens=max_new_tokens), settings)


def eval_pair(
    cfg: EvaluateConfig,
    target_dir: str,
    head_dir: str,
    traffic_path: str,
    settings: Settings,
    longest: int | None = None,
) -> tuple[VllmServer, VllmServer]:
    """The plain and speculative servers `evaluate_in_vllm` runs for these held-out prompts, not started (also to be
    started early, `EnginePool.launch`: built here alike, the evaluation takes them); `longest`: the samples'
    longest length limit (None: read from the traffic)."""
    refuse_sampled(cfg, settings)
    if longest is None:
        longest = max(p.max_new_tokens for p in engine_samples(cfg, target_dir, traffic_path, settings))
    return (
        plain_server(cfg, target_dir, settings, longest),
        VllmServer(eval_spec(cfg, target_dir, head_dir, max_new_tokens=longest), settings),
    )


def evaluate_in_vllm(
    cfg: EvaluateConfig,
    head: HeadEval,
    settings: Settings,
    ours: list[list[int]] | None = None,
    plain: VllmServer | None = None,
    progress: Callable[[str], None] = print,
    engines=None,
) -> EngineEvalResult:
    """`head.head_dir` on `head.target_dir` over the held-out prompts of `head.heldout`, the report into
    `head.out_dir` (`head.history_file` plays no part here). `ours`: this project's greedy outputs on the same prompts
    (from `evaluate.json`); `plain`: a running `plain_server` for this target and config (else one is started beside
    the head's); `head.baseline_dir`: the current champion's head, also served on the same prompts, so that a gate on
    the engine's τ compares like with like (`baseline_tau`; None: not measured); `engines`: an
    `infra.engine_pool.EnginePool` that the plain and speculative servers are taken from when it holds them and left
    running in for a later stage (the load sweep)."""
    target_dir, head_dir = head.target_dir, head.head_dir
    refuse_sampled(cfg, settings)
    out = Path(head.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = engine_samples(cfg, target_dir, head.heldout, settings)
    longest = max(p.max_new_tokens for p in prompts)
    if plain is not None and plain.spec.max_model_len < engine_max_len(target_dir, cfg, longest):
        plain = None  # too short a context for these samples' limits: one of the right length is started
    with ExitStack() as stack:
        if plain is None:  # both started at once: their start-ups overlap
            progress(
                f"evaluate (vLLM): starting the engine without speculation and with the head "
                f"({cfg.spec.depth} speculative tokens), side by side"
            )
            both = eval_pair(cfg, target_dir, head_dir, head.heldout, settings, longest)
            plain, srv = stack.enter_context(
                engines.running(*both, keep=not head.baseline_dir)  # the champion's
                if engines
                else running(*both)
            )  # server needs their memory
        else:
            progress(f"evaluate (vLLM): starting the engine with the head ({cfg.spec.depth} speculative tokens)")
            srv = stack.enter_context(
                VllmServer(eval_spec(cfg, target_dir, head_dir, max_new_tokens=longest), settings)
            )
        measured = _interleaved(cfg, plain, srv, prompts, progress)
    baseline = None
    if head.baseline_dir:
        from components.targets.servable import servable_head

        served = servable_head(
            head.baseline_dir, target_dir, settings.state_dir / "servable", settings.trust_remote_code
        )
        baseline = _run_head(cfg, target_dir, str(served), prompts, settings, progress, "champion")[1].tau
    return _finish(cfg, out, prompts, measured, ours, baseline)


def _interleaved(cfg: EvaluateConfig, plain: VllmServer, srv: VllmServer, prompts, progress) -> Interleaved:
    """Rounds of plain and speculative requests, interleaved prompt by prompt (components/evaluate/speed.py): round 0's
    outputs of both, the speculative server's counter deltas over round 0 (the prompts once, as ours), the timing."""
    n, temp = len(prompts), cfg.spec.temperature
    warm_up((plain, srv), [p.ids for p in prompts])
    before = srv.spec_counters()
    outs: dict[str, list] = {"plain": [None] * n, "spec": [None] * n, "steps": [None] * n}
    counters: list[SpecCounters] = []

    def run(server: VllmServer, key: str, i: int, r: int) -> int:
        c = server.complete(prompts[i].ids, prompts[i].max_new_tokens, temp, cfg.ignore_eos)
        if r == 0:
            outs[key][i] = c.token_ids
            if key == "spec":
                outs["steps"][i] = c.accepted_per_step
                if all(o is not None for o in outs["spec"]):
                    counters.append(srv.spec_counters() - before)
        return len(c.token_ids)

    pause = SwitchPause.between(
        plain.spec,
        last="spec",  # the warm-up's last request went to the head's server
        seconds=cfg.speed.switch_pause_s,
    )
    speed = measure_speedup(
        n,
        lambda i, r: run(plain, "plain", i, r),
        lambda i, r: run(srv, "spec", i, r),
        cfg.speed,
        progress,
        Timing(
            what=" (vLLM)",
            own_pgids=[s.proc.pid for s in (plain, srv) if s.proc is not None],  # own sessions
            settle=pause,
            block=cfg.speed.block_for(switch_costs=pause.seconds > 0),
        ),
    )
    return Interleaved(
        EngineRun(outs["plain"], sum(speed.plain_s[0])),
        EngineRun(outs["spec"], sum(speed.spec_s[0]), outs["steps"]),
        counters[0],
        speed,
    )


class SwitchPause:
    """`pause(kind)` before a timed request to server `kind`: sleeps `seconds` when the previous request went to the
    other server (its worker is still busy-polling a core, infra/vllm_server.py `IDLE_SPIN_S`), else returns at once.
    Interleaved prompt by prompt with the order alternating, half the requests follow one on the other server.
    On a GPU build `seconds` is 0: the spin takes a host core, not the GPU the requests run on."""

    def __init__(self, seconds: float, last: str | None = None, sleep: Callable[[float], None] = time.sleep) -> None:
        self.seconds, self.last, self.sleep = seconds, last, sleep

    @classmethod
    def between(cls, spec: EngineSpec, last: str | None = None, seconds: float | None = None) -> "SwitchPause":
        """The pause between servers of `spec`'s device: `seconds` when given (`evaluate.speed.switch_pause_s`),
        else past the idle spin on a CPU build, none on a GPU."""
        if seconds is None:
            seconds = IDLE_SPIN_S + SETTLE_MARGIN_S if spec.resolved_device() == "cpu" else 0.0
        return cls(seconds, last)

    def __call__(self, kind: str) -> None:
        if self.seconds > 0 and self.last is not None and kind != self.last:
            self.sleep(self.seconds)
        self.last = kind


@dataclass(frozen=True)
class EngineRun:
    """Outputs (token ids per prompt) and wall-clock seconds of one pass over the prompts in vLLM."""

    outputs: list[list[int]]
    seconds: float
    accepted_per_step: list[list[int] | None] | None = None  # per prompt, from the per-request metrics (if given)


@dataclass(frozen=True)
class Interleaved:
    """What `_interleaved` measured: round 0 of the plain and the speculative server, the speculative server's
    counters over it, the timing of all rounds."""

    plain: EngineRun
    spec: EngineRun
    counters: SpecCounters
    speed: SpeedupEstimate


def _run_head(
    cfg: EvaluateConfig,
    target_dir: str,
    head_dir: str,
    prompts,
    settings: Settings,
    progress: Callable[[str], None],
    what: str,
) -> tuple[EngineRun, SpecCounters]:
    """vLLM with `head_dir` (EAGLE-3, `cfg.spec.depth` tokens) alone over `prompts`: outputs, seconds, counters."""
    progress(f"evaluate (vLLM): starting the engine with the {what} head ({cfg.spec.depth} speculative tokens)")
    longest = max(p.max_new_tokens for p in prompts)
    with VllmServer(eval_spec(cfg, target_dir, head_dir, pair=False, max_new_tokens=longest), settings) as srv:
        srv.complete(prompts[0].ids, 4)  # warm-up, before the counters are read
        before = srv.spec_counters()
        outputs, seconds = time_requests(
            srv,
            [p.ids for p in prompts],
            [p.max_new_tokens for p in prompts],
            cfg.spec.temperature,
            ignore_eos=cfg.ignore_eos,
        )
        return EngineRun(outputs, seconds), srv.spec_counters() - before


def _finish(
    cfg: EvaluateConfig, out: Path, prompts, measured: Interleaved, ours, baseline_tau: float | None = None
) -> EngineEvalResult:
    spec_run, counters, speed = measured.spec, measured.counters, measured.speed
    plain, spec = measured.plain.outputs, spec_run.outputs
    n_tokens = sum(len(s) for s in spec)
    same_plain = [a == b for a, b in zip(plain, spec)]
    same_ours = None if ours is None else [list(a) == b for a, b in zip(ours, spec)]
    steps = spec_run.accepted_per_step or [None] * len(spec)
    given = all(s is not None for s in steps)  # a vLLM without per-request metrics gives none: no buckets then
    by_position = acceptance_by_position([raw_steps(s) for s in steps], cfg.position_edges) if given else []
    res = EngineEvalResult(
        engine="vllm",
        tau=counters.tau,
        acceptance=counters.acceptance,
        drafts=counters.drafts,
        accepted_per_pos=list(counters.accepted_per_pos),
        speedup=speed.speedup,
        plain_tokens_per_s=speed.plain_tokens_per_s,
        spec_tokens_per_s=speed.spec_tokens_per_s,
        identical_to_plain=all(same_plain),
        identical_to_ours=None if same_ours is None else all(same_ours),
        n_samples=len(prompts),
        n_tokens=n_tokens,
        report_file=str(out / REPORT),
        baseline_tau=baseline_tau,
        speedup_lo=speed.lo,
        speedup_hi=speed.hi,
        speedup_reliable=speed.reliable,
        speedup_note=speed.reason,
        speedup_rounds=speed.rounds,
        by_position=by_position,
    )
    samples = [
        {
            "segment": h.segment,
            "prompt_len": len(h.ids),
            "max_new_tokens": h.max_new_tokens,
            "plain": p,
            "spec": s,
            "identical_to_plain": sp,
            "accept_lengths": steps[i],
            **({} if same_ours is None else {"identical_to_ours": same_ours[i]}),
        }
        for i, (h, p, s, sp) in enumerate(zip(prompts, plain, spec, same_plain))
    ]
    atomic_write_text(
        out / REPORT,
        json.dumps({"config": asdict(cfg), "result": asdict(res), "speed": asdict(speed), "samples": samples}, indent=2)
        + "\n",
    )
    if by_position:
        from components.evaluate.plots import plot_by_output_position

        plot_by_output_position(by_position, out / "acceptance_by_output_position_vllm.png", label="vLLM")
    if cfg.spec.greedy and (not res.identical_to_plain or res.identical_to_ours is False):
        bad_plain = sum(not s for s in same_plain)
        bad_ours = 0 if same_ours is None else sum(not s for s in same_ours)
        raise NotLosslessError(
            f"in vLLM, {bad_plain}/{len(prompts)} speculative outputs differ from vLLM's plain "
            f"greedy output and {bad_ours} from this project's; see {out / REPORT}"
        )
    return res
