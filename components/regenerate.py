"""Stage 1, regenerate: the target answers every user turn of the training traffic; its answers are the data.

Purpose: `regenerate(cfg, target_dir, traffic_path, out_dir) -> RegenerateResult`. Multi-turn conversations are
answered turn by turn (each answer becomes the history of the next turn), batched with HF generation on a local
target, or through any OpenAI-compatible endpoint (a vLLM or SGLang server) when `cfg.endpoint_url` is set.
Resumable: conversations are written in shards of `cfg.shard_size`, each shard atomically (temp file + rename)
with a sidecar listing its ok and failed ids; a re-run skips every conversation of a finished shard. The
accounting (`accounting.json`) always satisfies total = ok + failed + skipped.
Run: through flows/train_head.py or `eagle-heads train`; in tests directly.
Not here: tokenisation for training (components/extract.py), evaluation prompts (components/evaluate.py).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from components.atomic import atomic_write_text, remove_stale_temps
from components.chat import prompt_ids
from components.traffic_io import Conversation, load_traffic
from eagle.config_checks import at_least, finite


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

    def __post_init__(self) -> None:
        at_least(self, {"max_new_tokens": 1, "batch_size": 1, "shard_size": 1, "seed": 0})
        if self.limit is not None:
            at_least(self, {"limit": 1})
        finite(self, "temperature", lambda x: x >= 0, ">= 0")
        finite(self, "top_p", lambda x: 0 < x <= 1, "in (0, 1]")
        finite(self, "endpoint_timeout_s", lambda x: x > 0, "> 0")


@dataclass(frozen=True)
class RegenerateResult:
    out_dir: str
    shards: tuple[str, ...]
    total: int
    ok: int
    failed: int
    skipped: int
    failures: dict[str, str] = field(default_factory=dict)


Answerer = Callable[[list[list[dict[str, str]]]], list[str | Exception]]


class RegenerateError(ValueError):
    """No conversation of the traffic could be regenerated (every one failed)."""


def _history_turns(conv: Conversation) -> tuple[list[dict[str, str]], list[str]]:
    """(system messages, user turns) of a conversation; original assistant answers are dropped."""
    system = [{"role": "system", "content": m.content} for m in conv.messages if m.role == "system"]
    users = [m.content for m in conv.messages if m.role == "user"]
    return system, users


def answer_all(convs: Sequence[Conversation], answer: Answerer, batch_size: int,
               on_batch: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Regenerate every conversation turn by turn; each record is ok (messages) or failed (reason)."""
    states = []
    for c in convs:
        system, users = _history_turns(c)
        states.append({"conv": c, "msgs": list(system), "users": users, "error": None})
    max_turns = max((len(s["users"]) for s in states), default=0)
    for t in range(max_turns):
        live = [s for s in states if s["error"] is None and t < len(s["users"])]
        for s in live:
            s["msgs"].append({"role": "user", "content": s["users"][t]})
        for b in range(0, len(live), batch_size):
            chunk = live[b:b + batch_size]
            t0 = time.perf_counter()
            for s, reply in zip(chunk, answer([s["msgs"] for s in chunk])):
                if isinstance(reply, Exception):
                    s["error"] = f"turn {t + 1}: {reply}"
                else:
                    s["msgs"].append({"role": "assistant", "content": reply})
            if on_batch:
                on_batch(f"  turn {t + 1}: {min(b + batch_size, len(live))}/{len(live)} conversations "
                         f"({time.perf_counter() - t0:.1f} s for this batch)")
    out = []
    for s in states:
        c = s["conv"]
        rec = {"id": c.id, "segment": c.segment, "source_file": c.source_file}
        out.append({**rec, "error": s["error"]} if s["error"] else {**rec, "messages": s["msgs"]})
    return out


def hf_answerer(target: Any, tokenizer: Any, cfg: RegenerateConfig) -> Answerer:
    """Batched generation by the HF target with left padding; prompts too long for the context fail individually.

    Decoding uses `eagle.speculative.generate_plain` (the HF model's forward with a preallocated KV cache; greedy
    or temperature/top-p sampling, tested token-for-token against HF greedy), which skips `model.generate`'s
    per-step overhead.
    """
    import torch

    from eagle.speculative import SpecConfig, generate_plain

    limit = int(getattr(target.config, "max_position_embeddings", 2048)) - cfg.max_new_tokens
    eos = target.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)

    def answer(batch: list[list[dict[str, str]]]) -> list[str | Exception]:
        ids = [prompt_ids(tokenizer, msgs) for msgs in batch]
        results: list[str | Exception] = [ValueError(f"prompt of {len(x)} tokens exceeds the target's context "
                                                     f"({limit} tokens left for the prompt)") for x in ids]
        keep = [i for i, x in enumerate(ids) if len(x) <= limit]
        if not keep:
            return results
        width = max(len(ids[i]) for i in keep)
        inp = torch.full((len(keep), width), pad, dtype=torch.long)
        att = torch.zeros_like(inp)
        for r, i in enumerate(keep):
            inp[r, width - len(ids[i]):] = torch.tensor(ids[i])
            att[r, width - len(ids[i]):] = 1
        spec = SpecConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                          eos_token_id=tuple(eos) if isinstance(eos, list) else eos, pad_token_id=pad)
        with torch.inference_mode():  # the same model and sampling rule as HF generate, with the lean KV cache
            out = generate_plain(target, inp.to(cfg.device), att.to(cfg.device), spec)
        for r, i in enumerate(keep):
            toks = out.sequences[r, : int(out.lengths[r])]
            results[i] = tokenizer.decode(toks, skip_special_tokens=True)  # verbatim: code's indent
        return results

    return answer


