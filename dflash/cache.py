"""The hidden-state cache: a zarr v3 group of fixed-shape shards (format in data/README.md).

Layout of a cache folder:
    zarr.json                     group; attribute "dflash" = the manifest (written last at creation)
    hidden/ input_ids/ loss_mask/ target_ids/ doc_lens/ row_ids/      the shard arrays
    hidden_scale/                 fp8 storage only: the scales of `hidden`'s e4m3 values
    last_hidden/ (last_hidden_scale/)   `extract --last-hidden` only: the state after the final norm
    dropped_row_ids/ dropped_reasons/ truncated_row_ids/             what the plan left out or cut
    commits/00000042.json         shard 42's commit record (checksums), written last, atomically
    target_weights.safetensors    the target's embed_tokens and lm_head, for training
    target_config.json            the target's config.json
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np
import zarr
import zarr.codecs
import zarr.storage

from dflash.errors import DflashError
from dflash.files import load_tensors, save_tensors, sha256_file, write_json_atomic, write_text_atomic
from dflash.manifest import FORMAT_VERSION, FP8_FORMAT_VERSION, LAST_HIDDEN_STATE, STORAGE_DTYPES, Manifest

MANIFEST_ATTR = "dflash"
COMMITS = "commits"
WEIGHTS_FILE = "target_weights.safetensors"
TARGET_CONFIG_FILE = "target_config.json"
# Arrays extract writes per shard; `doc_lens` and `row_ids` are the plan, written before any forward.
SHARD_ARRAYS = ("input_ids", "loss_mask", "target_ids")
PLAN_ARRAYS = ("doc_lens", "row_ids")
LIST_ARRAYS = ("dropped_row_ids", "dropped_reasons", "truncated_row_ids")
# Everything a cache folder may hold: an interrupted creation leaves a subset of these.
CACHE_ENTRIES = {"zarr.json", "hidden", "hidden_scale", "last_hidden", "last_hidden_scale", *SHARD_ARRAYS,
                 *PLAN_ARRAYS, *LIST_ARRAYS, COMMITS, WEIGHTS_FILE, TARGET_CONFIG_FILE}
# Manifest fields hashed into the cache key: everything that changes what the cache holds.
KEY_FIELDS = ("format_version", "target_config_hash", "target_weights", "tokenizer_hash", "chat_template_hash",
              "data_sha256", "limit", "layer_ids", "token_budget", "max_docs", "max_len", "compute_dtype",
              "storage_dtype", "packer")
# Key fields of some caches only (fp8's scale_block, the optional last_hidden array): hashed when present, so
# that caches without them keep their keys.
OPTIONAL_KEY_FIELDS = ("scale_block", "last_hidden")
LAST_HIDDEN = "last_hidden"  # the array, and its key among a record's state_stats


STAT_KEYS = ("sum_squares", "abs_max", "zeros", "nonfinite", "values")  # a record's statistics of one layer
log = logging.getLogger(__name__)
_RECORD_NAME = re.compile(r"[0-9]{8}")  # commits/00000042.json; ASCII digits only


def _record_problem(record: dict, shard: int, num_layers: int, layer_arrays, shard_arrays,
                    token_budget: int) -> str | None:
    """What makes a commit record unable to prove its shard, or None."""
    if record.get("shard") != shard:
        return f"it is shard {record.get('shard')!r}'s"
    for field in ("docs", "tokens", "loss_tokens"):
        value = record.get(field)
        if type(value) is not int or not 0 <= value <= token_budget:
            return f"{field} {value!r}"
    sums = record.get("crc32c")
    if not isinstance(sums, dict):
        return "no checksums"
    for name in layer_arrays:
        layer_sums = sums.get(name)
        if not (isinstance(layer_sums, list) and len(layer_sums) == num_layers
                and all(type(x) is int for x in layer_sums)):
            return f"checksums of {name} missing or not one per layer"
    for name in (*shard_arrays, *PLAN_ARRAYS):
        if type(sums.get(name)) is not int:
            return f"checksum of {name} missing"
    stats = record.get("state_stats", {})
    numbers = lambda v: isinstance(v, dict) and all(isinstance(v.get(k), (int, float)) for k in STAT_KEYS)  # noqa: E731
    if not (isinstance(stats, dict) and all(numbers(v) for v in stats.values())):
        return "state_stats damaged"
    return None


class CorruptShardError(DflashError):
    def __init__(self, cache: str | Path, shard: int, detail: str):
        super().__init__(f"{cache}: shard {shard} is corrupt ({detail}); run `dflash cache verify {cache}`")
        self.shard, self.detail = shard, detail


def cache_key(fields: dict) -> str:
    hashed = {k: fields[k] for k in KEY_FIELDS}
    hashed |= {k: fields[k] for k in OPTIONAL_KEY_FIELDS if fields.get(k) is not None}
    return hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()[:20]


def storage_fields(storage: str, scale_block: int, hidden_size: int, last_hidden: bool = False) -> dict:
    """The manifest fields that say which states are stored and how (`last_hidden`: as `hidden`).
    `scale_block` 0 or >= H: one scale per row."""
    if storage == "bf16":
        fields = {"format_version": FORMAT_VERSION, "storage_dtype": STORAGE_DTYPES["bf16"]}
    else:
        block = hidden_size if scale_block <= 0 else min(scale_block, hidden_size)
        fields = {"format_version": FP8_FORMAT_VERSION, "storage_dtype": STORAGE_DTYPES["fp8"], "scale_block": block}
    if last_hidden:
        fields["last_hidden"] = {"state": LAST_HIDDEN_STATE, "storage_dtype": fields["storage_dtype"]}
    return fields


def state_arrays(m: Manifest) -> dict[str, tuple[tuple, tuple, str]]:
    """name -> (shape, chunks, dtype) of the arrays that hold states: `hidden` (a chunk per layer and shard),
    `last_hidden` when stored (a chunk per shard), and with fp8 storage each one's `_scale` array, chunked alike."""
    S, T, L, H = m.num_shards, m.token_budget, len(m.layer_ids), m.hidden_size
    out = {}
    for name, lead, chunk in (("hidden", (S, T, L), (1, T, 1)), (LAST_HIDDEN, (S, T), (1, T))):
        if name == LAST_HIDDEN and m.last_hidden is None:
            continue
        out[name] = ((*lead, H), (*chunk, H), "uint8" if m.fp8 else "uint16")  # e4m3 bits or bf16 bits
        if m.fp8:
            G = m.num_scale_groups
            out[f"{name}_scale"] = ((*lead, G), (*chunk, G), "uint16")  # bf16 bits
    return out


