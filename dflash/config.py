"""Run configuration: one kw-only dataclass per long-running command (`ExtractConfig`, `TrainConfig`,
`RegenerateConfig`), the single source of each option: its type, its default and, in the docstring under
it, its `--help` text (the CLI's options are generated from these classes: `cli/options.py`).

Constructing a config checks it: field types (a TOML integer is accepted for a float field, and becomes
one), then `validate()`. Values come from a TOML preset (`configs/*.toml`: one table per command,
`[extract]`, `[train]`, `[regenerate]`), then from CLI options; relative paths in a preset are resolved
against the preset's own folder, so a preset works from any working directory.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dflash.errors import DflashError

ComputeDtype = Literal["auto", "bf16", "fp16", "fp32"]
Storage = Literal["bf16", "fp8"]
ExpertsImplementation = Literal["auto", "grouped_mm", "batched_mm", "eager"]
FROM_TARGET = {"from_target": True}  # a field resolved from the target or the cache, never an option


class _Checked:
    """Base of the configs: field types are checked and `validate()` runs when one is constructed."""

    def __post_init__(self) -> None:
        hints = type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, check_value(f.name, getattr(self, f.name), hints[f.name]))
        self.validate()

    def validate(self) -> None:
        """Checks across fields and of ranges (types are checked before)."""

    def _at_least(self, minimum: int, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < minimum:
                raise DflashError(f"{option(name)} must be >= {minimum}, got {value}")


def option(name: str) -> str:
    """The CLI option of a field: `token_budget` -> `--token-budget`."""
    return "--" + name.replace("_", "-")


@dataclass(kw_only=True)
class ExtractConfig(_Checked):
    """Everything `dflash extract` needs; the fields that change the cache's contents feed its key."""

    target: str = ""
    """Hugging Face causal LM: a local folder or a hub id (must already be in the local HF cache
    when the machine is offline)."""
    data: list[str] = field(default_factory=list)
    """Input files, JSONL (`{"text"}` or `{"messages"}` rows) or Parquet, read in this order."""
    out: str = ""
    """The cache folder (a zarr v3 group). Re-running with the same inputs resumes it."""
    layers: list[int] | None = None
    """Target layer ids to capture (id i = output of decoder layer i). None: the default ids for a
    drafter of `draft_layers` layers."""
    draft_layers: int = 5
    """Depth of the drafter the default `layers` are chosen for: round(1 + k(N-4)/(n-1)) for k < n over a target
    of N layers (n = 1: [N // 2])."""
    token_budget: int = 8192
    """T: tokens per shard. Every shard has exactly T positions (pad after the last document)."""
    max_docs: int = 64
    """D: most documents packed into one shard."""
    max_len: int | None = None
    """Documents longer than this are truncated (and counted). None: T."""
    batch_size: int = 32
    """Most documents (padded rows) in one target forward."""
    batch_tokens: int = 32768
    """Most padded tokens (rows x longest row) in one target forward."""
    window: int = 4
    """Shards planned into one group of forwards; a window is the unit a rank takes and, after a
    crash, recomputes. Batches never span windows, so a resumed run computes identical batches."""
    write_threads: int = 4
    """Threads writing chunks in parallel (each chunk is one file)."""
    device: str = "auto"
    """`auto` (cuda if available), `cpu`, `cuda`, `cuda:N`."""
    dtype: ComputeDtype = "auto"
    """Target compute dtype: `auto` (bf16 on GPU, fp32 on CPU), `bf16`, `fp16`, `fp32`."""
    limit: int | None = None
    """Use only the first N rows of the data (in file order)."""
    compressor: Literal["none", "zstd"] = "none"
    """Chunk compression of `hidden`: `none` (fastest) or `zstd` (level 1, ~1.3x smaller)."""
    storage: Storage = "bf16"
    """How `hidden` is stored: `bf16`, or `fp8` (e4m3 + bf16 scales, quantised on the device at capture:
    ~half the bytes on disk, in host memory and in host-to-device copies)."""
    scale_block: int = 128
    """fp8 storage: channels sharing one scale (0: one scale per token and layer)."""
    last_hidden: bool = False
    """Also store the target's last hidden state after its final norm (`last_hidden`, row i predicting token
    i+1, stored like `hidden`): what DSpark-style drafters train their head on. One more hidden-size state per
    token."""
    attn_implementation: str | None = None
    """Passed to `from_pretrained` (`sdpa`, `eager`, `flash_attention_2`); None: transformers' choice."""
    device_map: str | None = None
    """Spread a target too big for one GPU over the machine's: `auto`, `balanced`, `sequential`, or a
    JSON map of module -> device (inline or a .json file). Captured states are gathered on `device`."""
    experts_implementation: ExpertsImplementation = "auto"
    """MoE targets: `auto` (= `grouped_mm`, the fastest exact one), `grouped_mm`, `batched_mm`, `eager`."""
    trust_remote_code: bool = False
    """Allow the target's own modeling code. Off unless asked for."""
    nonfinite: Literal["fail", "warn"] = "fail"
    """A layer's states holding NaN or inf (the target overflowed): `fail` stops before the shard is committed,
    naming the layer and shard; `warn` keeps them and says so."""

    def resolved_max_len(self) -> int:
        return self.token_budget if self.max_len is None else self.max_len

    def validate(self) -> None:
        _require_io(self)
        self._at_least(1, "token_budget", "max_docs", "batch_size", "batch_tokens", "window", "draft_layers",
                       "write_threads", "limit")
        if not 2 <= self.resolved_max_len() <= self.token_budget:
            raise DflashError(f"--max-len must be in [2, token budget {self.token_budget}], got {self.max_len}")
        if self.batch_tokens < self.resolved_max_len():
            raise DflashError(f"--batch-tokens {self.batch_tokens} is below the longest document "
                              f"({self.resolved_max_len()})")
        check_storage(self.storage, self.scale_block)
        _check_device_map(self.device_map)


