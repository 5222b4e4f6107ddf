"""Long-output chat traffic made from the corpus: whole modules and classes continued from their first lines.

Purpose: the `long` traffic kind (`TrafficConfig.kind`). Each conversation shows the first `long_prompt_lines`
lines of a whole file (segment `long-module`) or of a module-level class (segment `long-class`) and asks for the
rest; the reference answer is the real rest of the unit, cut at a line boundary so that the rendered prompt plus
the answer fit the target's context (`max_positions`, one position kept for the end-of-turn token). Each
conversation carries `max_new_tokens`, the answer's length in the target's tokens, and only units whose answer
has at least `long_min_new_tokens` tokens are kept (1,000 by default: the held-out samples ask for >= 1,000 new
tokens). Choices (ask, system prompt) are drawn from a generator seeded by (seed, domain, file path), as in
`traffic.py`, so a file's conversations do not depend on which other files are present.
Run: chosen by the build (`{"traffic": {"kind": "long"}}` in `python -m embedded --config FILE`);
from Python, `long_conversations(files, domain, tokenizer, traffic, max_positions, seed)`.
Not here: the chat mix of the default kind (`traffic.py`), the sampling and writing of the files (`build.py`),
the target's training (its chat samples are the default kind's, whatever the traffic kind).
"""

from __future__ import annotations

import ast
import random
from typing import Sequence

from transformers import PreTrainedTokenizerBase

from components.data.traffic_io import Conversation, Message
from embedded.config import TrafficConfig
from embedded.corpus import SourceFile
from embedded.tokenizer import render_chat
from embedded.traffic import SYSTEM_PROMPTS

LONG_MODULE_ASKS = (
    "Continue this module to its end:",
    "Here are the first lines of `{path}`. Write the rest of the file.",
    "Complete this Python module:",
)
LONG_CLASS_ASKS = (
    "Write the rest of class `{name}`:",
    "Continue this class from `{path}` to its end.",
    "Complete the class below:",
)
CHARS_PER_TOKEN = 6  # a first guess for how much text holds `budget` tokens (more is read when it holds fewer)
LONG_TEXT_ASKS = ("Continue this text to its end:",)  # a domain that is not code (the docstrings fallback)


def long_conversations(
    files: Sequence[SourceFile],
    domain: str,
    tokenizer: PreTrainedTokenizerBase,
    traffic: TrafficConfig,
    max_positions: int,
    seed: int,
) -> list[Conversation]:
    """Every long conversation of `files`, in file order (a file's module first, then its classes)."""
    out = []
    for f in files:
        rng = random.Random(f"{seed}:long:{domain}:{f.rel_path}")
        for k, (segment, name, text) in enumerate(_units(f)):
            conv = _long(f, segment, name, text, tokenizer, traffic, max_positions, rng)
            if conv is not None:
                out.append(
                    Conversation(
                        id=f"{domain}:{f.rel_path}:long{k}",
                        messages=conv[0],
                        segment=segment,
                        source_file=f.rel_path,
                        max_new_tokens=conv[1],
                    )
                )
    return out


def _units(f: SourceFile) -> list[tuple[str, str, str]]:
    """(segment, name, source text) of the whole file and of each module-level class, in file order."""
    units = [("long-module", f.rel_path, f.text)]
    try:
        tree = ast.parse(f.text)
    except (SyntaxError, ValueError):
        return units  # prose (the docstrings fallback domain): the whole text only
    lines = f.text.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            units.append(("long-class", node.name, "".join(lines[start : node.end_lineno])))
    return units


def _long(
    f: SourceFile,
    segment: str,
    name: str,
    text: str,
    tokenizer: PreTrainedTokenizerBase,
    traffic: TrafficConfig,
    max_positions: int,
    rng: random.Random,
) -> tuple[tuple[Message, ...], int] | None:
    """(messages, answer tokens) of one unit, or None when its answer would be shorter than the minimum."""
    lines = text.splitlines(keepends=True)
    head, rest = "".join(lines[: traffic.long_prompt_lines]), "".join(lines[traffic.long_prompt_lines :])
    if not head.strip() or not rest.strip():
        return None
    asks = (
        LONG_CLASS_ASKS
        if segment == "long-class"
        else LONG_MODULE_ASKS
        if f.rel_path.endswith(".py")
        else LONG_TEXT_ASKS
    )
    ask = rng.choice(asks).format(name=name, path=f.rel_path)
    messages = [Message("user", f"{ask}\n\n{head}")]
    if rng.random() < traffic.system_prompt_fraction:
        messages.insert(0, Message("system", rng.choice(SYSTEM_PROMPTS)))
    prompt = render_chat([{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True)
    budget = max_positions - 1 - len(_ids(tokenizer, prompt))  # one position for the end-of-turn token
    if budget < traffic.long_min_new_tokens:
        return None
    answer, n = _fit(rest, budget, tokenizer)
    if n < traffic.long_min_new_tokens or not answer.strip():
        return None
    return tuple(messages) + (Message("assistant", answer),), n


def _fit(text: str, budget: int, tokenizer: PreTrainedTokenizerBase) -> tuple[str, int]:
    """The longest prefix of `text` ending at a line end (or all of it) with at most `budget` tokens, and its
    token count. Tokenises a growing prefix (from `CHARS_PER_TOKEN` x budget characters), not a whole long file."""
    size = CHARS_PER_TOKEN * max(budget, 1)
    while True:
        enc = tokenizer(text[:size], add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) > budget:
            break
        if size >= len(text):
            return text, len(enc["input_ids"])
        size *= 2
    text = text[:size]
    end = enc["offset_mapping"][budget - 1][1] if budget > 0 else 0
    while end > 0:
        cut = text.rfind("\n", 0, end) + 1
        n = len(_ids(tokenizer, text[:cut]))
        if n <= budget:  # a cut's tokens can differ from the prefix of the whole text's tokens; re-check
            return text[:cut], n
        end = cut - 1
    return "", 0


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]
