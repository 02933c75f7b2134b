"""`dflash cache verify --recompute N`: rerun the target on documents of a cache and compare the states.

Checksums prove that a cache holds the bytes it was written with; this proves the bytes are the target's
states. N documents are sampled across the committed shards (one stratum of shards each), their cached
tokens run through the target alone, and every cached layer is compared with the recomputed one, after the
storage's own rounding (bf16, or the same fp8 quantisation): the relative error |cached - recomputed| /
|recomputed| over the document; a cache that stores `last_hidden` has it compared with the final norm's output
likewise. A state that does not match is also compared with every other layer of the target and with the last
layer before the final norm, so that a cache captured one layer off or on the other side of the norm says so.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from dflash import fp8
from dflash.cache import LAST_HIDDEN, Cache
from dflash.config import RecomputeConfig
from dflash.errors import DflashError
from dflash.target import (
    Target,
    config_hash,
    decoder_layers,
    load_target,
    resolve_device,
    resolve_dtype,
    resolve_target,
    text_config,
    weights_fingerprint,
)

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
PRE_NORM = "before the final norm"  # the key of the last layer's pre-norm output among the candidates


def sample_documents(cache: Cache, n: int, seed: int) -> list[tuple[int, int]]:
    """(shard, document index) of `n` documents: the committed shards cut into n equal strata, a random
    document of a random shard of each (fewer shards than n: several documents of a shard, none twice)."""
    shards = cache.committed()
    if not shards:
        raise DflashError(f"{cache.path}: no committed shard to recompute")
    rng = np.random.default_rng(seed)
    _, doc_lens = cache.plan()
    docs = {s: [j for j, length in enumerate(doc_lens[s]) if length > 0] for s in shards}
    n = min(n, sum(map(len, docs.values())))
    picked: list[tuple[int, int]] = []
    for k in range(n):
        lo, hi = k * len(shards) // n, max((k + 1) * len(shards) // n, k * len(shards) // n + 1)
        stratum = [s for s in shards[lo:hi] if docs[s]] or [s for s in shards if docs[s]]
        s = stratum[int(rng.integers(len(stratum)))]
        j = docs[s].pop(int(rng.integers(len(docs[s]))))
        picked.append((s, j))
    return sorted(picked)


def relative_error(cached: torch.Tensor, recomputed: torch.Tensor) -> float:
    """|cached - recomputed| / |recomputed| over a document's tokens (Frobenius norms, fp32)."""
    return ((cached.float() - recomputed.float()).norm() / recomputed.float().norm().clamp_min(1e-30)).item()


def as_stored(states: torch.Tensor, scale_block: int | None) -> torch.Tensor:
    """Recomputed states [n, H] with the storage's rounding: bf16, or fp8 quantised as extraction does (from
    the bf16-rounded states)."""
    x = states.to(torch.bfloat16)
    if scale_block is None:
        return x.float()
    q, scale = fp8.quantize(x, scale_block)
    return fp8.dequantize(q, scale, scale_block, torch.float32)


def _load(cfg: RecomputeConfig, cache: Cache):
    """The target (model, path) for the cache, checked against the manifest: same widths, the cache's
    layers present. A different config or weights is said, not refused: the states decide."""
    from transformers import AutoConfig

    m = cache.manifest
    name = cfg.target or m.target.path
    if not cfg.target and not Path(name).is_dir():
        name = m.target.name or name  # the recorded folder is gone: its hub id, if any
    path = resolve_target(name, cfg.trust_remote_code)
    config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    tconf = text_config(config)
    if tconf.hidden_size != m.hidden_size:
        raise DflashError(f"--target {path}: hidden size {tconf.hidden_size}, the cache's states have "
                          f"{m.hidden_size}: not the target of this cache")
    beyond = [i for i in m.layer_ids if i >= tconf.num_hidden_layers]
    if beyond:
        raise DflashError(f"--target {path}: {tconf.num_hidden_layers} layers, the cache holds layers {beyond}")
    if config_hash(config) != m.target_config_hash:
        log.warning(f"--target {path}: its config differs from the one the cache was extracted with")
    elif weights_fingerprint(path) != m.target_weights:
        log.warning(f"--target {path}: its weight files differ from those the cache was extracted with")
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(_DTYPES[m.compute_dtype] if cfg.dtype == "auto" else cfg.dtype, device)
    model, _ = load_target(path, device, dtype, cfg.trust_remote_code, device_map=cfg.device_map,
                           experts_implementation=cfg.experts_implementation)
    return model, path, dtype


class _PreNormHook:
    """The last decoder layer's output before the final norm (the layer id servers capture as the last)."""

    def __init__(self, model, num_layers: int):
        self.state = None
        decoder_layers(model, num_layers)[-1].register_forward_hook(self)

    def __call__(self, module, args, output):
        self.state = output[0] if isinstance(output, tuple) else output


