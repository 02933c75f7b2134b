"""`dflash eval`: offline acceptance length of a drafter on cached shards.

For every valid anchor of the evaluated shards, the drafter proposes B-1 tokens greedily; they are
accepted while they equal the target's own greedy predictions (`target_ids`, recorded at extraction).
A verify step yields its accepted drafts + 1 (the target's bonus token). Three averages, each named:

- `tau` (pooled): 1 + all accepted drafts / all verify steps, over decoding replayed document by document
  (the walk over every anchor); what vLLM and SGLang log while serving.
- `tau_per_request`: the mean over documents of each one's pooled tau; what a benchmark that averages
  per request (SpecForge's) reports.
- `tau_anchors`: 1 + the mean accepted drafts over every anchor, decoding order playing no part.

The training log's `tau_walk` is SpecForge's walk over the step's own sampled anchors (`walk_tau`): the
same walk as `tau`'s, on the anchors a step drew rather than on every position.
"""

from __future__ import annotations

import torch

from dflash.cache import Cache
from dflash.drafter import Drafter
from dflash.drafter_io import load_drafter
from dflash.errors import DflashError
from dflash.objective import eager_attention, layout, valid_anchors


@torch.inference_mode()
def acceptance(drafter: Drafter, cache: Cache, shards: list[int], device, anchors_per_pass: int = 256) -> dict:
    """Greedy acceptance of the drafter against the target's recorded choices, on `shards` (cache opened
    with the drafter's layers). Every valid anchor is drafted once (a block's draft depends only on its
    anchor and the context before it); then:

    - `tau`, `per_slot`: decoding order, pooled over verify steps, as `dflash spec` counts. Each document is
      replayed from its first trained position: a cycle drafts at anchor p, accepts a tokens, and the next
      cycle starts at p + a + 1 (the target's bonus token). On a cache of the target's own greedy answers
      this is the online tau, up to the bf16 rounding of the stored states. `tau_per_request`: the mean
      over documents of each one's tau.
    - `tau_anchors`, `per_slot_anchors`: the mean over every anchor. Higher on repetitive text: decoding
      spends more cycles where the drafter fails, since each failure starts one."""
    B, window, causal = drafter.cfg.block_size, drafter.cfg.sliding_window, drafter.cfg.causal_block
    per_anchor, documents = [], []  # accepted drafts at every valid anchor / per replayed cycle of each document
    for s in shards:
        shard = cache.read_shard(s)
        hidden = cache.states(shard, device, drafter.fc.weight.dtype)  # [T, L, H]; fp8 dequantised as in training
        input_ids = torch.from_numpy(shard.input_ids).long().to(device)
        target_ids = torch.from_numpy(shard.target_ids).long().to(device)
        loss_mask = torch.from_numpy(shard.loss_mask).to(device)
        T = input_ids.shape[0]
        lay = layout(torch.from_numpy(shard.doc_lens).to(device), T)
        valid = valid_anchors(lay, loss_mask).nonzero()[:, 0]  # eval only: data-dependent shapes are fine
        ctx = drafter.context(hidden)
        ctx_kv = drafter.context_kv(ctx, lay.pos)  # once per shard, shared by every pass of anchors
        k = torch.arange(1, B, device=device)
        accepted_at = torch.full((T,), -1, dtype=torch.long)  # [T] drafts accepted at each valid anchor
        for i in range(0, len(valid), anchors_per_pass):
            anchors = valid[i : i + anchors_per_pass]
            ids = torch.full((len(anchors), B), drafter.cfg.mask_token_id, device=device)
            ids[:, 0] = input_ids[anchors]
            pos = lay.pos[anchors][:, None] + torch.arange(B, device=device)
            attend = eager_attention(anchors, lay, B, window, causal)
            h = drafter(ctx, lay.pos, ids.reshape(-1), pos.reshape(-1), attend, ctx_kv=ctx_kv)
            pred = drafter.propose(h.view(len(anchors), B, -1)[:, 1:], input_ids[anchors])  # [n, B-1] greedy drafts
            label_pos = anchors[:, None] + k  # the token slot k drafts; target_ids[t-1] is the target's choice
            inside = label_pos < lay.doc_end[anchors][:, None]
            match = ((pred == target_ids[(label_pos - 1).clamp(max=T - 1)]) & inside).long().cumprod(1)
            accepted_at[anchors.cpu()] = match.sum(1).cpu()  # host sync: eval only
        per_anchor += accepted_at[accepted_at >= 0].tolist()
        documents += replay_cycles(accepted_at, lay.doc_end.cpu())
    if not per_anchor:
        raise DflashError("no valid anchor in the evaluated shards")
    cycles = [a for doc in documents for a in doc]
    per_slot, per_slot_anchors = by_slot(cycles, B), by_slot(per_anchor, B)
    return {"tau": 1.0 + sum(per_slot), "tau_per_request": per_request_tau(documents), "per_slot": per_slot,
            "tau_anchors": 1.0 + sum(per_slot_anchors), "per_slot_anchors": per_slot_anchors, "cycles": len(cycles),
            "documents": len(documents), "blocks": len(per_anchor), "shards": shards, "block_size": B}


