"""The fixed-shape DFlash training objective for one shard: anchors, blocks, attention mask, loss.

Every tensor has a shape fixed by (T, D, A, B), nothing syncs with the host, and the same code runs
eagerly on CPU (attention scored per block, `block_attention`) and compiled on GPU (flex_attention with a
block mask built inside the graph). `dflash.naive` is the plain per-anchor reference it is tested
against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.drafter import Drafter


def default_gamma(block_size: int) -> float:
    """Loss decay of the reference recipe: 7 for B = 16, 5 for B = 10, 4 for B = 8."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2.3)


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..B-1  -> [B-1]."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


@dataclass
class Layout:
    """Where the documents of a packed shard are, per position [T]."""

    doc_id: torch.Tensor  # [T] int64: index of the document; D (past the last) at padding
    pos: torch.Tensor  # [T] int64: position inside its document (0 at each document start)
    doc_end: torch.Tensor  # [T] int64: exclusive end of its document (absolute)
    real: torch.Tensor  # [T] bool: not padding


def layout(doc_lens: torch.Tensor, T: int) -> Layout:
    """Vectorised over doc_lens [D]: no repeat_interleave, no data-dependent shapes."""
    ends = doc_lens.long().cumsum(0)  # [D]
    starts = ends - doc_lens.long()
    t = torch.arange(T, device=doc_lens.device)
    doc_id = (t[:, None] >= ends[None, :]).sum(1)  # [T]
    d = doc_id.clamp(max=doc_lens.shape[0] - 1)
    return Layout(doc_id, t - starts[d], ends[d], t < ends[-1])


def valid_anchors(lay: Layout, loss_mask: torch.Tensor) -> torch.Tensor:
    """[T] bool: positions p with loss on p and p+1, both in one document."""
    lm = loss_mask.bool()
    nxt = torch.cat([lm[1:], lm.new_zeros(1)])
    p = torch.arange(lm.shape[0], device=lm.device)
    return lay.real & lm & nxt & (p + 1 < lay.doc_end)


