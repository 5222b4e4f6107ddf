"""A deliberately plain TTT implementation: the reference for tests/test_ttt.py and the "naive" side of ttt_memory.py.

It materialises, at every step k, the full [S, (k+1)*S] score matrix with an explicit mask, and full-vocabulary
fp32 teacher logits for the whole batch — exactly the memory traps eagle.ttt avoids. Not for training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_ttt(draft, input_ids, aux, loss_mask, last_hidden, lm_head_w, K, gamma):
    """Returns (loss, per-step acc list, per-step cond-acc list, tau) written one obvious step at a time.

    One long function on purpose (over 60 lines): a reference is read top to bottom against the TTT alignment in
    eagle/ttt.py's docstring, with no helper to jump into."""
    B, S = input_ids.shape
    cfg = draft.cfg
    layer = draft.midlayer
    logits_t = last_hidden.float() @ lm_head_w.float().T  # [B,S,V] full vocab, fp32
    draft_ids = draft.draft_ids()
    target_argmax = logits_t.argmax(-1)
    target_probs = torch.softmax(logits_t[..., draft_ids], -1)
    in_vocab = draft.t2d[target_argmax]

    if draft.cfg.fc_norm:  # eagle3.1, as vLLM's combine_hidden_states: one RMSNorm per fused state, then fc
        aux = torch.cat([n(c) for n, c in zip(draft.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
    hidden = draft.fc(aux)
    keys, values = [], []
    loss = 0.0
    correct_all = []
    scored_all = []
    for k in range(K):
        tok = torch.zeros_like(input_ids)
        scored = torch.zeros(B, S, dtype=torch.bool)
        teacher_p = torch.zeros(B, S, target_probs.shape[-1])
        teacher_arg = torch.zeros(B, S, dtype=torch.long)
        teacher_in = torch.zeros(B, S, dtype=torch.bool)
        for i in range(S):
            if i + 1 + k < S:
                tok[:, i] = input_ids[:, i + 1 + k]
                teacher_p[:, i] = target_probs[:, i + 1 + k]
                teacher_arg[:, i] = target_argmax[:, i + 1 + k]
                teacher_in[:, i] = in_vocab[:, i + 1 + k]
            if i + 2 + k < S:
                scored[:, i] = loss_mask[:, i + 2 + k].bool()
        pos = (torch.arange(S) + k)[None].expand(B, S)
        emb = draft.embed_tokens(tok)
        q, kk, vv = layer.project_qkv(emb, hidden, pos)
        keys.append(kk)
        values.append(vv)
        allk = torch.cat(keys, dim=2)  # B,kvh,(k+1)S,D
        allv = torch.cat(values, dim=2)
        mask = torch.zeros(S, (k + 1) * S, dtype=torch.bool)
        for i in range(S):
            mask[i, : i + 1] = True
            for j in range(1, k + 1):
                mask[i, j * S + i] = True
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        allk = allk.repeat_interleave(rep, dim=1)
        allv = allv.repeat_interleave(rep, dim=1)
        scores = (q @ allk.transpose(-1, -2)) / cfg.head_dim**0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        attn = torch.softmax(scores.float(), -1) @ allv
        out = layer.finish(hidden, attn)
        logp = F.log_softmax(draft.logits(out).float(), -1)
        w = (scored & teacher_in).float()
        ce = -(teacher_p * logp).sum(-1)
        loss = loss + gamma**k * (ce * w).sum() / w.sum().clamp(min=1)
        pred = draft.draft_ids()[logp.argmax(-1)]
        correct_all.append(pred == teacher_arg)
        scored_all.append(scored)
        hidden = draft.norm(out) if draft.cfg.norm_output else out  # eagle3.1: the next step reads the post-norm state

    acc, cond = [], []
    for k in range(K):
        n = scored_all[k].sum().clamp(min=1)
        acc.append(float((correct_all[k] & scored_all[k]).sum() / n))
        prev = torch.ones(B, S, dtype=torch.bool)
        for j in range(k):
            prev &= correct_all[j]
        both = prev & correct_all[k] & scored_all[k]
        cond.append(float(both.sum() / (prev & scored_all[k]).sum().clamp(min=1)))
    total, count = 0.0, 0
    for b in range(B):
        for i in range(S):
            if all(bool(scored_all[k][b, i]) for k in range(K)):
                run = 0
                for k in range(K):
                    if not correct_all[k][b, i]:
                        break
                    run += 1
                total += 1 + run
                count += 1
    return loss, acc, cond, total / max(count, 1)
