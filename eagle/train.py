"""The head-training step, shared by the self-check and the distributed trainer (components/train/stage.py).

Purpose: build a head for a target from token counts (`init_head`; `as_variant` for a warm start across head
variants; `start_from_target_layer` to begin as the target's next layer), turn token batches into TTT batches with
the target's features computed on the fly (`online_batch`) or from stored features (`TTTBatch` directly),
an AdamW optimiser with linear warm-up and cosine decay (`make_optimizer`), one optimisation step with
gradient clipping and optional autocast (`train_step`), the TTT loss and simulated tau of a head on held-out
batches, without gradients (`heldout_metrics`), and which weights a run keeps: `Selection` (the best held-out
tau, a tie going to the lower loss, and the last) with `BestSoFar` (a copy of the best weights).
Not here: data loading, checkpoints and where the best weights are stored, distribution, logging (the caller owns
those; DDP wraps from outside).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from eagle.config import PARALLEL_VARIANTS, DraftConfig
from eagle.draft import Eagle3Draft
from eagle.export import head_state_dict
from eagle.features import target_forward, teacher_targets
from eagle.run_config import OptimConfig, TTTConfig
from eagle.ttt import TTTBatch, TTTOutput, ttt_loss
from eagle.vocab import select_draft_vocab


def init_head(
    target: nn.Module,
    token_counts_V: torch.Tensor,
    draft_vocab_size: int,
    always_include: Iterable[int] = (),
    aux_layer_ids: Sequence[int] = (),
    variant: str = "eagle3",
) -> Eagle3Draft:
    """A fresh head for `target`: draft vocabulary from counts, frozen target embedding, lm_head from its rows;
    fused layers `aux_layer_ids` (empty: the default rule for the target's depth); `variant` (eagle/config.py)."""
    return head_from_tensors(
        target.config,
        token_counts_V,
        target.get_input_embeddings().weight,
        target.get_output_embeddings().weight,
        draft_vocab_size,
        always_include,
        aux_layer_ids,
        variant,
    )


def head_from_tensors(
    target_config,
    token_counts_V: torch.Tensor,
    embed_VH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    draft_vocab_size: int,
    always_include: Iterable[int] = (),
    aux_layer_ids: Sequence[int] = (),
    variant: str = "eagle3",
) -> Eagle3Draft:
    """As `init_head`, from the target's config, embedding and lm_head alone (offline training, where the
    layer ids are those the features were extracted at)."""
    cfg = DraftConfig.from_target(target_config, draft_vocab_size, aux_layer_ids, variant)
    draft = Eagle3Draft(cfg)
    draft.set_draft_vocab(select_draft_vocab(token_counts_V, cfg.draft_vocab_size, always_include))
    draft.init_from_target(embed_VH.detach().float().cpu(), lm_head_VH.detach().float().cpu())
    return draft


# A target decoder layer's tensors (named as in a Llama-family checkpoint, after `model.layers.<i>.`) that the head's
# layer has at the same shape. q/k/v read the fused feature in the head's right half of their input.
TARGET_LAYER_PARTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


@torch.no_grad()
def start_from_target_layer(draft: Eagle3Draft, layer: dict[str, torch.Tensor], norm: torch.Tensor | None) -> list:
    """Start a fresh head as the target's own next layer: `layer` holds the decoder layer the highest fused state
    enters in the target (TARGET_LAYER_PARTS, any subset), `norm` its final norm. The fusion starts by passing that
    state through (`fc` = [0, 0, I]), the layer's attention and MLP are the target layer's (the attention's
    embedding half keeps a tenth of its random start), its norms and the output norm the target's; the draft then
    begins from a function of the target's own features rather than from noise (bench/README.md "A head started
    from the target's layer"). Tensors absent or of another shape (an MoE layer's experts, another family's
    names) keep their random start; when no tensor of the layer fits, nothing changes. Returns the names set."""
    m, H = draft.midlayer, draft.cfg.hidden_size
    dest = {
        "self_attn.o_proj.weight": m.self_attn.o_proj.weight,
        "mlp.gate_proj.weight": m.mlp.gate_proj.weight,
        "mlp.up_proj.weight": m.mlp.up_proj.weight,
        "mlp.down_proj.weight": m.mlp.down_proj.weight,
        "input_layernorm.weight": m.hidden_norm.weight,  # the norm the feature passes through in the head
        "post_attention_layernorm.weight": m.post_attention_layernorm.weight,
    }
    copied = []
    for name, src in layer.items():
        src = src.to(torch.float32)
        proj = name.removeprefix("self_attn.").removesuffix(".weight")
        if proj in ("q_proj", "k_proj", "v_proj"):
            w = getattr(m.self_attn, proj).weight
            if src.shape != (w.shape[0], H):
                continue
            w[:, H:] = src.to(w.dtype)
            w[:, :H] *= 0.1
        elif name in dest and dest[name].shape == src.shape:
            dest[name].copy_(src.to(dest[name].dtype))
        else:
            continue
        copied.append(name)
    if not copied:  # nothing of the layer fits: the head stays as it was
        return copied
    draft.fc.weight.zero_()
    draft.fc.weight[:, 2 * H :] = torch.eye(H, dtype=draft.fc.weight.dtype)
    copied.append("fc.weight")
    if norm is not None and norm.shape == draft.norm.weight.shape:
        draft.norm.weight.copy_(norm.to(draft.norm.weight.dtype))
        copied.append("norm.weight")
    return copied


def as_variant(draft: Eagle3Draft, variant: str, mask_token_id: int | None = None) -> Eagle3Draft:
    """`draft` as a head of `variant` (a warm start across variants): every weight both have is copied; eagle3.1's
    `fc_norm` starts at ones and parallel's `mask_hidden` at its initial values when the source has none, and each
    is dropped when the target variant has none. A parallel head keeps the source's `mask_token_id`, else takes
    `mask_token_id` (None: the DraftConfig default)."""
    if draft.cfg.variant == variant:
        return draft
    mask = (draft.cfg.mask_token_id if draft.cfg.parallel else mask_token_id) if variant in PARALLEL_VARIANTS else None
    out = Eagle3Draft(replace(draft.cfg, variant=variant, mask_token_id=mask))
    own = out.state_dict()
    out.load_state_dict(
        {k: v for k, v in draft.state_dict().items() if k in own and v.shape == own[k].shape}, strict=False
    )
    return out


@torch.no_grad()
def online_batch(
    target: nn.Module,
    draft: Eagle3Draft,
    input_ids_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    attention_mask_BS: torch.Tensor | None = None,
) -> TTTBatch:
    """Run the target over a right-padded batch and package its features and teacher signal."""
    step = target_forward(target, input_ids_BS, draft.cfg.aux_layer_ids, attention_mask=attention_mask_BS)
    teacher = teacher_targets(step.last_hidden_BTH, target.get_output_embeddings().weight, draft.draft_ids())
    return TTTBatch(input_ids_BS, step.aux_BT3H, loss_mask_BS, teacher)


def cpu_has_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware: Intel AMX tiles (Sapphire Rapids and later) or
    AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake). Both outrun fp32 in a head's step (1.3-1.45x with AMX,
    1.68x on Zen 4: bench/README.md); without either, bf16 autocast is slower than fp32."""
    return any(
        bool(probe and probe())
        for probe in (
            getattr(torch.cpu, "_is_amx_tile_supported", None),
            getattr(torch.cpu, "_is_avx512_bf16_supported", None),
        )
    )


def autocast_dtype(mode: str, device_type: str) -> torch.dtype | None:
    """The autocast dtype of a `train.autocast` `mode` ("gpu", "auto", "off") on a device of `device_type` (None:
    fp32): bf16 on a GPU unless "off", on a CPU only with "auto" where it has bf16 units (`cpu_has_bf16_units`)."""
    if mode == "off" or device_type not in ("cuda", "cpu"):
        return None
    if device_type == "cuda" or (mode == "auto" and cpu_has_bf16_units()):
        return torch.bfloat16
    return None


def make_optimizer(params, cfg: OptimConfig, total_steps: int):
    """AdamW with linear warm-up to `lr`, then cosine decay to `lr * min_lr_ratio` at `total_steps`."""
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        t = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train_step(
    model: nn.Module,
    draft: Eagle3Draft,
    batch: TTTBatch,
    ttt: TTTConfig,
    opt,
    sched,
    grad_clip: float,
    autocast_dtype: torch.dtype | None = None,
) -> TTTOutput:
    """One optimisation step. `model` is the head itself or a DDP wrapper of it (used only for its hooks)."""
    opt.zero_grad(set_to_none=True)
    device_type = batch.input_ids_BS.device.type
    with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        out = ttt_loss(draft, batch, ttt) if model is draft else model(batch, ttt)
    if not torch.isfinite(out.loss):
        raise FloatingPointError(
            f"non-finite TTT loss {out.loss.item()}: lower the learning rate or check the "
            "features (NaN/inf in the stored hidden states?)"
        )
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.trainable_parameters(), grad_clip)
    opt.step()
    sched.step()
    return out


@torch.no_grad()
def heldout_metrics(
    draft: Eagle3Draft, batches: Iterable[TTTBatch], ttt: TTTConfig, autocast_dtype: torch.dtype | None = None
) -> dict[str, float]:
    """`heldout_loss` (TTT loss, batches weighted by their scored positions), `heldout_acc_0` and `heldout_tau`
    (simulated tau) of `draft` pooled over every position of `batches`; no gradients, the weights untouched."""
    loss_sum = scored = correct = tau_sum = tau_count = 0.0
    for batch in batches:
        device_type = batch.input_ids_BS.device.type
        with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            out = ttt_loss(draft, batch, ttt)
        n = float(out.counted[0])
        loss_sum, scored, correct = loss_sum + float(out.loss) * n, scored + n, correct + float(out.correct[0])
        tau_sum, tau_count = tau_sum + float(out.tau_sum), tau_count + float(out.tau_count)
    return {
        "heldout_loss": loss_sum / max(scored, 1.0),
        "heldout_acc_0": correct / max(scored, 1.0),
        "heldout_tau": tau_sum / max(tau_count, 1.0),
    }


@dataclass(frozen=True)
class Selection:
    """The held-out evaluations of a run so far: the best (highest simulated tau; on a tie the lower loss, then the
    earlier step) and the last. A value: `record` returns the next one."""

    best_step: int = 0  # 0: nothing evaluated yet
    best_tau: float = 0.0
    best_loss: float = 0.0
    last_step: int = 0
    last_tau: float = 0.0

    def record(self, step: int, tau: float, loss: float) -> "Selection":
        """This selection with the evaluation (held-out `tau`, `loss`) of the weights after `step` added."""
        if self.best_step == 0 or (tau, -loss) > (self.best_tau, -self.best_loss):
            return Selection(step, tau, loss, step, tau)
        return replace(self, last_step=step, last_tau=tau)

    def choose(self, rule: str, steps: int) -> tuple[int, str]:
        """The step whose weights a run of `steps` exports under `rule`, and the reason in words."""
        if not self.best_step:
            return steps, f"last step {steps} (no held-out evaluation)"
        if rule == "last":
            return steps, (
                f"last step {steps} (held-out tau {self.last_tau:.2f}; best {self.best_tau:.2f} at step "
                f"{self.best_step})"
            )
        if self.best_step == self.last_step:
            return self.best_step, (
                f"best held-out tau at step {self.best_step} of {steps}, the last ({self.best_tau:.2f})"
            )
        return self.best_step, (
            f"best held-out tau at step {self.best_step} of {steps} ({self.best_tau:.2f} vs last {self.last_tau:.2f})"
        )

    def lineage(self, rule: str, steps: int) -> dict[str, Any]:
        """What the exported head's lineage and the TrainResult record of the choice."""
        step, reason = self.choose(rule, steps)
        out = {"selected_step": step, "selection_rule": reason, "best_step": self.best_step}
        if not self.best_step:
            return {**out, "selected_heldout_tau": None, "last_heldout_tau": None, "best_heldout_tau": None}
        return {
            **out,
            "selected_heldout_tau": self.best_tau if step == self.best_step else self.last_tau,
            "last_heldout_tau": self.last_tau,
            "best_heldout_tau": self.best_tau,
        }


@dataclass
class BestSoFar:
    """Rank 0's selection and a CPU copy of the best weights (`head_state_dict` names)."""

    selection: Selection = field(default_factory=Selection)
    weights: dict | None = None

    def record(self, step: int, tau: float, loss: float, draft: Eagle3Draft) -> bool:
        """Add an evaluation of `draft` at `step`; True when it is the new best (its weights are kept)."""
        self.selection = self.selection.record(step, tau, loss)
        if self.selection.best_step != step:
            return False
        self.weights = {k: v.clone() for k, v in head_state_dict(draft).items()}
        return True


class TTTModule(nn.Module):
    """Wraps a head so that DDP's forward is the TTT loss (DDP syncs gradients of the wrapped module)."""

    def __init__(self, draft: Eagle3Draft, ttt: TTTConfig):
        super().__init__()
        self.draft = draft
        self.ttt = ttt

    def forward(self, batch: TTTBatch, ttt: TTTConfig | None = None) -> TTTOutput:
        return ttt_loss(self.draft, batch, ttt or self.ttt)
