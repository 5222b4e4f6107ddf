"""Stage 4b, evaluate in the engine: the head served by vLLM, measured the way production will see it.

Purpose: `evaluate_in_vllm(cfg, target_dir, head_dir, traffic_path, out_dir, settings) -> EngineEvalResult`.
On the same held-out prompts as the local evaluation (their token ids, sent to `/v1/completions`, so both see the
very same prompt), it runs vLLM twice, one request at a time: plain decoding, then EAGLE-3 with the head
(`num_speculative_tokens` = the evaluation's depth), and, given the champion's head, a third time with it. It
reports
- tau and alpha_k from the deltas of vLLM's own `/metrics` counters (drafts, accepted tokens per position),
- the champion's tau on the same prompts (`baseline_tau`), for a promotion gate on the engine's figures,
- wall-clock speedup in the engine (plain seconds / speculative seconds over the same requests),
- whether vLLM's speculative output equals vLLM's plain output token for token, and (when `ours` gives this
  project's greedy outputs for the same prompts) whether it equals ours.
Writes `engine_evaluation.json`. A greedy output that differs raises `NotLosslessError` after the report is written.
vLLM's counters count every accepted draft token, also those past an EOS or the token limit, so the per-position
counts to compare with are this project's raw `accept_lengths` (what `evaluate.json` stores per sample).
Not here: starting/stopping vLLM (infra/vllm_server.py), the local evaluation (components/evaluate.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from components.atomic import atomic_write_text
from components.evaluate import EvaluateConfig, NotLosslessError, held_out_prompts
from infra.settings import Settings
from infra.vllm_server import EngineSpec, SpecCounters, VllmServer

REPORT = "engine_evaluation.json"


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

    def metrics(self) -> dict[str, float]:
        m = {"tau_vllm": self.tau, "speedup_vllm": self.speedup, "identical_vllm": float(self.identical_to_plain),
             "spec_tokens_per_s_vllm": self.spec_tokens_per_s, "plain_tokens_per_s_vllm": self.plain_tokens_per_s}
        m.update({f"alpha_vllm_{k + 1}": a for k, a in enumerate(self.acceptance)})
        return m


def target_context(target_dir: str | Path) -> int:
    """The target's context length (`max_position_embeddings`): vLLM refuses a longer max_model_len."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))


def engine_max_len(target_dir: str | Path, cfg: EvaluateConfig) -> int:
    """What the evaluation needs (prompt + new tokens + one draft), within the target's context."""
    need = cfg.max_prompt_tokens + cfg.spec.max_new_tokens + cfg.spec.depth + 8
    return min(target_context(target_dir), max(need, 256))


def our_outputs(report_file: str | Path) -> list[list[int]]:
    """This project's greedy outputs per held-out prompt, from the local evaluation's `evaluate.json`."""
    return [s["output_ids"] for s in json.loads(Path(report_file).read_text())["samples"]]


def time_requests(server: VllmServer, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
                  progress: Callable[[int], None] | None = None) -> tuple[list[list[int]], float]:
    """Each prompt in turn (batch 1): its output token ids and the summed request seconds. Warm the server up
    first: every request is timed."""
    outs, seconds = [], 0.0
    for i, ids in enumerate(prompts):
        t0 = time.perf_counter()
        outs.append(server.complete(ids, max_tokens, temperature).token_ids)
        seconds += time.perf_counter() - t0
        if progress:
            progress(i + 1)
    return outs, seconds


def _run_all(server: VllmServer, prompts, cfg: EvaluateConfig, progress: Callable[[str], None], what: str):
    def report(done: int) -> None:
        if done % 8 == 0 or done == len(prompts):
            progress(f"evaluate (vLLM {what}): {done}/{len(prompts)}")

    return time_requests(server, [ids for _, ids in prompts], cfg.spec.max_new_tokens, cfg.spec.temperature, report)


@dataclass(frozen=True)
class EngineRun:
    """Outputs (token ids per prompt) and wall-clock seconds of one pass over the prompts in vLLM."""

    outputs: list[list[int]]
    seconds: float


def engine_prompts(cfg: EvaluateConfig, target_dir: str, traffic_path: str, settings: Settings):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=settings.trust_remote_code)
    return held_out_prompts(tokenizer, traffic_path, cfg)


def run_plain(cfg: EvaluateConfig, target_dir: str, prompts, settings: Settings,
              progress: Callable[[str], None] = print) -> EngineRun:
    """vLLM without speculation over `prompts` (reusable across heads of the same target)."""
    spec = EngineSpec(str(target_dir), method=None, max_model_len=engine_max_len(target_dir, cfg))
    progress(f"evaluate (vLLM): starting the engine without speculation ({len(prompts)} prompts)")
    with VllmServer(spec, settings) as srv:
        srv.complete(prompts[0][1], 4)  # warm-up: first-request costs out of the timing
        return EngineRun(*_run_all(srv, prompts, cfg, progress, "plain"))