@dataclass(kw_only=True)
class DrafterConfig(_Checked):
    """The drafter's shape: what a run trains and an export describes. Fields left at None are resolved from
    the target (`resolve_drafter`): widths as the target's own, hidden and vocabulary sizes as it has them,
    the target layers as the cache holds them. Its fields are options of `dflash train` (`--num-layers`, ...),
    and keys of the preset's `[train]` table, except those marked `from_target`."""

    arch: Literal["dflash", "dflash2"] = "dflash"
    """`dflash`: the DFlash drafter. `dflash2`: DFlash2, the same layers with a grouped dynamic causal convolution
    inside each block around every attention and MLP sublayer, and a low-rank candidate selector that rescores the
    top-K tokens of each slot given the token drafted before it (exported as `DFlash2DraftModel`, which vLLM and
    SGLang serve)."""
    num_layers: int = 5
    """Drafter depth."""
    block_size: int = 16
    """B: tokens per draft block (the anchor and B-1 MASK tokens)."""
    sliding_window: int | None = None
    """Attend to the last W positions only (W >= B): block slot k of an anchor at position a sees context
    positions p > a + k - W; bounds the drafter's KV cache and attention cost on long contexts. None: the
    whole context before the anchor."""
    causal_block: bool = False
    """Slot k of a block sees slots 0..k of it only (else the whole block). With --sliding-window this is how
    SGLang, vLLM and the reference model serve `sliding_attention` layers by default: both export layouts
    serve it as trained."""
    intermediate_size: int | None = None
    """Drafter MLP width (None: the target's dense MLP width, else 3 x hidden)."""
    num_attention_heads: int | None = None
    """Query heads (None: the target's)."""
    num_key_value_heads: int | None = None
    """Key/value heads (None: the target's)."""
    head_dim: int | None = None
    """Head width (None: the target's, else hidden / heads)."""
    rope_theta: float | None = None
    """RoPE base (None: the target's)."""
    mask_token_id: int | None = None
    """The MASK token id (None: `dflash_mask_token_id` of the target's config)."""
    conv_kernel_size: int = 2
    """dflash2: taps of each convolution (a token and the ones before it in its block, K - 1 at most)."""
    conv_group_size: int = 16
    """dflash2: channels sharing one dynamic tap weight (must divide the hidden size)."""
    selector_rank: int = 256
    """dflash2: rank of the candidate selector (its hidden projection and its two [vocab, rank] codebooks)."""
    selector_top_k: int = 16
    """dflash2: candidates per slot the selector chooses from (the unary logits' top K)."""
    hidden_size: int | None = field(default=None, metadata=FROM_TARGET)
    """The target's hidden size (the drafter reads its states and borrows its embeddings and head)."""
    vocab_size: int | None = field(default=None, metadata=FROM_TARGET)
    """The target's vocabulary size."""
    rms_norm_eps: float | None = field(default=None, metadata=FROM_TARGET)
    """RMSNorm epsilon (the target's, else 1e-6)."""
    max_position_embeddings: int | None = field(default=None, metadata=FROM_TARGET)
    """Recorded in the export's config.json (the target's, else 40960); RoPE itself needs no table."""
    target_layer_ids: list[int] | None = field(default=None, metadata=FROM_TARGET)
    """Target layers the drafter reads (`--layers`: a subset of the cache's); their count sets fc's input width."""

    def validate(self) -> None:
        self._at_least(1, "num_layers", "sliding_window", "intermediate_size", "num_attention_heads",
                       "num_key_value_heads", "head_dim")
        self._at_least(2, "block_size")
        self._at_least(0, "mask_token_id")
        if self.sliding_window is not None and self.sliding_window < self.block_size:
            raise DflashError(f"--sliding-window {self.sliding_window} is shorter than the block "
                              f"(--block-size {self.block_size}): a slot must see its own block")
        if self.arch == "dflash2":
            self._validate_dflash2()

    def _validate_dflash2(self) -> None:
        self._at_least(1, "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        if self.conv_kernel_size > self.block_size:
            raise DflashError(f"--conv-kernel-size {self.conv_kernel_size} is longer than the block "
                              f"(--block-size {self.block_size}): its taps never reach past the block's start")
        if self.hidden_size is not None and self.hidden_size % self.conv_group_size:
            raise DflashError(f"--conv-group-size {self.conv_group_size} does not divide the hidden size "
                              f"{self.hidden_size}")
        if self.vocab_size is not None and self.selector_top_k > self.vocab_size:
            raise DflashError(f"--selector-top-k {self.selector_top_k} is more than the vocabulary "
                              f"({self.vocab_size} tokens)")

    def unresolved(self) -> list[str]:
        """Fields still waiting for the target's value."""
        optional = ("sliding_window",)  # None is a value of its own
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is None and f.name not in optional]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def hf_widths(hf: dict) -> dict:
    """The Qwen3-style widths of a Hugging Face config.json (a target's text config, or a drafter's), with
    Qwen3's choices for keys some configs leave out: a 3 x hidden MLP (an MoE target has no dense width),
    key/value heads = query heads, head_dim = hidden / heads, RMSNorm eps 1e-6, RoPE base 1e6
    (transformers 5 keeps it in `rope_parameters`), 40960 positions."""
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    rope = (hf.get("rope_parameters") or {}).get("rope_theta") or hf.get("rope_theta") or 1e6
    return {"intermediate_size": hf.get("intermediate_size") or 3 * hidden, "num_attention_heads": heads,
            "num_key_value_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hidden // heads, "rms_norm_eps": hf.get("rms_norm_eps") or 1e-6,
            "rope_theta": float(rope), "max_position_embeddings": hf.get("max_position_embeddings") or 40960}


