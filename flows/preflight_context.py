"""Preflight's checks of a target's context: what the settings and the traffic ask of it fits in it.

Purpose: `check_context(target, config, tokenizer, heldout, cfg, stages)` refuses a target whose context
(`context_of`: `max_position_embeddings`, with the stages' default) is shorter than `extract.max_len`, leaves no room
for a prompt beside the new tokens of regeneration or evaluation, or cannot hold a held-out prompt the evaluation
takes with its new tokens; `check_first_turns_fit(load, config, tokenizer, cfg)` refuses training traffic of which no
first turn fits the context with its new tokens (regeneration would fail every conversation after the run started),
naming the first conversation's line. Each refusal is `BadInput` (a `TrafficFormatError` for the traffic), one line.
Run: through flows/preflight.py (the train flow's `check_inputs`, the `evaluate` command's preflight).
Not here: the target directory's own checks (flows/preflight.py `check_target_dir`, components/targets/target.py),
a later turn's prompt (it holds the target's own answers, known only once regenerated). Imports nothing heavy.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from components.data.traffic_io import TrafficFormatError, TrafficLoad
from eagle.errors import BadInput

if TYPE_CHECKING:
    from components.config.pipeline import PipelineConfig
    from components.regenerate.stage import RegenerateConfig


def context_of(config) -> int:
    """The target's context (`max_position_embeddings`), with the default the stages take when a config has none."""
    from components.regenerate.stage import prompt_room

    return prompt_room(config, 0)[0]


def check_context(target: str, config, tokenizer, heldout: str, cfg: PipelineConfig, stages: tuple[str, ...]) -> None:
    """Refuse a target whose context is shorter than what the `stages` (of TARGET_STAGES) of `cfg` ask of it:
    `extract.max_len` positions per sequence (past the context the features are of positions the target never
    served); room for a prompt beside `regenerate.max_new_tokens` (a server by URL decides for itself) and beside
    `evaluate.spec.max_new_tokens`; and each held-out prompt the evaluation takes (components/evaluate/stage.py
    `held_out_samples`: first user turns within `evaluate.max_prompt_tokens`) with its new tokens (vLLM refuses
    such a request with HTTP 400, mid-evaluation; our decoder would run past the context). `max_prompt_tokens` is
    a filter, not a demand: a target with less context passes when the prompts it is given fit."""
    ctx = context_of(config)
    where = f"{target}{'' if target.lower().endswith('.gguf') else '/config.json'}: max_position_embeddings {ctx}"
    if "extract" in stages and cfg.extract.max_len > ctx:
        raise BadInput(
            f"{where} is shorter than extract.max_len {cfg.extract.max_len}: extraction would keep "
            f"positions the target never served; set extract.max_len to at most {ctx}"
        )
    news = {
        "regenerate.max_new_tokens": cfg.regenerate.max_new_tokens
        if "regenerate" in stages and not cfg.regenerate.endpoint_url
        else 0,
        "evaluate.spec.max_new_tokens": cfg.evaluate.spec.max_new_tokens if "evaluate" in stages else 0,
    }
    for key, n in news.items():
        if n >= ctx:
            raise BadInput(f"{where} leaves no room for a prompt beside {key} {n}; lower {key} below {ctx}")
    if "evaluate" in stages:
        _check_held_out_fits(target, ctx, tokenizer, heldout, cfg)


def _check_held_out_fits(target: str, ctx: int, tokenizer, heldout: str, cfg: PipelineConfig) -> None:
    from components.evaluate.stage import held_out_samples

    try:
        samples = held_out_samples(tokenizer, heldout, cfg.evaluate)
    except ValueError as e:  # none within evaluate.max_prompt_tokens: the evaluation would refuse it after training
        raise BadInput(f"{e} (held-out traffic; raise evaluate.max_prompt_tokens or give shorter prompts)") from None
    over = [s for s in samples if len(s.ids) + s.max_new_tokens > ctx]
    if not over:
        return
    worst = max(over, key=lambda s: len(s.ids) + s.max_new_tokens)
    room = max(ctx - max(s.max_new_tokens for s in samples), 1)
    raise BadInput(
        f"{heldout}: {len(over)} of the {len(samples)} held-out prompts the evaluation takes (first user "
        f"turns within evaluate.max_prompt_tokens {cfg.evaluate.max_prompt_tokens}) do not fit the "
        f"target's context with their new tokens: the longest needs {len(worst.ids)} + "
        f"{worst.max_new_tokens} positions, more than its max_position_embeddings {ctx} ({target}); set "
        f"evaluate.max_prompt_tokens to at most {room} or lower evaluate.spec.max_new_tokens"
    )


def check_first_turns_fit(load: TrafficLoad, config, tokenizer, cfg: RegenerateConfig) -> None:
    """Refuse training traffic of which no first turn fits the target's context: regeneration fails each such
    conversation (components/regenerate/stage.py `hf_answerer`: the prompt rendered with the target's chat template,
    `components.data.chat.prompt_ids`, must leave room for the conversation's `max_new_tokens`, else
    `regenerate.max_new_tokens`) and, with none left, refuses the run after it started. The message names the
    first conversation's line. Stops at the first turn that fits (one render for usual traffic). When this process
    or a vLLM started for the run answers (no `endpoint_url`; the engine's `max_model_len` is the target's context
    and it renders the same chat template from the same tokenizer files, components/regenerate/endpoint.py
    `engine_endpoint`); a server given by URL decides for itself. A later turn's prompt holds the target's own
    answers, known only once regenerated (the flow cleans up after that refusal)."""
    if cfg.endpoint_url:
        return
    from components.data.chat import prompt_ids
    from components.regenerate.endpoint import history_turns
    from components.regenerate.stage import prompt_room

    def first_turn(c) -> tuple[int, int]:  # (its prompt's tokens, the room the context leaves for a prompt)
        system, users = history_turns(c)
        return (
            len(prompt_ids(tokenizer, [*system, {"role": "user", "content": users[0]}])),
            prompt_room(config, c.max_new_tokens or cfg.max_new_tokens)[1],
        )

    convs = load.conversations[: cfg.limit]
    if any(n <= room for n, room in map(first_turn, convs)):  # lazily: stops at the first that fits
        return
    (n, room), c = first_turn(convs[0]), convs[0]
    new = (
        f"its max_new_tokens {c.max_new_tokens}"
        if c.max_new_tokens
        else f"regenerate.max_new_tokens {cfg.max_new_tokens}"
    )
    unit, number = _record_number(load.path, 0)
    raise TrafficFormatError(
        load.path,
        number,
        f"the first turn of {c.id!r} is a prompt of {n} tokens (with the "
        f"target's chat template), more than the {room} its context leaves "
        f"(max_position_embeddings {prompt_room(config, 0)[0]} - {new}), and no first turn "
        f"of the {len(convs)} "
        "conversations fits: regeneration would refuse them all (training traffic; shorten the "
        "prompts or lower the new tokens)",
        unit,
    )


def _record_number(path: Path, index: int) -> tuple[str, int]:
    """("line", the 1-based line) of the `index`-th conversation of a JSONL file (blank lines hold none), or
    ("row", index + 1) of a table."""
    from components.data.traffic_sources import traffic_kind

    if traffic_kind(path) != "jsonl":
        return "row", index + 1
    with open(path, "rb") as f:
        lines = [n for n, raw in enumerate(f, 1) if raw.strip()][: index + 1]
    return "line", lines[index]
