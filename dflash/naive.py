"""The plain reference of the DFlash objective: one anchor at a time, dense attention over exactly the
keys that anchor may see, full logits, fp32. Slow and obviously right; `dflash.objective` must match it.
DFlash2's too: its convolutions token by token and tap by tap, its selector candidate by candidate, its walk
slot by slot. Also the fp8 storage done one block at a time, which `dflash.fp8` must match."""

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


def plain_conv(x: torch.Tensor, base: torch.Tensor, projected: torch.Tensor, side: int, group: int) -> torch.Tensor:
    """One side of a DFlash2 convolution over one block x [B, H]: base [2, K, H], projected [B, 2 K H/G] (the kernel
    projection of the sublayer's normed input, row side*K*(H/G) + tap*(H/G) + group):
    out[t, c] = sum over taps o <= t, o < K of (base[side, o, c] + delta[t, side, o, c // G]) x[t - o, c]."""
    B, H = x.shape
    K, n = base.shape[1], H // group
    rows = []
    for t in range(B):
        out = torch.zeros(H)
        for o in range(min(K, t + 1)):  # a tap before the block's start reads nothing
            first = side * K * n + o * n  # channel c takes row first + c // G
            delta = projected[t, first : first + n].repeat_interleave(group)  # [H]
            out = out + (base[side, o] + delta) * x[t - o]
        rows.append(out)
    return torch.stack(rows)


def block_states(model: Drafter, ctx, ctx_pos, ids, block_pos, attend) -> torch.Tensor:
    """The final normed states [B, H] of one block: the drafter's forward, DFlash2's layers written out with
    `plain_conv` (side 0 on the sublayer's normed input, side 1 on its output, before the residual add)."""
    if model.cfg.arch != "dflash2":
        return model(ctx, ctx_pos, ids, block_pos, attend)
    G = model.cfg.conv_group_size
    rope_q = model.rope(block_pos)
    x = model.embed(ids)
    for layer in model.layers:
        kv = layer.self_attn.kv(ctx, *model.rope(ctx_pos))
        for conv, norm, sublayer in ((layer.attention_conv, layer.input_layernorm,
                                      lambda y, layer=layer, kv=kv: layer.self_attn(y, kv, rope_q, attend)),
                                     (layer.mlp_conv, layer.post_attention_layernorm, layer.mlp)):
            normed = norm(x)
            projected = normed @ conv.kernel_projection.weight.t()
            x = x + plain_conv(sublayer(plain_conv(normed, conv.base_kernel, projected, 0, G)), conv.base_kernel,
                               projected, 1, G)
    return model.norm(x)


def selector_terms(model: Drafter, logits, h, prev: list[int], labels: list[int | None]):
    """DFlash2's selector over one block, the plain way: (per slot 1..B-1 the K-way cross-entropy of the teacher-forced
    scores over the top-K candidates with the label put last when missing, None without a label; the greedy walk's
    drafts from the anchor over the strict top-K). logits [B, V], h [B, H] the final states; prev[k - 1]: the data's
    token before slot k (the anchor's for slot 1); labels[k - 1] of slot k."""
    K, sel = model.cfg.selector_top_k, model.candidate_selector

    def score(k: int, p: int, c: int) -> torch.Tensor:
        q = sel.predecessor_codebook[p] * (sel.hidden_projection.weight @ h[k])
        return logits[k, c] + (q * sel.successor_codebook[c]).sum()

    ce, drafts, walked = [], [], prev[0]
    for k in range(1, logits.shape[0]):
        top = torch.argsort(logits[k].detach(), descending=True, stable=True)[:K].tolist()
        scores = torch.stack([score(k, walked, c) for c in top])
        walked = top[int(scores.argmax())]  # ties: the higher unary logit (earlier in `top`)
        drafts.append(walked)
        y = labels[k - 1]
        if y is None:
            ce.append(None)
            continue
        cand = top if y in top else top[:-1] + [y]
        scores = torch.stack([score(k, prev[k - 1], c) for c in cand])
        ce.append(-F.log_softmax(scores, -1)[cand.index(y)])
    return ce, drafts


def naive_loss(model: Drafter, hidden, input_ids, loss_mask, target_ids, doc_lens, anchors, *, gamma: float = 7.0,
               loss: str = "decay", dpace_alpha: float = 0.5, labels_from: str = "target", selector_alpha: float = 1.0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, slot_correct [B-1], slot_count [B-1]) for the given anchor positions of one shard. DFlash2: the loss
    adds selector_alpha x its selector's cross-entropies under the same slot weights, and a slot is correct when the
    selector's walk drafts its label."""
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
        h = block_states(model, ctx, ctx_pos, ids, block_pos, lambda q, k, v: plain_attention(q, k, v, seen))  # [B, H]
        logits = (h.float() @ model.head_weight.float().t())  # [B, V]
        ce, labels = [None] * (B - 1), [None] * (B - 1)
        for k in range(1, B):
            t = p + k
            if t >= e or not loss_mask[t]:
                continue
            labels[k - 1] = int(target_ids[t - 1]) if labels_from == "target" else int(input_ids[t])
            ce[k - 1] = F.cross_entropy(logits[k][None], torch.tensor([labels[k - 1]]))
        drafts = [int(logits[k].argmax()) for k in range(1, B)]
        selector_ce = [None] * (B - 1)
        if cfg.arch == "dflash2":
            prev = [int(input_ids[min(p + k - 1, len(input_ids) - 1)]) for k in range(1, B)]
            selector_ce, drafts = selector_terms(model, logits, h, prev, labels)
        if loss == "dpace":
            weights = dpace_slot_weights([None if x is None else x.item() for x in ce], dpace_alpha)
        else:
            weights = [math.exp(-(k - 1) / gamma) for k in range(1, B)]
        for k in range(1, B):
            if ce[k - 1] is None:
                continue
            total = total + weights[k - 1] * ce[k - 1]
            if selector_ce[k - 1] is not None:
                total = total + selector_alpha * weights[k - 1] * selector_ce[k - 1]
            weight_sum = weight_sum + weights[k - 1]
            correct[k - 1] += int(drafts[k - 1] == labels[k - 1])
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