def key_differences(old: dict, new: dict) -> list[str]:
    """Names (and short values) of the key fields in which two manifests differ."""
    diffs = []
    for k in KEY_FIELDS + OPTIONAL_KEY_FIELDS:
        a, b = old.get(k), new.get(k)
        if a != b:
            short = lambda v: (json.dumps(v)[:40] + "…") if len(json.dumps(v)) > 40 else json.dumps(v)  # noqa: E731
            diffs.append(f"{k} ({short(a)} in the cache, {short(b)} now)")
    return diffs


def check_same_key(out: Path, existing: dict, fields: dict) -> None:
    """Refuse to resume the cache at `out` (manifest `existing`) with inputs of another key."""
    diffs = key_differences(existing, fields)
    if diffs:
        raise DflashError(f"--out {out} holds a cache with another key ({existing['cache_key']}): it differs in "
                          + "; ".join(diffs) + ". Use another --out.")


def checksum(a: np.ndarray) -> int:
    """crc32c of an array's bytes: the value zarr's crc32c codec appends to a chunk. The `crc32c`
    package releases the GIL (google_crc32c, zarr's own, does not), so writer threads checksumming
    gigabytes do not stall the thread that launches the target's kernels."""
    return crc32c.crc32c(np.ascontiguousarray(a))


def read_manifest(path: str | Path) -> dict | None:
    """The manifest of a cache folder; None if the folder is not (yet) a complete dflash cache."""
    meta = Path(path) / "zarr.json"
    try:
        return json.loads(meta.read_text()).get("attributes", {}).get(MANIFEST_ATTR)
    except (OSError, ValueError):
        return None


def _bytes_codecs(compressor: str):
    # crc32c last: every chunk carries its own checksum, so a flipped byte fails the read and is named.
    return ([zarr.codecs.ZstdCodec(level=1)] if compressor == "zstd" else []) + [zarr.codecs.Crc32cCodec()]


