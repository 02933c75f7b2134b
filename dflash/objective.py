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


def decay_weights(supervised: torch.Tensor, gamma: float) -> torch.Tensor:
    """`--loss decay`: w_k = exp(-(k-1)/gamma) for slots k = 1..B-1 where supervised [A, B-1], else 0."""
    k = torch.arange(1, supervised.shape[1] + 1, device=supervised.device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma) * supervised


def dpace_weights(ce: torch.Tensor, supervised: torch.Tensor, alpha: float) -> torch.Tensor:
    """`--loss dpace` (D-PACE): per block, q_j = exp(-CE_j), q~_j = (1 - alpha) q_j + alpha (1 where slot j is
    not supervised), C_j = prod_{i<=j} q~_i (the chance the walk reaches past slot j), w_j = sum_{m>=j} C_m
    (0 where not supervised). ce, supervised: [A, B-1]; the weights carry no gradient. The running product
    and the suffix sum are products with triangular matrices of ones (B-1 is small): a compiled step gets
    two matmuls instead of scan kernels, which are slow to compile."""
    with torch.no_grad():
        n = ce.shape[1]
        q = torch.where(supervised, (1 - alpha) * torch.exp(-ce.float()) + alpha, 1.0)  # >= alpha > 0
        upper = torch.ones(n, n, device=ce.device).triu()  # upper[i, j] = 1 for i <= j
        reach = torch.exp(q.log() @ upper)  # [A, B-1] C_j
        return (reach @ upper.t()) * supervised  # w_j = sum over m >= j of C_m


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


