"""`dflash eval`: offline acceptance length of a drafter on cached shards.

For every valid anchor of the evaluated shards, the drafter proposes B-1 tokens greedily; they are
accepted while they equal the target's own greedy predictions (`target_ids`, recorded at extraction).
tau = mean accepted + 1 (the target's bonus token), as speculative decoding would count it per block.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash import checkpoint
from dflash.cache import Cache
from dflash.drafter import Drafter, DrafterConfig
from dflash.errors import DflashError
from dflash.objective import eager_attention, layout, valid_anchors


def read_drafter(path: str | Path) -> tuple[DrafterConfig, dict, dict]:
    """(config, weights, info) of a training run folder (latest checkpoint) or an exported HF folder;
    info names a run's held-out shards and cache key."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        raise DflashError(f"--drafter {path}: no config.json (not a run or an exported drafter)") from None
    if "drafter" in config:  # a training run
        ckpt = checkpoint.latest(path)
        if ckpt is None:
            raise DflashError(f"--drafter {path}: the run has no checkpoint yet")
        info = {"holdout_shards": config.get("holdout_shards", []), "cache_key": config["cache"]["cache_key"]}
        return DrafterConfig(**config["drafter"]), checkpoint.load_weights(ckpt), info
    return drafter_config_from_export(config, path), load_file(str(path / "model.safetensors")), \
        {"holdout_shards": [], "cache_key": None}


def load_drafter(path: str | Path, embed: torch.Tensor, head: torch.Tensor, available_layers: list[int] | None = None,
                 device="cpu") -> tuple[Drafter, dict]:
    """A drafter from a training run folder or an exported HF folder (`read_drafter`), on the target's
    embeddings and head [V, H] (from a cache or from the target itself). Returns (drafter, info)."""
    dcfg, weights, info = read_drafter(path)
    vocab, hidden = embed.shape
    if dcfg.hidden_size != hidden or dcfg.vocab_size != vocab:
        raise DflashError(f"--drafter {path}: hidden {dcfg.hidden_size} / vocab {dcfg.vocab_size} do not match the "
                          f"cache's target (hidden {hidden}, vocab {vocab})")
    missing = [i for i in dcfg.target_layer_ids if available_layers is not None and i not in available_layers]
    if missing:
        raise DflashError(f"--drafter {path} reads target layers {missing} that the cache does not hold "
                          f"(it holds {available_layers})")
    drafter = Drafter(dcfg, embed, head).to(device)
    copy_weights(drafter, weights, f"--drafter {path}")
    return drafter.to(embed.dtype).eval(), info


@torch.no_grad()
def copy_weights(drafter: Drafter, weights: dict, what: str) -> None:
    for name, p in drafter.named_parameters():
        if name not in weights:
            raise DflashError(f"{what}: weights lack {name}")
        p.copy_(weights[name].to(p.dtype))


