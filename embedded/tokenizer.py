"""A byte-level BPE tokenizer with a chat template, trained on the corpus and saved as a standard HF tokenizer.

Purpose: `train_tokenizer(texts, cfg)` returns a `PreTrainedTokenizerFast` that `save_pretrained` writes and
`AutoTokenizer.from_pretrained` loads back with nothing special-cased. Special tokens: `<|endoftext|>` (bos, and
the separator of raw documents), `<|pad|>`, `<|system|>`, `<|user|>`, `<|assistant|>`, `<|end|>` (end of a turn,
the eos). The chat template renders `<|endoftext|>` then, per message, `<|role|>{content}<|end|>`; with
`add_generation_prompt` it ends with `<|assistant|>`. No newline follows a role token: byte-level BPE would
merge it with the indentation that starts a code answer, so a generation prompt would end mid-token. Assistant
turns sit in `{% generation %}` blocks, so `apply_chat_template(..., return_assistant_tokens_mask=True)` marks
the tokens a model is trained to produce.
Not here: the corpus, or any model.
"""

from __future__ import annotations

import time
from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast

from embedded.config import TokenizerConfig

BOS, PAD, END = "<|endoftext|>", "<|pad|>", "<|end|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = (BOS, PAD, *ROLE_TOKENS.values(), END)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role'] + '; expected system, user or assistant') }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def render_chat(messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The template's output, in plain Python (fast path for building training text; tests check they agree)."""
    parts = [BOS]
    for m in messages:
        if m["role"] not in ROLE_TOKENS:
            raise ValueError(f"unknown role {m['role']}; expected system, user or assistant")
        parts.append(f"{ROLE_TOKENS[m['role']]}{m['content']}{END}")
    if add_generation_prompt:
        parts.append(ROLE_TOKENS["assistant"])
    return "".join(parts)


def train_tokenizer(
    texts: Sequence[str], cfg: TokenizerConfig, progress: bool = True, model_max_length: int = 2048
) -> PreTrainedTokenizerFast:
    """Train the BPE on `texts` (deterministic for the same texts in the same order)."""
    if cfg.vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size {cfg.vocab_size} is below the 256 bytes + {len(SPECIAL_TOKENS)} specials")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_with_progress(texts, progress), trainer=trainer, length=len(texts))
    return wrap_tokenizer(tok, model_max_length)


def wrap_tokenizer(tok: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=END,
        pad_token=PAD,
        extra_special_tokens=list(ROLE_TOKENS.values()),
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def _with_progress(texts: Sequence[str], progress: bool) -> Iterable[str]:
    total = sum(len(t.encode()) for t in texts)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="tokenizer (BPE)", disable=not progress, mininterval=1.0
    ) as bar:
        for t in texts:
            yield t
            bar.update(len(t.encode()))


def encode_texts(
    tokenizer: PreTrainedTokenizerFast, texts: Sequence[str], desc: str, progress: bool = True, batch: int = 512
) -> list[list[int]]:
    """Token ids of each text (special tokens in the text are recognised; nothing is added)."""
    out: list[list[int]] = []
    start, tokens = time.perf_counter(), 0
    with tqdm(total=len(texts), unit="doc", desc=desc, disable=not progress, mininterval=1.0) as bar:
        for i in range(0, len(texts), batch):
            enc = tokenizer.backend_tokenizer.encode_batch(list(texts[i : i + batch]), add_special_tokens=False)
            out.extend(e.ids for e in enc)
            tokens += sum(len(e.ids) for e in enc)
            bar.update(len(enc))
            bar.set_postfix(tokens=f"{tokens:,}", tok_s=f"{tokens / (time.perf_counter() - start):,.0f}", refresh=False)
    return out