def sample_anchors(valid: torch.Tensor, num_anchors: int, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A anchors drawn uniformly without replacement from the valid positions, sorted ([A] int64), and
    which of them are real ([A] bool: fewer valid positions than A leaves some slots unused)."""
    scores = torch.rand(valid.shape[0], device=valid.device, generator=generator)
    scores = torch.where(valid, scores, -1.0)
    # ascending by a second topk, not sort: Inductor lowers a sort of <= 512 elements to a Triton sorting
    # network (slow to compile), while topk stays one library call
    anchors = scores.topk(num_anchors).indices.topk(num_anchors, largest=False).values
    return anchors, valid[anchors]


@dataclass
class Blocks:
    ids: torch.Tensor  # [A*B] block tokens: anchor token, then MASK
    pos: torch.Tensor  # [A*B] their positions inside the document
    labels: torch.Tensor  # [A, B-1] what slots 1..B-1 should predict
    weights: torch.Tensor  # [A, B-1] loss weight (0: no loss)


def make_blocks(anchors, anchor_ok, lay: Layout, input_ids, target_ids, loss_mask, *, block_size: int,
                mask_token_id: int, gamma: float, labels_from: str) -> Blocks:
    T, B = input_ids.shape[0], block_size
    k = torch.arange(B, device=anchors.device)
    ids = torch.where(k == 0, input_ids[anchors][:, None], mask_token_id)  # [A, B]
    pos = lay.pos[anchors][:, None] + k  # [A, B]
    label_pos = anchors[:, None] + k[1:]  # [A, B-1] absolute positions of the predicted tokens
    inside = label_pos < lay.doc_end[anchors][:, None]
    lp = label_pos.clamp(max=T - 1)
    if labels_from == "target":  # target_ids[t] is the target's prediction of the token at t+1
        labels = target_ids[lp - 1]
    else:
        labels = input_ids[lp]
    weights = slot_weights(B, gamma, anchors.device)[None, :] * (inside & loss_mask[lp].bool() & anchor_ok[:, None])
    return Blocks(ids.reshape(-1), pos.reshape(-1), labels.long(), weights)


def context_mask(anchors: torch.Tensor, lay: Layout, block_size: int) -> torch.Tensor:
    """[A*B, T] bool: block token (a, k) sees context j < anchor_a of its document."""
    A, B = anchors.shape[0], block_size
    a = torch.arange(A * B, device=anchors.device) // B  # [A*B] block of each query
    j = torch.arange(lay.doc_id.shape[0], device=anchors.device)
    return (lay.doc_id[None, :] == lay.doc_id[anchors][a][:, None]) & (j[None, :] < anchors[a][:, None])


def dense_mask(anchors: torch.Tensor, lay: Layout, block_size: int) -> torch.Tensor:
    """[A*B, T + A*B] bool: the context mask, then each block token sees its own block. The reference
    layout (and SDPA's on GPU); the flex path builds the same mask as a BlockMask."""
    a = torch.arange(anchors.shape[0] * block_size, device=anchors.device) // block_size
    return torch.cat([context_mask(anchors, lay, block_size), a[:, None] == a[None, :]], dim=1)


SPARSE_BLOCK = 128  # flex_attention's tile: the block mask says which [128 queries x 128 keys] tiles to visit


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, 1, R, C] bool -> per row the number of true columns [1, 1, R] and the columns, true ones first,
    each group ascending [1, 1, R, C] (int32): flex_attention's block-list layout. Counted, not sorted: the
    j-th true column is the number of columns whose running count of trues is <= j. Plain sums only
    (C is the number of key or query tiles, ~T/128): torch's stable argsort becomes a Triton sorting network
    that takes minutes to compile at some shapes (torch <= 2.12), and a cumsum a scan kernel that takes
    seconds."""
    d = dense.to(torch.int32)
    col = torch.arange(d.shape[-1], device=d.device)
    num = d.sum(-1, keepdim=True)  # [1, 1, R, 1]
    trues = (d[..., None, :] * (col[None, :] <= col[:, None])).sum(-1)  # [1, 1, R, C]: trues in columns <= c
    falses = col + 1 - trues
    slot = col[:, None]  # [C, 1]: output position j
    true_col = (trues[..., None, :] <= slot).sum(-1)  # [1, 1, R, C]: the j-th true column
    false_col = (falses[..., None, :] <= slot - num[..., None]).sum(-1)  # the (j - num)-th false
    idx = torch.where(slot[:, 0] < num, true_col, false_col)
    return num[..., 0].to(torch.int32), idx.to(torch.int32, memory_format=torch.contiguous_format)


def flex_block_mask(anchors: torch.Tensor, lay: Layout, block_size: int):
    """The BlockMask of `dense_mask` for flex_attention, built from each query's two key intervals (its
    document's context before its anchor, and its own block) at tile granularity: the same tensors as
    `create_block_mask(mask_mod, 1, 1, A*B, T + A*B)`, without evaluating the mask per element and without
    a sort, so the compiled step neither materialises [A*B, T+A*B] nor compiles a sorting network."""
    from torch.nn.attention.flex_attention import BlockMask

    T, A, B, R = lay.doc_id.shape[0], anchors.shape[0], block_size, SPARSE_BLOCK
    Q, KV = A * B, T + A * B
    Qb, KVb = -(-Q // R), -(-KV // R)
    doc_id, anchor_doc = lay.doc_id, lay.doc_id[anchors]

    def mask_mod(b, h, q, kv):  # applied by the kernel inside partial tiles
        a = q // B
        in_ctx = kv < T
        ctx_ok = (doc_id[kv.clamp(max=T - 1)] == anchor_doc[a]) & (kv < anchors[a])
        return torch.where(in_ctx, ctx_ok, (kv - T) // B == a)

    q = torch.arange(Qb * R, device=anchors.device)  # [Qb*R] queries, padded to whole tiles
    real_q = (q < Q)[:, None]
    a = (q // B).clamp(max=A - 1)
    anchor = anchors[a]
    lo = torch.stack([anchor - lay.pos[anchor], T + a * B], -1)[:, None, :]  # [Qb*R, 1, 2]: context, own block
    hi = torch.stack([anchor, T + a * B + B], -1)[:, None, :]
    tile_lo = torch.arange(KVb, device=anchors.device)[None, :, None] * R  # [1, KVb, 1]
    tile_hi = tile_lo + R
    sees_some = ((lo < hi) & (lo < tile_hi) & (hi > tile_lo)).any(-1) & real_q  # [Qb*R, KVb]; hi <= KV
    sees_all = ((lo <= tile_lo) & (tile_hi <= hi)).any(-1) & real_q  # the two intervals never touch
    sees_some = sees_some.view(Qb, R, KVb).any(1)  # [Qb, KVb] per tile
    sees_all = sees_all.view(Qb, R, KVb).all(1)
    partial = (sees_some & ~sees_all)[None, None]  # [1, 1, Qb, KVb]
    full = sees_all[None, None]
    kv_num, kv_idx = _ordered(partial)
    full_kv_num, full_kv_idx = _ordered(full)
    q_num, q_idx = _ordered(partial.transpose(-2, -1))
    full_q_num, full_q_idx = _ordered(full.transpose(-2, -1))
    return BlockMask(seq_lengths=(Q, KV), kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=full_kv_num,
                     full_kv_indices=full_kv_idx, q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=full_q_num,
                     full_q_indices=full_q_idx, BLOCK_SIZE=(R, R), mask_mod=mask_mod)


def sdpa_attention(mask: torch.Tensor):
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True)
    return attend


def block_attention(ctx_mask: torch.Tensor, block_size: int):
    """Attention over [context ; blocks] where each query scores the T context keys and only the B keys of
    its own block, under one softmax. Same result as SDPA with `dense_mask`, without the A*B - B block keys
    per query that the dense mask throws away (on CPU most of the work at A*B > T). ctx_mask: [A*B, T]."""
    def attend(q, k, v):  # q [1, nq, N, D]; k, v [1, nkv, T+N, D]
        _, nq, N, D = q.shape
        T, A, B = k.shape[2] - N, N // block_size, block_size
        k, v = (x[0].repeat_interleave(nq // x.shape[1], dim=0) for x in (k, v))  # GQA: [nq, T+N, D]
        q = q[0] * D**-0.5
        s_ctx = (q @ k[:, :T].transpose(1, 2)).masked_fill(~ctx_mask, float("-inf"))  # [nq, N, T]
        s_own = q.view(nq, A, B, D) @ k[:, T:].view(nq, A, B, D).transpose(2, 3)  # [nq, A, B, B]
        p = torch.cat([s_ctx, s_own.view(nq, N, B)], dim=-1).softmax(-1)  # never empty: the own block
        own = p[..., T:].reshape(nq, A, B, B) @ v[:, T:].view(nq, A, B, D)  # [nq, A, B, D]
        return (p[..., :T] @ v[:, :T] + own.view(nq, N, D))[None]
    return attend


def eager_attention(anchors: torch.Tensor, lay: Layout, block_size: int):
    """The uncompiled path's attention: per-block scores on CPU; on GPU, SDPA's fused kernels with the
    dense mask (they never materialise the scores)."""
    if anchors.is_cuda:
        return sdpa_attention(dense_mask(anchors, lay, block_size))
    return block_attention(context_mask(anchors, lay, block_size), block_size)


_flex_kernel = None
# BACKEND TRITON: the training kernel even when few queries would pick the decoding one
FLEX_KERNEL_OPTIONS = {"BACKEND": "TRITON"}


def flex_attention_fn(block_mask):
    """Inside a compiled step flex_attention fuses into it; eagerly (GPU only) it is compiled alone, as
    SpecForge and the flex docs do: uncompiled it materialises the whole score matrix."""
    global _flex_kernel
    from torch.nn.attention.flex_attention import flex_attention

    kernel = flex_attention
    if block_mask.kv_indices.is_cuda and not torch.compiler.is_compiling():
        if _flex_kernel is None:
            _flex_kernel = torch.compile(flex_attention, dynamic=False)
        kernel = _flex_kernel

    def attend(q, k, v):
        return kernel(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=dict(FLEX_KERNEL_OPTIONS))
    return attend


def _chunk(hc, weight, yc, wc, need_grad: bool):
    """One chunk of rows: (sum of w * CE, argmax correct [c], gradient for hc [c, H] or None)."""
    logits = (hc @ weight.t()).float()  # [c, V]
    lse = logits.logsumexp(-1)
    loss = (wc * (lse - logits.gather(1, yc[:, None])[:, 0])).sum()
    correct = logits.argmax(-1) == yc
    if not need_grad:
        return loss, correct, None
    p = torch.exp(logits - lse[:, None])  # softmax
    p = p.scatter_add(1, yc[:, None], -torch.ones_like(p[:, :1]))
    return loss, correct, ((p * wc[:, None]).to(weight.dtype) @ weight).to(hc.dtype)


def ce_rows(vocab_size: int, budget_bytes: int = 5 << 28) -> int:
    """The cross-entropy's default chunk: the most rows, a power of two, whose float32 logits fit in
    `budget_bytes` (1.25 GiB). Each chunk is one more call the compiler traces and schedules."""
    return 1 << max(0, (budget_bytes // (4 * vocab_size)).bit_length() - 1)


# compiled once and called for every chunk: an unrolled chunk has its own offsets baked into its kernels
_chunk_region = torch.compiler.nested_compile_region(_chunk)


def head_cross_entropy(h, weight, labels, w, chunk: int = 1024, region: bool = False):
    """(sum of w * CE, per-row correctness of the argmax) for rows h [N, H] under the frozen head W.
    Chunked: the [N, V] logits never exist at once. The gradient for h is computed chunk by chunk with the
    loss (nothing of the logits is kept) and reaches h through a surrogate term of value 0, so no custom
    autograd.Function is needed (one in the graph keeps AOT autograd from caching a compiled step).
    `region`: in a compiled step, the chunk is one nested compile region instead of unrolled copies."""
    N = h.shape[0]
    need_grad = h.requires_grad and torch.is_grad_enabled()
    body = _chunk_region if region else _chunk
    with torch.no_grad():
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.empty(N, dtype=torch.bool, device=h.device)
        grad = torch.empty_like(h) if need_grad else None
        for i in range(0, N, chunk):  # fixed trip count: unrolled in a compiled graph (`region`: calls of one)
            loss, correct[i : i + chunk], g = body(h[i : i + chunk], weight, labels[i : i + chunk], w[i : i + chunk],
                                                   need_grad)
            total = total + loss
            if need_grad:
                grad[i : i + chunk] = g
    if need_grad:
        surrogate = (h * grad).float().sum()  # d/dh = grad
        total = total + (surrogate - surrogate.detach())
    return total, correct


@dataclass
class StepOutput:
    loss: torch.Tensor  # [] weighted mean cross-entropy
    weight_sum: torch.Tensor  # []
    slot_correct: torch.Tensor  # [B-1] correct predictions among trained slots
    slot_count: torch.Tensor  # [B-1] trained slots
    anchors: torch.Tensor  # [A]
    anchor_ok: torch.Tensor  # [A]
    visible_keys: torch.Tensor  # [] keys seen by all block queries together (for FLOP counts)


def drafter_loss(model: Drafter, hidden, input_ids, loss_mask, target_ids, doc_lens, *, num_anchors: int,
                 gamma: float, labels_from: str = "target", attention: str = "eager", ce_chunk: int = 1024,
                 ce_region: bool = False,
                 anchors: torch.Tensor | None = None, generator=None) -> StepOutput:
    """The DFlash loss of one shard: hidden [T, L, H], input_ids / loss_mask / target_ids [T],
    doc_lens [D]. `anchors` (sorted [A]) replaces the random draw, for tests."""
    cfg = model.cfg
    T, B = input_ids.shape[0], cfg.block_size
    lay = layout(doc_lens, T)
    valid = valid_anchors(lay, loss_mask)
    if anchors is None:
        anchors, anchor_ok = sample_anchors(valid, num_anchors, generator)
    else:
        anchor_ok = valid[anchors]
    blocks = make_blocks(anchors, anchor_ok, lay, input_ids, target_ids, loss_mask, block_size=B,
                         mask_token_id=cfg.mask_token_id, gamma=gamma, labels_from=labels_from)
    if attention == "flex":
        attend = flex_attention_fn(flex_block_mask(anchors, lay, B))
    elif attention == "dense":  # the reference layout, for tests
        attend = sdpa_attention(dense_mask(anchors, lay, B))
    else:
        attend = eager_attention(anchors, lay, B)
    ctx = model.context(hidden)  # [T, H]
    h = model(ctx, lay.pos, blocks.ids, blocks.pos, attend)  # [A*B, H]
    h = h.view(-1, B, h.shape[-1])[:, 1:].reshape(-1, h.shape[-1])  # slots 1..B-1: [A*(B-1), H]
    w = blocks.weights.reshape(-1)
    total, correct = head_cross_entropy(h, model.head_weight, blocks.labels.reshape(-1), w, ce_chunk, ce_region)
    weight_sum = w.sum()
    trained = (blocks.weights > 0).view(-1, B - 1)
    visible = B * (torch.where(anchor_ok, lay.pos[anchors], 0) + B).sum()  # per query: context before p + own block
    return StepOutput(total / weight_sum.clamp(min=1e-6), weight_sum,
                      (correct.view(-1, B - 1) & trained).sum(0), trained.sum(0), anchors, anchor_ok, visible)


def flops_per_step(cfg, T: int, num_anchors: int, visible_keys: float | None = None) -> float:
    """Training FLOPs of one step (fwd + bwd; the frozen head: fwd + input grad):
    per layer 6[(Wq+Wo+Wmlp)AB + (Wk+Wv)(AB+T)], + 6 Wfc T, + 4 V H A(B-1), + 12 heads head_dim sum(visible
    keys) per layer. `visible_keys` (StepOutput.visible_keys) defaults to half the shard of context per
    block token, as for one long document."""
    A, B, H = num_anchors, cfg.block_size, cfg.hidden_size
    q_o = 2 * H * cfg.num_attention_heads * cfg.head_dim
    k_v = 2 * H * cfg.num_key_value_heads * cfg.head_dim
    mlp = 3 * H * cfg.intermediate_size
    per_layer = 6 * ((q_o + mlp) * A * B + k_v * (A * B + T))
    fc = 6 * len(cfg.target_layer_ids) * H * H * T
    head = 4 * cfg.vocab_size * H * A * (B - 1)
    if visible_keys is None:
        visible_keys = A * B * (T / 2 + B)
    attn = 12 * cfg.num_attention_heads * cfg.head_dim * visible_keys * cfg.num_layers
    return cfg.num_layers * per_layer + fc + head + attn
