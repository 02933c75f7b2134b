"""The plain reference of the DFlash objective: one anchor at a time, dense attention over exactly the
keys that anchor may see, full logits, fp32. Slow and obviously right; `dflash.objective` must match it.
Also the fp8 storage done one block at a time, which `dflash.fp8` must match."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dflash.drafter import Drafter


def plain_attention(q, k, v, mask=None):
    """Softmax attention with GQA by repetition, unmasked or under a bool mask [N, M] (True: seen).
    q [1, n_q, N, D], k / v [1, n_kv, M, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def dpace_slot_weights(ce: list[float | None], alpha: float) -> list[float]:
    """D-PACE's weights of one block's slots 1..B-1 from their cross-entropies (None: the slot has no label):
    q_j = exp(-CE_j), q~_j = (1 - alpha) q_j + alpha (1 without a label), C_j = q~_1 ... q~_j,
    w_j = C_j + C_{j+1} + ... + C_{B-1}; 0 without a label."""
    reach, c = [], 1.0
    for x in ce:
        c *= 1.0 if x is None else (1 - alpha) * math.exp(-x) + alpha
        reach.append(c)
    return [0.0 if x is None else sum(reach[j:]) for j, x in enumerate(ce)]


def naive_loss(model: Drafter, hidden, input_ids, loss_mask, target_ids, doc_lens, anchors, *, gamma: float = 7.0,
               loss: str = "decay", dpace_alpha: float = 0.5, labels_from: str = "target"
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, slot_correct [B-1], slot_count [B-1]) for the given anchor positions of one shard."""
    cfg = model.cfg
    B, W, causal = cfg.block_size, cfg.sliding_window, cfg.causal_block
    ctx_all = model.context(hidden)  # per-position features: computing them for all positions is the same
    ends = doc_lens.long().cumsum(0).tolist()
    starts = [e - n for e, n in zip(ends, doc_lens.tolist())]
    total, weight_sum = torch.zeros(()), torch.zeros(())
    correct, count = torch.zeros(B - 1, dtype=torch.long), torch.zeros(B - 1, dtype=torch.long)
    for p in anchors.tolist():
        doc = next((i for i, (s, e) in enumerate(zip(starts, ends)) if s <= p < e), None)
        if doc is None or p + 1 >= ends[doc] or not (loss_mask[p] and loss_mask[p + 1]):
            continue  # not a valid anchor: no loss
        s, e = starts[doc], ends[doc]
        ctx = ctx_all[s:p]  # the context before the anchor, this document only
        ctx_pos = torch.arange(0, p - s)
        ids = torch.full((B,), cfg.mask_token_id, dtype=torch.long)
        ids[0] = input_ids[p]
        block_pos = torch.arange(p - s, p - s + B)
        # slot k (at position p - s + k) sees context positions > p - s + k - W, and its whole block (causal:
        # slots 0..k)
        seen = torch.ones(B, p - s + B, dtype=torch.bool)
        if W is not None:
            seen[:, : p - s] = ctx_pos[None, :] > block_pos[:, None] - W
        if causal:
            seen[:, p - s :] = torch.ones(B, B, dtype=torch.bool).tril()
        h = model(ctx, ctx_pos, ids, block_pos, lambda q, k, v: plain_attention(q, k, v, seen))  # [B, H]
        logits = (h.float() @ model.head_weight.float().t())  # [B, V]
        ce, labels = [None] * (B - 1), [None] * (B - 1)
        for k in range(1, B):
            t = p + k
            if t >= e or not loss_mask[t]:
                continue
            labels[k - 1] = int(target_ids[t - 1]) if labels_from == "target" else int(input_ids[t])
            ce[k - 1] = F.cross_entropy(logits[k][None], torch.tensor([labels[k - 1]]))
        if loss == "dpace":
            weights = dpace_slot_weights([None if x is None else x.item() for x in ce], dpace_alpha)
        else:
            weights = [math.exp(-(k - 1) / gamma) for k in range(1, B)]
        for k in range(1, B):
            if ce[k - 1] is None:
                continue
            total = total + weights[k - 1] * ce[k - 1]
            weight_sum = weight_sum + weights[k - 1]
            correct[k - 1] += int(logits[k].argmax() == labels[k - 1])
            count[k - 1] += 1
    return total / weight_sum.clamp(min=1e-6), correct, count


def fp8_round_trip(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 storage of `dflash.fp8`, one row and one block at a time: (x as stored and read back
    [N, H] fp32, scales [N, G] fp32) for states x [N, H]."""
    N, H = x.shape
    G = -(-H // block)
    out, scales = torch.zeros(N, H), torch.zeros(N, G)
    for n in range(N):
        for g in range(G):
            part = x[n, g * block : (g + 1) * block].float()
            s = (part.abs().max() / 448.0).to(torch.bfloat16).float()  # the scale as stored
            if s == 0:
                continue  # an all-zero block reads back as zeros
            q = (part / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
            out[n, g * block : (g + 1) * block] = q * s
            scales[n, g] = s
    return out, scales
