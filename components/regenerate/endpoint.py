"""Regeneration through an OpenAI-compatible server (vLLM, SGLang): one request per turn, many conversations at once.

Purpose: `endpoint_ask(cfg)` sends one chat-completions request and returns the answer's text or the failure as an
exception value: a connection error, a timeout, a 5xx (or 408/429) or a malformed answer is retried, a refused request
(any other 4xx, e.g. vLLM's 400 for a prompt longer than the context) is final at once and its body, which names the
reason, becomes the failure. `answer_concurrently(convs, ask, concurrency)` answers every conversation turn by turn
(turn t+1 is asked after turn t was answered: its history holds that answer; each request asks for at most the
conversation's own `max_new_tokens` when it has one, else the config's) with at most `concurrency` requests in
flight (one thread per conversation being answered); records come back in conversation order, and a failed request
fails its own conversation only. `history_turns` and `conversation_record` are the conversation state that
components/regenerate/stage.py's batched path shares.
`engine_endpoint(cfg, target_dir, settings, runtime=...)` starts the endpoint itself where the run's `TargetRuntime`
regenerates in the engine (`regenerate.engine: vllm`, or `target.runtime: vllm`) and no `endpoint_url` is given: a
plain vLLM for the target, stopped when the block ends.
Run: through `components.regenerate.stage.regenerate` with `cfg.endpoint_url` set; tests/test_regenerate_scale.py.
Not here: shards, seeds, accounting and resume (components/regenerate/stage.py), the server process
(infra/vllm_server.py).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from components.data.traffic_io import Conversation
from components.targets.runtime import TargetRuntime

Ask = Callable[..., "str | Exception"]  # (messages[, max_new_tokens]) -> the answer's text or the failure
RETRIED_4XX = (408, 429)  # timeout and rate limit: the only refusals a later attempt may get past


def history_turns(conv: Conversation) -> tuple[list[dict[str, str]], list[str]]:
    """(system messages, user turns) of a conversation; original assistant answers are dropped."""
    system = [{"role": "system", "content": m.content} for m in conv.messages if m.role == "system"]
    users = [m.content for m in conv.messages if m.role == "user"]
    return system, users


def conversation_record(conv: Conversation, msgs: list[dict[str, str]], error: str | None) -> dict[str, Any]:
    """A shard line: the regenerated messages, or the reason the conversation failed."""
    rec = {"id": conv.id, "segment": conv.segment, "source_file": conv.source_file}
    return {**rec, "error": error} if error else {**rec, "messages": msgs}


def _refusal(url: str, err: urllib.error.HTTPError) -> RuntimeError:
    try:
        detail = err.read().decode(errors="replace").strip()[:500]
    except OSError:
        detail = ""
    return RuntimeError(f"{url}: HTTP {err.code}: {detail or err.reason}")


def endpoint_ask(cfg: Any, retries: int = 3) -> Ask:
    """One chat-completions request to `cfg.endpoint_url` (a RegenerateConfig) for at most `max_new_tokens` new
    tokens (None: `cfg.max_new_tokens`); the text or the failure."""
    url = cfg.endpoint_url.rstrip("/") + "/v1/chat/completions"

    def ask(msgs: list[dict[str, str]], max_new_tokens: int | None = None) -> str | Exception:
        body = json.dumps(
            {
                "model": cfg.endpoint_model,
                "messages": msgs,
                "max_tokens": max_new_tokens or cfg.max_new_tokens,
                "temperature": cfg.temperature,
                "top_p": cfg.top_p,
            }
        ).encode()
        err: Exception = RuntimeError("no attempt")
        for attempt in range(retries):
            try:
                req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=cfg.endpoint_timeout_s) as r:
                    content = json.loads(r.read())["choices"][0]["message"]["content"]
                if not isinstance(content, str):
                    raise ValueError(f"no text in the answer (content {content!r})")
                return content
            except urllib.error.HTTPError as e:  # before URLError/OSError: it is both
                err = _refusal(url, e)
                if e.code < 500 and e.code not in RETRIED_4XX:
                    return err  # the server refused this request: asking again cannot help
            except (urllib.error.URLError, OSError, KeyError, IndexError, TypeError, ValueError) as e:
                err = RuntimeError(f"{url}: {e}")
            if attempt + 1 < retries:
                time.sleep(0.5 * 2**attempt)
        return err

    return ask


@contextmanager
def engine_endpoint(
    cfg: Any,
    target_dir: str,
    settings: Any = None,
    progress: Callable[[str], None] = print,
    runtime: TargetRuntime | None = None,
) -> Iterator[Any]:
    """`cfg` (a RegenerateConfig) as it is, unless `runtime` (None: the one `cfg` alone says) regenerates in the
    engine and `cfg` names no `endpoint_url`: then a plain vLLM started here for `target_dir` (the dtype its
    config.json states, its whole context), and `cfg` pointed at it while it runs. `settings`:
    infra.settings.Settings (None: from the environment)."""
    runtime = runtime or TargetRuntime.from_sections(regenerate=cfg)
    if not runtime.regenerates_in_engine or cfg.endpoint_url:
        yield cfg
        return
    from components.targets.target import declared_dtype, target_context
    from infra.settings import Settings
    from infra.vllm_engine_spec import EngineSpec
    from infra.vllm_server import VllmServer

    spec = EngineSpec(
        str(target_dir), method=None, dtype=declared_dtype(target_dir), max_model_len=target_context(target_dir)
    )
    progress(f"regenerate (vLLM): starting the engine for {target_dir}")
    with VllmServer(spec, settings or Settings.from_env()) as srv:
        yield dataclasses.replace(cfg, endpoint_url=srv.base_url, endpoint_model=spec.served_model_name)


def endpoint_answerer(cfg: Any, retries: int = 3) -> Callable[..., list[str | Exception]]:
    """The batch form (`components.regenerate.stage.Answerer`): a batch's requests sent `cfg.endpoint_concurrency` at a
    time, answers in the batch's order."""
    ask = endpoint_ask(cfg, retries)

    def answer(batch: list[list[dict[str, str]]], max_new_tokens: int | None = None) -> list[str | Exception]:
        with ThreadPoolExecutor(max_workers=max(1, min(cfg.endpoint_concurrency, len(batch)))) as pool:
            return list(pool.map(lambda msgs: ask(msgs, max_new_tokens), batch))

    return answer


def answer_concurrently(
    convs: Sequence[Conversation], ask: Ask, concurrency: int, on_progress: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """Every conversation answered turn by turn, at most `concurrency` requests in flight; records in `convs` order."""
    done, lock, t0 = [0], threading.Lock(), time.perf_counter()
    step = max(1, len(convs) // 4)

    def converse(conv: Conversation) -> dict[str, Any]:
        msgs, users = history_turns(conv)
        msgs, error = list(msgs), None
        for t, user in enumerate(users):
            msgs.append({"role": "user", "content": user})
            reply = ask(msgs) if conv.max_new_tokens is None else ask(msgs, conv.max_new_tokens)
            if isinstance(reply, Exception):
                error = f"turn {t + 1}: {reply}"
                break
            msgs.append({"role": "assistant", "content": reply})
        with lock:
            done[0] += 1
            n = done[0]
        if on_progress and (n % step == 0 or n == len(convs)):
            on_progress(
                f"  endpoint: {n}/{len(convs)} conversations ({time.perf_counter() - t0:.1f} s, "
                f"{concurrency} in flight at most)"
            )
        return conversation_record(conv, msgs, error)

    if not convs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(convs)))) as pool:
        return list(pool.map(converse, convs))  # map keeps the input order whatever finishes first
