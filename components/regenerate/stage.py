"""Stage 1, regenerate: the target answers every user turn of the training traffic; its answers are the data.

Purpose: `regenerate(cfg, target_dir, traffic_path, out_dir, context=StageContext()) -> RegenerateResult` (`context`:
components/targets/runtime.py, whether the target's code is trusted, the Settings, the run's `TargetRuntime`).
Multi-turn conversations are answered turn by turn (each answer becomes the history of the next turn), batched with HF
generation on a local target, or through any OpenAI-compatible endpoint (a vLLM or SGLang server) when
`cfg.endpoint_url` is set, with up to `cfg.endpoint_concurrency` requests in flight (components/regenerate/endpoint.py);
where the run's `TargetRuntime` regenerates in the engine (`regenerate.engine: vllm`, or `target.runtime: vllm`: our
process never loads the target) and no URL is given, through a vLLM this stage starts for the target.
Length: each answer is at most the conversation's own `max_new_tokens` when the traffic gives one (the long
traffic does: components/data/traffic_io.py), else `cfg.max_new_tokens`, on every path (local batches, endpoint, vLLM,
Ray). An `Answerer` is called `answer(batch)` for the global limit and `answer(batch, max_new_tokens=N)` for a
batch of conversations that ask for N (batches are grouped by limit).
Resumable: conversations are written in shards of `cfg.shard_size`, each shard atomically (temp file + rename)
with a sidecar listing its ok and failed ids; a re-run skips every conversation of a finished shard. The
accounting (`accounting.json`) always satisfies total = ok + failed + skipped.
Distributed: `cfg.num_workers` 0 answers the shards in this process; N >= 1 answers them on N Ray actors, one shard
per task (infra/actor_pool.py), each actor a `ShardWorker` loading the target (or opening the endpoint, with up to
`cfg.endpoint_concurrency` requests in flight) once and answering a shard exactly as this process does
(`answer_shard`); this process still writes every file as each shard returns, and each shard is seeded by its index
alone, so the files are byte-identical whatever `num_workers` is, resume works the same, and the workers need no
filesystem shared with the driver (only the target directory).
Run: through flows/train_head.py or `eagle-heads train`; in tests directly.
Not here: tokenisation for training (components/extract/stage.py), evaluation prompts (components/evaluate/stage.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from components.data.atomic import atomic_write_text, remove_stale_temps
from components.data.chat import prompt_ids
from components.data.regenerated import shard_paths
from components.data.traffic_io import Conversation, load_traffic
from components.regenerate.endpoint import (
    answer_concurrently,
    conversation_record,
    endpoint_answerer,
    endpoint_ask,
    engine_endpoint,
    history_turns,
)
from components.targets.runtime import STAGE_ENGINES, StageContext, TargetRuntime
from eagle.config_checks import NOT_IDENTITY, FieldError, at_least, finite, one_of
from eagle.errors import BadInput
from infra.settings import http_url_problem

__all__ = [
    "Answerer",
    "RegenerateConfig",
    "RegenerateError",
    "RegenerateResult",
    "answer_all",
    "answer_shard",
    "endpoint_answerer",
    "hf_answerer",
    "regenerate",
    "responder",
]


@dataclass(frozen=True)
class RegenerateConfig:
    max_new_tokens: int = 128
    temperature: float = 0.7
    top_p: float = 1.0
    batch_size: int = 16
    shard_size: int = 64
    seed: int = 0
    device: str = "cpu"
    limit: int | None = None  # only the first N conversations
    endpoint_url: str | None = None  # OpenAI-compatible server, e.g. http://127.0.0.1:8000
    endpoint_model: str | None = None
    endpoint_timeout_s: float = 120.0
    engine: str = "local"  # "vllm": without endpoint_url, a vLLM started here answers (so does target.runtime vllm)
    # where and how fast, not what: the files are the same whatever these are (not part of a run's identity)
    endpoint_concurrency: int = field(default=4, metadata=NOT_IDENTITY)  # requests in flight at most, per worker
    num_workers: int = field(default=0, metadata=NOT_IDENTITY)  # 0: in this process; N: N Ray actors, a shard each
    cpus_per_worker: int = field(default=1, metadata=NOT_IDENTITY)  # of each actor (one GPU each too on CUDA)

    def __post_init__(self) -> None:
        at_least(
            self,
            {
                "max_new_tokens": 1,
                "batch_size": 1,
                "shard_size": 1,
                "seed": 0,
                "endpoint_concurrency": 1,
                "num_workers": 0,
                "cpus_per_worker": 1,
            },
        )
        if self.limit is not None:
            at_least(self, {"limit": 1})
        finite(self, "temperature", lambda x: x >= 0, ">= 0")
        finite(self, "top_p", lambda x: 0 < x <= 1, "in (0, 1]")
        finite(self, "endpoint_timeout_s", lambda x: x > 0, "> 0")
        if self.endpoint_url is not None and (problem := http_url_problem(self.endpoint_url)):
            raise FieldError(self, "endpoint_url", f"{self.endpoint_url!r}: {problem}")
        one_of(self, "engine", STAGE_ENGINES)

    def engine_conflict(self, in_engine: bool) -> tuple[str, str] | None:
        """(key, why) when this section cannot run where the runtime puts it (components/targets/runtime.py asks):
        Ray actors, each loading the target, beside the one engine started for the run."""
        if in_engine and self.num_workers and not self.endpoint_url:
            return "num_workers", (
                f"must be 0 with engine 'vllm' (one engine answers every shard), got {self.num_workers}"
            )
        return None


@dataclass(frozen=True)
class RegenerateResult:
    out_dir: str
    shards: tuple[str, ...]
    total: int
    ok: int
    failed: int
    skipped: int
    failures: dict[str, str] = field(default_factory=dict)


Answerer = Callable[..., list[str | Exception]]  # (batch of message lists[, max_new_tokens=N]) -> texts or failures
Responder = Callable[[Sequence[Conversation], Callable[[str], None] | None], list[dict[str, Any]]]


class RegenerateError(BadInput):
    """No conversation of the traffic could be regenerated (every one failed)."""


def answer_all(
    convs: Sequence[Conversation], answer: Answerer, batch_size: int, on_batch: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """Regenerate every conversation turn by turn; each record is ok (messages) or failed (reason). A turn's
    conversations are batched by their `max_new_tokens` (in order of first appearance; one group without any)."""
    states = []
    for c in convs:
        system, users = history_turns(c)
        states.append({"conv": c, "msgs": list(system), "users": users, "error": None})
    max_turns = max((len(s["users"]) for s in states), default=0)
    for t in range(max_turns):
        live = [s for s in states if s["error"] is None and t < len(s["users"])]
        for s in live:
            s["msgs"].append({"role": "user", "content": s["users"][t]})
        groups = [
            [s for s in live if s["conv"].max_new_tokens == n]
            for n in dict.fromkeys(s["conv"].max_new_tokens for s in live)
        ]
        for group, b in ((g, b) for g in groups for b in range(0, len(g), batch_size)):
            chunk = group[b : b + batch_size]
            t0, limit = time.perf_counter(), chunk[0]["conv"].max_new_tokens
            msgs = [s["msgs"] for s in chunk]
            for s, reply in zip(chunk, answer(msgs) if limit is None else answer(msgs, max_new_tokens=limit)):
                if isinstance(reply, Exception):
                    s["error"] = f"turn {t + 1}: {reply}"
                else:
                    s["msgs"].append({"role": "assistant", "content": reply})
            if on_batch:
                on_batch(
                    f"  turn {t + 1}: {min(b + batch_size, len(group))}/{len(group)} conversations"
                    f"{'' if limit is None else f' of {limit} new tokens'} "
                    f"({time.perf_counter() - t0:.1f} s for this batch)"
                )
    return [conversation_record(s["conv"], s["msgs"], s["error"]) for s in states]


def hf_answerer(target: Any, tokenizer: Any, cfg: RegenerateConfig) -> Answerer:
    """Batched generation by the HF target with left padding; prompts too long for the context fail individually.
    `answer(batch, max_new_tokens=N)` answers with at most N new tokens (default `cfg.max_new_tokens`).

    Decoding uses `eagle.speculative.generate_plain` (the HF model's forward with a preallocated KV cache; greedy
    or temperature/top-p sampling, tested token-for-token against HF greedy), which skips `model.generate`'s
    per-step overhead. It runs the target on the default path of `eagle.target_path` (or the one
    `EAGLE_TARGET_PATH` pins), never "auto": a path measured per process could differ between Ray workers or
    between a run and its resume, and the paths agree only up to rounding, which sampling can turn into other
    tokens; the shard files must be byte-identical whatever runs them.
    """
    import torch

    from eagle import target_path
    from eagle.speculative import SpecConfig, generate_plain

    path = target_path.pinned() or target_path.DEFAULT

    eos = target.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)

    def answer(batch: list[list[dict[str, str]]], max_new_tokens: int | None = None) -> list[str | Exception]:
        new = max_new_tokens or cfg.max_new_tokens
        limit = prompt_room(target.config, new)[1]
        ids = [prompt_ids(tokenizer, msgs) for msgs in batch]
        results: list[str | Exception] = [
            ValueError(f"prompt of {len(x)} tokens exceeds the target's context ({limit} tokens left for the prompt)")
            for x in ids
        ]
        keep = [i for i, x in enumerate(ids) if len(x) <= limit]
        if not keep:
            return results
        width = max(len(ids[i]) for i in keep)
        inp = torch.full((len(keep), width), pad, dtype=torch.long)
        att = torch.zeros_like(inp)
        for r, i in enumerate(keep):
            inp[r, width - len(ids[i]) :] = torch.tensor(ids[i])
            att[r, width - len(ids[i]) :] = 1
        spec = SpecConfig(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=new,
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=pad,
            path=path,
        )
        with torch.inference_mode():  # the same model and sampling rule as HF generate, with the lean KV cache
            out = generate_plain(target, inp.to(cfg.device), att.to(cfg.device), spec)
        for r, i in enumerate(keep):
            toks = out.sequences[r, : int(out.lengths[r])]
            results[i] = tokenizer.decode(toks, skip_special_tokens=True)  # verbatim: code's indent
        return results

    return answer


def prompt_room(config: Any, new_tokens: int) -> tuple[int, int]:
    """(the target's context, the tokens it leaves a prompt when `new_tokens` are to be generated): the rule by which
    the local answerer refuses a prompt (flows/preflight.py applies it to first turns before a run starts)."""
    context = int(getattr(config, "max_position_embeddings", 2048))
    return context, context - new_tokens


def _load_local(target_dir: str, cfg: RegenerateConfig, trust_remote_code: bool):
    from components.targets.target import load_target

    target, tokenizer = load_target(target_dir, cfg.device, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    return hf_answerer(target, tokenizer, cfg)


def responder(
    cfg: RegenerateConfig, target_dir: str, trust_remote_code: bool = False, answer: Answerer | None = None
) -> Responder:
    """What answers a shard's conversations: `answer` in batches if given, else the endpoint (concurrent requests)
    when `cfg.endpoint_url` is set, else the local target, loaded here once, in batches."""
    if answer is None and cfg.endpoint_url:
        ask = endpoint_ask(cfg)
        return lambda convs, report: answer_concurrently(convs, ask, cfg.endpoint_concurrency, report)
    batched = answer or _load_local(target_dir, cfg, trust_remote_code)
    return lambda convs, report: answer_all(convs, batched, cfg.batch_size, on_batch=report)


def _seed_shard(seed: int, shard: int) -> None:
    import torch

    torch.manual_seed(seed * 1_000_003 + shard)


def answer_shard(
    cfg: RegenerateConfig,
    shard: int,
    convs: Sequence[Conversation],
    respond: Responder,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One shard's records. Seeded by its index alone: its samples do not depend on which shards ran before it, in
    which process (resume = clean run, Ray = in-process)."""
    _seed_shard(cfg.seed, shard)
    return respond(convs, progress)


class ShardWorker:
    """A Ray actor's state (infra/actor_pool.py): the config and, from its first shard on, the loaded target (or
    the endpoint client)."""

    def __init__(self, cfg: RegenerateConfig, target_dir: str, trust_remote_code: bool):
        self.cfg, self.target_dir, self.trust_remote_code = cfg, target_dir, trust_remote_code
        self.respond: Responder | None = None

    def run(self, shard: int, convs: Sequence[Conversation]) -> list[dict[str, Any]]:
        if self.respond is None:  # in the first task, so a load error is that task's error, raised as itself
            self.respond = responder(self.cfg, self.target_dir, self.trust_remote_code)
        return answer_shard(self.cfg, shard, convs, self.respond)


def _finished_ok(out: Path, s: int, chunk: Sequence[Conversation]) -> int | None:
    """The ok count of shard `s` if a previous run finished it (for these very conversations), else None."""
    data, meta = shard_paths(out, s)
    if meta.is_file() and data.is_file():
        done = json.loads(meta.read_text())
        if done.get("ids") == [c.id for c in chunk]:
            return int(done.get("ok", 0))
    return None


def _chunks(cfg: RegenerateConfig, traffic_path: str) -> list[list[Conversation]]:
    """The shards' conversations: the traffic's first `cfg.limit`, `cfg.shard_size` a shard."""
    convs = list(load_traffic(traffic_path).conversations)[: cfg.limit]
    return [convs[i : i + cfg.shard_size] for i in range(0, len(convs), cfg.shard_size)]


def link_twins(
    cfg: RegenerateConfig, traffic_path: str, out_dir: str, reuse: Sequence[str], progress=print
) -> dict[str, int]:
    """Before the stage runs: each shard of `out_dir` not finished there whose twin is finished in a `reuse` folder
    (earlier runs' folders of the same answers, components/regenerate/reuse.py: the same index, the same
    conversation ids) is linked from there, so the stage skips it. Returns {folder: shards linked}."""
    from components.regenerate.reuse import link_shard

    out, linked = Path(out_dir), {}
    if not reuse:  # the common case (no earlier run of the same answers): the traffic is not read for nothing
        return linked
    for s, chunk in enumerate(_chunks(cfg, traffic_path)):
        if _finished_ok(out, s, chunk) is not None:
            continue
        folder = next((Path(f) for f in reuse if _finished_ok(Path(f), s, chunk) is not None), None)
        if folder is not None:
            out.mkdir(parents=True, exist_ok=True)
            link_shard(*shard_paths(folder, s), out)
            linked[str(folder)] = linked.get(str(folder), 0) + 1
    for folder, n in linked.items():
        progress(f"regenerate: {n} finished shard(s) of the same answers linked from {folder}")
    return linked


def _write_shard(
    out: Path, s: int, chunk: Sequence[Conversation], records: list[dict[str, Any]]
) -> tuple[int, dict[str, str]]:
    """Shard `s`'s files (the data first, then the sidecar that marks it done; nothing when every conversation
    failed, so a re-run tries it again); returns (ok, failures)."""
    good = [r for r in records if "messages" in r]
    bad = {r["id"]: r["error"] for r in records if "error" in r}
    if good:
        data, meta = shard_paths(out, s)
        atomic_write_text(data, "".join(json.dumps(r) + "\n" for r in good))
        atomic_write_text(meta, json.dumps({"ids": [c.id for c in chunk], "ok": len(good), "failed": bad}) + "\n")
    return len(good), bad


def regenerate(
    cfg: RegenerateConfig,
    target_dir: str,
    traffic_path: str,
    out_dir: str,
    answer: Answerer | None = None,
    progress: Callable[[str], None] = print,
    context: StageContext = StageContext(),
) -> RegenerateResult:
    """Regenerate the traffic's answers into `out_dir` (resuming a previous run) and return the accounting.

    A shard whose every conversation failed is not marked done, so a re-run tries it again (an endpoint that was
    down); when no conversation at all could be regenerated, `RegenerateError` says why (accounting.json is written).
    `cfg.num_workers` >= 1 answers the shards on Ray; where `context.runtime` (components/targets/runtime.py; None: the
    one `cfg` alone says) regenerates in the engine, a vLLM started here answers (`context.settings`: the
    infra.settings.Settings that say where Ray runs and where vLLM's venv is; None: from the environment);
    `answer` (a batch Answerer, for tests) runs in this process only.
    """
    trust_remote_code, ray_settings = context.trust_remote_code, context.settings
    runtime = context.runtime or TargetRuntime.from_sections(regenerate=cfg)
    if answer is not None and cfg.num_workers:
        raise ValueError("regenerate: `answer` runs in this process only; use num_workers 0 with it")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)  # left by a run killed mid-write
    chunks = _chunks(cfg, traffic_path)
    before = {s: _finished_ok(out, s, chunk) for s, chunk in enumerate(chunks)}
    pending = {s: chunks[s] for s, n_ok in before.items() if n_ok is None}
    outcomes: dict[int, tuple[int, dict[str, str]]] = {}

    def finish(s: int, records: list[dict[str, Any]], seconds: float) -> None:
        outcomes[s] = _write_shard(out, s, chunks[s], records)
        progress(
            f"regenerate: shard {s + 1}/{len(chunks)}: {outcomes[s][0]} ok, {len(outcomes[s][1])} failed "
            f"({seconds:.1f} s)"
        )

    if pending and cfg.num_workers:
        from infra.actor_pool import run_on_ray

        run_on_ray(
            cfg, ShardWorker, (target_dir, trust_remote_code), pending, finish, "regenerate", ray_settings, progress
        )
    elif pending:  # the target is loaded, or its engine started, only when work is left
        with engine_endpoint(cfg, target_dir, ray_settings, progress, runtime) as run_cfg:
            respond = responder(run_cfg, target_dir, trust_remote_code, answer)
            for s, chunk in pending.items():
                t0 = time.perf_counter()
                finish(s, answer_shard(run_cfg, s, chunk, respond, progress), time.perf_counter() - t0)
    return _account(out, traffic_path, chunks, before, outcomes)