def create_cache(path: Path, manifest: dict, plan, dropped: np.ndarray, dropped_reasons: np.ndarray,
                 truncated: np.ndarray, weights: dict, target_config: dict, compressor: str = "none") -> None:
    """Create the group, its arrays and the plan; the manifest (checked as a reader will check it) goes in
    last, so a folder without one is an interrupted creation that the next run starts over."""
    m = Manifest.parse({**manifest, "weights_sha256": ""}, str(path))  # its hash once the file is written
    S, D = plan.row_ids.shape
    T = m.token_budget
    group = zarr.open_group(path, mode="w")
    conf = {"write_empty_chunks": True}  # a missing chunk is then always damage, never "all fill"

    def array(name, shape, chunks, dtype, fill, codecs=None):
        return group.create_array(name, shape=shape, chunks=chunks, dtype=dtype, fill_value=fill,
                                  compressors=codecs or _bytes_codecs("none"), config=conf)

    for name, (shape, chunks, dtype) in state_arrays(m).items():
        array(name, shape, chunks, dtype, 0, _bytes_codecs(compressor))
    array("input_ids", (S, T), (1, T), "int32", m.pad_id)
    array("loss_mask", (S, T), (1, T), "uint8", 0)
    array("target_ids", (S, T), (1, T), "int32", m.pad_id)
    array("doc_lens", (S, D), (1, D), "int32", 0)[:] = plan.doc_lens
    array("row_ids", (S, D), (1, D), "int64", -1)[:] = plan.row_ids
    for name, values, dtype in (("dropped_row_ids", dropped, "int64"), ("dropped_reasons", dropped_reasons, "uint8"),
                                ("truncated_row_ids", truncated, "int64")):
        a = array(name, (len(values),), (max(len(values), 1),), dtype, 0)
        if len(values):
            a[:] = values
    save_tensors({k: v.contiguous() for k, v in weights.items()}, path / WEIGHTS_FILE,
                 metadata={"cache_key": m.cache_key})
    write_text_atomic(path / TARGET_CONFIG_FILE, json.dumps(target_config, indent=2, sort_keys=True))
    (path / COMMITS).mkdir(exist_ok=True)
    group.attrs[MANIFEST_ATTR] = dataclasses.replace(m, weights_sha256=sha256_file(path / WEIGHTS_FILE)).to_dict()


def committed_note(path: Path) -> str:
    """What a stopped extract or convert leaves in the cache at `path` (for its error message)."""
    manifest = read_manifest(path)
    if manifest is None:
        return "no shard is committed yet"
    done = len([p for p in (Path(path) / COMMITS).glob("*.json")])
    return f"{done} of {manifest.get('num_shards', '?')} shards are committed and intact"


