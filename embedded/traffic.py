"""Code-heavy chat traffic made from the corpus, in the OpenAI `messages` form of `components.data.traffic_io`.

Purpose: turn the files of one domain split into conversations, each tagged with its `segment` and `source_file`:
  complete  a signature + docstring, asking for the body (the reference answer is the real body);
  explain   a function without its docstring, asking what it does (the answer is the docstring);
  continue  a file chunk, asking to continue it (the answer is the next lines);
  followup  two turns: complete one function, then the next function of the same file.
About a third carry a system prompt. Every choice is drawn from a generator seeded by (seed, file path), so a
file's conversations do not depend on which other files are present. The same pools feed the target's chat
training samples (train split) and the traffic files (a seeded sample of each split).
Not here: file selection and splitting (`corpus.py`), reading user traffic (`components.data.traffic_io`).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from components.data.traffic_io import Conversation, Message
from embedded.config import CorpusConfig, TrafficConfig
from embedded.corpus import FunctionPair, SourceFile, function_pairs, raw_chunks

SYSTEM_PROMPTS = (
    "You are a helpful Python coding assistant.",
    "You write idiomatic Python that uses only the standard library.",
    "You are an expert Python programmer. Answer with code only, no commentary.",
    "You help maintain the CPython standard library and its test suite.",
)
COMPLETE_ASKS = (
    "Write the body of this function.",
    "Complete this Python function:",
    "Implement the function below.",
    "Fill in the implementation of `{name}`.",
    "Here is a function from `{path}`. Write its body.",
)
EXPLAIN_ASKS = (
    "Explain what this function does.",
    "What does `{name}` do?",
    "Write a docstring for this function.",
    "Summarise this code from `{path}`.",
)
CONTINUE_ASKS = (
    "Continue this code.",
    "Continue this code from `{path}`:",
    "What comes next in this file?",
    "Keep going:",
)
FOLLOWUP_ASKS = (
    "Good. Now write the next one:",
    "Thanks. Next, implement this:",
    "Now do `{name}` too.",
)
EXPLAIN_PROB, FOLLOWUP_PROB, CONTINUE_PROB = 0.3, 0.2, 0.35


def file_conversations(
    f: SourceFile, domain: str, is_code: bool, corpus: CorpusConfig, traffic: TrafficConfig, seed: int
) -> list[Conversation]:
    """Every conversation drawn from one file, in a fixed order."""
    rng = random.Random(f"{seed}:{domain}:{f.rel_path}")
    pairs = function_pairs(f, corpus) if is_code else []
    made: list[tuple[str, list[Message]]] = []
    for i, pair in enumerate(pairs):
        made.append(("complete", _complete(pair, rng)))
        if pair.docstring and len(pair.docstring) >= 20 and rng.random() < EXPLAIN_PROB:
            made.append(("explain", _explain(pair, rng)))
        if i + 1 < len(pairs) and rng.random() < FOLLOWUP_PROB:
            made.append(("followup", _complete(pair, rng) + _followup(pairs[i + 1], rng)))
    for chunk in raw_chunks(f, corpus.chunk_lines):
        if (not is_code or rng.random() < CONTINUE_PROB) and (conv := _continue(chunk, f, traffic, rng)):
            made.append(("continue", conv))
    out = []
    for k, (segment, messages) in enumerate(made):
        if rng.random() < traffic.system_prompt_fraction:
            messages = [Message("system", rng.choice(SYSTEM_PROMPTS))] + messages
        out.append(
            Conversation(
                id=f"{domain}:{f.rel_path}:{k}", messages=tuple(messages), segment=segment, source_file=f.rel_path
            )
        )
    return out


def domain_conversations(
    files: Sequence[SourceFile], domain: str, is_code: bool, corpus: CorpusConfig, traffic: TrafficConfig, seed: int
) -> list[Conversation]:
    return [c for f in files for c in file_conversations(f, domain, is_code, corpus, traffic, seed)]


def sample_traffic(pool: Sequence[Conversation], n: int, seed: int, split: str) -> list[Conversation]:
    """A seeded sample of `n` conversations (all of them when the pool is smaller), re-numbered per split."""
    rng = random.Random(f"{seed}:sample:{split}")
    picked = rng.sample(list(pool), min(n, len(pool)))
    return [dataclasses.replace(c, id=f"{split}-{i:05d}") for i, c in enumerate(picked)]


def _fmt(template: str, pair: FunctionPair | None = None, path: str = "") -> str:
    name = pair.qualname if pair else ""
    return template.format(name=name, path=pair.source_file if pair else path)


def _complete(pair: FunctionPair, rng: random.Random) -> list[Message]:
    ask = _fmt(rng.choice(COMPLETE_ASKS), pair)
    return [Message("user", f"{ask}\n\n{pair.header}"), Message("assistant", pair.body)]


def _followup(pair: FunctionPair, rng: random.Random) -> list[Message]:
    ask = _fmt(rng.choice(FOLLOWUP_ASKS), pair)
    return [Message("user", f"{ask}\n\n{pair.header}"), Message("assistant", pair.body)]


def _explain(pair: FunctionPair, rng: random.Random) -> list[Message]:
    ask = _fmt(rng.choice(EXPLAIN_ASKS), pair)
    return [Message("user", f"{ask}\n\n{pair.signature}{pair.body}"), Message("assistant", pair.docstring or "")]


def _continue(chunk: str, f: SourceFile, traffic: TrafficConfig, rng: random.Random) -> list[Message] | None:
    lines = chunk.splitlines(keepends=True)
    answer_lines = traffic.continue_answer_lines
    if len(lines) < answer_lines + 4:
        return None
    cut = len(lines) - answer_lines
    prefix, answer = "".join(lines[:cut]), "".join(lines[cut:])
    if not answer.strip():
        return None
    ask = _fmt(rng.choice(CONTINUE_ASKS), path=f.rel_path)
    return [Message("user", f"{ask}\n\n{prefix}"), Message("assistant", answer)]