def _account(
    out: Path,
    traffic_path: str,
    chunks: list[list[Conversation]],
    before: dict[int, int | None],
    outcomes: dict[int, tuple[int, dict[str, str]]],
) -> RegenerateResult:
    """The run's accounting in shard order (accounting.json); `RegenerateError` when nothing at all is usable."""
    ok = sum(n for n, _ in outcomes.values())
    failed = sum(len(bad) for _, bad in outcomes.values())
    failures = {k: v for s in sorted(outcomes) for k, v in outcomes[s][1].items()}
    skipped = sum(len(chunks[s]) for s, n_ok in before.items() if n_ok is not None)
    usable = ok + sum(n_ok or 0 for n_ok in before.values())
    total = sum(len(c) for c in chunks)
    shards = tuple(str(shard_paths(out, s)[0]) for s in range(len(chunks)))
    res = RegenerateResult(str(out), shards, total, ok, failed, skipped, failures)
    assert res.total == res.ok + res.failed + res.skipped
    atomic_write_text(
        out / "accounting.json",
        json.dumps(
            {"total": res.total, "ok": ok, "failed": failed, "skipped": skipped, "failures": failures}, indent=2
        ),
    )
    if usable == 0:
        first = next(iter(failures.items()), ("-", "-"))
        raise RegenerateError(
            f"{traffic_path}: none of {total} conversations could be regenerated by the target "
            f"(first failure: {first[0]}: {first[1]}); every reason is in {out / 'accounting.json'}. "
            "Shorten the prompts, lower regenerate.max_new_tokens, or check the endpoint"
        )
    return res
