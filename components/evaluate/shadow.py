"""Shadow test: the new head and the champion served by vLLM on the newest held-out captured requests, side by side.

Purpose: `shadow_test(cfg, head, settings) -> ShadowResult` (`head`: components/evaluate/stage.py `HeadEval`, the new
head on its target, the held-out requests, the output folder, the champion as its `baseline_dir`), before anything
changes in service. The held-out requests are the newest captured ones no head was trained on
(components/data/captured_traffic.py `split_heldout`, `heldout.jsonl`): each prompt is what was asked (the messages
before the served answer, through the chat template), decoded for as many new tokens as the target produced when it was
served (at most `evaluate.spec.max_new_tokens`, greedy, as the engine evaluation decodes). One vLLM without
speculation runs throughout; the new head's server beside it is measured first, then stopped, and the champion's
started beside the same plain server and measured the same way: for each head the served speedup over plain at
batch 1 is the median of interleaved rounds with its interval (components/evaluate/speed.py `measure_speedup`, the
engine evaluation's pause between servers, `evaluate.speed`), so both figures are ratios to the same plain server.
The verdict (`verdict`): promote only when the new head's greedy outputs equal plain decoding's, both figures can be
compared, and the new head's interval lies wholly above the champion's (its low end above the champion's high end).
A figure can be compared when it is reliable, or unreliable only because its interval is wider than
`evaluate.speed.max_spread` (enough rounds, no other load: an honest interval, only wide, which makes the new head's
harder to clear); not when too few rounds fit or other processes used the cores (they move the ratio itself).
`ShadowResult.gate()` is the extra gate components/registry/register.py applies (`HeadToRegister.extra_gate`), `tags()`
the registry tags (`shadow_verdict`, `shadow_reason`, `shadow_speedup[_lo|_hi]`, `shadow_champion_speedup[_lo|_hi]`,
`shadow_tau`, `shadow_champion_tau`, `shadow_prompts`; an unreliable figure is tagged "unreliable", its number kept as
`..._median`), `metrics()` the new head's figure for the served-speedup gate (`speedup_shadow[_lo|_hi]`).
`shadow.json` in `out_dir` holds both measurements; a re-run with the same inputs reads it back.
Run: inside the `train-head` flow when it trains on a capture plan and the head model has a champion
(flows/train_head.py, started by flows/retrain_capture.py).
Not here: what is held out (components/data/captured_traffic.py), the τ and served-speedup gates
(components/registry/register.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from components.data.atomic import atomic_write_text, file_sha256
from components.evaluate.engine import SwitchPause, engine_max_len, eval_spec, refuse_sampled
from components.evaluate.speed import SpeedupEstimate, Timing, measure_speedup, warm_up
from components.evaluate.stage import EvaluateConfig, HeadEval, HeldOut
from infra.settings import Settings
from infra.vllm_server import VllmServer, running

REPORT = "shadow.json"


@dataclass(frozen=True)
class Figure:
    """One head's served speedup over plain at batch 1 on the held-out requests, and what else its rounds showed."""

    speedup: float  # the median of the rounds' ratios
    lo: float
    hi: float
    reliable: bool
    note: str  # why the figure is unreliable ("" when it is reliable)
    rounds: int
    identical: bool  # greedy outputs equal to plain decoding's (round 0)
    tau: float  # vLLM's counters over every round
    wide_only: bool = False  # unreliable only for a wide interval (speed.py `SpeedupEstimate.wide_only`)

    @classmethod
    def of(cls, est: SpeedupEstimate, identical: bool, tau: float) -> "Figure":
        return cls(est.speedup, est.lo, est.hi, est.reliable, est.reason, est.rounds, identical, tau, est.wide_only)

    def describe(self) -> str:
        return f"{self.speedup:.2f}x [{self.lo:.2f}, {self.hi:.2f}]"


