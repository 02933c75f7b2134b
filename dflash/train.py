"""`dflash train`: the drafter's training loop over a hidden-state cache.

One step = one shard: T context tokens, A anchors, blocks of B. On GPU the loss (forward) is compiled
once with torch.compile(mode="reduce-overhead", dynamic=False) and its backward follows as CUDA
graphs; every input is a persistent device buffer that the loader refills, so nothing recompiles
after the first step (counted, logged). On CPU the same step runs eagerly (attention through SDPA).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import dflash
from dflash import checkpoint, fp8
from dflash.cache import TARGET_CONFIG_FILE, Cache
from dflash.config import TrainConfig
from dflash.dist import Dist, close_dist, init_dist
from dflash.drafter import Drafter, DrafterConfig
from dflash.errors import DflashError
from dflash.evaluate import acceptance, copy_weights, read_drafter
from dflash.loader import ShardLoader, epoch_order
from dflash.objective import drafter_loss, flops_per_step
from dflash.target import resolve_device

PEAK_TFLOPS = 811.0  # bf16 dense matmul measured on the project's H200: the MFU denominator


# -- setup --------------------------------------------------------------------------------------------


def drafter_config(cfg: TrainConfig, cache: Cache) -> DrafterConfig:
    """The drafter's shape: the cache fixes hidden and vocab sizes; other widths default to the target's."""
    m = cache.manifest
    target = json.loads((cache.path / TARGET_CONFIG_FILE).read_text())
    target = target.get("text_config", target)
    rope = target.get("rope_parameters") or {}
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else target.get("dflash_mask_token_id")
    if mask is None:
        raise DflashError("--mask-token-id is needed: the target's config names no dflash_mask_token_id")
    if not 0 <= mask < m["vocab_size"]:
        raise DflashError(f"--mask-token-id {mask} is outside the target's vocabulary (size {m['vocab_size']})")

    def pick(name, default=None):
        value = getattr(cfg, name, None)
        return value if value is not None else target.get(name, default)

    heads = pick("num_attention_heads")
    return DrafterConfig(
        # MoE targets without a dense MLP width (Qwen3.5-MoE): 3x hidden, the dense Qwen3 ratio
        num_layers=cfg.num_layers, hidden_size=m["hidden_size"], intermediate_size=pick("intermediate_size") or 3 * m["hidden_size"],
        num_attention_heads=heads, num_key_value_heads=pick("num_key_value_heads", heads),
        head_dim=pick("head_dim") or m["hidden_size"] // heads, rms_norm_eps=target.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.rope_theta or rope.get("rope_theta") or target.get("rope_theta", 1e6),
        block_size=cfg.block_size, target_layer_ids=list(cache.layer_ids), mask_token_id=int(mask),
        vocab_size=m["vocab_size"], max_position_embeddings=target.get("max_position_embeddings", 40960))


def preflight(cfg: TrainConfig, cache: Cache, dcfg: DrafterConfig) -> None:
    """Mismatches fail here, before any heavy work."""
    T = cache.token_budget
    if cfg.block_size > T:
        raise DflashError(f"--block-size {cfg.block_size} does not fit shards of {T} tokens")
    if cfg.num_anchors > T:
        raise DflashError(f"--num-anchors {cfg.num_anchors} is more than the {T} positions of a shard")
    if dcfg.num_attention_heads % dcfg.num_key_value_heads:
        raise DflashError(f"{dcfg.num_attention_heads} attention heads are not a multiple of "
                          f"{dcfg.num_key_value_heads} key/value heads")
    if not cache.committed() and not cfg.follow:
        raise DflashError(f"{cache.path}: no committed shard yet (extract still running? use --follow)")


def init_weights(drafter: Drafter, path: str) -> None:
    """--init-from: another run's or an export's weights, if the drafter it holds has this run's shape."""
    src, weights, _ = read_drafter(path)
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