def check_writable(out: Path) -> None:
    """`out` can hold a cache: writable, and empty or already a (possibly half-created) dflash cache."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-probe-{id(out)}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise DflashError(f"--out {out}: cannot write there ({e.strerror})") from None
    foreign = {p.name for p in out.iterdir() if not p.name.startswith(".")} - CACHE_ENTRIES
    if foreign and read_manifest(out) is None:
        raise DflashError(f"--out {out}: folder is not empty and is not a dflash cache (holds {sorted(foreign)[0]!r})")


@dataclass
class Shard:
    index: int
    hidden: np.ndarray  # [T, L', H] uint16 (bf16 bits) or uint8 (e4m3 bits); L' = the opened layers (a view)
    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] uint8
    target_ids: np.ndarray  # [T] int32
    doc_lens: np.ndarray  # [D] int32
    row_ids: np.ndarray  # [D] int64
    hidden_scale: np.ndarray | None = None  # fp8 storage: [T, L', G] uint16 (bf16 bits)
    last_hidden: np.ndarray | None = None  # read with last_hidden=True: [T, H], stored as `hidden` is
    last_hidden_scale: np.ndarray | None = None  # ... and with fp8 storage: [T, G] uint16 (bf16 bits)


class Cache:
    """A cache opened for reading (any subset of its layers) or, by extract, for writing shards."""

    def __init__(self, path: str | Path, layers: list[int] | None = None, mode: str = "r"):
        self.path = Path(path)
        raw = read_manifest(self.path)
        if raw is None:
            raise DflashError(f"{path}: not a dflash cache (no manifest in {self.path / 'zarr.json'})")
        self.manifest = m = Manifest.parse(raw, str(path))
        self.fp8 = m.fp8
        # arrays with one chunk per layer per shard: the states, and with fp8 storage their scales
        self.layer_arrays = ("hidden", "hidden_scale") if self.fp8 else ("hidden",)
        self.has_last_hidden = m.last_hidden is not None
        # `last_hidden` (+ its scales): a chunk per shard, like the arrays extract writes beside the states
        self.last_hidden_arrays = tuple(name for name in state_arrays(m) if name.startswith(LAST_HIDDEN))
        self.shard_arrays = (*SHARD_ARRAYS, *self.last_hidden_arrays)  # what a commit record has one checksum of
        self.arrays = self._open_arrays(mode)
        cached = m.layer_ids
        self.layer_ids = list(cached if layers is None else layers)
        missing = [i for i in self.layer_ids if i not in cached]
        if missing:
            raise DflashError(f"{path}: layers {missing} are not in the cache (it holds layers {cached})")
        self.layer_slots = [cached.index(i) for i in self.layer_ids]  # positions along the L axis

    def _open_arrays(self, mode: str) -> dict:
        """The shard and plan arrays, each checked against the manifest's shapes and the format's dtypes."""
        m = self.manifest
        S, T, D = m.num_shards, m.token_budget, m.max_docs
        expected = {**state_arrays(m),
                    "input_ids": ((S, T), (1, T), "int32"), "loss_mask": ((S, T), (1, T), "uint8"),
                    "target_ids": ((S, T), (1, T), "int32"), "doc_lens": ((S, D), (1, D), "int32"),
                    "row_ids": ((S, D), (1, D), "int64")}
        try:
            self.group = zarr.open_group(self.path, mode=mode)
            arrays = {name: self.group[name] for name in expected}
        except KeyError as e:
            raise DflashError(f"{self.path}: array {e.args[0]} is missing") from None
        except Exception as e:  # zarr refusing its metadata: unknown codecs, bad chunk keys, damaged JSON
            raise DflashError(f"{self.path}: unreadable zarr metadata ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None
        for name, (shape, chunks, dtype) in expected.items():
            a = arrays[name]
            if (tuple(a.shape), tuple(a.chunks), str(a.dtype)) != (shape, chunks, dtype):
                raise DflashError(f"{self.path}: array {name} is {str(a.dtype)} {tuple(a.shape)} in chunks of "
                                  f"{tuple(a.chunks)}; the manifest makes it {dtype} {shape} in chunks of {chunks}")
        return arrays

    @property
    def scale_block(self) -> int | None:
        """Channels per fp8 scale (None: bf16 storage)."""
        return self.manifest.scale_block

    def layer_buffers(self) -> dict[str, np.ndarray]:
        """Empty [L', T, ...] buffers for `read_shard_into`: one contiguous block per chunk."""
        m = self.manifest
        L, T = len(self.layer_slots), m.token_budget
        if not self.fp8:
            return {"hidden": np.empty((L, T, m.hidden_size), np.uint16)}
        return {"hidden": np.empty((L, T, m.hidden_size), np.uint8),
                "hidden_scale": np.empty((L, T, m.num_scale_groups), np.uint16)}

    def states(self, shard: Shard, device, dtype):
        """The shard's states as a [T, L', H] tensor of `dtype` on `device` (fp8: dequantised there)."""
        return self._decode(shard.hidden, shard.hidden_scale, device, dtype)

    def last_states(self, shard: Shard, device, dtype):
        """The shard's `last_hidden` (read with `read_shard(i, last_hidden=True)`) as a [T, H] tensor: the target's
        last hidden state after its final norm, row i giving the logits for token i+1 through the LM head."""
        if shard.last_hidden is None:
            raise DflashError(f"{self.path}: shard {shard.index} was read without last_hidden "
                              f"(read_shard(..., last_hidden=True))")
        return self._decode(shard.last_hidden, shard.last_hidden_scale, device, dtype)

    def _decode(self, bits: np.ndarray, scale_bits: np.ndarray | None, device, dtype):
        """Stored states [..., H] (bf16 bits, or e4m3 bits with their scales [..., G]) -> `dtype` on `device`."""
        import torch

        from dflash import fp8

        if not self.fp8:
            return fp8.bf16_from_bits(bits).to(device).to(dtype)
        q = torch.from_numpy(np.ascontiguousarray(bits)).to(device)
        return fp8.dequantize(q, fp8.bf16_from_bits(scale_bits).to(device), self.scale_block, dtype)

    @property
    def num_shards(self) -> int:
        return self.manifest.num_shards

    @property
    def token_budget(self) -> int:
        return self.manifest.token_budget

    def _record_path(self, shard: int) -> Path:
        return self.path / COMMITS / f"{shard:08d}.json"

    def commit_record(self, shard: int) -> dict | None:
        """The shard's commit record; None if it has none (or one of another cache). A damaged record is not
        a commit either: `damaged()` names it."""
        record, _ = self._record(shard)
        return record

    def _record(self, shard: int) -> tuple[dict | None, str | None]:
        """(the valid record or None, what is wrong with the record if it is damaged)."""
        try:
            record = json.loads(self._record_path(shard).read_text())
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError) as e:
            return None, f"commit record unreadable ({type(e).__name__})"
        if not isinstance(record, dict) or record.get("cache_key") != self.manifest.cache_key:
            return None, None  # another cache's (extract writes this shard anew)
        problem = _record_problem(record, shard, len(self.manifest.layer_ids), self.layer_arrays, self.shard_arrays,
                                  self.token_budget)
        return (None, f"commit record damaged: {problem}") if problem else (record, None)

    def _record_files(self) -> dict[int, Path]:
        return {int(p.stem): p for p in (self.path / COMMITS).glob("*.json")
                if _RECORD_NAME.fullmatch(p.stem) and int(p.stem) < self.num_shards}

    def committed(self) -> list[int]:
        """Shards with a valid commit record, read afresh (extract may still be adding some)."""
        return sorted(s for s in self._record_files() if self.commit_record(s) is not None)

    def warn_damaged(self) -> None:
        """Say (once, where a command opens the cache) that some shards' commit records cannot prove them, so
        those shards are left out as if not committed."""
        bad = self.damaged()
        if bad:
            named = ", ".join(f"shard {s}" if s >= 0 else "a stray record" for s, _ in bad[:5])
            log.warning(f"{self.path}: {len(bad)} commit record(s) damaged ({named}{', ...' if len(bad) > 5 else ''}): "
                        f"those shards are left out; `dflash cache verify {self.path}` names the damage, the "
                        f"extract command run again rewrites them")

    def damaged(self) -> list[tuple[int, str]]:
        """(shard, what is wrong) for every commit record that cannot prove its shard (the shard counts as not
        committed: extract writes it again), and (-1, ...) for a record of no shard of this cache."""
        out = [(s, problem) for s in sorted(self._record_files()) for problem in [self._record(s)[1]] if problem]
        for p in sorted((self.path / COMMITS).glob("*.json")):
            if not (_RECORD_NAME.fullmatch(p.stem) and int(p.stem) < self.num_shards):
                out.append((-1, f"{COMMITS}/{p.name}: a commit record of no shard of this cache "
                                f"({self.num_shards} shards)"))
        return out

    def plan(self) -> tuple[np.ndarray, np.ndarray]:
        """(row_ids [S, D], doc_lens [S, D]) of every shard, committed or not."""
        return self.arrays["row_ids"][:], self.arrays["doc_lens"][:]

    def target_weights(self, device, dtype) -> tuple:
        """The target's (embed_tokens, lm_head) weights [V, H], saved beside the shards."""
        w = load_tensors(self.path / WEIGHTS_FILE, "the cache's target weights")
        if "embed_tokens.weight" not in w or "lm_head.weight" not in w:
            raise DflashError(f"{self.path / WEIGHTS_FILE}: lacks embed_tokens.weight or lm_head.weight")
        embed, head = w["embed_tokens.weight"], w["lm_head.weight"]
        m = self.manifest
        if embed.shape != (m.vocab_size, m.hidden_size) or head.shape != embed.shape:
            raise DflashError(f"{self.path / WEIGHTS_FILE}: embeddings {tuple(embed.shape)} / head {tuple(head.shape)} "
                              f"do not match the manifest (vocab {m.vocab_size}, hidden {m.hidden_size})")
        return embed.to(device, dtype), head.to(device, dtype)

    # -- writing (extract) --------------------------------------------------------------------------

    def write_shard(self, shard: int, hidden: np.ndarray, input_ids: np.ndarray, loss_mask: np.ndarray,
                    target_ids: np.ndarray, pool=None, hidden_scale: np.ndarray | None = None,
                    state_stats: dict | None = None, last_hidden: np.ndarray | None = None,
                    last_hidden_scale: np.ndarray | None = None) -> None:
        """Write one shard's arrays (chunks in parallel on `pool`, a thread pool), then its commit
        record. `hidden` is [L, T, H] uint16 (bf16 bits) or uint8 (e4m3 bits, with `hidden_scale`
        [L, T, G] uint16): one contiguous [T, ...] block per chunk; `last_hidden` [T, H] (with fp8,
        `last_hidden_scale` [T, G]) likewise, in a cache that stores it. `state_stats`: per layer id (and
        `last_hidden`), what its states look like (kept in the record; `info` sums them)."""
        given = {"hidden": hidden, "hidden_scale": hidden_scale, "input_ids": input_ids, "loss_mask": loss_mask,
                 "target_ids": target_ids, "last_hidden": last_hidden, "last_hidden_scale": last_hidden_scale}
        wanted = {*self.layer_arrays, *self.shard_arrays}
        wrong = [name for name, a in given.items() if (a is not None) != (name in wanted)]
        if wrong:
            raise ValueError(f"{self.path}: {wrong[0]} is {'required' if wrong[0] in wanted else 'not used'} here")
        jobs = [(name, (shard, 0, slot, 0), block) for name in self.layer_arrays
                for slot, block in enumerate(given[name])]
        jobs += [(name, self._shard_chunk(name, shard), given[name]) for name in self.shard_arrays]
        sums = list(pool.map(lambda job: self._write_chunk(*job), jobs)) if pool else \
            [self._write_chunk(*j) for j in jobs]
        crcs, i = {}, 0
        for name in self.layer_arrays:
            crcs[name], i = sums[i : i + len(hidden)], i + len(hidden)
        crcs.update(zip(self.shard_arrays, sums[i:]))
        row_ids, doc_lens = self.arrays["row_ids"][shard], self.arrays["doc_lens"][shard]
        record = {"shard": shard, "cache_key": self.manifest.cache_key, "docs": int((row_ids >= 0).sum()),
                  "tokens": int(doc_lens.sum()), "loss_tokens": int(loss_mask.sum()),
                  "crc32c": {**crcs, "row_ids": checksum(row_ids), "doc_lens": checksum(doc_lens)}}
        if state_stats is not None:
            record["state_stats"] = state_stats
        write_json_atomic(self._record_path(shard), record, indent=None)  # the record is either whole or absent

    def _shard_chunk(self, name: str, shard: int) -> tuple:
        """The chunk coordinates of an array with one chunk per shard: (shard, 0, ...)."""
        return (shard,) + (0,) * (self.arrays[name].ndim - 1)

    def _write_chunk(self, name: str, coords: tuple, block: np.ndarray) -> int:
        """Write the chunk at `coords` (one whole chunk) and return the crc32c of its bytes.

        For an uncompressed array on a local folder, the file is written directly with the bytes zarr
        would write (raw little-endian values, then their crc32c): one pass over the data instead of
        zarr's three copies, and no GIL held during the write."""
        arr = self.arrays[name]
        block = np.ascontiguousarray(block)
        crc = checksum(block)
        if self._direct_io(arr):
            path = self.path / name / arr.metadata.encode_chunk_key(coords)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.writev(fd, [block.view(np.uint8).reshape(-1), crc.to_bytes(4, "little")])
            finally:
                os.close(fd)
        else:
            arr[tuple(slice(c * n, (c + 1) * n) for c, n in zip(coords, arr.chunks))] = block.reshape(arr.chunks)
        return crc

    @staticmethod
    def _direct_io(arr) -> bool:
        """Chunks are raw little-endian values + crc32c in a local file: we read and write them directly."""
        codecs = arr.metadata.codecs
        return (isinstance(arr.store, zarr.storage.LocalStore) and len(codecs) == 2
                and isinstance(codecs[0], zarr.codecs.BytesCodec)
                and getattr(codecs[0].endian, "value", codecs[0].endian) in (None, "little")  # None: 1-byte values
                and isinstance(codecs[1], zarr.codecs.Crc32cCodec) and np.little_endian)

    # -- reading ------------------------------------------------------------------------------------

    def read_shard(self, shard: int, verify: bool = True, last_hidden: bool = False) -> Shard:
        """One committed shard, reading only the chunks of the opened layers (and, with `last_hidden`, those of
        the `last_hidden` array). With `verify`, the bytes are checked against the commit record, which also
        catches a chunk deleted from disk."""
        if last_hidden and not self.has_last_hidden:
            raise DflashError(f"{self.path}: the cache holds no last_hidden (extract it with --last-hidden)")
        layered = self.layer_buffers()
        out = {name: np.empty(self.arrays[name].shape[1:], self.arrays[name].dtype)
               for name in (*SHARD_ARRAYS, *PLAN_ARRAYS, *(self.last_hidden_arrays if last_hidden else ()))}
        self.read_shard_into(shard, layered["hidden"], out, verify, layered.get("hidden_scale"))
        scale = layered.get("hidden_scale")
        return Shard(shard, layered["hidden"].transpose(1, 0, 2), **out,
                     hidden_scale=None if scale is None else scale.transpose(1, 0, 2))

    def read_shard_into(self, shard: int, hidden: np.ndarray, arrays: dict[str, np.ndarray],
                        verify: bool = True, hidden_scale: np.ndarray | None = None) -> None:
        """Read a committed shard into given buffers (the loader's pinned memory): hidden [L', T, H]
        (uint16 bf16 bits, or uint8 e4m3 bits with hidden_scale [L', T, G]), layer-major, so each chunk
        lands in one contiguous block; `arrays` holds any of input_ids, loss_mask, target_ids, doc_lens,
        row_ids (and last_hidden, last_hidden_scale of a cache that stores them)."""
        record, problem = self._record(shard)
        if problem:
            raise CorruptShardError(self.path, shard, problem)
        if record is None:
            raise DflashError(f"{self.path}: shard {shard} is not committed")
        if (hidden_scale is not None) != self.fp8:
            raise ValueError(f"{self.path}: hidden_scale is {'required' if self.fp8 else 'not used'} here")
        sums = record["crc32c"]
        layered = {"hidden": hidden, "hidden_scale": hidden_scale}
        for name in self.layer_arrays:
            for j, slot in enumerate(self.layer_slots):
                what = f"{name} layer {self.manifest.layer_ids[slot]}"
                crc = self._read_chunk_into(shard, name, (shard, 0, slot, 0), layered[name][j], what)
                if verify and crc != sums[name][slot]:
                    raise CorruptShardError(self.path, shard, f"{what}: checksum mismatch")
        for name, buf in arrays.items():
            crc = self._read_chunk_into(shard, name, self._shard_chunk(name, shard), buf, name)
            if verify and crc != sums[name]:
                raise CorruptShardError(self.path, shard, f"{name}: checksum mismatch")
        problem = self._value_problem(arrays, record)
        if problem:
            raise CorruptShardError(self.path, shard, problem)

    def _value_problem(self, arrays: dict[str, np.ndarray], record: dict) -> str | None:
        """What no cache extract writes holds (whatever the checksums say): token ids outside the vocabulary,
        negative document lengths or more tokens than the shard has, row ids below -1."""
        m = self.manifest
        for name in ("input_ids", "target_ids"):
            ids = arrays.get(name)
            if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= m.vocab_size):
                return f"{name} outside the vocabulary [0, {m.vocab_size})"
        lens = arrays.get("doc_lens")
        if lens is not None and (lens.min() < 0 or lens.sum() != record["tokens"]):
            return f"doc_lens negative or not summing to the {record['tokens']} tokens of its commit record"
        rows = arrays.get("row_ids")
        if rows is not None and rows.min() < -1:
            return "row_ids below -1"
        return None

    def _read_chunk_into(self, shard: int, name: str, coords: tuple, out: np.ndarray, what: str) -> int:
        """Read one whole chunk into `out` (contiguous, the chunk's size) and return the crc32c of its
        values. Uncompressed local chunks are read straight into `out` and checked against their own
        trailing crc32c; others go through zarr."""
        arr = self.arrays[name]
        if self._direct_io(arr):
            path = self.path / name / arr.metadata.encode_chunk_key(coords)
            try:
                with open(path, "rb", buffering=0) as f:
                    n = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
                    tail = f.read(5)
            except FileNotFoundError:
                raise CorruptShardError(self.path, shard, f"{what}: chunk file missing") from None
            crc = checksum(out)
            if n != out.nbytes or len(tail) != 4 or crc != int.from_bytes(tail, "little"):
                raise CorruptShardError(self.path, shard, f"{what}: chunk fails its crc32c (or has the wrong size)")
            return crc
        try:
            out[...] = arr[tuple(slice(c * n, (c + 1) * n) for c, n in zip(coords, arr.chunks))].reshape(out.shape)
        except Exception as e:  # zarr's crc32c codec: "Stored and computed checksum do not match"
            raise CorruptShardError(self.path, shard, f"{what}: {str(e).splitlines()[0][:120]}") from None
        return checksum(out)