def recompute(path: str | Path, cfg: RecomputeConfig, progress=None) -> dict:
    """Recompute `cfg.recompute` documents of the cache at `path`; returns what matched and what did not:
    {"documents": [...], "layers": {id: largest error}, "mismatches": [...], ...}. Never raises on a mismatch."""
    cache = Cache(path)
    m = cache.manifest
    picked = sample_documents(cache, cfg.recompute, cfg.seed)
    model, target_path, dtype = _load(cfg, cache)
    num_layers = text_config(model.config).num_hidden_layers
    target = Target(model, list(range(num_layers)))  # every layer: a mismatch is compared with all of them
    pre_norm = _PreNormHook(model, num_layers)
    scale_block = cache.scale_block
    documents, mismatches = [], []
    names = [*map(str, m.layer_ids), *([LAST_HIDDEN] if cache.has_last_hidden else [])]  # the states compared
    worst = {name: 0.0 for name in names}
    by_shard: dict[int, list[int]] = {}
    for s, j in picked:
        by_shard.setdefault(s, []).append(j)
    steps = [(s, j) for s in sorted(by_shard) for j in by_shard[s]]
    shard = None
    for s, j in progress(steps) if progress else steps:
        if shard is None or shard.index != s:
            shard = cache.read_shard(s, verify=True, last_hidden=cache.has_last_hidden)
        start, n = int(shard.doc_lens[:j].sum()), int(shard.doc_lens[j])
        ids = torch.from_numpy(shard.input_ids[start : start + n].astype(np.int64))[None]  # [1, n]
        hidden, last = target.forward(ids)  # num_layers x [1, n, H]
        raw = {**{str(i): h[0] for i, h in enumerate(hidden)}, PRE_NORM: pre_norm.state[0].to(target.device)}
        layers = cache.states(shard, target.device, torch.float32)[start : start + n]  # [n, L, H]
        cached = dict(zip(map(str, m.layer_ids), layers.unbind(1), strict=True))  # each [n, H]
        if cache.has_last_hidden:  # the state after the final norm: the last layer's, as Target returns it
            cached[LAST_HIDDEN] = cache.last_states(shard, target.device, torch.float32)[start : start + n]
        recomputed = {name: raw[name] if name != LAST_HIDDEN else last[0] for name in names}  # each [n, H]
        greedy = target.greedy(last[0]).cpu().numpy()
        doc = {"shard": s, "document": j, "row": int(shard.row_ids[j]), "tokens": n,
               "target_ids_agree": float((greedy == shard.target_ids[start : start + n]).mean()),
               "errors": {}}
        for name in names:
            err = relative_error(cached[name], as_stored(recomputed[name], scale_block))
            doc["errors"][name] = err
            worst[name] = max(worst[name], err)
            if err > cfg.tolerance:
                best, best_err = min(((k, relative_error(cached[name], as_stored(v, scale_block)))
                                      for k, v in raw.items()), key=lambda kv: kv[1])
                layer = name if name == LAST_HIDDEN else int(name)
                mismatches.append({"shard": s, "document": j, "row": doc["row"], "layer": layer, "error": err,
                                   "closest": best if best_err <= cfg.tolerance else None, "closest_error": best_err})
        documents.append(doc)
    return {"target": str(target_path), "device": str(target.device), "dtype": str(dtype).removeprefix("torch."),
            "tolerance": cfg.tolerance, "documents": documents, "layers": worst, "mismatches": mismatches,
            "target_ids_agree": float(np.mean([d["target_ids_agree"] for d in documents]))}


# Below this share of the cached greedy predictions (`target_ids`, the labels of `--labels target`) agreeing
# with the recomputed ones, they are reported as wrong; near-ties may flip between dtypes, never this many.
TARGET_IDS_AGREE = 0.9


def describe(mismatch: dict, tolerance: float) -> str:
    """One line for a mismatch: where, how far, and which state the cached one is instead, if any."""
    last = mismatch["layer"] == LAST_HIDDEN
    where = (f"shard {mismatch['shard']}, document {mismatch['document']} (row {mismatch['row']}), "
             + (LAST_HIDDEN if last else f"layer {mismatch['layer']}"))
    line = f"{where}: relative error {mismatch['error']:.3g} > {tolerance:g}"
    closest = mismatch["closest"]
    if closest == PRE_NORM:
        return line + (f"; it matches the last layer {PRE_NORM} ({mismatch['closest_error']:.3g}): dflash takes "
                       f"{LAST_HIDDEN if last else 'the last layer'} after it")
    if closest is not None and last:
        return line + f"; it matches layer {closest} ({mismatch['closest_error']:.3g}), not the final norm's output"
    if closest is not None:
        return line + (f"; it matches layer {closest} ({mismatch['closest_error']:.3g}): captured "
                       f"{int(closest) - mismatch['layer']:+d} layer(s) off?")
    return line + "; no layer of this target matches (another target, other weights, or other tokens)"