def run_config(cfg: TrainConfig, dcfg: DrafterConfig, cache: Cache, train_shards: list[int], holdout: list[int]) -> dict:
    return {"dflash_version": dflash.__version__, "train": asdict(cfg), "drafter": dcfg.to_dict(),
            "train_shards": train_shards,
            "cache": {"path": str(cache.path.resolve()), "cache_key": cache.manifest["cache_key"],
                      "layer_ids": cache.manifest["layer_ids"], "target": cache.manifest["target"]},
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
    checkpoint.write_json_atomic(path, config)
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
    """The drafter with its loss as forward: what torch.compile and DDP wrap."""

    def __init__(self, drafter: Drafter, cfg: TrainConfig, attention: str, autocast: bool,
                 scale_block: int | None = None):
        super().__init__()
        self.drafter, self.cfg, self.attention, self.autocast = drafter, cfg, attention, autocast
        self.gamma = cfg.resolved_gamma()
        self.scale_block = scale_block  # fp8 cache: channels per scale

    def forward(self, hidden, input_ids, loss_mask, target_ids, doc_lens, hidden_scale=None):
        """hidden [L, T, H] (the loader's layer-major layout: bf16, or e4m3 with hidden_scale [L, T, G]);
        the rest as `drafter_loss` takes them."""
        if hidden_scale is not None:  # inside the compiled step: fuses into the copy that feeds fc
            hidden = fp8.dequantize(hidden, hidden_scale, self.scale_block,
                                    torch.bfloat16 if self.autocast else self.drafter.fc.weight.dtype)
        with torch.autocast("cuda", torch.bfloat16, enabled=self.autocast):
            out = drafter_loss(self.drafter, hidden.transpose(0, 1), input_ids.long(), loss_mask,
                               target_ids.long(), doc_lens,
                               num_anchors=self.cfg.num_anchors, gamma=self.gamma, labels_from=self.cfg.labels,
                               attention=self.attention, ce_chunk=self.cfg.ce_chunk)
        return out.loss, out.weight_sum, out.slot_correct, out.slot_count, out.visible_keys


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process: any growth after the first step is a recompile."""
    from torch._dynamo.utils import counters

    return counters["stats"].get("unique_graphs", 0)


def cudagraph_skips() -> int:
    """Compiled graphs that inductor ran without CUDA graphs (silently slower)."""
    from torch._dynamo.utils import counters

    return counters["inductor"].get("cudagraph_skips", 0)


# -- the loop -----------------------------------------------------------------------------------------


def train(cfg: TrainConfig, log=print) -> dict:
    cfg.validate()
    device = resolve_device(cfg.device)
    d = init_dist("nccl" if device.type == "cuda" else "gloo")
    try:
        return _train(cfg, d, device, log if d.is_main else (lambda *a, **k: None))
    finally:
        close_dist()


def _train(cfg: TrainConfig, d: Dist, device: torch.device, log) -> dict:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    cache = Cache(cfg.cache, layers=cfg.layers)
    dcfg = drafter_config(cfg, cache)
    preflight(cfg, cache, dcfg)
    train_shards, holdout = split_shards(cfg, cache.num_shards)
    if not cfg.follow:  # without --follow, train on what is committed now
        done = set(cache.committed())
        train_shards = [s for s in train_shards if s in done]
    if d.world > 1 and cfg.on_corrupt == "skip":
        raise DflashError("--on-corrupt skip runs in one process only (DDP ranks would fall out of step); "
                          "`dflash cache verify` names bad shards, and deleting their commits/ records excludes them")
    if len(train_shards) < d.world:
        raise DflashError(f"{len(train_shards)} training shards cannot be split across {d.world} ranks")
    run = Path(cfg.out)
    config = None
    if d.is_main:  # a resumed run keeps the shard lists it started with, whatever was committed since
        config = check_or_write_run_config(run, run_config(cfg, dcfg, cache, train_shards, holdout), cfg)
    config = d.broadcast(config)
    train_shards, holdout = config.get("train_shards", train_shards), config["holdout_shards"]

    embed, head = cache.target_weights(device, torch.bfloat16 if cuda else torch.float32)
    torch.manual_seed(cfg.seed)
    drafter = Drafter(dcfg, embed, head).to(device)
    drafter.reset_parameters(seed=cfg.seed)
    params = list(drafter.parameters())
    lr = torch.tensor(cfg.lr, device=device) if cuda else cfg.lr  # a tensor: changing it never recompiles
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, fused=cuda)

    start = 0
    ckpt = d.broadcast(checkpoint.latest(run))  # rank 0's: every rank resumes from the same step
    if ckpt is not None:
        start = checkpoint.load(ckpt, drafter, optimizer)["step"]
        log(f"resuming {run} from step {start}")
    elif cfg.init_from:  # a resumed run has its own weights: the source is read only at the start
        init_weights(drafter, cfg.init_from)
    total = cfg.max_steps or cfg.epochs * (len(train_shards) // d.world)
    if start >= total:
        log(f"{run}: already trained for {start} steps: nothing to do")
        return {"steps": start, "resumed_at": start}
    if d.is_main:
        truncate_metrics(run / "metrics.jsonl", start)

    module = LossModule(drafter, cfg, "flex" if cuda else "eager", autocast=cuda, scale_block=cache.scale_block)
    if d.world > 1:
        # broadcast_buffers=False: the frozen embeddings/head are buffers, identical on every rank (each loads
        # them from the cache); DDP's default would sync with the host and broadcast them every step
        module = torch.nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if cuda else None,
                                                           broadcast_buffers=False)
    compiled = cfg.compile == "yes" or (cfg.compile == "auto" and cuda)
    loss_fn = torch.compile(module, mode="reduce-overhead", dynamic=False) if compiled else module

    schedule = rank_schedule(train_shards, cfg, d, start, total)
    committed = set(cache.committed())
    holdout = [s for s in holdout if s in committed]
    loader = ShardLoader(cache, schedule, device, cfg.prefetch, cfg.follow, cfg.on_corrupt, log)
    T = cache.token_budget
    bar = tqdm(total=total, initial=start, unit="step", desc=f"train {run.name}", disable=not d.is_main,
               dynamic_ncols=True)
    acc = _Accumulator(dcfg.block_size, device)
    saved = start

    def save(at: int) -> None:
        nonlocal saved
        if d.is_main:
            checkpoint.save(run, at, drafter, optimizer, {"shards_seen": at * d.world})
        d.barrier()
        saved = at

    def evaluate(at: int) -> None:
        if not (holdout and d.is_main):
            return
        result = acceptance(drafter.eval(), cache, holdout[: cfg.eval_shards], device)
        drafter.train()
        with (run / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": at, "tau": result["tau"], "per_slot": result["per_slot"]}) + "\n")
        bar.write(f"step {at}: tau {result['tau']:.3f} on {len(result['shards'])} held-out shards")

    step, t_log, wait_log, first_step_s, compiles_after_first = start, time.perf_counter(), 0.0, None, 0
    skips_before = cudagraph_skips()  # process-wide counter: report this run's
    try:
        for shard, inputs in loader:
            t0 = time.perf_counter()
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            if cuda:
                optimizer.param_groups[0]["lr"].fill_(lr_at(cfg, step, total))
            else:
                optimizer.param_groups[0]["lr"] = lr_at(cfg, step, total)
            loss, wsum, correct, count, visible = loss_fn(**inputs.tensors())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            acc.add(loss, wsum, correct, count, visible)  # sums on the device: graph outputs are reused
            step += 1
            if step == start + 1:
                if cuda:
                    torch.cuda.synchronize()  # host sync, once: time the first (compiling) step
                first_step_s = time.perf_counter() - t0
                graphs_after_first = compiled_graphs()
            bar.update(1)
            if step % cfg.log_every == 0 or step == total:
                now = time.perf_counter()
                record = acc.flush(step)  # host sync: every log_every steps only
                n = record.pop("_steps")
                visible = record.pop("_visible_keys")
                dt = now - t_log
                record.update(lr=lr_at(cfg, step - 1, total), tokens_per_s=n * T * d.world / dt,
                              input_wait=(loader.wait_s - wait_log) / dt, epoch=(step - 1) * d.world // len(train_shards))
                if cuda:
                    flops = flops_per_step(dcfg, T, cfg.num_anchors, visible)
                    record["mfu"] = n * flops / dt / (PEAK_TFLOPS * 1e12)
                    compiles_after_first = compiled_graphs() - graphs_after_first
                    record["recompiles"] = compiles_after_first
                    record["cudagraph_skips"] = cudagraph_skips() - skips_before
                t_log, wait_log = now, loader.wait_s
                bar.set_postfix_str(f"loss {record['loss']:.3f} acc1 {record['slot_acc'][0]:.2f}", refresh=False)
                if d.is_main:
                    with (run / "metrics.jsonl").open("a") as f:
                        f.write(json.dumps(record) + "\n")
            if step % cfg.save_every == 0 or step == total:
                save(step)
            if cfg.eval_every and step % cfg.eval_every == 0 and step != total:
                evaluate(step)
            if step >= total:
                break
        if saved != step:  # the schedule ran out early (skipped shards): keep what was learned
            save(step)
        evaluate(step)
    finally:
        loader.close()
        bar.close()
    log(f"{run}: trained to step {step} of {total}" + (f"; first step {first_step_s:.1f}s" if first_step_s else "")
        + (f"; recompiles after step 1: {compiles_after_first}" if compiled else ""))
    return {"steps": step, "resumed_at": start, "first_step_s": first_step_s, "recompiles": compiles_after_first,
            "cudagraph_skips": cudagraph_skips() - skips_before if compiled else 0,
            "input_wait_s": loader.wait_s, "skipped_shards": loader.skipped}


class _Accumulator:
    """Sums of the step outputs on the device; read back only when a log line is due."""

    def __init__(self, block_size: int, device):
        self.device, self.B = device, block_size
        self.reset()

    def reset(self):
        z = lambda *s: torch.zeros(*s, device=self.device)  # noqa: E731
        self.loss, self.wsum, self.visible = z(()), z(()), z(())
        self.correct, self.count, self.steps = z(self.B - 1), z(self.B - 1), 0

    def add(self, loss, wsum, correct, count, visible):
        self.loss += loss.detach() * wsum.detach()
        self.wsum += wsum.detach()
        self.correct += correct
        self.count += count
        self.visible += visible
        self.steps += 1

    def flush(self, step: int) -> dict:
        loss = (self.loss / self.wsum.clamp(min=1e-6)).item()
        acc = (self.correct / self.count.clamp(min=1)).tolist()
        out = {"step": step, "loss": loss, "slot_acc": [round(a, 4) for a in acc], "_steps": self.steps,
               "trained_slots_per_step": self.count.sum().item() / self.steps,  # useful draft tokens
               "_visible_keys": self.visible.item() / self.steps}
        self.reset()
        return out


def truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop log lines past the checkpoint (and a line torn by a crash) so the log reads as
    one run. Replaced atomically: a kill here loses nothing."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    checkpoint.write_text_atomic(path, "".join(line + "\n" for line in keep))