def verdict(new: Figure, champion: Figure) -> tuple[bool, str]:
    """(promote, why): only when the new head is lossless, both figures can be compared, and the new interval lies
    wholly above the champion's. A figure unreliable only for its width can be compared (a wider interval only makes
    the new head's harder to clear); one from too few rounds or measured beside other load cannot."""
    both = f"new head {new.describe()} vs champion {champion.describe()} over plain at batch 1"
    if not new.identical:
        return False, f"the new head's greedy outputs differ from plain decoding's ({both})"
    figs = (("new head", new), ("champion", champion))
    bad = [f"{who}'s: {f.note}" for who, f in figs if not f.reliable and not f.wide_only]
    if bad:
        return False, f"{both}; not judged, a figure is unreliable ({'; '.join(bad)})"
    wide = [f"{who}'s: {f.note}" for who, f in figs if not f.reliable]
    also = f" (judged on a wide interval, which only makes this harder: {'; '.join(wide)})" if wide else ""
    if new.lo > champion.hi:
        return True, f"{both}: the new interval lies wholly above the champion's{also}"
    return False, f"{both}: the new interval does not lie wholly above the champion's{also}"


@dataclass(frozen=True)
class ShadowResult:
    new: Figure
    champion: Figure
    promoted: bool
    reason: str
    prompts: int  # held-out requests measured
    skipped: int  # held-out requests too long for the evaluation's bounds
    champion_uri: str
    key: str  # hash of the inputs: a re-run with the same ones reads the report back
    report_file: str

    def gate(self) -> tuple[bool, str]:
        """The extra promotion gate (components/registry/register.py `HeadToRegister.extra_gate`)."""
        return self.promoted, f"shadow: {self.reason}"

    def tags(self) -> dict[str, str]:
        tags = {
            "shadow_verdict": "promote" if self.promoted else "keep champion",
            "shadow_reason": self.reason,
            "shadow_prompts": str(self.prompts),
            "shadow_champion": self.champion_uri,
        }
        for name, f in (("shadow_speedup", self.new), ("shadow_champion_speedup", self.champion)):
            tags[name] = f"{f.speedup:.4f}" if f.reliable else "unreliable"
            if not f.reliable:
                tags[f"{name}_median"] = f"{f.speedup:.4f}"
            tags[f"{name}_lo"], tags[f"{name}_hi"] = f"{f.lo:.4f}", f"{f.hi:.4f}"
        tags["shadow_tau"], tags["shadow_champion_tau"] = f"{self.new.tau:.4f}", f"{self.champion.tau:.4f}"
        return tags

    def metrics(self) -> dict[str, float]:
        """The new head's served speedup on the held-out captured requests, for the served-speedup gate
        (components/registry/register.py judges it before the engine evaluation's figure on the registered held-out
        traffic: a head retrained on what is served must pay on it); none when the figure cannot be compared."""
        f = self.new
        if not (f.reliable or f.wide_only):
            return {}
        return {"speedup_shadow": f.speedup, "speedup_shadow_lo": f.lo, "speedup_shadow_hi": f.hi}

    @classmethod
    def read(cls, path: str | Path) -> "ShadowResult":
        d = json.loads(Path(path).read_text())["result"]
        return cls(**{**d, "new": Figure(**d["new"]), "champion": Figure(**d["champion"])})


def shadow_samples(cfg: EvaluateConfig, tokenizer, heldout_path: str | Path) -> tuple[list[HeldOut], int]:
    """(the held-out requests as prompts with their new-token limits, how many were too long): each prompt is the
    messages before the served answer; its limit the served length (else `evaluate.spec.max_new_tokens`), at most
    that; a prompt over `evaluate.max_prompt_tokens` is skipped."""
    from components.data.chat import prompt_ids
    from components.data.traffic_io import load_traffic

    out, skipped = [], 0
    for conv in load_traffic(heldout_path).conversations:
        msgs = [{"role": m.role, "content": m.content} for m in conv.messages[:-1]]
        ids = prompt_ids(tokenizer, msgs)
        if len(ids) > cfg.max_prompt_tokens:
            skipped += 1
            continue
        out.append(
            HeldOut(
                conv.segment or "captured",
                ids,
                min(conv.max_new_tokens or cfg.spec.max_new_tokens, cfg.spec.max_new_tokens),
            )
        )
    if not out:
        raise ValueError(
            f"{heldout_path}: no held-out request fits in evaluate.max_prompt_tokens {cfg.max_prompt_tokens}"
        )
    return out, skipped