def resolve_drafter(drafter: DrafterConfig, target: dict, *, hidden_size: int, vocab_size: int,
                    target_layer_ids: list[int]) -> DrafterConfig:
    """The drafter over the target of this Hugging Face config.json (its text config, for a multimodal one):
    `drafter`'s fields left at None take the target's values. The one place a drafter's shape is resolved."""
    target = target.get("text_config", target)
    told = {k: v for k, v in dataclasses.asdict(drafter).items() if v is not None}
    widths = hf_widths({**target, "hidden_size": hidden_size,
                        **{k: told[k] for k in ("num_attention_heads",) if k in told}})  # head_dim follows heads
    mask = told.get("mask_token_id", target.get("dflash_mask_token_id"))
    if mask is None:
        raise DflashError("--mask-token-id is needed: the target's config names no dflash_mask_token_id")
    if not 0 <= mask < vocab_size:
        raise DflashError(f"--mask-token-id {mask} is outside the target's vocabulary (size {vocab_size})")
    return DrafterConfig(**{**widths, **told, "mask_token_id": mask, "hidden_size": hidden_size,
                            "vocab_size": vocab_size, "target_layer_ids": list(target_layer_ids)})


@dataclass(kw_only=True)
class TrainConfig(_Checked):
    """Everything `dflash train` needs: the drafter's shape (`drafter`, resolved against the target), the data,
    the objective, the schedule and how the step runs."""

    cache: str = ""
    """The hidden-state cache to train from."""
    out: str = ""
    """Run folder: config, checkpoints, metrics. Running again on it resumes."""
    layers: list[int] | None = None
    """Target layers the drafter reads (a subset of the cache's). None: all of the cache's."""
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    """The drafter's shape; its fields are options (and `[train]` keys) of their own."""
    num_anchors: int = 512
    """A: anchors (blocks) per shard and step."""
    loss: Literal["dpace", "decay"] = "dpace"
    """Weights of the draft slots in the loss. `dpace`: D-PACE, each slot weighted by the expected number of
    accepted drafts it can still lead to, from the drafter's current per-slot likelihoods (the weights carry
    no gradient). `decay`: the original fixed exp(-(k-1)/gamma) for slot k."""
    gamma: float | None = None
    """`--loss decay`: decay over block slots (None: 7 for B = 16, 5 for 10, 4 for 8)."""
    dpace_alpha: float = 0.5
    """`--loss dpace`: in (0, 1]; each slot's acceptance estimate is (1 - alpha) exp(-CE) + alpha (1: every
    slot weighted by its remaining depth)."""
    labels: Literal["target", "data"] = "target"
    """`target`: learn the target's own greedy predictions (what acceptance is measured against);
    `data`: the data's next tokens."""
    selector_loss_alpha: float = 1.0
    """`--arch dflash2`: weight of the candidate selector's loss (the K-way cross-entropy over each slot's top-K
    unary candidates, the label put in last place when missing, weighted per slot as the unary loss) beside
    the unary loss; 0 trains the selector not at all."""
    mask_token_id: int | None = None
    """The MASK token id (None: `dflash_mask_token_id` of the target's config)."""
    lr: float = 6e-4
    """Peak learning rate."""
    warmup: float = 0.04
    """Linear warmup, as a fraction of all steps."""
    min_lr_ratio: float = 0.0
    """The cosine decays to lr * min_lr_ratio."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this."""
    epochs: int = 6
    """Passes over the training shards."""
    max_steps: int | None = None
    """Stop after this many steps (and size the schedule for them)."""
    holdout_shards: int = 0
    """Shards kept out of training for `dflash eval` (chosen by the seed)."""
    seed: int = 0
    """Seeds shard order, anchors and initialisation."""
    init_from: str | None = None
    """Start from these weights instead of a random init: a run folder (its latest checkpoint) or an
    exported drafter, e.g. a released DFlash model to fine-tune. Its shape must equal this run's."""
    save_every: int = 1000
    """Checkpoint every N steps (and at the end)."""
    log_every: int = 10
    """Read the loss back from the device and log every N steps."""
    eval_every: int = 0
    """Measure tau on (up to `eval_shards` of) the held-out shards every N steps and at the end
    (0: only at the end; needs --holdout-shards)."""
    eval_shards: int = 4
    """Held-out shards used by the evaluations during training."""
    device: str = "auto"
    """`auto` (cuda if available), `cpu`, `cuda`, `cuda:N`."""
    compile: Literal["auto", "yes", "no"] = "auto"
    """`auto` (on GPU), `yes`, `no`: torch.compile(mode="reduce-overhead") of the step."""
    compile_cache: bool = True
    """Keep the compiled step's artifacts in dflash's user cache folder ($DFLASH_CACHE_DIR, default
    ~/.cache/dflash) and load them on start: a later run of the same step (drafter, shapes, code, torch,
    GPU) starts warm. `--no-compile-cache`: every run compiles cold."""
    ce_chunk: int = 0
    """Rows of logits computed at once by the chunked cross-entropy; 0: the most rows (a power of two) whose
    float32 logits fit in 1.25 GiB (2048 at a 152k vocabulary). Fewer chunks compile faster."""
    compile_regions: bool = True
    """Compiled step: the cross-entropy's chunk is compiled once and called for every chunk
    (torch.compiler.nested_compile_region) instead of unrolled into one copy per chunk: the same result,
    a shorter cold compile and a lower peak memory for large drafters. `--no-compile-regions`: unrolled."""
    activation_memory_budget: float = 1.0
    """Compiled step: in (0, 1], the share of its recomputable activations (what the forward keeps for the
    backward) the step aims to keep; below 1, AOT autograd's partitioner recomputes the cheapest of the rest in the
    backward (pointwise work first, then the fewest FLOPs), inside the same CUDA graphs; it keeps more than the share
    (0.5 kept 83 % at the Qwen3-8B shape). 1: what the default partitioner keeps. Trades step time for memory; an
    uncompiled step cannot use it (--recompute can)."""
    recompute: Literal["none", "mlp", "attention", "layers"] = "none"
    """Recompute a part of every drafter layer in the backward instead of keeping its activations
    (torch.utils.checkpoint, compiled into the same graphs): `mlp` (about half of a layer's activations; its gate
    and up projections run twice), `attention` (its projections, norms and attention run twice), or `layers`
    (all of each layer: only its input is kept, its forward runs twice). `none`: keep everything."""
    optimizer_state: Literal["fp32", "bf16"] = "fp32"
    """AdamW's moments: `fp32` (torch's AdamW, fused on GPU: 16 bytes per trained parameter with the fp32 weights
    and gradients) or `bf16` (12 bytes: the moments are kept in bfloat16, rounded stochastically, and every
    update is computed in fp32). A run may resume with the other one (its moments are converted)."""
    memory_check: bool = True
    """Before compiling, estimate the step's peak GPU memory (logged) and stop, naming options that fit, when it
    exceeds the device's free memory. `--no-memory-check`: log the estimate and try anyway."""
    prefetch: int = 3
    """Shards read ahead into pinned memory."""
    follow: bool = False
    """Train on shards as an extract still commits them into the cache."""
    on_corrupt: Literal["fail", "skip"] = "fail"
    """A shard failing its checksums: `fail` (exit, naming it) or `skip` it."""

    # fields that change only how a run executes, not what it computes: free to differ on resume
    RUNTIME_FIELDS = ("save_every", "log_every", "eval_every", "eval_shards", "device", "compile", "compile_cache",
                      "prefetch", "follow", "on_corrupt", "ce_chunk", "compile_regions", "activation_memory_budget",
                      "recompute", "optimizer_state", "memory_check")

    def resolved_gamma(self) -> float:
        from dflash.objective import default_gamma

        return default_gamma(self.drafter.block_size) if self.gamma is None else self.gamma

    def validate(self) -> None:
        if not self.cache:
            raise DflashError("no cache: pass --cache")
        if not self.out:
            raise DflashError("no run folder: pass --out")
        self._at_least(1, "num_anchors", "epochs", "save_every", "log_every", "prefetch", "max_steps", "eval_shards")
        self._at_least(0, "ce_chunk", "seed", "holdout_shards", "eval_every")
        if self.layers is not None and (not self.layers or self.layers != sorted(set(self.layers))):
            raise DflashError(f"--layers must be increasing and distinct, got {self.layers}")
        for name in ("lr", "grad_clip"):
            if not getattr(self, name) > 0:
                raise DflashError(f"{option(name)} must be > 0, got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise DflashError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise DflashError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.dpace_alpha <= 1:
            raise DflashError(f"--dpace-alpha must be in (0, 1], got {self.dpace_alpha}")
        if self.selector_loss_alpha < 0:
            raise DflashError(f"--selector-loss-alpha must be >= 0, got {self.selector_loss_alpha}")
        if self.gamma is not None and self.gamma <= 0:
            raise DflashError(f"--gamma must be > 0, got {self.gamma}")
        if not 0 <= self.warmup < 1:
            raise DflashError(f"--warmup is a fraction of the run in [0, 1), got {self.warmup}")
        if not 0 < self.activation_memory_budget <= 1:
            raise DflashError(f"--activation-memory-budget must be in (0, 1], got {self.activation_memory_budget}")

    def identity(self) -> dict:
        """The fields a resumed run must share with the run it continues (the drafter's flattened in)."""
        return {k: v for k, v in flat_dict(self).items() if k not in self.RUNTIME_FIELDS}


@dataclass(kw_only=True)
class RegenerateConfig(_Checked):
    """Everything `dflash regenerate` needs: the target runs in this process, or behind `server`."""

    target: str = ""
    """The Hugging Face target (folder or hub id). With --server: optional, read for its tokenizer only (text
    rows' prompts, the chat template's reasoning field)."""
    data: list[str] = field(default_factory=list)
    """Input JSONL/Parquet files."""
    out: str = ""
    """Output JSONL (plus OUT.meta.json, its settings); the same command resumes it."""
    server: str | None = None
    """Base URL of an OpenAI-compatible server that serves the target (vLLM, SGLang, `transformers serve`),
    e.g. http://localhost:8000/v1: requests go there, concurrently, instead of running the target here."""
    model: str | None = None
    """With --server: the served model's name. None: the server's only model."""
    api_key_env: str | None = None
    """With --server: the environment variable that holds the server's API key (sent as a bearer token, never
    logged). None: no key."""
    concurrency: int = 8
    """With --server: rows (conversations) in flight at once."""
    timeout: float = 600.0
    """With --server: seconds a request may wait for its answer before it is retried."""
    retries: int = 4
    """With --server: retries of a request that failed (HTTP 5xx, 408, 429, a timeout, a dropped connection),
    waiting 1, 2, 4, ... s (at most 30) between tries."""
    turns: Literal["all", "last"] = "all"
    """`messages` rows: regenerate every assistant turn given the conversation so far (`all`), or only the last
    one (`last`); a conversation that ends on another role gets a new last assistant turn."""
    max_new_tokens: int = 512
    """Longest generated response (per turn)."""
    temperature: float = 0.0
    """0: greedy; otherwise sampling at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling (with temperature > 0)."""
    prompt_tokens: int = 32
    """Tokens of a `text` row kept as the prompt of its continuation."""
    batch_size: int = 16
    """Prompts generated together (in-process)."""
    seed: int = 0
    """Sampling seed: in-process, each chunk reseeds from it, so a resumed run samples the same; with --server,
    each request carries a seed of its own derived from it, its row and its turn."""
    limit: int | None = None
    """Only the first N rows."""
    device: str = "auto"
    """`auto` (cuda if available), `cpu`, `cuda`, `cuda:N` (in-process)."""
    dtype: ComputeDtype = "auto"
    """Target compute dtype: `auto` (bf16 on GPU, fp32 on CPU), `bf16`, `fp16`, `fp32` (in-process)."""
    device_map: str | None = None
    """Spread a target too big for one GPU over the machine's: `auto`, `balanced`, `sequential`, or a
    JSON map of module -> device (inline or a .json file) (in-process)."""

    def validate(self) -> None:
        if self.server is None:
            _require_io(self)
        elif not self.data:
            raise DflashError("no data: pass --data or set `data` in the preset")
        elif not self.out:
            raise DflashError("no output: pass --out")
        self._at_least(1, "max_new_tokens", "batch_size", "prompt_tokens", "limit", "concurrency")
        self._at_least(0, "retries")
        if not self.timeout > 0:
            raise DflashError(f"--timeout must be > 0, got {self.timeout}")
        if self.server is not None and not self.server.startswith(("http://", "https://")):
            raise DflashError(f"--server {self.server}: not an http:// or https:// URL")
        _check_device_map(self.device_map)


@dataclass(kw_only=True)
class RecomputeConfig(_Checked):
    """What `dflash cache verify --recompute` needs: how many documents, which target, where it runs."""

    recompute: int = 0
    """Rerun the target on N documents sampled across the committed shards and compare their states with
    the cache's, layer by layer (0: checksums only)."""
    target: str | None = None
    """The target to recompute with (a folder or hub id). None: the one the cache was extracted from."""
    device: str = "auto"
    """`auto` (cuda if available), `cpu`, `cuda`, `cuda:N`."""
    dtype: ComputeDtype = "auto"
    """Compute dtype: `auto` (the one the cache was computed in), `bf16`, `fp16`, `fp32`."""
    tolerance: float = 0.05
    """Largest relative error (|cached - recomputed| / |recomputed|, per document and layer) that still
    matches. The same dtype on the same kind of device gives ~0; bf16 against fp32 about 1e-2 on small
    targets; a wrong layer or target, far more."""
    seed: int = 0
    """Which documents are sampled."""
    device_map: str | None = None
    """Spread a target too big for one GPU over the machine's (as `dflash extract --device-map`)."""
    experts_implementation: ExpertsImplementation = "auto"
    """MoE targets: `auto` (= `grouped_mm`), `grouped_mm`, `batched_mm`, `eager`."""
    trust_remote_code: bool = False
    """Allow the target's own modeling code. Off unless asked for."""

    def validate(self) -> None:
        self._at_least(0, "recompute", "seed")
        if not 0 < self.tolerance < 1:
            raise DflashError(f"--tolerance must be in (0, 1), got {self.tolerance}")
        _check_device_map(self.device_map)


def _require_io(cfg) -> None:
    """extract and regenerate read --target and --data, and write --out."""
    if not cfg.target:
        raise DflashError("no target: pass --target or set `target` in the preset")
    if not cfg.data:
        raise DflashError("no data: pass --data or set `data` in the preset")
    if not cfg.out:
        raise DflashError("no output: pass --out")


def _check_device_map(device_map: str | None) -> None:
    if device_map:
        from dflash.target import parse_device_map

        parse_device_map(device_map)


def check_storage(storage: str, scale_block: int) -> None:
    check_value("storage", storage, Storage)
    if scale_block < 0:
        raise DflashError(f"--scale-block must be >= 0 (0: one scale per token and layer), got {scale_block}")


# Fields holding paths: resolved against the preset's folder when they come from a preset.
_PATH_FIELDS = {"target", "data", "out", "cache"}


def load_preset(path: str | Path) -> dict:
    """The TOML preset as a dict (one table per command)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise DflashError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise DflashError(f"--config {path}: invalid TOML ({e})") from None


def _resolve_path(value: str, base: Path) -> str:
    # A value that is not an existing relative path (a hub id such as "Qwen/Qwen3-8B") stays as is.
    candidate = base / value
    if Path(value).is_absolute() or not (candidate.exists() or value.startswith(".")):
        return value
    return str(candidate.resolve())


def option_fields(cls: type) -> dict[str, tuple[type, dataclasses.Field]]:
    """name -> (the class that declares it, the field): every option of `cls`, the fields of a nested config
    (such as `TrainConfig.drafter`) flattened in, those resolved from the target left out."""
    out = {}
    for f in dataclasses.fields(cls):
        hint = type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            out.update(option_fields(hint))
        elif not f.metadata.get("from_target"):
            out[f.name] = (cls, f)
    return out


def flat_dict(cfg) -> dict:
    """The config's values with those of its nested configs flattened in: one key per option."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update({k: v for k, v in flat_dict(value).items() if k in option_fields(type(value))})
        else:
            out[f.name] = value
    return out


def nest(cls: type, values: dict) -> dict:
    """Flat option values (`option_fields`) as the keyword arguments of `cls`: a nested config's own
    fields gathered into it."""
    values, out = dict(values), {}
    for f in dataclasses.fields(cls):
        hint = type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            own = {k: values.pop(k) for k in list(values) if k in option_fields(hint)}
            out[f.name] = hint(**nest(hint, own))
        elif f.name in values:
            out[f.name] = values.pop(f.name)
    if values:
        raise DflashError(f"bad configuration: unknown option(s) {', '.join(sorted(values))}")
    return out


def preset_values(cls: type, preset: str | Path, section: str) -> dict:
    """`[section]` of the preset as option values of `cls` (flat: `option_fields`): keys and types checked
    (errors name the file), paths resolved against the preset's folder."""
    table = load_preset(preset).get(section, {})
    base = Path(preset).resolve().parent
    fields = option_fields(cls)
    values = {}
    for key, value in table.items():
        if key not in fields:
            raise DflashError(f"--config {preset}: unknown key {key!r} in [{section}]")
        owner, _ = fields[key]
        value = check_value(key, value, type_hints(owner)[key], where=f"--config {preset}: ")
        if key in _PATH_FIELDS:
            value = [_resolve_path(v, base) for v in value] if isinstance(value, list) else _resolve_path(value, base)
        values[key] = value
    return values


def build_config(cls: type, preset: str | Path | None, section: str, overrides: dict):
    """`cls` filled from `[section]` of the preset, then from `overrides` (CLI values that are not None),
    both flat (a nested config's fields by their own names)."""
    values = preset_values(cls, preset, section) if preset is not None else {}
    values.update({k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()
                   if v is not None and v != () and v != []})
    try:
        return cls(**nest(cls, values))
    except TypeError as e:
        raise DflashError(f"bad configuration: {e}") from None


def check_value(name: str, value, hint, where: str = ""):
    """`value` if it has type `hint` (an int is accepted, as a float, for a float), else a DflashError naming
    the field (`where`: the preset it came from, else the CLI option)."""
    if dataclasses.is_dataclass(hint):  # a nested config (e.g. TrainConfig.drafter), as itself or as its dict
        if isinstance(value, dict):
            try:
                return hint(**value)
            except TypeError as e:
                raise DflashError(f"{where}{name}: {e}") from None
        if isinstance(value, hint):
            return value
    allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None and type(None) in allowed:
        return None
    for kind in allowed:
        origin, args = typing.get_origin(kind) or kind, typing.get_args(kind)
        if origin is Literal:
            if value in args:
                return value
            what = name if where else option(name)
            raise DflashError(f"{where}{what} must be one of {', '.join(args)}, got {value!r}")
        if origin is list and isinstance(value, list) and all(_is(v, args[0]) for v in value):
            return value
        if origin is float and _is(value, int):
            return float(value)
        if origin is not list and _is(value, origin):
            return value
    raise DflashError(f"{where}{name} = {value!r} has the wrong type (expected {_type_name(hint)})")


def _is(value, kind: type) -> bool:
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))  # True is no int here


def _type_name(hint) -> str:
    return str(hint).replace("typing.", "") if not isinstance(hint, type) else hint.__name__


@functools.cache
def type_hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (Python keeps none at run time: read from the source),
    with its whitespace folded: what `--help` prints."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    docs, body = {}, tree.body[0].body
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs
