"""`dflash extract`: run a frozen target over a dataset once and write the hidden-state cache.

Flow (per rank): key -> (rank 0) plan + create, or resume -> windows of shards -> batched forwards into
a device buffer -> copy to (pinned) host -> writer thread writes the shards and their commit records
while the next window runs. A window is `window` consecutive shards; the windows still to do are
dealt round-robin to the ranks, so several torchrun ranks write one cache, each its own shards.
"""

from __future__ import annotations

import logging
import math
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import dflash
from dflash import cache as cachelib, fp8, logs
from dflash.config import ExtractConfig
from dflash.data import DROP_REASONS, Doc, Dropped, Tokenizer, file_fingerprints, read_rows
from dflash.dist import Dist, close_dist, init_dist
from dflash.errors import DflashError
from dflash.files import disk_full_is_an_error
from dflash.packing import PACKER, plan_shards
from dflash.target import (
    Target,
    check_layer_ids,
    config_hash,
    default_layer_ids,
    load_target,
    resolve_device,
    resolve_dtype,
    resolve_target,
    text_config,
    tokenizer_hash,
    weights_fingerprint,
)

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def extract(cfg: ExtractConfig) -> dict:
    """Extract (or resume) the cache described by `cfg`; returns a summary of what this rank did."""
    d = init_dist()
    try:
        with disk_full_is_an_error(cfg.out, lambda: cachelib.committed_note(Path(cfg.out))), \
                logs.where(lambda: stop_note(Path(cfg.out))):
            return _extract(cfg, d)
    finally:
        close_dist()


def _extract(cfg: ExtractConfig, d: Dist) -> dict:
    out = Path(cfg.out)
    if cfg.device_map and d.world > 1:
        raise DflashError("--device-map spreads one target over this machine's GPUs: run one process, not torchrun")
    if d.is_main:
        cachelib.check_writable(out)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    target_path = resolve_target(cfg.target, cfg.trust_remote_code)
    config, tokenizer = _load_config_and_tokenizer(target_path, cfg.trust_remote_code)
    tconf = text_config(config)
    layer_ids = check_layer_ids(cfg.layers, tconf.num_hidden_layers) if cfg.layers else \
        default_layer_ids(tconf.num_hidden_layers, cfg.draft_layers)

    docs: dict[int, Doc] = {}
    model = None
    if d.is_main:
        fields = _key_fields(cfg, config, tokenizer, target_path, layer_ids, dtype)
        existing = cachelib.read_manifest(out)
        if existing is not None:
            cachelib.check_same_key(out, existing, fields)
        else:
            docs, manifest_extra, plan_arrays = _plan(cfg, tokenizer, fields)
            model = _load_model(target_path, device, dtype, cfg)
            _create(out, cfg, fields, manifest_extra, plan_arrays, model, tconf, tokenizer)
            fill = manifest_extra["stats"]["tokens"] / (manifest_extra["num_shards"] * cfg.token_budget)
            log.info(f"planned {manifest_extra['num_shards']} shards of {cfg.token_budget} tokens (fill {fill:.1%})")
    d.barrier()

    cache = cachelib.Cache(out, mode="r+")
    committed = set(d.broadcast(cache.committed() if d.is_main else None))  # one view for every rank
    windows = _my_windows(cache.num_shards, committed, cfg.window, d)
    if not windows:  # this rank's shards are all committed (other ranks may still have work)
        if len(committed) == cache.num_shards:
            log.info(f"{out}: cache complete ({cache.num_shards} shards, key {cache.manifest.cache_key}): "
                     f"nothing to do")
        d.barrier()
        return {"shards_written": 0, "complete": len(committed) == cache.num_shards}
    if model is None:
        model = _load_model(target_path, device, dtype, cfg)
    docs = _docs_for(cfg, tokenizer, cache, windows, docs)
    target = Target(model, layer_ids, device=device)
    stats = _run(cfg, cache, committed, target, windows, docs, device, d)
    d.barrier()
    if d.is_main:
        done = len(cache.committed())
        log.info(f"{out}: {done}/{cache.num_shards} shards committed"
                 + (" (complete)" if done == cache.num_shards else ""))
    return stats