def shadow_test(
    cfg: EvaluateConfig,
    head: HeadEval,
    settings: Settings,
    champion_uri: str = "",
    progress: Callable[[str], None] = print,
) -> ShadowResult:
    """Measure the new head (`head.head_dir`) and the champion (`head.baseline_dir`) in vLLM on the held-out requests
    (`head.heldout`) into `head.out_dir` (see the module doc)."""
    from transformers import AutoTokenizer

    from components.targets.servable import servable_head

    target_dir, head_dir, champion_dir, heldout_path = head.target_dir, head.head_dir, head.baseline_dir, head.heldout
    out = Path(head.out_dir)
    key = hashlib.sha256(
        json.dumps(
            [
                file_sha256(Path(head_dir) / "model.safetensors"),
                file_sha256(Path(champion_dir) / "model.safetensors"),
                file_sha256(heldout_path),
                asdict(cfg),
            ],
            sort_keys=True,
        ).encode()
    ).hexdigest()
    if (out / REPORT).is_file() and (done := ShadowResult.read(out / REPORT)).key == key:
        return done
    refuse_sampled(cfg, settings)
    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=settings.trust_remote_code)
    samples, skipped = shadow_samples(cfg, tokenizer, heldout_path)
    heads = [
        str(servable_head(d, target_dir, settings.state_dir / "servable", settings.trust_remote_code))
        for d in (head_dir, champion_dir)
    ]
    longest = max(s.max_new_tokens for s in samples)

    def server(served: str | None) -> VllmServer:
        return VllmServer(eval_spec(cfg, target_dir, served, max_new_tokens=longest), settings)

    progress(f"shadow: {len(samples)} held-out captured requests; the new head and plain decoding side by side")
    with running(server(None), server(heads[0])) as (plain, new_srv):
        new = _measure(cfg, plain, new_srv, samples, progress, "new head")
        new_srv.stop()  # its memory for the champion's server, beside the same plain one
        progress("shadow: the champion and plain decoding side by side")
        with server(heads[1]) as champ_srv:
            champion = _measure(cfg, plain, champ_srv, samples, progress, "champion")
    promoted, reason = verdict(new, champion)
    res = ShadowResult(new, champion, promoted, reason, len(samples), skipped, champion_uri, key, str(out / REPORT))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        out / REPORT,
        json.dumps(
            {"result": asdict(res), "heads": heads, "max_model_len": engine_max_len(target_dir, cfg, longest)}, indent=2
        )
        + "\n",
    )
    progress(f"shadow: {'promote' if promoted else 'keep the champion'}: {reason}")
    return res


def _measure(
    cfg: EvaluateConfig,
    plain: VllmServer,
    srv: VllmServer,
    samples: list[HeldOut],
    progress: Callable[[str], None],
    what: str,
) -> Figure:
    """Interleaved rounds of plain and speculative requests (as the engine evaluation times them)."""
    warm_up((plain, srv), [s.ids for s in samples])  # first-visit costs out of the timing and the counters
    before = srv.spec_counters()
    outs: dict[str, list] = {"plain": [None] * len(samples), "spec": [None] * len(samples)}

    def run(server: VllmServer, side: str, i: int, r: int) -> int:
        c = server.complete(samples[i].ids, samples[i].max_new_tokens, cfg.spec.temperature, cfg.ignore_eos)
        if r == 0:
            outs[side][i] = c.token_ids
        return len(c.token_ids)

    pause = SwitchPause.between(plain.spec, last="spec", seconds=cfg.speed.switch_pause_s)
    est = measure_speedup(
        len(samples),
        lambda i, r: run(plain, "plain", i, r),
        lambda i, r: run(srv, "spec", i, r),
        cfg.speed,
        progress,
        Timing(
            what=f" (shadow, {what})",
            settle=pause,
            own_pgids=[s.proc.pid for s in (plain, srv) if s.proc is not None],
            block=cfg.speed.block_for(switch_costs=pause.seconds > 0),
        ),
    )
    identical = outs["plain"] == outs["spec"] or not cfg.spec.greedy  # sampled outputs are not comparable
    return Figure.of(est, identical, (srv.spec_counters() - before).tau)
