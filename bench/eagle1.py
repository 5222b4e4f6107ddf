"""An EAGLE-1-style head, for comparison only: one top-layer feature, feature regression + token loss, no TTT.

Purpose: the baseline of `bench/acceptance_vs_depth.py` (the only user, so it lives next to it, outside `eagle/`).
`Eagle1Draft` is the EAGLE-3 head (`eagle.draft`) with a
different input: instead of `fc` over the fused low/mid/high states it reads one feature, the input of the
target's last decoder layer, as is (its `aux_layer_ids` are the inputs of the last three layers, so the unchanged
capture and drafting code of `eagle.speculative` run it; `fuse` keeps the last one). It is trained as EAGLE-1 was:
at position i, from (token x_{i+1}, true feature f_i plus uniform noise), the head's output should regress the next
feature f_{i+1} (smooth L1) and its logits should match the target's next-token distribution (soft cross-entropy on the
draft vocabulary, weight 0.1); drafting then feeds the predicted feature back, one step at a time. Features are
computed online from the target (`eagle1_batch`), since the extract stage stores EAGLE-3's layers.
How to run: `from eagle1 import ...` in a bench script (bench/ is on `sys.path` there; this module puts the repo
root there too); `head = eagle1_head(target, token_counts, Vd)`, then `eagle1_loss(head, eagle1_batch(...))` per
step; `bench/acceptance_vs_depth.py` does this with the optimiser of `eagle.train`.
Not here: export to serving engines (EAGLE-1 heads are not an EAGLE-3 checkpoint); the original EAGLE-1 reads
the final hidden state after the target's last layer and norm, one layer above what the capture hooks expose.

Shape legend: B batch, S sequence, H hidden, Vd draft vocabulary.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from eagle.config import DraftConfig  # noqa: E402
from eagle.draft import Eagle3Draft  # noqa: E402
from eagle.features import Teacher, target_forward, teacher_targets  # noqa: E402
from eagle.vocab import select_draft_vocab  # noqa: E402


def eagle1_config(cfg: DraftConfig) -> DraftConfig:
    """The same head shapes, reading the input of the last decoder layer (the last of three, see the module doc)."""
    top = cfg.target_num_layers - 1
    return dataclasses.replace(cfg, aux_layer_ids=(top - 2, top - 1, top))


class Eagle1Draft(Eagle3Draft):
    """The EAGLE-3 head whose input feature is the top feature itself (no fusion; `fc` is unused)."""

    def fuse(self, aux_BT3H: torch.Tensor) -> torch.Tensor:
        return aux_BT3H[..., -self.cfg.hidden_size :].to(self.lm_head.weight.dtype)

    def trainable_parameters(self):
        return [p for n, p in self.named_parameters() if not n.startswith(("embed_tokens", "fc."))]


def eagle1_head(target: nn.Module, token_counts_V: torch.Tensor, draft_vocab_size: int) -> Eagle1Draft:
    """A fresh EAGLE-1-style head for `target`: draft vocabulary from counts, frozen embedding, lm_head rows."""
    cfg = eagle1_config(DraftConfig.from_target(target.config, draft_vocab_size))
    draft = Eagle1Draft(cfg)
    draft.set_draft_vocab(select_draft_vocab(token_counts_V, cfg.draft_vocab_size))
    draft.init_from_target(
        target.get_input_embeddings().weight.detach().float().cpu(),
        target.get_output_embeddings().weight.detach().float().cpu(),
    )
    return draft


@dataclass
class Eagle1Batch:
    input_ids_BS: torch.Tensor
    feature_BSH: torch.Tensor  # input of the target's last decoder layer
    loss_mask_BS: torch.Tensor
    teacher: Teacher


@torch.no_grad()
def eagle1_batch(
    target: nn.Module,
    draft: Eagle1Draft,
    input_ids_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    attention_mask_BS: torch.Tensor,
) -> Eagle1Batch:
    """Run the target over a right-padded batch: its top feature and the teacher on the draft vocabulary."""
    top = draft.cfg.aux_layer_ids[-1]
    step = target_forward(target, input_ids_BS, (top,), attention_mask=attention_mask_BS)
    teacher = teacher_targets(step.last_hidden_BTH, target.get_output_embeddings().weight, draft.draft_ids())
    return Eagle1Batch(input_ids_BS, step.aux_BT3H.float(), loss_mask_BS, teacher)


@dataclass(frozen=True)
class Eagle1LossConfig:
    regression_weight: float = 1.0
    token_weight: float = 0.1
    noise: float = 0.1  # half-width of the uniform noise added to the input features (EAGLE-1's augmentation)


def eagle1_loss(draft: Eagle1Draft, batch: Eagle1Batch, cfg: Eagle1LossConfig = Eagle1LossConfig()):
    """(loss, metrics): smooth-L1 regression of f_{i+1} plus weighted soft CE against p_{i+1}, at trained positions.

    Position i reads token x_{i+1} and feature f_i (RoPE position i); it is scored where x_{i+2} is trained.
    """
    ids, f, t = batch.input_ids_BS, batch.feature_BSH, batch.teacher
    B, S = ids.shape
    tok = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
    noisy = f + (torch.rand_like(f) * 2 - 1) * cfg.noise if draft.training and cfg.noise else f
    pos = torch.arange(S, device=ids.device)[None].expand(B, S)
    out_BSH, logits_BSV = draft(tok, noisy, pos)
    n = S - 2  # position i predicts row i+1; the last two positions have no trained next token
    w = batch.loss_mask_BS[:, 2:].float() * t.in_vocab_BT[:, 1:-1].float()
    valid = batch.loss_mask_BS[:, 2:].float()
    reg = F.smooth_l1_loss(out_BSH[:, :n], f[:, 1 : n + 1], reduction="none").mean(-1)
    logp = F.log_softmax(logits_BSV[:, :n].float(), -1)
    ce = -(t.probs_BTVd[:, 1 : n + 1] * logp).sum(-1)
    reg_loss = (reg * valid).sum() / valid.sum().clamp(min=1)
    ce_loss = (ce * w).sum() / w.sum().clamp(min=1)
    loss = cfg.regression_weight * reg_loss + cfg.token_weight * ce_loss
    right = (draft.to_target_ids(logp.argmax(-1)) == t.argmax_BT[:, 1 : n + 1]).float()
    acc = float((right * valid).sum() / valid.sum().clamp(min=1))
    return loss, {
        "loss": float(loss.detach()),
        "regression": float(reg_loss.detach()),
        "ce": float(ce_loss.detach()),
        "acc_0": acc,
    }