def stop_note(out: Path) -> str:
    """Where a stopped extract (or convert) leaves the cache at `out`: the line a stop (Ctrl-C, SIGTERM) prints,
    once the writes in flight are committed."""
    manifest = cachelib.read_manifest(out)
    if manifest is None:
        return "before the cache was created (nothing is committed); run the same command again: it starts over"
    total = manifest["num_shards"]
    done = {int(p.stem) for p in (out / cachelib.COMMITS).glob("*.json") if p.stem.isdigit()}
    first = next((s for s in range(total) if s not in done), total)
    return f"at shard {first} of {total} ({len(done)} committed); run the same command again: it resumes"


# -- key, plan, creation -------------------------------------------------------------------------------


def _load_config_and_tokenizer(path: Path, trust_remote_code: bool):
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise DflashError(f"--target {path}: cannot load config/tokenizer ({str(e).splitlines()[0]})") from None
    return config, tokenizer


def _key_fields(cfg, config, tokenizer, target_path, layer_ids, dtype) -> dict:
    tok_hash, template_hash = tokenizer_hash(tokenizer)
    files = file_fingerprints(cfg.data)
    return {
        "target_config_hash": config_hash(config),
        "target_weights": weights_fingerprint(target_path),
        "tokenizer_hash": tok_hash,
        "chat_template_hash": template_hash,
        "data_sha256": [f["sha256"] for f in files],
        "limit": cfg.limit,
        "layer_ids": layer_ids,
        "token_budget": cfg.token_budget,
        "max_docs": cfg.max_docs,
        "max_len": cfg.resolved_max_len(),
        "compute_dtype": _DTYPE_NAMES[dtype],
        **cachelib.storage_fields(cfg.storage, cfg.scale_block, text_config(config).hidden_size, cfg.last_hidden),
        "packer": PACKER,
        "_files": files,  # not a key field: carried into the manifest
    }


def _plan(cfg: ExtractConfig, tokenizer, fields: dict):
    """Tokenize every row and pack the documents into shards: the plan is fixed before any forward."""
    per_file: dict[str, int] = {}
    rows = list(read_rows(cfg.data, cfg.limit, per_file))
    if not rows:
        raise DflashError(f"--data {', '.join(cfg.data)}: no rows (empty dataset)")
    tok = Tokenizer(tokenizer, cfg.resolved_max_len())
    docs, dropped = {}, []
    for item in tqdm(tok(rows), total=len(rows), desc="tokenize", unit="row", disable=not sys.stderr.isatty(),
                     leave=False):
        if isinstance(item, Dropped):
            dropped.append(item)
        else:
            docs[item.row_id] = item
    if not docs:
        reasons = sorted({DROP_REASONS[x.reason] for x in dropped})
        raise DflashError(f"--data: all {len(rows)} rows were dropped ({', '.join(reasons)}); nothing to extract")
    row_ids = np.fromiter(docs, np.int64, len(docs))
    lengths = np.array([len(docs[r].input_ids) for r in row_ids], np.int64)
    plan = plan_shards(row_ids, lengths, cfg.token_budget, cfg.max_docs)
    truncated = np.array(sorted(r for r, doc in docs.items() if doc.truncated), np.int64)
    files, first = [], 0
    for f in fields["_files"]:
        n = per_file.get(f["path"], 0)
        files.append(dict(f, rows=n, first_row=first))
        first += n
    extra = {
        "num_shards": plan.num_shards,
        "data_files": files,
        "stats": {
            "rows": len(rows), "docs": len(docs), "tokens": int(lengths.sum()),
            "loss_tokens": int(sum(int(doc.loss_mask.sum()) for doc in docs.values())),
            "truncated": len(truncated),
            "dropped": {DROP_REASONS[i]: int(n) for i, n in
                        zip(*np.unique([x.reason for x in dropped], return_counts=True))} if dropped else {},
        },
    }
    if truncated.size:
        log.info(f"{len(truncated)} of {len(rows)} rows were longer than {cfg.resolved_max_len()} tokens and are "
                 f"truncated")
    if dropped:
        log.info(f"{len(dropped)} rows dropped: {extra['stats']['dropped']}")
    plan_arrays = (plan, np.array([x.row_id for x in dropped], np.int64),
                   np.array([x.reason for x in dropped], np.uint8), truncated)
    return docs, extra, plan_arrays