def endpoint_answerer(cfg: RegenerateConfig, retries: int = 3) -> Answerer:
    """One chat-completions request per conversation to an OpenAI-compatible server (vLLM, SGLang)."""
    url = cfg.endpoint_url.rstrip("/") + "/v1/chat/completions"  # type: ignore[union-attr]

    def one(msgs: list[dict[str, str]]) -> str | Exception:
        body = json.dumps({"model": cfg.endpoint_model, "messages": msgs, "max_tokens": cfg.max_new_tokens,
                           "temperature": cfg.temperature, "top_p": cfg.top_p}).encode()
        err: Exception = RuntimeError("no attempt")
        for attempt in range(retries):
            try:
                req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=cfg.endpoint_timeout_s) as r:
                    content = json.loads(r.read())["choices"][0]["message"]["content"]
                if not isinstance(content, str):
                    raise ValueError(f"no text in the answer (content {content!r})")
                return content
            except (urllib.error.URLError, OSError, KeyError, IndexError, TypeError, ValueError) as e:
                err = RuntimeError(f"{url}: {e}")
                if attempt + 1 < retries:
                    time.sleep(0.5 * 2 ** attempt)
        return err

    return lambda batch: [one(m) for m in batch]


def _load_local(target_dir: str, cfg: RegenerateConfig, trust_remote_code: bool):
    from components.targets import load_target

    target, tokenizer = load_target(target_dir, cfg.device, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    return hf_answerer(target, tokenizer, cfg)


def _seed_shard(seed: int, shard: int) -> None:
    import torch

    torch.manual_seed(seed * 1_000_003 + shard)


def regenerate(cfg: RegenerateConfig, target_dir: str, traffic_path: str, out_dir: str,
               answer: Answerer | None = None, progress: Callable[[str], None] = print,
               trust_remote_code: bool = False) -> RegenerateResult:
    """Regenerate the traffic's answers into `out_dir` (resuming a previous run) and return the accounting.

    A shard whose every conversation failed is not marked done, so a re-run tries it again (an endpoint that was
    down); when no conversation at all could be regenerated, `RegenerateError` says why (accounting.json is written).
    """
    convs = list(load_traffic(traffic_path).conversations)[: cfg.limit]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)  # left by a run killed mid-write
    shards, ok, failed, skipped, failures, usable = [], 0, 0, 0, {}, 0
    for s, start in enumerate(range(0, len(convs), cfg.shard_size)):
        chunk = convs[start:start + cfg.shard_size]
        data, meta = out / f"shard-{s:05d}.jsonl", out / f"shard-{s:05d}.json"
        shards.append(str(data))
        if meta.is_file() and data.is_file():
            done = json.loads(meta.read_text())
            if done.get("ids") == [c.id for c in chunk]:
                skipped += len(chunk)
                usable += int(done.get("ok", 0))
                continue
        answer = answer or (endpoint_answerer(cfg) if cfg.endpoint_url else
                            _load_local(target_dir, cfg, trust_remote_code))
        _seed_shard(cfg.seed, s)  # a shard's samples do not depend on which shards ran before it (resume = clean run)
        t0 = time.perf_counter()
        records = answer_all(chunk, answer, cfg.batch_size, on_batch=progress)
        good = [r for r in records if "messages" in r]
        bad = {r["id"]: r["error"] for r in records if "error" in r}
        if good:  # the data first, then the sidecar that marks the shard done
            atomic_write_text(data, "".join(json.dumps(r) + "\n" for r in good))
            atomic_write_text(meta, json.dumps({"ids": [c.id for c in chunk], "ok": len(good), "failed": bad}) + "\n")
        ok, failed, usable = ok + len(good), failed + len(bad), usable + len(good)
        failures.update(bad)
        progress(f"regenerate: shard {s + 1}/{-(-len(convs) // cfg.shard_size)}: {len(good)} ok, {len(bad)} failed "
                 f"({time.perf_counter() - t0:.1f} s)")
    res = RegenerateResult(str(out), tuple(shards), len(convs), ok, failed, skipped, failures)
    assert res.total == res.ok + res.failed + res.skipped
    atomic_write_text(out / "accounting.json", json.dumps({"total": res.total, "ok": ok, "failed": failed,
                                                            "skipped": skipped, "failures": failures}, indent=2))
    if usable == 0:
        first = next(iter(failures.items()), ("-", "-"))
        raise RegenerateError(f"{traffic_path}: none of {len(convs)} conversations could be regenerated by the target "
                              f"(first failure: {first[0]}: {first[1]}); every reason is in {out / 'accounting.json'}. "
                              "Shorten the prompts, lower regenerate.max_new_tokens, or check the endpoint")
    return res


def read_regenerated(out_dir: str) -> list[Conversation]:
    """Every regenerated conversation of a finished regeneration directory, in shard order."""
    from components.traffic_io import load_traffic as _load

    convs: list[Conversation] = []
    for p in sorted(Path(out_dir).glob("shard-*.jsonl")):
        if p.stat().st_size:
            convs.extend(_load(p).conversations)
    if not convs:
        raise ValueError(f"{out_dir}: no regenerated conversation (every one failed?); see accounting.json")
    return convs