# -- inspection (cache info / verify / ls) -------------------------------------------------------------


def disk_bytes_by_entry(path: Path) -> dict[str, int]:
    """Bytes on disk under each top-level entry of `path` (a file counts under its own name): one walk."""
    sizes: dict[str, int] = {}
    for p in path.rglob("*"):
        if p.is_file():
            top = p.relative_to(path).parts[0]
            sizes[top] = sizes.get(top, 0) + p.stat().st_size
    return sizes


def info(path: str | Path) -> dict:
    """Manifest and progress, from the manifest and the commit records alone (no array reads)."""
    cache = Cache(path)
    m = cache.manifest
    records = [cache.commit_record(s) for s in cache.committed()]
    S, T = m.num_shards, m.token_budget
    done_tokens = sum(r["tokens"] for r in records)
    sizes = disk_bytes_by_entry(cache.path)
    size = sum(sizes.values())
    side = sizes.get(WEIGHTS_FILE, 0) + sizes.get(TARGET_CONFIG_FILE, 0)
    states = sum(sizes.get(name, 0) for name in (*cache.layer_arrays, *cache.last_hidden_arrays))
    last = sum(sizes.get(name, 0) for name in cache.last_hidden_arrays)
    return {
        "path": str(cache.path),
        "cache_key": m.cache_key,
        "complete": len(records) == S,
        "shards": {"committed": len(records), "total": S, "damaged_records": len(cache.damaged())},
        "rows": {"total": m.stats.rows, "planned": m.stats.docs,
                 "in_committed_shards": sum(r["docs"] for r in records),
                 "truncated": m.stats.truncated, "dropped": m.stats.dropped},
        "tokens": {"planned": m.stats.tokens, "committed": done_tokens, "loss": m.stats.loss_tokens},
        "fill_ratio": m.stats.tokens / (S * T),
        "bytes_on_disk": size,
        "bytes_per_token": size / done_tokens if done_tokens else None,
        "shard_bytes_per_token": (size - side) / done_tokens if done_tokens else None,  # without the weights
        "state_bytes_per_token": states / done_tokens if done_tokens else None,  # hidden, last_hidden (+ scales)
        "storage": {"dtype": m.storage_dtype, "scale_block": m.scale_block},
        "last_hidden": None if m.last_hidden is None else {
            **dataclasses.asdict(m.last_hidden), "bytes_per_token": last / done_tokens if done_tokens else None},
        "states": state_summary(records, [*map(str, m.layer_ids), *([LAST_HIDDEN] if cache.has_last_hidden else [])]),
        "manifest": m.to_dict(),
    }


