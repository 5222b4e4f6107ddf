"""Chat formatting shared by the stages: conversations -> token ids with an assistant-only loss mask.

Purpose: `tokenize_conversation` renders a conversation with the target tokenizer's own chat template and marks
the tokens of assistant turns (loss mask 1) by rendering growing prefixes, which works for any template that
renders a prefix of the conversation as a prefix of the text (Llama 3, Qwen, Mistral, the embedded default).
`prompt_ids` renders everything before an assistant turn plus the generation prompt.
Not here: reading traffic files (components/data/traffic_io.py) or running a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from components.data.traffic_io import Conversation
from eagle.errors import BadInput


class ChatTemplateError(BadInput):
    """The tokenizer has no chat template, or its template does not render prefixes as prefixes."""


@dataclass(frozen=True)
class TokenizedChat:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens
    truncated: bool


def _messages(conv: Conversation | Sequence[dict[str, str]]) -> list[dict[str, str]]:
    if isinstance(conv, Conversation):
        return [{"role": m.role, "content": m.content} for m in conv.messages]
    return [dict(m) for m in conv]


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template; "
            "set one (tokenizer.chat_template) before regenerating or extracting"
        )
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of `messages` followed by the assistant generation prompt."""
    return _render(tokenizer, list(messages), add_generation_prompt=True)


def tokenize_conversation(tokenizer: Any, conv: Conversation | Sequence[dict[str, str]], max_len: int) -> TokenizedChat:
    """Token ids of the whole conversation and a mask that is 1 exactly on assistant-turn tokens."""
    msgs = _messages(conv)
    ids = _render(tokenizer, msgs, add_generation_prompt=False)
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    mask = [0] * len(ids)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start = len(_render(tokenizer, msgs[:i], add_generation_prompt=True))
        end = len(_render(tokenizer, msgs[: i + 1], add_generation_prompt=False))
        prefix_text = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False)  # e.g. no rewritten past turns
        if end > len(ids) or start > end or not text.startswith(prefix_text):
            raise ChatTemplateError(
                "the chat template does not render a prefix of the conversation as a prefix "
                "of its tokens; cannot locate assistant turns"
            )
        for j in range(start, end):
            mask[j] = 1
    truncated = len(ids) > max_len
    return TokenizedChat(ids[:max_len], mask[:max_len], truncated)