def walk_tau(anchors, anchor_ok, anchor_doc, accepted) -> tuple[int, int]:
    """SpecForge's walk over sampled anchors (its `compute_walk_accepted_length_terms`): per document, from its
    start, visit the next real anchor at or after the resume position, credit its accepted drafts + 1 and
    resume past them. Returns (tokens credited, visits); tau_walk = their ratio. Sequences of [A] (anchors
    sorted), one step's or several steps' concatenated."""
    total = visits = 0
    resume, doc_now = 0, None
    for p, ok, doc, a in zip(anchors, anchor_ok, anchor_doc, accepted):
        if doc != doc_now:
            resume, doc_now = 0, doc
        if ok and p >= resume:
            total, visits, resume = total + a + 1, visits + 1, p + a + 1
    return total, visits


def per_request_tau(requests: list[list[int]]) -> float:
    """The mean over requests of each one's tau (1 + its accepted drafts / its verify steps); requests
    without a verify step do not count."""
    taus = [1 + sum(r) / len(r) for r in requests if r]
    return sum(taus) / max(len(taus), 1)


def by_slot(accepted: list[int], block_size: int) -> list[float]:
    """Per draft slot k = 1..B-1, the share of blocks that accepted at least k drafts (tau = 1 + their sum)."""
    return [sum(a >= k for a in accepted) / max(len(accepted), 1) for k in range(1, block_size)]


def replay_cycles(accepted_at: torch.Tensor, doc_end: torch.Tensor) -> list[list[int]]:
    """Decoding order over one shard, per document (with a valid anchor): accepted_at [T] (-1 where no anchor
    is valid), doc_end [T]. From each document's first valid anchor, a cycle at p accepts a = accepted_at[p]
    drafts and the next starts at p + a + 1, or at the next valid anchor (past an untrained span: a user
    turn)."""
    acc, end = accepted_at.tolist(), doc_end.tolist()
    out, p, doc_end_now = [], 0, -1
    while p < len(acc):
        if acc[p] < 0:
            p += 1
            continue
        if end[p] != doc_end_now:  # the first cycle of another document
            out.append([])
            doc_end_now = end[p]
        out[-1].append(acc[p])
        nxt = p + acc[p] + 1
        p = nxt if nxt < end[p] else end[p]  # the next document starts from its own first anchor
    return out


def evaluate(drafter_path: str, cache_path: str, shards: list[int] | None = None, device: str = "auto",
             max_shards: int | None = None) -> dict:
    from dflash.target import resolve_device

    dev = resolve_device(device)
    probe = Cache(cache_path)
    embed, head = probe.target_weights(dev, torch.float32 if dev.type == "cpu" else torch.bfloat16)
    drafter, info = load_drafter(drafter_path, embed, head, probe.manifest.layer_ids, dev)
    cache = Cache(cache_path, layers=drafter.cfg.target_layer_ids)
    cache.warn_damaged()
    committed = set(cache.committed())
    if shards is None:
        same_cache = info["cache_key"] == cache.manifest.cache_key
        shards = [s for s in info["holdout_shards"] if s in committed] if same_cache else []
        if not shards:
            shards = sorted(committed)
    missing = [s for s in shards if s not in committed]
    if missing:
        raise DflashError(f"--shards {missing[:5]}: not committed in {cache_path}")
    if max_shards is not None:
        shards = shards[:max_shards]
    return acceptance(drafter, cache, shards, dev)
