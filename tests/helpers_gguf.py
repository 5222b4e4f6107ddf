"""Tiny GGUF files written from a tiny random Llama, without network or llama.cpp (tests/test_gguf_target.py).

Purpose: `tiny_tokenizer()` trains a byte-level BPE (a few hundred tokens, ChatML template) in well under a second;
`tiny_llama(tokenizer, tied)` builds a random 8-layer Llama (hidden 64, 2 heads of 32) over it;
`write_tiny_gguf(model, tokenizer, path)` writes both as llama.cpp's converter would, all tensors in F32:
tokenizer metadata (`tokenizer.ggml.*`, chat template), llama.cpp tensor names, q/k rows permuted the way
llama.cpp does (transformers reverses it on load), `output.weight` only when the weights are not tied.
Not here: quantized tensor types (F32 keeps the round trip exact), other architectures than Llama.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, how are you today?",
    "speculative decoding drafts tokens that the target verifies",
    "user assistant system: 12345 67890",
] * 8


def tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE with the ChatML specials (ids 0..2) and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )


def tiny_llama(tokenizer, tied: bool = True, seed: int = 0):
    """A random Llama (hidden 64, 8 layers, 2 heads and 1 kv head of 32) over `tokenizer`'s vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norms, so that a norm mapped to the wrong tensor shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py `LlamaModel.permute`): rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_fields(writer, tokenizer) -> None:
    import json

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids must be dense"
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: CONTROL, 1: NORMAL
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:  # a base model's GGUF has none
        writer.add_chat_template(tokenizer.chat_template)


def write_tiny_gguf(model, tokenizer, path: str | Path, name: str = "tiny-llama", architecture: str = "llama") -> Path:
    """`model` (a LlamaForCausalLM) and `tokenizer` as one F32 GGUF file at `path`; `architecture` other than
    "llama" writes the same tensors under another `general.architecture` (for refusal tests)."""
    import gguf

    c = model.config
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_vocab_size(c.vocab_size)
    _tokenizer_fields(writer, tokenizer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"no llama.cpp name for {hf_name}"
        w = tensor.detach().float().numpy().copy()
        if base.endswith("q_proj"):
            w = _permute(w, c.num_attention_heads)
        elif base.endswith("k_proj"):
            w = _permute(w, c.num_key_value_heads)
        writer.add_tensor(f"{gguf_name}.{suffix}", w, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