def state_summary(records: list[dict], names: list[str]) -> dict:
    """Per layer id (and `last_hidden`), over the committed shards whose records hold statistics: RMS, largest
    |value|, share of exact zeros, non-finite values, and how many shards were counted (older caches have none)."""
    out = {}
    for name in names:
        parts = [r["state_stats"][name] for r in records if name in r.get("state_stats", {})]
        values = sum(p["values"] for p in parts)
        out[name] = {"shards": len(parts),
                     "rms": (sum(p["sum_squares"] for p in parts) / values) ** 0.5 if values else None,
                     "abs_max": max((p["abs_max"] for p in parts), default=None),
                     "zero_fraction": sum(p["zeros"] for p in parts) / values if values else None,
                     "nonfinite": sum(p["nonfinite"] for p in parts)}
    return out


def verify(path: str | Path, progress=None) -> list[tuple[int, str]]:
    """(shard, problem) for every committed shard that fails its checksums or values, every damaged commit
    record, and (-1, problem) for the weights file or a stray record. Shards without a record are not errors:
    extract has not finished them."""
    cache = Cache(path)
    try:
        bad = [] if sha256_file(cache.path / WEIGHTS_FILE) == cache.manifest.weights_sha256 else \
            [(-1, f"{WEIGHTS_FILE}: checksum mismatch")]
    except OSError as e:
        bad = [(-1, f"{WEIGHTS_FILE}: unreadable ({e.strerror or type(e).__name__})")]
    bad += cache.damaged()
    shards = cache.committed()
    for s in progress(shards) if progress else shards:
        try:
            cache.read_shard(s, verify=True, last_hidden=cache.has_last_hidden)
        except CorruptShardError as e:
            bad.append((s, e.detail))
    return bad


def find_caches(root: str | Path) -> list[Path]:
    """Cache folders under root (not descending into a cache)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if "zarr.json" in filenames and read_manifest(dirpath) is not None:
            found.append(Path(dirpath))
            dirnames.clear()
        dirnames.sort()
    return found
