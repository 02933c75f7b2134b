"""`dflash train`: the drafter's training loop over a hidden-state cache.

One step = one shard: T context tokens, A anchors, blocks of B. On GPU the loss (forward) is compiled
once with torch.compile(mode="reduce-overhead", dynamic=False) and its backward follows as CUDA
graphs; every input is a persistent device buffer that the loader refills, so nothing recompiles
after the first step (counted, logged). On CPU the same step runs eagerly (attention through SDPA).

    train = build (cache, drafter shape, preflight checks, run folder, drafter, optimizer, the step wrapped
            in DDP and compiled, once) -> resume (the latest checkpoint, else --init-from) -> loop (the
            steps of this rank's shard schedule; `Metrics` logs them; checkpoints; evaluations)

A compiled step starts warm when an earlier run compiled the same one: its artifacts are loaded before
the first step and kept after it (`dflash.compile_cache`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import dflash
from dflash import checkpoint, dflash2, drafter as drafter_module, fp8, logs, memory, objective
from dflash.cache import TARGET_CONFIG_FILE, Cache
from dflash.compile_cache import StepArtifacts, source_hash
from dflash.config import TrainConfig, flat_dict, resolve_drafter
from dflash.dist import Dist, close_dist, init_dist
from dflash.drafter import Drafter, DrafterConfig, build_drafter
from dflash.drafter_io import FORMATS, check_servable, copy_weights, read_drafter
from dflash.errors import DflashError
from dflash.evaluate import acceptance
from dflash.files import disk_full_is_an_error, held, write_json_atomic
from dflash.loader import ShardLoader, epoch_order
from dflash.memory import BF16AdamW, MemoryPlan, StepShape
from dflash.metrics import Metrics, StepResult
from dflash.objective import ce_rows, drafter_loss
from dflash.target import resolve_device

log = logging.getLogger(__name__)

# mode="reduce-overhead" (CUDA graphs), fixed shapes; pointwise kernels take Inductor's heuristic launch
# config instead of benchmarking each candidate (on an H200: 1.5 s of autotuning instead of 3.0, the same step time)
COMPILE_OPTIONS = {"dynamic": False, "options": {"triton.cudagraphs": True, "triton.autotune_pointwise": False}}

# -- setup --------------------------------------------------------------------------------------------


def drafter_config(cfg: TrainConfig, cache: Cache) -> DrafterConfig:
    """The drafter's shape: the cache fixes hidden and vocab sizes and the layers; other fields left at None
    are the target's."""
    m = cache.manifest
    target = json.loads((cache.path / TARGET_CONFIG_FILE).read_text())
    return resolve_drafter(cfg.drafter, target, hidden_size=m.hidden_size, vocab_size=m.vocab_size,
                           target_layer_ids=cache.layer_ids)


def preflight(cfg: TrainConfig, cache: Cache, dcfg: DrafterConfig) -> None:
    """Mismatches fail here, before any heavy work."""
    T = cache.token_budget
    if dcfg.block_size > T:
        raise DflashError(f"--block-size {dcfg.block_size} does not fit shards of {T} tokens")
    if cfg.num_anchors > T:
        raise DflashError(f"--num-anchors {cfg.num_anchors} is more than the {T} positions of a shard")
    if dcfg.num_attention_heads % dcfg.num_key_value_heads:
        raise DflashError(f"{dcfg.num_attention_heads} attention heads are not a multiple of "
                          f"{dcfg.num_key_value_heads} key/value heads")
    if not cache.committed() and not cfg.follow:
        raise DflashError(f"{cache.path}: no committed shard yet (extract still running? use --follow)")


def note_exports(dcfg: DrafterConfig, num_target_layers: int) -> None:
    """Say before training what `dflash export` will refuse for this drafter (and why), not after it."""
    refused = {}
    for fmt in FORMATS:
        try:
            check_servable(dcfg, fmt, num_target_layers)
        except DflashError as e:
            refused[fmt] = str(e)
    if refused:
        served = [f for f in FORMATS if f not in refused]
        what = f"exports to {' and '.join(served)} only" if served else "cannot be exported"
        log.info(f"note: this drafter {what}: {next(iter(refused.values()))}")


def init_weights(drafter: Drafter, path: str) -> None:
    """--init-from: another run's or an export's weights, if the drafter it holds has this run's shape."""
    src, weights, _ = read_drafter(path, "--init-from")
    ours, theirs = drafter.cfg.to_dict(), src.to_dict()
    diffs = [f"{k} {theirs[k]} vs {ours[k]}" for k in ours if k != "max_position_embeddings" and theirs[k] != ours[k]]
    if diffs:
        raise DflashError(f"--init-from {path}: another drafter shape ({'; '.join(diffs)})")
    copy_weights(drafter, weights, f"--init-from {path}")


def split_shards(cfg: TrainConfig, num_shards: int) -> tuple[list[int], list[int]]:
    """(train, holdout) shard ids; the holdout is a seeded choice, fixed for the run."""
    if cfg.holdout_shards >= num_shards:
        raise DflashError(f"--holdout-shards {cfg.holdout_shards} leaves no shard of {num_shards} to train on")
    perm = np.random.default_rng([cfg.seed, 7]).permutation(num_shards)
    holdout = sorted(int(s) for s in perm[: cfg.holdout_shards])
    return [s for s in range(num_shards) if s not in set(holdout)], holdout


def run_config(cfg: TrainConfig, dcfg: DrafterConfig, cache: Cache, train_shards: list[int],
               holdout: list[int]) -> dict:
    return {"dflash_version": dflash.__version__, "train": flat_dict(cfg), "drafter": dcfg.to_dict(),
            "train_shards": train_shards,
            "cache": {"path": str(cache.path.resolve()), "cache_key": cache.manifest.cache_key,
                      "layer_ids": cache.manifest.layer_ids, "target": dataclasses.asdict(cache.manifest.target)},
            "holdout_shards": holdout}


