"""The cache's manifest as a type: parsed and checked once, when a cache is opened.

The manifest is the JSON object a cache keeps in its group's `zarr.json` (attribute "dflash"; its fields
are described in data/README.md). `Manifest.parse` accepts exactly the fields below with their JSON types
and possible values; anything else (a field missing or unknown, a string where a number belongs, a negative
or absurd size, layers the target does not have) is one line naming the field, so a damaged or foreign
manifest never reaches numpy or zarr.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

from dflash.errors import DflashError

FORMAT_VERSION = 1  # bf16 storage
FP8_FORMAT_VERSION = 2  # fp8 storage (+ `hidden_scale`): a format-1 reader refuses it instead of misreading it
SUPPORTED_FORMATS = (FORMAT_VERSION, FP8_FORMAT_VERSION)
# --storage name -> the manifest's storage_dtype
STORAGE_DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
MAX_CHUNK_VALUES = 1 << 32  # T x H of one chunk: 8 GiB of bf16, far beyond any real shard
# The state `last_hidden` holds: what the LM head reads, so lm_head(last_hidden[i]) is the logits for token i+1
LAST_HIDDEN_STATE = "after the final norm"


def num_groups(hidden_size: int, block: int) -> int:
    """G: scales per state row of fp8 storage with `block` channels per scale."""
    return -(-hidden_size // block)


@dataclass(frozen=True, kw_only=True)
class TargetInfo:
    """The target the states came from, as recorded at extraction."""

    name: str | None
    path: str
    model_type: str
    num_layers: int
    architectures: list[str] | None = None
    revision: str | None = None  # the hub commit, where the target came from the hub cache
    config_hash: str | None = None


@dataclass(frozen=True, kw_only=True)
class PlanStats:
    """What the plan holds, counted before any forward."""

    rows: int
    docs: int
    tokens: int
    loss_tokens: int
    truncated: int
    dropped: dict[str, int]


@dataclass(frozen=True, kw_only=True)
class DataFile:
    path: str
    size: int
    sha256: str
    rows: int
    first_row: int


@dataclass(frozen=True, kw_only=True)
class ConvertedFrom:
    path: str
    cache_key: str


@dataclass(frozen=True, kw_only=True)
class LastHidden:
    """The optional `last_hidden` array: which state it holds, and its storage (always that of `hidden`)."""

    state: str
    storage_dtype: str


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A cache's manifest. The fields up to `packer` (and `scale_block` of fp8 caches, `last_hidden` of caches
    that store it) are its key."""

    format_version: int
    target_config_hash: str
    target_weights: str
    tokenizer_hash: str
    chat_template_hash: str
    data_sha256: list[str]
    limit: int | None
    layer_ids: list[int]
    token_budget: int
    max_docs: int
    max_len: int
    compute_dtype: str
    storage_dtype: str
    packer: dict[str, Any]
    scale_block: int | None = None  # fp8 storage: channels per scale
    last_hidden: LastHidden | None = None  # `extract --last-hidden` only
    cache_key: str
    dflash_version: str
    target: TargetInfo
    hidden_size: int
    vocab_size: int
    pad_id: int
    drop_reasons: list[str]
    created_at: str
    num_shards: int
    data_files: list[DataFile]
    stats: PlanStats
    weights_sha256: str
    layer_convention: str | None = None  # caches of older versions do not say
    converted_from: ConvertedFrom | None = None  # `dflash cache convert` wrote it from another cache

    @property
    def fp8(self) -> bool:
        return self.storage_dtype == STORAGE_DTYPES["fp8"]

    @property
    def num_scale_groups(self) -> int:
        """G of an fp8 cache: scales per state row."""
        return num_groups(self.hidden_size, self.scale_block)

    def to_dict(self) -> dict:
        """The JSON object as stored (optional fields that are unset left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if not (v is None and k in ("scale_block", "last_hidden", "layer_convention", "converted_from"))}

    @classmethod
    def parse(cls, data, where: str) -> Manifest:
        """The manifest from its JSON object; `where` (the cache) starts every error."""
        m = _parse(cls, data, where, "manifest")
        m._check(where)
        return m

    def _check(self, where: str) -> None:
        def bad(field: str, why: str):
            raise DflashError(f"{where}: manifest field {field} {why}")

        if self.format_version not in SUPPORTED_FORMATS:
            bad("format_version", f"is {self.format_version}: this dflash reads cache formats "
                f"{', '.join(map(str, SUPPORTED_FORMATS))} (a newer dflash wrote it?)")
        if self.storage_dtype not in STORAGE_DTYPES.values():
            bad("storage_dtype", f"is {self.storage_dtype!r}, not one of {', '.join(STORAGE_DTYPES.values())}")
        if self.fp8 != (self.format_version == FP8_FORMAT_VERSION) or self.fp8 != (self.scale_block is not None):
            bad("format_version", f"{self.format_version}, storage_dtype {self.storage_dtype} and scale_block "
                f"{self.scale_block} do not go together")
        if self.last_hidden is not None and self.last_hidden.state != LAST_HIDDEN_STATE:
            bad("last_hidden.state", f"is {self.last_hidden.state!r}: this dflash knows {LAST_HIDDEN_STATE!r}")
        if self.last_hidden is not None and self.last_hidden.storage_dtype != self.storage_dtype:
            bad("last_hidden.storage_dtype", f"is {self.last_hidden.storage_dtype}, not the cache's "
                f"{self.storage_dtype}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            bad("compute_dtype", f"is {self.compute_dtype!r}, not one of {', '.join(COMPUTE_DTYPES)}")
        for field, low, high in (("num_shards", 1, 1 << 31), ("token_budget", 1, 1 << 24), ("max_docs", 1, None),
                                 ("max_len", 2, None), ("hidden_size", 1, 1 << 20), ("vocab_size", 1, 1 << 26),
                                 ("pad_id", 0, None), ("limit", 1, None)):
            value = getattr(self, field)
            if value is not None and (value < low or (high is not None and value > high)):
                bad(field, f"is {value}: out of range")
        if self.max_docs > self.token_budget or self.max_len > self.token_budget:
            bad("max_docs" if self.max_docs > self.token_budget else "max_len",
                f"exceeds token_budget {self.token_budget}")
        if self.token_budget * self.hidden_size > MAX_CHUNK_VALUES:
            bad("token_budget", f"x hidden_size = {self.token_budget * self.hidden_size:,} values per chunk: "
                "impossible")
        if self.pad_id >= self.vocab_size:
            bad("pad_id", f"{self.pad_id} is outside the vocabulary ({self.vocab_size})")
        if self.scale_block is not None and not 1 <= self.scale_block <= self.hidden_size:
            bad("scale_block", f"is {self.scale_block}: must be in [1, hidden_size {self.hidden_size}]")
        if self.target.num_layers < 1:
            bad("target.num_layers", f"is {self.target.num_layers}")
        ids = self.layer_ids
        if not ids or len(set(ids)) != len(ids) or not all(0 <= i < self.target.num_layers for i in ids):
            bad("layer_ids", f"{ids} must be distinct ids of the target's {self.target.num_layers} layers")
        counts = dataclasses.asdict(self.stats)
        if any(v < 0 for v in [*(v for k, v in counts.items() if k != "dropped"), *self.stats.dropped.values()]):
            bad("stats", "holds a negative count")


def _parse(hint, value, where: str, field: str):
    """`value` (decoded JSON) as `hint` says, or one line naming `field`."""
    def wrong(expected: str):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "…"
        raise DflashError(f"{where}: manifest field {field} must be {expected}, got {type(value).__name__} {shown}")

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):  # X | None
        if value is None and type(None) in args:
            return None
        return _parse(next(a for a in args if a is not type(None)), value, where, field)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            wrong("an object")
        fields = {f.name: f for f in dataclasses.fields(hint)}
        hints = typing.get_type_hints(hint)
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise DflashError(f"{where}: manifest field {field}.{unknown[0]} is unknown to this dflash")
        out = {}
        for name, f in fields.items():
            path = name if field == "manifest" else f"{field}.{name}"
            if name not in value:
                if f.default is dataclasses.MISSING:
                    raise DflashError(f"{where}: manifest field {path} is missing")
                continue
            out[name] = _parse(hints[name], value[name], where, path)
        return hint(**out)
    if origin is list:
        if not isinstance(value, list):
            wrong("a list")
        return [_parse(args[0], v, where, f"{field}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            wrong("an object")
        return {k: _parse(args[1], v, where, f"{field}.{k}") for k, v in value.items()}
    if hint is Any:
        return value
    if hint is int:
        if type(value) is not int:
            wrong("an integer")
    elif hint is str:
        if not isinstance(value, str):
            wrong("a string")
    else:  # pragma: no cover - a field of a type this parser does not know
        raise TypeError(hint)
    return value