def sample_anchors(valid: torch.Tensor, num_anchors: int, generator=None,
                   scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A anchors drawn uniformly without replacement from the valid positions, sorted ([A] int64), and
    which of them are real ([A] bool: fewer valid positions than A leaves some slots unused). `scores` [T]:
    uniform draws made by the caller (the training step draws them outside its compiled graph)."""
    if scores is None:
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
    supervised: torch.Tensor  # [A, B-1] bool: the slot has a label (inside the document, with loss, real anchor)
    prev: torch.Tensor  # [A, B-1] the data's token before each of slots 1..B-1 (the anchor's, then the data's)


def make_blocks(anchors, anchor_ok, lay: Layout, input_ids, target_ids, loss_mask, *, block_size: int,
                mask_token_id: int, labels_from: str) -> Blocks:
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
    supervised = inside & loss_mask[lp].bool() & anchor_ok[:, None]
    prev = input_ids[(label_pos - 1).clamp(max=T - 1)]
    return Blocks(ids.reshape(-1), pos.reshape(-1), labels.long(), supervised, prev.long())


def context_mask(anchors: torch.Tensor, lay: Layout, block_size: int, window: int | None = None) -> torch.Tensor:
    """[A*B, T] bool: block token (a, k) sees context j < anchor_a of its document (with a sliding window W,
    only j > anchor_a + k - W: the window is measured from the slot's own position)."""
    A, B = anchors.shape[0], block_size
    q = torch.arange(A * B, device=anchors.device)
    a = q // B  # [A*B] block of each query
    j = torch.arange(lay.doc_id.shape[0], device=anchors.device)
    mask = (lay.doc_id[None, :] == lay.doc_id[anchors][a][:, None]) & (j[None, :] < anchors[a][:, None])
    if window is not None:
        mask &= j[None, :] > (anchors[a] + q % B - window)[:, None]
    return mask


def own_block_mask(num_anchors: int, block_size: int, causal: bool, device=None) -> torch.Tensor:
    """[A*B, A*B] bool: each block token sees its own block (`causal`: its slots up to its own)."""
    q = torch.arange(num_anchors * block_size, device=device)
    mask = q[:, None] // block_size == q[None, :] // block_size
    return mask & (q[None, :] <= q[:, None]) if causal else mask


def dense_mask(anchors: torch.Tensor, lay: Layout, block_size: int, window: int | None = None,
               causal: bool = False) -> torch.Tensor:
    """[A*B, T + A*B] bool: the context mask, then each block token sees its own block (`causal`: slots 0..k).
    The reference layout (and SDPA's on GPU); the flex path builds the same mask as a BlockMask."""
    return torch.cat([context_mask(anchors, lay, block_size, window),
                      own_block_mask(anchors.shape[0], block_size, causal, anchors.device)], dim=1)


def visible_keys(anchors: torch.Tensor, anchor_ok: torch.Tensor, lay: Layout, block_size: int,
                 window: int | None = None, causal: bool = False) -> torch.Tensor:
    """[] keys seen by all block queries together (the FLOP count's attention term): per query, the context
    it sees (`context_mask`) and its own block (`causal`: slots 0..k)."""
    k = torch.arange(block_size, device=anchors.device)
    before = torch.where(anchor_ok, lay.pos[anchors], 0)[:, None]  # [A, 1] context before each anchor
    if window is not None:  # slot k sees min(before, W - 1 - k) of it
        before = torch.minimum(before, (window - 1 - k).clamp(min=0))
    own = k + 1 if causal else torch.full_like(k, block_size)  # [B]
    return (before.expand(-1, block_size) + own).sum()


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


def flex_block_mask(anchors: torch.Tensor, lay: Layout, block_size: int, window: int | None = None,
                    causal: bool = False):
    """The BlockMask of `dense_mask` for flex_attention, built from each query's two key intervals (its
    document's context before its anchor, inside the window if any, and its own block, all of it or up to
    the query's slot) at tile granularity: the same tensors as `create_block_mask(mask_mod, 1, 1, A*B,
    T + A*B)`, without evaluating the mask per element and without a sort, so the compiled step neither
    materialises [A*B, T+A*B] nor compiles a sorting network."""
    from torch.nn.attention.flex_attention import BlockMask

    T, A, B, R = lay.doc_id.shape[0], anchors.shape[0], block_size, SPARSE_BLOCK
    Q, KV = A * B, T + A * B
    Qb, KVb = -(-Q // R), -(-KV // R)
    doc_id, anchor_doc = lay.doc_id, lay.doc_id[anchors]

    def mask_mod(b, h, q, kv):  # applied by the kernel inside partial tiles
        a = q // B
        in_ctx = kv < T
        ctx_ok = (doc_id[kv.clamp(max=T - 1)] == anchor_doc[a]) & (kv < anchors[a])
        if window is not None:
            ctx_ok = ctx_ok & (kv > anchors[a] + q % B - window)
        own = (kv - T) // B == a
        if causal:
            own = own & (kv - T <= q)
        return torch.where(in_ctx, ctx_ok, own)

    q = torch.arange(Qb * R, device=anchors.device)  # [Qb*R] queries, padded to whole tiles
    real_q = (q < Q)[:, None]
    a = (q // B).clamp(max=A - 1)
    anchor = anchors[a]
    ctx_lo = anchor - lay.pos[anchor]  # the document's start
    if window is not None:
        ctx_lo = torch.maximum(ctx_lo, anchor + q % B - window + 1)
    lo = torch.stack([ctx_lo, T + a * B], -1)[:, None, :]  # [Qb*R, 1, 2]: context, own block
    hi = torch.stack([anchor, T + (q + 1 if causal else a * B + B)], -1)[:, None, :]
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


def block_attention(ctx_mask: torch.Tensor, block_size: int, causal: bool = False):
    """Attention over [context ; blocks] where each query scores the T context keys and only the B keys of
    its own block (`causal`: slots 0..k), under one softmax. Same result as SDPA with `dense_mask`, without
    the A*B - B block keys per query that the dense mask throws away (on CPU most of the work at A*B > T).
    ctx_mask: [A*B, T]."""
    def attend(q, k, v):  # q [1, nq, N, D]; k, v [1, nkv, T+N, D]
        _, nq, N, D = q.shape
        T, A, B = k.shape[2] - N, N // block_size, block_size
        k, v = (x[0].repeat_interleave(nq // x.shape[1], dim=0) for x in (k, v))  # GQA: [nq, T+N, D]
        q = q[0] * D**-0.5
        s_ctx = (q @ k[:, :T].transpose(1, 2)).masked_fill(~ctx_mask, float("-inf"))  # [nq, N, T]
        s_own = q.view(nq, A, B, D) @ k[:, T:].view(nq, A, B, D).transpose(2, 3)  # [nq, A, B, B]
        if causal:
            s_own = s_own.masked_fill(~torch.ones(B, B, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        p = torch.cat([s_ctx, s_own.view(nq, N, B)], dim=-1).softmax(-1)  # never empty: the own block
        own = p[..., T:].reshape(nq, A, B, B) @ v[:, T:].view(nq, A, B, D)  # [nq, A, B, D]
        return (p[..., :T] @ v[:, :T] + own.view(nq, N, D))[None]
    return attend


def eager_attention(anchors: torch.Tensor, lay: Layout, block_size: int, window: int | None = None,
                    causal: bool = False):
    """The uncompiled path's attention: per-block scores on CPU; on GPU, SDPA's fused kernels with the
    dense mask (they never materialise the scores)."""
    if anchors.is_cuda:
        return sdpa_attention(dense_mask(anchors, lay, block_size, window, causal))
    return block_attention(context_mask(anchors, lay, block_size, window), block_size, causal)


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


def _chunk(hc, weight, yc, need_grad: bool, top_k: int = 0):
    """One chunk of rows: (CE [c], argmax correct [c], gradient of each row's CE for hc [c, H] or None, the top_k
    logits' values and indices [c, top_k] or None)."""
    raw = hc @ weight.t()  # [c, V] in the head's dtype
    logits = raw.float()
    lse = logits.logsumexp(-1)
    ce = lse - logits.gather(1, yc[:, None])[:, 0]
    correct = logits.argmax(-1) == yc
    # topk is a library call, not a fused kernel: on the raw logits (the same values) it reads half the bytes of a
    # bf16 head's and needs no float32 copy of the chunk
    top_values, top_ids = raw.topk(top_k) if top_k else (None, None)
    if top_k:
        top_values = top_values.float()
    if not need_grad:
        return ce, correct, None, top_values, top_ids
    p = torch.exp(logits - lse[:, None])  # softmax
    p = p.scatter_add(1, yc[:, None], -torch.ones_like(p[:, :1]))
    return ce, correct, (p.to(weight.dtype) @ weight).to(hc.dtype), top_values, top_ids


def ce_rows(vocab_size: int, budget_bytes: int = 5 << 28) -> int:
    """The cross-entropy's default chunk: the most rows, a power of two, whose float32 logits fit in
    `budget_bytes` (1.25 GiB). Each chunk is one more call the compiler traces and schedules."""
    return 1 << max(0, (budget_bytes // (4 * vocab_size)).bit_length() - 1)


# compiled once and called for every chunk: an unrolled chunk has its own offsets baked into its kernels
_chunk_region = torch.compiler.nested_compile_region(_chunk)


def head_cross_entropy(h, weight, labels, weigh, chunk: int = 1024, region: bool = False, top_k: int = 0):
    """(sum of w * CE, w [N], per-row correctness of the argmax [N], the top_k logits' (values, indices) [N, top_k]
    or None when top_k is 0) for rows h [N, H] under the frozen head W,
    where the row weights w = weigh(CE) [N] are constants (no gradient flows through them: a fixed decay, or
    D-PACE's weights of the rows' own CE). Chunked: the [N, V] logits never exist at once. Each row's CE and
    the gradient of its CE for h are computed chunk by chunk (nothing of the logits is kept); once all CEs
    are known the weights scale those gradients, which is exact because the weights are constants, and the
    result reaches h through a surrogate term of value 0: one pass of the head, no custom
    autograd.Function (one in the graph keeps AOT autograd from caching a compiled step).
    `region`: in a compiled step, the chunk is one nested compile region instead of unrolled copies."""
    N = h.shape[0]
    need_grad = h.requires_grad and torch.is_grad_enabled()
    body = _chunk_region if region else _chunk
    with torch.no_grad():
        ce = torch.empty(N, dtype=torch.float32, device=h.device)
        correct = torch.empty(N, dtype=torch.bool, device=h.device)
        grad = torch.empty_like(h) if need_grad else None
        top = (torch.empty(N, top_k, dtype=torch.float32, device=h.device),
               torch.empty(N, top_k, dtype=torch.long, device=h.device)) if top_k else None
        for i in range(0, N, chunk):  # fixed trip count: unrolled in a compiled graph (`region`: calls of one)
            ce[i : i + chunk], correct[i : i + chunk], g, values, ids = body(h[i : i + chunk], weight,
                                                                             labels[i : i + chunk], need_grad, top_k)
            if need_grad:
                grad[i : i + chunk] = g
            if top_k:
                top[0][i : i + chunk], top[1][i : i + chunk] = values, ids
        w = weigh(ce)
        total = (w * ce).sum()
    if need_grad:
        surrogate = (h.float() * (grad.float() * w[:, None])).sum()  # d/dh = w * dCE/dh, rounded once
        total = total + (surrogate - surrogate.detach())
    return total, w, correct, top


@dataclass
class StepOutput:
    loss: torch.Tensor  # [] weighted mean cross-entropy (+ the architecture's own terms, `Drafter.extra_loss`)
    weight_sum: torch.Tensor  # []
    slot_correct: torch.Tensor  # [B-1] correct predictions among trained slots
    slot_count: torch.Tensor  # [B-1] trained slots
    accepted: torch.Tensor  # [A] drafts greedy verification would accept (leading correct drafts) per anchor
    anchors: torch.Tensor  # [A]
    anchor_ok: torch.Tensor  # [A]
    anchor_doc: torch.Tensor  # [A] document of each anchor
    visible_keys: torch.Tensor  # [] keys seen by all block queries together (for FLOP counts)


def accepted_drafts(correct: torch.Tensor) -> torch.Tensor:
    """[A] leading correct slots of each block (correct [A, B-1] bool): the drafts greedy verification would
    accept. Counted with a matmul (a slot is accepted when no slot up to it is wrong), not a cumprod scan."""
    n = correct.shape[1]
    wrong_so_far = (~correct).float() @ torch.ones(n, n, device=correct.device).triu()  # [A, B-1]
    return (wrong_so_far == 0).sum(1)


def drafter_loss(model: Drafter, hidden, input_ids, loss_mask, target_ids, doc_lens, *, num_anchors: int,
                 gamma: float = 7.0, loss: str = "decay", dpace_alpha: float = 0.5, labels_from: str = "target",
                 attention: str = "eager", ce_chunk: int = 1024, ce_region: bool = False, recompute: str = "none",
                 selector_alpha: float = 1.0, anchors: torch.Tensor | None = None,
                 anchor_scores: torch.Tensor | None = None, generator=None) -> StepOutput:
    """The drafter's loss of one shard: hidden [T, L, H], input_ids / loss_mask / target_ids [T],
    doc_lens [D]. `loss`: `decay` (fixed slot weights, `gamma`) or `dpace` (D-PACE, `dpace_alpha`), over the unary
    cross-entropy, plus the architecture's own terms with the same weights (DFlash2: its selector's, times
    `selector_alpha`), normalised by the weights' sum.
    `recompute`: what of each drafter layer the backward recomputes (`Drafter.forward`).
    `anchor_scores` [T] (uniform) are the random draw's numbers, drawn by the caller; `anchors` (sorted [A])
    replaces the draw, for tests."""
    cfg = model.cfg
    T, B, W, causal = input_ids.shape[0], cfg.block_size, cfg.sliding_window, cfg.causal_block
    lay = layout(doc_lens, T)
    valid = valid_anchors(lay, loss_mask)
    if anchors is None:
        anchors, anchor_ok = sample_anchors(valid, num_anchors, generator, anchor_scores)
    else:
        anchor_ok = valid[anchors]
    blocks = make_blocks(anchors, anchor_ok, lay, input_ids, target_ids, loss_mask, block_size=B,
                         mask_token_id=cfg.mask_token_id, labels_from=labels_from)
    if attention == "flex":
        attend = flex_attention_fn(flex_block_mask(anchors, lay, B, W, causal))
    elif attention == "dense":  # the reference layout, for tests
        attend = sdpa_attention(dense_mask(anchors, lay, B, W, causal))
    else:
        attend = eager_attention(anchors, lay, B, W, causal)
    ctx = model.context(hidden)  # [T, H]
    h = model(ctx, lay.pos, blocks.ids, blocks.pos, attend, recompute=recompute)  # [A*B, H]
    h = h.view(-1, B, h.shape[-1])[:, 1:].reshape(-1, h.shape[-1])  # slots 1..B-1: [A*(B-1), H]
    supervised = blocks.supervised
    if loss == "dpace":
        weigh = lambda ce: dpace_weights(ce.view(-1, B - 1), supervised, dpace_alpha).reshape(-1)  # noqa: E731
    else:
        weigh = lambda ce: decay_weights(supervised, gamma).reshape(-1)  # noqa: E731
    labels = blocks.labels.reshape(-1)
    total, w, correct, top = head_cross_entropy(h, model.head_weight, labels, weigh, ce_chunk, ce_region,
                                                model.candidates)
    weight_sum = w.sum()
    correct = correct.view(-1, B - 1)
    extra = model.extra_loss(h, labels, w, top, blocks.prev, selector_alpha)
    if extra is not None:  # its own terms, and drafts that are not the unary argmax
        total = total + extra[0]
        correct = extra[1] == blocks.labels
    correct = correct & supervised
    return StepOutput(total / weight_sum.clamp(min=1e-6), weight_sum, correct.sum(0), supervised.sum(0),
                      accepted_drafts(correct), anchors, anchor_ok, lay.doc_id[anchors],
                      visible_keys(anchors, anchor_ok, lay, B, W, causal))


def flops_per_step(cfg, T: int, num_anchors: int, visible: float | None = None) -> float:
    """Training FLOPs of one step (fwd + bwd; the frozen head: fwd + input grad):
    per layer 6[(Wq+Wo+Wmlp)AB + (Wk+Wv)(AB+T)], + 6 Wfc T, + 4 V H A(B-1), + 12 heads head_dim sum(visible
    keys) per layer. `visible` (StepOutput.visible_keys) defaults to half the shard of context per block
    token (at most the sliding window), as for one long document."""
    A, B, H = num_anchors, cfg.block_size, cfg.hidden_size
    q_o = 2 * H * cfg.num_attention_heads * cfg.head_dim
    k_v = 2 * H * cfg.num_key_value_heads * cfg.head_dim
    mlp = 3 * H * cfg.intermediate_size
    per_layer = 6 * ((q_o + mlp) * A * B + k_v * (A * B + T))
    fc = 6 * len(cfg.target_layer_ids) * H * H * T
    head = 4 * cfg.vocab_size * H * A * (B - 1)
    if visible is None:
        visible = A * B * (min(T / 2, cfg.sliding_window or T) + ((B + 1) / 2 if cfg.causal_block else B))
    attn = 12 * cfg.num_attention_heads * cfg.head_dim * visible * cfg.num_layers
    return cfg.num_layers * per_layer + fc + head + attn