def drafter_config_from_export(config: dict, path) -> DrafterConfig:
    d = config.get("dflash_config") or {}
    if "target_layer_ids" not in d:
        raise DflashError(f"--drafter {path}: config.json has no dflash_config (not a DFlash drafter)")
    return DrafterConfig(num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
                         intermediate_size=config["intermediate_size"], num_attention_heads=config["num_attention_heads"],
                         num_key_value_heads=config["num_key_value_heads"],
                         head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                         rms_norm_eps=config["rms_norm_eps"],
                         rope_theta=(config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta", 1e6),
                         block_size=config["block_size"], target_layer_ids=d["target_layer_ids"],
                         mask_token_id=d["mask_token_id"], vocab_size=config["vocab_size"],
                         max_position_embeddings=config.get("max_position_embeddings", 40960))


@torch.inference_mode()
def acceptance(drafter: Drafter, cache: Cache, shards: list[int], device, anchors_per_pass: int = 256,
               head_chunk: int = 1024) -> dict:
    """Greedy acceptance of the drafter against the target's recorded choices, on `shards` (cache opened
    with the drafter's layers). Every valid anchor is drafted once (a block's draft depends only on its
    anchor and the context before it); then:

    - `tau`, `per_slot`: decoding order, as `dflash spec` counts. Each document is replayed from its first
      trained position: a cycle drafts at anchor p, accepts a tokens, and the next cycle starts at
      p + a + 1 (the target's bonus token). On a cache of the target's own greedy answers this is the
      online tau, up to the bf16 rounding of the stored states.
    - `tau_anchors`, `per_slot_anchors`: the mean over every anchor. Higher on repetitive text: decoding
      spends more cycles where the drafter fails, since each failure starts one."""
    B = drafter.cfg.block_size
    head = drafter.head_weight  # states are cast to its dtype, never the [V, H] head to theirs
    per_anchor, cycles = [], []  # accepted drafts at every valid anchor / per replayed cycle
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
            attend = eager_attention(anchors, lay, B)
            h = drafter(ctx, lay.pos, ids.reshape(-1), pos.reshape(-1), attend, ctx_kv=ctx_kv)
            h = h.view(len(anchors), B, -1)[:, 1:].reshape(-1, h.shape[-1])
            pred = torch.cat([(h[j : j + head_chunk].to(head.dtype) @ head.t()).argmax(-1)
                              for j in range(0, h.shape[0], head_chunk)]).view(len(anchors), B - 1)
            label_pos = anchors[:, None] + k  # the token slot k drafts; target_ids[t-1] is the target's choice
            inside = label_pos < lay.doc_end[anchors][:, None]
            match = ((pred == target_ids[(label_pos - 1).clamp(max=T - 1)]) & inside).long().cumprod(1)
            accepted_at[anchors.cpu()] = match.sum(1).cpu()  # host sync: eval only
        per_anchor += accepted_at[accepted_at >= 0].tolist()
        cycles += replay_cycles(accepted_at, lay.doc_end.cpu())
    if not per_anchor:
        raise DflashError("no valid anchor in the evaluated shards")
    per_slot, per_slot_anchors = by_slot(cycles, B), by_slot(per_anchor, B)
    return {"tau": 1.0 + sum(per_slot), "per_slot": per_slot, "tau_anchors": 1.0 + sum(per_slot_anchors),
            "per_slot_anchors": per_slot_anchors, "cycles": len(cycles), "blocks": len(per_anchor), "shards": shards,
            "block_size": B}


def by_slot(accepted: list[int], block_size: int) -> list[float]:
    """Per draft slot k = 1..B-1, the share of blocks that accepted at least k drafts (tau = 1 + their sum)."""
    return [sum(a >= k for a in accepted) / max(len(accepted), 1) for k in range(1, block_size)]


def replay_cycles(accepted_at: torch.Tensor, doc_end: torch.Tensor) -> list[int]:
    """Decoding order over one shard: accepted_at [T] (-1 where no anchor is valid), doc_end [T]. From each
    document's first valid anchor, a cycle at p accepts a = accepted_at[p] drafts and the next starts at
    p + a + 1, or at the next valid anchor (past an untrained span: a user turn)."""
    acc, end = accepted_at.tolist(), doc_end.tolist()
    out, p = [], 0
    while p < len(acc):
        if acc[p] < 0:
            p += 1
            continue
        out.append(acc[p])
        nxt = p + acc[p] + 1
        p = nxt if nxt < end[p] else end[p]  # the next document starts from its own first anchor
    return out


def evaluate(drafter_path: str, cache_path: str, shards: list[int] | None = None, device: str = "auto",
             max_shards: int | None = None) -> dict:
    from dflash.target import resolve_device

    dev = resolve_device(device)
    probe = Cache(cache_path)
    embed, head = probe.target_weights(dev, torch.float32 if dev.type == "cpu" else torch.bfloat16)
    drafter, info = load_drafter(drafter_path, embed, head, probe.manifest["layer_ids"], dev)
    cache = Cache(cache_path, layers=drafter.cfg.target_layer_ids)
    committed = set(cache.committed())
    if shards is None:
        same_cache = info["cache_key"] == cache.manifest["cache_key"]
        shards = [s for s in info["holdout_shards"] if s in committed] if same_cache else []
        if not shards:
            shards = sorted(committed)
    missing = [s for s in shards if s not in committed]
    if missing:
        raise DflashError(f"--shards {missing[:5]}: not committed in {cache_path}")
    if max_shards is not None:
        shards = shards[:max_shards]
    return acceptance(drafter, cache, shards, dev)