def _create(out: Path, cfg: ExtractConfig, fields: dict, extra: dict, plan_arrays, model, tconf, tokenizer) -> None:
    key_fields = {k: v for k, v in fields.items() if not k.startswith("_")}
    vocab = model.get_input_embeddings().weight.shape[0]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    manifest = {
        **key_fields,
        "cache_key": cachelib.cache_key(key_fields),
        "dflash_version": dflash.__version__,
        "target": {"name": cfg.target, "path": str(model.name_or_path), "revision": hub_revision(model.name_or_path),
                   "config_hash": key_fields["target_config_hash"],
                   "model_type": tconf.model_type, "num_layers": tconf.num_hidden_layers,
                   "architectures": getattr(model.config, "architectures", None)},
        "layer_convention": LAYER_CONVENTION,
        "hidden_size": tconf.hidden_size,
        "vocab_size": vocab,
        "pad_id": int(pad_id),
        "drop_reasons": list(DROP_REASONS),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if embed.is_meta or head.is_meta:
        raise DflashError("--device-map: the target's embeddings and LM head are offloaded to disk; map them to a GPU "
                          "or the CPU (the cache keeps a copy of both for training)")
    weights = {"embed_tokens.weight": embed.detach().to("cpu", torch.bfloat16),
               "lm_head.weight": head.detach().to("cpu", torch.bfloat16)}
    cachelib.create_cache(out, manifest, *plan_arrays, weights=weights, target_config=model.config.to_dict(),
                          compressor=cfg.compressor)


def _load_model(path, device, dtype, cfg):
    model, _ = load_target(path, device, dtype, cfg.trust_remote_code, cfg.attn_implementation, cfg.device_map,
                           cfg.experts_implementation)
    return model


# -- scheduling -----------------------------------------------------------------------------------------


def _my_windows(num_shards: int, committed: set[int], window: int, d: Dist) -> list[list[int]]:
    """This rank's share of the windows that still have an uncommitted shard: dealt round-robin, so a
    resumed run spreads what is left over every rank, whoever had it before."""
    windows = [list(range(k, min(k + window, num_shards))) for k in range(0, num_shards, window)]
    todo = [w for w in windows if any(s not in committed for s in w)]
    return todo[d.rank :: d.world]


def _docs_for(cfg, tokenizer, cache, windows, docs: dict[int, Doc]) -> dict[int, Doc]:
    """The documents of the given windows (tokenized again on resume / on other ranks), checked
    against the stored plan: a changed tokenizer or file must never write a shard silently wrong."""
    row_ids, doc_lens = cache.plan()
    shards = [s for w in windows for s in w]
    need = {int(r): int(n) for s in shards for r, n in zip(row_ids[s], doc_lens[s]) if r >= 0}
    missing = [r for r in need if r not in docs]
    if missing:
        wanted = set(missing)
        rows = [row for row in read_rows(cfg.data, cfg.limit) if row.row_id in wanted]
        for item in Tokenizer(tokenizer, cfg.resolved_max_len())(rows):
            if isinstance(item, Doc):
                docs[item.row_id] = item
    for r, n in need.items():
        if r not in docs or len(docs[r].input_ids) != n:
            raise DflashError(f"row {r}: its tokens no longer match the cache's plan (data or tokenizer changed?); "
                              f"use another --out")
    return docs


LAYER_CONVENTION = ("layer id i is the output of decoder layer i, i.e. Hugging Face's output_hidden_states[i + 1] "
                    "(the residual stream before the next layer); the last layer, id N-1, is taken after the "
                    "model's final norm, as hidden_states[N] (last_hidden_state) is, while vLLM and SGLang capture "
                    "it before the norm")


def hub_revision(path) -> str | None:
    """The commit of a target loaded from the Hugging Face cache (its snapshot folder's name), else None."""
    parts = Path(str(path)).resolve().parts
    if len(parts) >= 2 and parts[-2] == "snapshots" and len(parts[-1]) == 40:
        return parts[-1]
    return None


# -- what the states look like: the cache's proof that it holds states, not zeros or overflow -----------------

STAT_FIELDS = ("sum_squares", "abs_max", "zeros", "nonfinite")  # per layer and shard, over its real tokens


def add_state_stats(stats: torch.Tensor, shard_of: torch.Tensor, states: torch.Tensor) -> None:
    """Add tokens' states [n, H] (bf16, as stored) to the per-shard sums `stats` [W, 4] (float64): sum of
    squares of the finite values, largest finite |value|, exact zeros, non-finite values. On the device, no
    host sync."""
    x = states.float()
    finite = torch.isfinite(x)
    clean = torch.where(finite, x, 0.0)
    per_token = torch.stack([clean.pow(2).sum(-1), clean.abs().amax(-1), (x == 0).sum(-1),
                             (~finite).sum(-1)], -1).double()  # [n, 4]
    sums = per_token.clone()
    sums[:, 1] = 0  # the maximum is no sum
    stats.index_add_(0, shard_of, sums)
    stats[:, 1] = stats[:, 1].scatter_reduce(0, shard_of, per_token[:, 1], "amax")


def check_states(stats: np.ndarray, cache: cachelib.Cache, shard: int, nonfinite: str) -> dict:
    """One shard's per-layer statistics [L, 4] (then `last_hidden`'s, when stored: [L + 1, 4]) as its commit
    record keeps them, after the checks: a layer (or last_hidden) whose states hold a non-finite value (unless
    `--nonfinite warn`) or are all zero stops the extraction before the shard is committed, naming it and the
    shard."""
    m = cache.manifest
    tokens = int(cache.arrays["doc_lens"][shard].sum())
    names = [*map(str, m.layer_ids), *([cachelib.LAST_HIDDEN] if cache.has_last_hidden else [])]
    out = {}
    for (sum_sq, abs_max, zeros, bad), name in zip(stats.tolist(), names, strict=True):
        values = tokens * m.hidden_size
        what, module = (f"layer {name}", "layer") if name != cachelib.LAST_HIDDEN else (name, "final norm")
        if bad:
            message = (f"{what}'s states in shard {shard} hold {int(bad)} non-finite values (the target "
                       f"overflowed in {m.compute_dtype}?)")
            if nonfinite == "fail":
                raise DflashError(f"{message}: nothing of the shard was committed; --dtype fp32 may avoid it, "
                                  f"--nonfinite warn keeps them")
            log.warning(f"{message}; kept (--nonfinite warn)")
        if values and zeros == values:
            raise DflashError(f"{what}'s states in shard {shard} are all zero: the target's {module} was not "
                              f"captured (a hook on the wrong module?); nothing of the shard was committed")
        out[name] = {"sum_squares": sum_sq, "abs_max": abs_max, "zeros": int(zeros), "nonfinite": int(bad),
                     "values": values}
    return out


# A forward's fixed cost (launches, per-layer work that does not scale with rows), in padded tokens: the
# batching below trades one more forward for at least this much less padding.
FORWARD_COST_TOKENS = 1024


def make_batches(lengths: list[int], batch_size: int, batch_tokens: int) -> list[list[int]]:
    """Group documents into forwards of <= batch_size rows and <= batch_tokens padded tokens (rows x the
    longest row), each batch's longest row first. Documents are sorted by length and cut into
    consecutive batches that minimise padded tokens + FORWARD_COST_TOKENS per forward (exact, by
    dynamic programming over the cut points), so rows of similar length share a forward."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = [lengths[i] for i in order]  # descending
    cost = [0] + [math.inf] * len(n)  # cost[j]: the best cost of the first j documents
    start = [0] * (len(n) + 1)  # start[j]: where the last batch of that best split begins
    for j in range(1, len(n) + 1):
        for i in range(j - 1, max(j - batch_size, 0) - 1, -1):  # the last batch is documents i..j-1
            if (j - i) * n[i] > batch_tokens and i < j - 1:
                break  # wider rows only get worse (one row always fits: batch_tokens >= any length)
            c = cost[i] + (j - i) * n[i] + FORWARD_COST_TOKENS
            if c < cost[j]:
                cost[j], start[j] = c, i
    batches, j = [], len(n)
    while j > 0:
        batches.append(order[start[j] : j])
        j = start[j]
    return batches[::-1]


# -- the extraction loop --------------------------------------------------------------------------------


@dataclass
class _Slot:
    """One ring entry: the device buffers a window is computed into, and their host copies."""

    # the states: the captured layers, then (`--last-hidden`) the last hidden state after the final norm
    hidden: torch.Tensor  # [L(+1), W, T, H] on the device: bf16, or e4m3 bits (uint8) with fp8 storage
    target_ids: torch.Tensor  # [W, T] int32 on the device
    scale: torch.Tensor | None  # fp8 storage: [L(+1), W, T, G] bf16 on the device
    stats: torch.Tensor  # [L(+1), W, 4] float64 on the device: per state and shard, `state_stats` of its states
    host: dict  # the same tensors by name, in pinned host memory (the device tensors themselves on CPU)
    copied: torch.cuda.Event | None = None  # CUDA: the window's device-to-host copy is done
    batches: list = field(default_factory=list)  # CUDA: (start, end) events around each forward

    def device_tensors(self) -> dict:
        return {"hidden": self.hidden, "target_ids": self.target_ids, "hidden_scale": self.scale,
                "stats": self.stats}


def _make_slot(L, W, T, H, device, scale_block: int | None) -> _Slot:
    fp8_storage = scale_block is not None
    hidden = torch.zeros(L, W, T, H, dtype=torch.uint8 if fp8_storage else torch.bfloat16, device=device)
    scale = torch.zeros(L, W, T, fp8.num_groups(H, scale_block), dtype=fp8.SCALE_DTYPE, device=device) \
        if fp8_storage else None
    stats = torch.zeros(L, W, len(STAT_FIELDS), dtype=torch.float64, device=device)
    slot = _Slot(hidden, torch.zeros(W, T, dtype=torch.int32, device=device), scale, stats, {})
    if device.type == "cpu":
        slot.host = slot.device_tensors()
    else:
        slot.host = {k: None if t is None else torch.empty_like(t, device="cpu").pin_memory()
                     for k, t in slot.device_tensors().items()}
        slot.copied = torch.cuda.Event()
    return slot


class _Writer(threading.Thread):
    """Writes finished windows while the main thread computes the next one."""

    def __init__(self, cache: cachelib.Cache, committed: set[int], free: queue.Queue, on_commit, write_threads: int,
                 nonfinite: str = "fail"):
        super().__init__(daemon=True, name="dflash-writer")
        self.cache, self.committed, self.free, self.on_commit = cache, committed, free, on_commit
        self.nonfinite = nonfinite
        self.pool = ThreadPoolExecutor(write_threads, thread_name_prefix="dflash-write")
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.write_s = self.gpu_forward_s = 0.0

    def run(self):
        with self.pool:
            self._loop()

    def _loop(self):
        while (job := self.jobs.get()) is not None:
            slot, shards, input_ids, loss_mask = job
            try:
                if self.error is None:
                    self._write(slot, shards, input_ids, loss_mask)
            except BaseException as e:  # surfaced to the main thread by check()
                self.error = e
            finally:
                self.free.put(slot)

    def _write(self, slot: _Slot, shards, input_ids, loss_mask):
        if slot.copied is not None:
            slot.copied.synchronize()  # host sync: the window's D2H copy has landed
            self.gpu_forward_s += sum(a.elapsed_time(b) for a, b in slot.batches) / 1e3
            slot.batches.clear()
        t1 = time.perf_counter()
        hidden = fp8.to_bits(slot.host["hidden"])  # [L(+1), W, T, H]: bf16 bits (uint16) or e4m3 bits (uint8)
        scale = None if slot.scale is None else fp8.to_bits(slot.host["hidden_scale"])  # [L(+1), W, T, G]
        target_ids = slot.host["target_ids"].numpy()
        stats = slot.host["stats"].numpy()  # [L(+1), W, 4]
        L = len(self.cache.manifest.layer_ids)  # the state past them is last_hidden
        last = self.cache.has_last_hidden
        for w, s in enumerate(shards):
            if s in self.committed:
                continue  # committed before a crash: the window was recomputed, the shard is not rewritten
            shard_stats = check_states(stats[:, w], self.cache, s, self.nonfinite)
            self.cache.write_shard(s, hidden[:L, w], input_ids[w], loss_mask[w], target_ids[w], self.pool,
                                   hidden_scale=None if scale is None else scale[:L, w], state_stats=shard_stats,
                                   last_hidden=hidden[L, w] if last else None,
                                   last_hidden_scale=scale[L, w] if last and scale is not None else None)
            self.on_commit(s)
        self.write_s += time.perf_counter() - t1

    def check(self):
        if self.error is not None:
            raise self.error


def _run(cfg: ExtractConfig, cache: cachelib.Cache, committed: set[int], target: Target, windows, docs, device,
         d: Dist) -> dict:
    m = cache.manifest
    T, L, H, W = m.token_budget, len(m.layer_ids), m.hidden_size, cfg.window
    pad = m.pad_id
    row_ids, doc_lens = cache.plan()
    todo = [s for w in windows for s in w if s not in committed]
    bar = tqdm(total=int(doc_lens[todo].sum()), unit="tok", unit_scale=True, desc=f"extract {Path(cfg.out).name}",
               disable=not d.is_main, dynamic_ncols=True, smoothing=0.1)
    done = {"shards": 0, "rows": 0}

    def on_commit(s):  # writer thread
        done["shards"] += 1
        done["rows"] += int((row_ids[s] >= 0).sum())
        bar.update(int(doc_lens[s].sum()))
        bar.set_postfix_str(f"shards {done['shards']}/{len(todo)} rows {done['rows']}", refresh=False)

    free: queue.Queue = queue.Queue()
    for _ in range(2):  # two slots: window k+1 computes while window k is copied and written
        free.put(_make_slot(L + int(cache.has_last_hidden), W, T, H, device, cache.scale_block))
    writer = _Writer(cache, committed, free, on_commit, cfg.write_threads, cfg.nonfinite)
    writer.start()
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    t_start, wait_free_s, tokens, padded = time.perf_counter(), 0.0, 0, 0
    try:
        for shards in windows:
            t0 = time.perf_counter()
            slot = free.get()  # blocks while both slots wait for the writer: the disk is the bottleneck
            wait_free_s += time.perf_counter() - t0
            writer.check()
            input_ids, loss_mask, n_real, n_padded = _compute_window(target, slot, shards, row_ids, doc_lens, docs,
                                                                     T, pad, cfg, device, cache.scale_block,
                                                                     cache.has_last_hidden)
            tokens, padded = tokens + n_real, padded + n_padded
            if copy_stream is not None:
                copy_stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(copy_stream):
                    for name, t in slot.device_tensors().items():
                        if t is not None:
                            slot.host[name].copy_(t, non_blocking=True)
                    slot.copied.record(copy_stream)
            writer.jobs.put((slot, shards, input_ids, loss_mask))
    finally:
        writer.jobs.put(None)
        writer.join()
        bar.close()
    writer.check()
    elapsed = time.perf_counter() - t_start
    stats = {"shards_written": done["shards"], "tokens": tokens, "padded_tokens": padded, "seconds": elapsed,
             "tokens_per_s": tokens / elapsed if elapsed else 0.0, "wait_for_writer_s": wait_free_s,
             "write_s": writer.write_s, "gpu_forward_s": writer.gpu_forward_s, "complete": False}
    log.info(f"wrote {done['shards']} shards, {tokens:,} tokens in {elapsed:.1f}s ({stats['tokens_per_s']:,.0f} tok/s"
             + (f" on rank 0 of {d.world}" if d.world > 1 else "") + f"; padding {padded / max(tokens, 1) - 1:.1%}; "
             f"waited {wait_free_s:.1f}s for the writer)")
    return stats


def _compute_window(target: Target, slot: _Slot, shards, row_ids, doc_lens, docs, T, pad, cfg, device,
                    scale_block: int | None, last_hidden: bool = False):
    """Run every document of the window's shards through the target and place its states in the slot (with
    `last_hidden`, the final norm's output after the captured layers).
    Returns the window's host input_ids / loss_mask [W, T], its real and its padded token counts."""
    W = len(shards)
    input_ids = np.full((cfg.window, T), pad, np.int32)
    loss_mask = np.zeros((cfg.window, T), np.uint8)
    placed = []  # (doc, flat destination offset in the [W*T] window)
    for w, s in enumerate(shards):
        offset = 0
        for r, n in zip(row_ids[s], doc_lens[s]):
            if r < 0:
                continue
            doc = docs[int(r)]
            input_ids[w, offset : offset + n] = doc.input_ids
            loss_mask[w, offset : offset + n] = doc.loss_mask
            placed.append((doc, w * T + offset))
            offset += n
        slot.hidden[:, w, offset:].zero_()  # pad positions hold zeros (the slot is reused)
        slot.stats[:, w].zero_()
        if slot.scale is not None:
            slot.scale[:, w, offset:].zero_()
        slot.target_ids[w, offset:] = pad
    hidden_flat = slot.hidden.view(slot.hidden.shape[0], -1, slot.hidden.shape[-1])  # [L, W*T, H]
    scale_flat = None if slot.scale is None else slot.scale.view(slot.scale.shape[0], -1, slot.scale.shape[-1])
    target_flat = slot.target_ids.view(-1)
    lengths = [len(doc.input_ids) for doc, _ in placed]
    padded = 0
    for batch in make_batches(lengths, cfg.batch_size, cfg.batch_tokens):
        width = lengths[batch[0]]
        padded += width * len(batch)
        ids = np.full((len(batch), width), pad, np.int64)  # right-padded rows
        src, dst = [], []
        for b, i in enumerate(batch):
            doc, offset = placed[i]
            n = lengths[i]
            ids[b, :n] = doc.input_ids
            src.append(np.arange(b * width, b * width + n))
            dst.append(np.arange(offset, offset + n))
        if device.type == "cuda":
            slot.batches.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            slot.batches[-1][0].record()
        src_t = torch.from_numpy(np.concatenate(src)).to(device, non_blocking=True)  # [n_real]
        dst_t = torch.from_numpy(np.concatenate(dst)).to(device, non_blocking=True)
        hidden, last = target.forward(torch.from_numpy(ids).to(device, non_blocking=True))
        shard_of = dst_t // T  # [n_real] the window's shard each token lands in
        # the slot's states: the captured layers, then last_hidden (what the LM head reads) when stored
        for layer, h in enumerate([*hidden, last] if last_hidden else hidden):  # h: [b, width, H]
            states = h.reshape(-1, h.shape[-1]).index_select(0, src_t).to(torch.bfloat16)  # [n_real, H]
            add_state_stats(slot.stats[layer], shard_of, states)
            if scale_flat is None:
                hidden_flat[layer].index_copy_(0, dst_t, states)
            else:  # quantised here, on the device, before the copy to the host: half the bytes to move
                # (from the bf16-rounded states, so `dflash cache convert` of a bf16 cache gives the same bytes)
                q, scale = fp8.quantize(states, scale_block)
                hidden_flat[layer].index_copy_(0, dst_t, q)
                scale_flat[layer].index_copy_(0, dst_t, scale)
        greedy = target.greedy(last.reshape(-1, last.shape[-1]).index_select(0, src_t))
        target_flat.index_copy_(0, dst_t, greedy.to(torch.int32))
        if device.type == "cuda":
            slot.batches[-1][1].record()
    return input_ids[:W], loss_mask[:W], sum(lengths), padded