def evaluate_in_vllm(cfg: EvaluateConfig, target_dir: str, head_dir: str, traffic_path: str, out_dir: str,
                     settings: Settings, ours: list[list[int]] | None = None, plain: EngineRun | None = None,
                     progress: Callable[[str], None] = print,
                     baseline_head_dir: str | None = None) -> EngineEvalResult:
    """`ours`: this project's greedy outputs on the same prompts (from `evaluate.json`); `plain`: a `run_plain`
    result for this target and config, to skip that pass; `baseline_head_dir`: the current champion's head, also
    served on the same prompts, so that a gate on the engine's τ compares like with like (`baseline_tau`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = engine_prompts(cfg, target_dir, traffic_path, settings)
    plain = plain or run_plain(cfg, target_dir, prompts, settings, progress)
    spec_run, counters = _run_head(cfg, target_dir, head_dir, prompts, settings, progress, "EAGLE-3")
    baseline = None
    if baseline_head_dir:
        from components.serve import servable_head

        served = servable_head(baseline_head_dir, target_dir, settings.state_dir / "servable",
                               settings.trust_remote_code)
        baseline = _run_head(cfg, target_dir, str(served), prompts, settings, progress, "champion")[1].tau
    return _finish(cfg, out, prompts, plain, spec_run, ours, counters, baseline)


def _run_head(cfg: EvaluateConfig, target_dir: str, head_dir: str, prompts, settings: Settings,
              progress: Callable[[str], None], what: str) -> tuple[EngineRun, SpecCounters]:
    """vLLM with `head_dir` (EAGLE-3, `cfg.spec.depth` tokens) over `prompts`: outputs, seconds, counter deltas."""
    spec = EngineSpec(str(target_dir), str(head_dir), method="eagle3", num_speculative_tokens=cfg.spec.depth,
                      max_model_len=engine_max_len(target_dir, cfg))
    progress(f"evaluate (vLLM): starting the engine with the {what} head ({cfg.spec.depth} speculative tokens)")
    with VllmServer(spec, settings) as srv:
        srv.complete(prompts[0][1], 4)  # warm-up, before the counters are read
        before = srv.spec_counters()
        outputs, seconds = _run_all(srv, prompts, cfg, progress, what)
        return EngineRun(outputs, seconds), srv.spec_counters() - before


def _finish(cfg: EvaluateConfig, out: Path, prompts, plain_run: EngineRun, spec_run: EngineRun, ours,
            counters: SpecCounters, baseline_tau: float | None = None) -> EngineEvalResult:
    plain, spec, t_plain, t_spec = plain_run.outputs, spec_run.outputs, plain_run.seconds, spec_run.seconds
    n_tokens = sum(len(s) for s in spec)
    same_plain = [a == b for a, b in zip(plain, spec)]
    same_ours = None if ours is None else [list(a) == b for a, b in zip(ours, spec)]
    res = EngineEvalResult(
        engine="vllm", tau=counters.tau, acceptance=counters.acceptance, drafts=counters.drafts,
        accepted_per_pos=list(counters.accepted_per_pos), speedup=t_plain / max(t_spec, 1e-9),
        plain_tokens_per_s=sum(len(p) for p in plain) / max(t_plain, 1e-9),
        spec_tokens_per_s=n_tokens / max(t_spec, 1e-9), identical_to_plain=all(same_plain),
        identical_to_ours=None if same_ours is None else all(same_ours), n_samples=len(prompts), n_tokens=n_tokens,
        report_file=str(out / REPORT), baseline_tau=baseline_tau)
    samples = [{"segment": seg, "prompt_len": len(ids), "plain": p, "spec": s, "identical_to_plain": sp,
                **({} if same_ours is None else {"identical_to_ours": same_ours[i]})}
               for i, ((seg, ids), p, s, sp) in enumerate(zip(prompts, plain, spec, same_plain))]
    atomic_write_text(out / REPORT, json.dumps({"config": asdict(cfg), "result": asdict(res), "samples": samples},
                                               indent=2) + "\n")
    if cfg.spec.greedy and (not res.identical_to_plain or res.identical_to_ours is False):
        bad_plain = sum(not s for s in same_plain)
        bad_ours = 0 if same_ours is None else sum(not s for s in same_ours)
        raise NotLosslessError(f"in vLLM, {bad_plain}/{len(prompts)} speculative outputs differ from vLLM's plain "
                               f"greedy output and {bad_ours} from this project's; see {out / REPORT}")
    return res