def check_or_write_run_config(run: Path, config: dict, cfg: TrainConfig) -> dict:
    """A run folder holds one run: the same command resumes it (with the shard lists it started with),
    another config is refused. Returns the run's config."""
    path = run / "config.json"
    if path.exists():
        old = json.loads(path.read_text())
        new_id, old_id = cfg.identity(), {k: v for k, v in old["train"].items() if k not in cfg.RUNTIME_FIELDS}
        diffs = [k for k in sorted(set(new_id) | set(old_id)) if new_id.get(k) != old_id.get(k) and k != "out"]
        if old["cache"]["cache_key"] != config["cache"]["cache_key"]:
            diffs.append("cache (another cache key)")
        if diffs:
            raise DflashError(f"--out {run} holds a run with another config (differs in {', '.join(diffs)}); "
                              f"use another --out")
        return old
    run.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, config)
    return config


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    """Linear warmup, then cosine to lr * min_lr_ratio."""
    warm = max(1, math.ceil(cfg.warmup * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def rank_schedule(train: list[int], cfg: TrainConfig, d: Dist, start: int, total: int) -> list[int]:
    """Shard ids this rank trains on for steps start..total-1: epoch orders dealt out across ranks."""
    per_epoch = len(train) // d.world
    out = []
    for step in range(start, total):
        epoch, i = divmod(step, per_epoch)
        out.append(epoch_order(train, cfg.seed, epoch)[i * d.world + d.rank])
    return out


class LossModule(torch.nn.Module):
    """The drafter with its loss as forward: what torch.compile and DDP wrap (`autocast`: the step runs
    under bf16 autocast, see `wrap_step`)."""

    def __init__(self, drafter: Drafter, cfg: TrainConfig, attention: str, autocast: bool,
                 scale_block: int | None = None):
        super().__init__()
        self.drafter, self.cfg, self.attention, self.autocast = drafter, cfg, attention, autocast
        self.gamma = cfg.resolved_gamma()
        self.ce_chunk = cfg.ce_chunk or ce_rows(drafter.cfg.vocab_size)
        self.scale_block = scale_block  # fp8 cache: channels per scale

    def forward(self, hidden, input_ids, loss_mask, target_ids, doc_lens, anchor_scores, hidden_scale=None):
        """hidden [L, T, H] (the loader's layer-major layout: bf16, or e4m3 with hidden_scale [L, T, G]);
        anchor_scores [T]: the anchor draw's uniform numbers; the rest as `drafter_loss` takes them."""
        if hidden_scale is not None:  # inside the compiled step: fuses into the copy that feeds fc
            hidden = fp8.dequantize(hidden, hidden_scale, self.scale_block,
                                    torch.bfloat16 if self.autocast else self.drafter.fc.weight.dtype)
        out = drafter_loss(self.drafter, hidden.transpose(0, 1), input_ids.long(), loss_mask, target_ids.long(),
                           doc_lens, num_anchors=self.cfg.num_anchors, gamma=self.gamma, loss=self.cfg.loss,
                           dpace_alpha=self.cfg.dpace_alpha, labels_from=self.cfg.labels, attention=self.attention,
                           ce_chunk=self.ce_chunk, ce_region=self.cfg.compile_regions, recompute=self.cfg.recompute,
                           selector_alpha=self.cfg.selector_loss_alpha, anchor_scores=anchor_scores)
        walk = torch.stack([out.anchors, out.anchor_ok.long(), out.anchor_doc, out.accepted.long()])  # [4, A]
        return out.loss, out.weight_sum, out.slot_correct, out.slot_count, walk, out.visible_keys


# -- build, resume, loop ------------------------------------------------------------------------------


def train(cfg: TrainConfig) -> dict:
    """Train (or resume, or find finished) the run `cfg` describes; returns a summary of this call."""
    device = resolve_device(cfg.device)
    d = init_dist("nccl" if device.type == "cuda" else "gloo")
    try:
        with disk_full_is_an_error(cfg.out, lambda: last_good(Path(cfg.out)), then="it resumes from there"), \
                (held(Path(cfg.out), "training run") if d.is_main else contextlib.nullcontext()), \
                logs.where(lambda: stop_note(Path(cfg.out), "before training began")):
            s = build(cfg, d, device)
            note_exports(s.dcfg, s.cache.manifest.target.num_layers)
            start = s.at = resume(s)
            if start >= s.total:
                log.info(f"{s.run}: already trained for {start} steps: nothing to do")
                return {"steps": start, "resumed_at": start}
            with logs.where(lambda: stop_note(s.run, f"after step {s.at} of {s.total}")):
                return loop(s, start)
    finally:
        close_dist()


@dataclass
class Setup:
    """A run ready to train: its config, cache and shard lists, the drafter, its optimizer and its step."""

    cfg: TrainConfig
    d: Dist
    device: torch.device
    run: Path
    cache: Cache
    dcfg: DrafterConfig
    train_shards: list[int]
    holdout: list[int]  # held-out shards that are committed: what evaluations read
    total: int  # steps of the whole schedule
    drafter: Drafter
    optimizer: torch.optim.Optimizer
    loss_fn: torch.nn.Module  # LossModule, in DDP over several ranks, compiled where asked, under autocast on GPU
    compiled: bool
    shape: StepShape  # what the step's memory depends on
    memory_plan: MemoryPlan  # its estimate, made before anything was allocated
    artifacts: StepArtifacts | None = None  # the compiled step's artifacts (None: not compiled)
    at: int = 0  # the last step done (what a stop says)


def build(cfg: TrainConfig, d: Dist, device: torch.device) -> Setup:
    """Everything the loop needs, checked before any heavy work."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    cache = Cache(cfg.cache, layers=cfg.layers)
    if d.is_main:
        cache.warn_damaged()
    dcfg = drafter_config(cfg, cache)
    preflight(cfg, cache, dcfg)
    compiled = compiles(cfg, device)
    shape = step_shape(cfg, dcfg, cache, d, compiled)
    memory_plan = check_memory(cfg, shape, device, d)
    if d.world > 1 and cfg.on_corrupt == "skip":
        raise DflashError("--on-corrupt skip runs in one process only (DDP ranks would fall out of step); "
                          "`dflash cache verify` names bad shards, and deleting their commits/ records excludes them")
    train_shards, holdout = run_shards(cfg, d, cache, dcfg)
    embed, head = cache.target_weights(device, torch.bfloat16 if cuda else torch.float32)
    torch.manual_seed(cfg.seed)
    drafter = build_drafter(dcfg, embed, head).to(device)
    drafter.reset_parameters(seed=cfg.seed)
    drafter.cache_rope(cache.token_budget + dcfg.block_size)  # every position of a shard's context and blocks
    optimizer = make_optimizer(cfg, drafter, device)
    module = LossModule(drafter, cfg, "flex" if cuda else "eager", autocast=cuda, scale_block=cache.scale_block)
    loss_fn = wrap_step(module, cfg, d, device, compiled)
    artifacts = StepArtifacts(step_fields(module, cache, d), device, enabled=cfg.compile_cache,
                              save=d.is_main) if compiled else None
    return Setup(cfg=cfg, d=d, device=device, run=Path(cfg.out), cache=cache, dcfg=dcfg, train_shards=train_shards,
                 holdout=holdout, total=cfg.max_steps or cfg.epochs * (len(train_shards) // d.world),
                 drafter=drafter, optimizer=optimizer, loss_fn=loss_fn, compiled=compiled, shape=shape,
                 memory_plan=memory_plan, artifacts=artifacts)


def compiles(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether the step is compiled: on GPU, or when asked. A budget for its activations needs a compiled step."""
    compiled = cfg.compile == "yes" or (cfg.compile == "auto" and device.type == "cuda")
    if cfg.activation_memory_budget < 1 and not compiled:
        raise DflashError(f"--activation-memory-budget {cfg.activation_memory_budget} applies to a compiled step "
                          f"(--compile yes, the default on a GPU); an uncompiled one can use --recompute")
    return compiled


def step_shape(cfg: TrainConfig, dcfg: DrafterConfig, cache: Cache, d: Dist, compiled: bool) -> StepShape:
    return StepShape(drafter=dcfg, T=cache.token_budget, A=cfg.num_anchors, D=cache.manifest.max_docs,
                     ce_chunk=cfg.ce_chunk or ce_rows(dcfg.vocab_size), scale_block=cache.scale_block,
                     compiled=compiled, regions=cfg.compile_regions, optimizer_state=cfg.optimizer_state,
                     budget=cfg.activation_memory_budget, recompute=cfg.recompute, world=d.world, prefetch=cfg.prefetch)


def check_memory(cfg: TrainConfig, shape: StepShape, device: torch.device, d: Dist) -> MemoryPlan:
    """The step's memory plan, logged. On a GPU, a step whose estimate exceeds the free memory stops here in one
    line that names options that fit, before anything is allocated or compiled (on every rank if on any);
    --no-memory-check says it and goes on. A step that fits with little to spare is warned of."""
    plan = memory.plan(shape)
    free = memory.device_memory(device)
    where = f"; {memory.size(free[0])} free on {device}" if free else " on a GPU (a CPU run is not checked)"
    log.info(f"memory plan: the step needs {plan.describe()}{where}; the loader pins {memory.size(plan.host_pinned)} "
             f"of host memory")
    refusal = memory.refusal(shape, plan, free[0], device) if free else None
    if d.world > 1:  # every rank stops if one does (a rank left alone would wait for the others forever)
        said = [None] * d.world
        torch.distributed.all_gather_object(said, refusal)
        refusal = next((x for x in said if x is not None), None)
    if refusal and cfg.memory_check:
        raise DflashError(refusal)
    if warning := refusal or (memory.tight(plan, free[0], device) if free else None):
        log.warning(warning)
    return plan


def make_optimizer(cfg: TrainConfig, drafter: Drafter, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the drafter's parameters, its moments in fp32 (torch's, fused on GPU) or bf16 (`BF16AdamW`)."""
    cuda = device.type == "cuda"
    lr = torch.tensor(cfg.lr, device=device) if cuda else cfg.lr  # a tensor: changing it never recompiles
    if cfg.optimizer_state == "bf16":
        return BF16AdamW(drafter.parameters(), lr=lr, weight_decay=cfg.weight_decay, seed=cfg.seed)
    return torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=cfg.weight_decay, fused=cuda)


def run_shards(cfg: TrainConfig, d: Dist, cache: Cache, dcfg: DrafterConfig) -> tuple[list[int], list[int]]:
    """(train, held-out) shards. A run keeps the lists it started with in RUN/config.json (written here, or
    found to hold this run) whatever was committed since; evaluations read the held-out shards committed now."""
    train_shards, holdout = split_shards(cfg, cache.num_shards)
    if not cfg.follow:  # without --follow, train on what is committed now
        done = set(cache.committed())
        train_shards = [s for s in train_shards if s in done]
    if len(train_shards) < d.world:
        raise DflashError(f"{len(train_shards)} training shards cannot be split across {d.world} ranks")
    config = None
    if d.is_main:
        config = check_or_write_run_config(Path(cfg.out), run_config(cfg, dcfg, cache, train_shards, holdout), cfg)
    config = d.broadcast(config)
    committed = set(cache.committed())
    return config.get("train_shards", train_shards), [s for s in config["holdout_shards"] if s in committed]


def wrap_step(module: LossModule, cfg: TrainConfig, d: Dist, device: torch.device, compiled: bool) -> torch.nn.Module:
    """The step as it runs: in DDP over several ranks, then compiled (reduce-overhead: CUDA graphs) if `compiled`,
    under its activation memory budget. The one place compilation is applied."""
    cuda, autocast = device.type == "cuda", module.autocast
    if d.world > 1:
        # broadcast_buffers=False: the frozen embeddings/head are buffers, identical on every rank (each loads
        # them from the cache); DDP's default would sync with the host and broadcast them every step
        module = torch.nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if cuda else None,
                                                           broadcast_buffers=False)
    step = torch.compile(module, **COMPILE_OPTIONS) if compiled else module
    if compiled and cfg.activation_memory_budget < 1:
        step = MemoryBudget(step, cfg.activation_memory_budget)
    return Autocast(step) if autocast else step


class MemoryBudget(torch.nn.Module):
    """`step` compiled under AOT autograd's activation memory budget: the partitioner, which splits the traced
    forward and backward when the first call compiles them, keeps at most this share of the activations and
    recomputes the rest in the backward. Set around every call (the same value each time), not for the process."""

    def __init__(self, step: torch.nn.Module, budget: float):
        super().__init__()
        self.step, self.budget = step, budget
        self.runtime = memory.FlopRuntime()  # one object: the cache key holds its uuid

    def forward(self, **inputs):
        with torch._functorch.config.patch(activation_memory_budget=self.budget,
                                           activation_memory_budget_runtime_estimator=self.runtime):
            return self.step(**inputs)


class Autocast(torch.nn.Module):
    """`step` under bf16 autocast, entered outside the compiled graph: an autocast region traced into the
    graph keeps AOT autograd from caching it (torch >= 2.13), and a warm start would then retrace."""

    def __init__(self, step: torch.nn.Module):
        super().__init__()
        self.step = step

    def forward(self, **inputs):
        with torch.autocast("cuda", torch.bfloat16):
            return self.step(**inputs)


def step_fields(module: LossModule, cache: Cache, d: Dist) -> dict:
    """What the compiled step's graphs depend on besides torch and the device (the compile artifacts' key):
    the drafter, the inputs' shapes and dtypes, the loss's constants, how it is compiled and wrapped, and
    the source of the code it traces."""
    m, cfg = cache.manifest, module.cfg
    # which target layers feed the drafter does not change its graph, only how many do (L)
    drafter = {k: v for k, v in module.drafter.cfg.to_dict().items() if k != "target_layer_ids"}
    return {"drafter": drafter, "T": cache.token_budget, "D": m.max_docs, "L": len(cache.layer_ids),
            "H": m.hidden_size, "A": cfg.num_anchors, "ce_chunk": module.ce_chunk, "gamma": module.gamma,
            "loss": cfg.loss, "dpace_alpha": cfg.dpace_alpha, "labels": cfg.labels, "storage": m.storage_dtype,
            "selector_loss_alpha": cfg.selector_loss_alpha,
            "scale_block": module.scale_block,
            "attention": module.attention, "autocast": module.autocast, "weights": str(module.drafter.fc.weight.dtype),
            "frozen": str(module.drafter.head_weight.dtype), "compile": COMPILE_OPTIONS,
            "regions": cfg.compile_regions, "world": d.world, "memory_budget": cfg.activation_memory_budget,
            "recompute": cfg.recompute,
            "code": source_hash(drafter_module, dflash2, objective, fp8, LossModule, Autocast)}


def resume(s: Setup) -> int:
    """The step to start from: the run's latest checkpoint (weights, optimizer, RNG), or, when that one is
    damaged, the newest earlier one that reads (said), else 0 (weights from --init-from if given: a resumed run
    has its own, so the source is read only at the start)."""
    found = s.d.broadcast(checkpoint.candidates(s.run))  # rank 0's: every rank resumes from the same step
    for i, ckpt in enumerate(found):
        try:
            start = checkpoint.load(ckpt, s.drafter, s.optimizer)["step"]
        except DflashError as e:
            if i + 1 == len(found):
                raise DflashError(f"{e}; no earlier checkpoint of {s.run} reads either") from None
            log.warning(f"{e}; resuming from the one before, {found[i + 1].name}")
            continue
        log.info(f"resuming {s.run} from step {start}")
        return start
    if s.cfg.init_from:
        init_weights(s.drafter, s.cfg.init_from)
    return 0


def train_step(s: Setup, inputs, lr: float) -> StepResult:
    """Forward, backward, clip, optimizer step; no host sync (the outputs stay on the device)."""
    if s.compiled:
        torch.compiler.cudagraph_mark_step_begin()
    group = s.optimizer.param_groups[0]
    if torch.is_tensor(group["lr"]):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr
    tensors = inputs.tensors()
    # drawn here, not in the compiled graph: AOT autograd's partitioner may recompute a random op in the
    # backward with fresh numbers under an activation memory budget (silently wrong gradients, torch 2.11-2.14)
    scores = torch.rand(tensors["input_ids"].shape[0], device=s.device)  # [T]
    loss, *outputs = s.loss_fn(**tensors, anchor_scores=scores)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(group["params"], s.cfg.grad_clip)
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, *outputs, grad_norm)


def loop(s: Setup, start: int) -> dict:
    """Steps start..total-1 over this rank's shard schedule: a log line every --log-every steps, a checkpoint
    every --save-every (and at the end), tau on the held-out shards every --eval-every (and at the end)."""
    cfg, d, run = s.cfg, s.d, s.run
    loader = ShardLoader(s.cache, rank_schedule(s.train_shards, cfg, d, start, s.total), s.device, cfg.prefetch,
                         cfg.follow, cfg.on_corrupt)
    metrics = Metrics(run / "metrics.jsonl" if d.is_main else None, start, s.dcfg, s.cache.token_budget,
                      cfg.num_anchors, d.world, s.device)
    if s.artifacts is not None:  # every rank loads them (each compiles), rank 0 alone keeps them
        log.info(f"compiling the training step ({s.artifacts.load()}) …")
    bar = tqdm(total=s.total, initial=start, unit="step", desc=f"train {run.name}", disable=not d.is_main,
               dynamic_ncols=True)
    step = saved = start
    compile_record = {}

    def save(at: int) -> int:
        metrics.check_finite(lambda: last_good(run))  # nothing non-finite is ever saved
        if d.is_main:
            checkpoint.save(run, at, s.drafter, s.optimizer, {"shards_seen": at * d.world})
        d.barrier()
        return at

    def evaluate(at: int) -> None:
        metrics.check_finite(lambda: last_good(run))
        if not (s.holdout and d.is_main):
            return
        result = acceptance(s.drafter.eval(), s.cache, s.holdout[: cfg.eval_shards], s.device)
        s.drafter.train()
        metrics.tau(at, result)
        log.info(f"step {at}: tau {result['tau']:.3f} (decoding order, pooled), {result['tau_per_request']:.3f} "
                 f"per document, on {len(result['shards'])} held-out shards")

    try:
        for _, inputs in loader:
            t0 = time.perf_counter()
            with out_of_memory_said(s, step + 1):
                out = train_step(s, inputs, lr_at(cfg, step, s.total))
            step = s.at = step + 1
            metrics.add(out, step)
            if step == start + 1:
                metrics.first_step(t0)
                if s.artifacts is not None:
                    compile_record = s.artifacts.finish(metrics.first_step_s)
                    metrics.compiled(step, compile_record)
            bar.update(1)
            if step % cfg.log_every == 0 or step == s.total:
                record = metrics.log(step, lr_at(cfg, step - 1, s.total), (step - 1) * d.world // len(s.train_shards),
                                     loader.wait_s)
                metrics.check_finite(lambda: last_good(run))
                bar.set_postfix_str(f"loss {record['loss']:.3f} acc1 {record['slot_acc'][0]:.2f}", refresh=False)
            if step % cfg.save_every == 0 or step == s.total:
                saved = save(step)
            if cfg.eval_every and step % cfg.eval_every == 0 and step != s.total:
                evaluate(step)
            if step >= s.total:
                break
        if saved != step:  # the schedule ran out early (skipped shards): keep what was learned
            saved = save(step)
        evaluate(step)
    finally:
        loader.close()
        bar.close()
    peak = torch.cuda.max_memory_allocated(s.device) if s.device.type == "cuda" else None
    log.info(f"{run}: trained to step {step} of {s.total}"
             + (f"; first step {metrics.first_step_s:.1f}s" if metrics.first_step_s else "")
             + (f"; recompiles after step 1: {metrics.recompiles}" if s.compiled else "")
             + (f"; peak GPU memory {memory.size(peak)} (planned {memory.size(s.memory_plan.peak)})" if peak else ""))
    return {"steps": step, "resumed_at": start, "first_step_s": metrics.first_step_s, "recompiles": metrics.recompiles,
            "compile": compile_record.get("compile"),
            "cudagraph_skips": metrics.cudagraph_skips() if s.compiled else 0,
            "input_wait_s": loader.wait_s, "skipped_shards": loader.skipped,
            "memory_plan_gb": s.memory_plan.peak / memory.GB, "peak_memory_gb": peak / memory.GB if peak else None}


@contextlib.contextmanager
def out_of_memory_said(s: Setup, step: int):
    """A CUDA out-of-memory in step `step` (its compile included) ends the run in one line: the plan, options that
    lower it, and the checkpoint the same command resumes from (nothing is saved after an out-of-memory)."""
    try:
        yield
    except Exception as e:
        if not memory.is_out_of_memory(e):
            raise
        options = memory.options_that_fit(s.shape, int(s.memory_plan.peak * 5 / 6))  # a sixth lower, or more
        fix = f"lower it with {', or '.join(options)}, and run the same command" if options else \
            "run the same command on a GPU with more free memory"
        raise DflashError(f"step {step}: out of GPU memory{memory.allocator_said(e)}; the plan estimated "
                          f"{s.memory_plan.describe()}; "
                          f"{last_good(s.run)}; {fix}: it resumes from there") from None


def stop_note(run: Path, at: str) -> str:
    """Where a stopped run is (`at`) and what it leaves: the line a stop (Ctrl-C, SIGTERM) prints."""
    return f"{at}; {last_good(run)}; run the same command again: it resumes from there"


def last_good(run: Path) -> str:
    """What a stopped run leaves: its latest checkpoint, the one the same command resumes from."""
    ckpt = checkpoint.latest(run)
    return f"its last good checkpoint, {ckpt.name}, is intact" if ckpt else "no checkpoint was saved yet"
