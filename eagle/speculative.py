"""Lossless speculative generation with a HF target and an EAGLE-3 head, and the plain-decoding baseline.

Purpose: `generate_speculative` drafts with the head (a chain, or an EAGLE-2 dynamic tree), verifies the draft in
one target pass, keeps what the target agrees with and rolls both KV caches back: the one loop of `eagle.verify`
with the head's drafter (`eagle.drafters.HeadDrafter`); `generate_plain` decodes one token per target pass with
the same runner, output buffer and pick, so that timings compare like with like.
The head's part: the target's prefill captures the fused features f_i (inputs of `aux_layer_ids`); the head consumes
(token x_{i+1}, f_i) at RoPE position i as its committed cache entries; drafting feeds the head its own output
hidden state with each drafted token, position +1 per depth. A parallel head (variants "parallel" and
"eagle3.1-parallel", eagle/config.py) drafts its chain in one head pass instead, as vLLM's `parallel_drafting`
does: the pass that commits the verified entries carries depth-1 masked slots after each row's last committed
entry (`eagle.drafters.commit_head` with `masked`), and the K drafts are the picks at that entry and at the masked
slots (`eagle.tree.draft_parallel`). After verification the accepted path's target features replace the head's
speculative entries, and the target keeps only the accepted path's entries.
Rows of a batch advance by their own accepted lengths (per-row cache lengths, positions and masks); a row stops
at EOS or `max_new_tokens` and is then frozen while the others finish.
How to run: `out = generate_speculative(target, draft, ids, mask, SpecConfig(method="tree"))`; `out.sequences`,
`out.stats.tau` (`eagle.stats.SpecStats`). Greedy when `temperature == 0`.
Speed (both functions alike): inference mode; the target runner's session (eagle/runners.py: CPU kernels, feature
hooks attached once), `eagle.fastpath.LeanDecoder` for Llama-family targets, preallocated caches written by slice
for one row, prebuilt causal masks; the head's lean inference path (`eagle.draft`). At batch 1 on a shared 2-core
CPU use 1 torch thread.
Not here: sliding-window targets past their window, flash-attention backends (4-D masks need "sdpa"/"eager"),
dropping finished rows from the batch, CUDA graphs / torch.compile.

Shape legend: B batch, T prompt positions, V target vocabulary, H hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle import sampling
from eagle.draft import Eagle3Draft
from eagle.drafters import HeadDrafter
from eagle.run_config import SpecConfig
from eagle.runners import Prefix, TargetRunner
from eagle.verify import Emitted, GenOutput, generate_drafted, outside_inference_mode, pack_left


def generate_plain(
    target: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cfg: SpecConfig,
    generator: torch.Generator | None = None,
) -> GenOutput:
    """One token per target pass (greedy or temperature/top-p sampling), with the speculative path's helpers."""
    with torch.inference_mode():
        ids_BT, n_B = pack_left(input_ids, attention_mask)
        runner = TargetRunner(target, ids_BT.shape[1] + cfg.max_new_tokens + 1, path=cfg.path, role="decode")
        with runner.session():
            out = _plain_loop(runner, ids_BT, n_B, cfg, generator)
    return outside_inference_mode(out)


def _plain_loop(
    runner: TargetRunner, ids_BT: torch.Tensor, n_B: torch.Tensor, cfg: SpecConfig, generator: torch.Generator | None
) -> GenOutput:
    out = Emitted(ids_BT.shape[0], cfg, ids_BT.device)
    logits_BV, _ = runner.prefill(ids_BT, n_B)
    one_B = torch.ones_like(n_B)
    lengths_B = n_B
    while True:
        tok_B, _ = sampling.pick(logits_BV, cfg.temperature, cfg.top_p, generator)
        active_B = ~out.done_B
        out.emit(tok_B[:, None], one_B)
        if bool(out.done_B.all()):
            return GenOutput(out.tokens_BN, out.count_B)
        prefix = Prefix.of(lengths_B)
        hidden_B1H, _ = runner(prefix, tok_B[:, None], lengths_B[:, None], None)
        logits_BV = runner.logits(hidden_B1H[:, 0])
        lengths_B = lengths_B + active_B.long()


def generate_speculative(
    target: nn.Module,
    draft: Eagle3Draft,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cfg: SpecConfig,
    generator: torch.Generator | None = None,
) -> GenOutput:
    """Speculative generation whose output is distributed exactly as `generate_plain`'s (identical when greedy)."""
    return generate_drafted(target, HeadDrafter(draft), input_ids, attention_mask, cfg, generator)
