"""`dflash cache convert`: rewrite a bf16 cache with fp8 storage, without the target.

The new cache has the source's plan, tokens, predictions, weights and target config; only the states
(`hidden`, and `last_hidden` where the source has it) are re-encoded (e4m3 + scales, as `dflash extract
--storage fp8` writes them from the same bf16 states), so
its key differs from the source's by the storage fields alone. Every source shard is checked against
its commit record as it is read; the source is opened read-only. Shards are committed one by one, so a
killed conversion resumes where it stopped.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

from tqdm.auto import tqdm

import dflash
from dflash import cache as cachelib, fp8, logs
from dflash.config import ExtractConfig, check_storage
from dflash.errors import DflashError
from dflash.files import disk_full_is_an_error
from dflash.target import resolve_device

log = logging.getLogger(__name__)


def convert(src: str | Path, out: str | Path, *, storage: str = "fp8", scale_block: int = ExtractConfig.scale_block,
            device: str = "auto", write_threads: int = ExtractConfig.write_threads) -> dict:
    """Convert the committed shards of `src` into the cache at `out` (created, or resumed); returns a summary."""
    from dflash.extract import stop_note

    with disk_full_is_an_error(out, lambda: cachelib.committed_note(Path(out))), \
            logs.where(lambda: stop_note(Path(out))):
        return _convert(src, Path(out), storage, scale_block, device, write_threads)


def _convert(src, out: Path, storage: str, scale_block: int, device: str, write_threads: int) -> dict:
    check_storage(storage, scale_block)
    if storage != "fp8":
        raise DflashError(f"--storage {storage}: only fp8 is a conversion target")
    src_cache = cachelib.Cache(src)
    if src_cache.fp8:
        raise DflashError(f"{src}: already an fp8 cache (storage {src_cache.manifest.storage_dtype})")
    if out.exists() and out.resolve() == src_cache.path.resolve():
        raise DflashError(f"--out {out}: is the source cache; convert writes a new one")
    cachelib.check_writable(out)
    manifest = converted_manifest(src_cache, storage, scale_block)
    existing = cachelib.read_manifest(out)
    if existing is None:
        _create(out, src_cache, manifest)
        log.info(f"created {out} (key {manifest['cache_key']}) from {src} (key {src_cache.manifest.cache_key})")
    else:
        cachelib.check_same_key(out, existing, manifest)
    dst = cachelib.Cache(out, mode="r+")
    done = set(dst.committed())
    src_committed = src_cache.committed()
    todo = [s for s in src_committed if s not in done]
    dev = resolve_device(device)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(write_threads, thread_name_prefix="dflash-convert") as pool:
        for s in tqdm(todo, desc=f"convert {out.name}", unit="shard", dynamic_ncols=True):
            _convert_shard(src_cache, dst, s, dev, pool)
    seconds = time.perf_counter() - t0
    missing = src_cache.num_shards - len(src_committed)
    committed = len(done) + len(todo)
    log.info(f"{out}: converted {len(todo)} shards in {seconds:.1f}s; {committed}/{dst.num_shards} committed"
             + (f" ({missing} shards of {src} are not committed yet: run convert again once they are)"
                if missing else ""))
    return {"shards_converted": len(todo), "seconds": seconds, "complete": committed == dst.num_shards}


def converted_manifest(src: cachelib.Cache, storage: str, scale_block: int) -> dict:
    """The source's manifest with the new storage, hence a new key."""
    m = {k: v for k, v in src.manifest.to_dict().items()
         if k not in ("cache_key", "weights_sha256", "scale_block", "last_hidden")}
    m.update(cachelib.storage_fields(storage, scale_block, m["hidden_size"], src.has_last_hidden))
    m["cache_key"] = cachelib.cache_key(m)
    m["created_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    m["dflash_version"] = dflash.__version__
    m["converted_from"] = {"path": str(src.path.resolve()), "cache_key": src.manifest.cache_key}
    return m


def _create(out: Path, src: cachelib.Cache, manifest: dict) -> None:
    from dflash.files import load_tensors

    row_ids, doc_lens = src.plan()
    g = src.group
    codecs = src.arrays["hidden"].metadata.codecs
    compressor = "zstd" if any(type(c).__name__ == "ZstdCodec" for c in codecs) else "none"
    cachelib.create_cache(out, manifest, SimpleNamespace(row_ids=row_ids, doc_lens=doc_lens),
                          g["dropped_row_ids"][:], g["dropped_reasons"][:], g["truncated_row_ids"][:],
                          weights=load_tensors(src.path / cachelib.WEIGHTS_FILE, "the source's target weights"),
                          target_config=json.loads((src.path / cachelib.TARGET_CONFIG_FILE).read_text()),
                          compressor=compressor)


def _convert_shard(src: cachelib.Cache, dst: cachelib.Cache, s: int, device, pool) -> None:
    # a corrupt source shard stops the conversion, named
    shard = src.read_shard(s, verify=True, last_hidden=src.has_last_hidden)

    def quantize(bits):  # [T, H] bf16 bits -> e4m3 bits [T, H], scale bits [T, G]
        q, scale = fp8.quantize(fp8.bf16_from_bits(bits).to(device), dst.scale_block)
        return q.cpu().numpy(), fp8.to_bits(scale.cpu())

    buffers = dst.layer_buffers()  # [L, T, H] e4m3 bits, [L, T, G] scale bits
    for layer in range(shard.hidden.shape[1]):  # one layer at a time: bounded memory on any device
        buffers["hidden"][layer], buffers["hidden_scale"][layer] = quantize(shard.hidden[:, layer])
    last, last_scale = quantize(shard.last_hidden) if src.has_last_hidden else (None, None)
    dst.write_shard(s, buffers["hidden"], shard.input_ids, shard.loss_mask, shard.target_ids, pool,
                    hidden_scale=buffers["hidden_scale"], state_stats=src.commit_record(s).get("state_stats"),
                    last_hidden=last, last_hidden_scale=last_scale)
