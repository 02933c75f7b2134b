"""The training log: what `dflash train` measures and writes to RUN/metrics.jsonl, a JSON line per logged
step (loss, per-slot accuracy, gradient norm, lr, tokens/s, input wait; on GPU MFU, recompiles, CUDA-graph
skips, peak memory), per evaluation (tau) and, for a compiled step, one after its first step (cold or warm, seconds).

Step outputs are summed on the device and read back only when a line is due (`log`): with the checkpoint
saves, the loop's only host syncs. A non-finite loss or gradient norm is remembered on the device too, with
its step, and stops the run at the next sync point, before anything is saved.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from dflash.errors import DflashError
from dflash.files import write_text_atomic
from dflash.objective import flops_per_step

# Dense bf16 tensor-core peaks (no sparsity) from the vendors' datasheets, TFLOP/s: the MFU denominator.
# A key matches a whole word (or words) of the device name, the first match wins: "H100 PCIe" before "H100".
# GPUs not in the table log no MFU.
PEAK_BF16_TFLOPS = (
    ("GB200", 2500.0), ("B200", 2250.0), ("B100", 1750.0),
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100", 989.4), ("H200", 989.4),
    ("GH200", 989.4), ("H800", 989.4), ("H20", 148.0),
    ("A100", 312.0), ("A800", 312.0), ("A10", 125.0), ("L40S", 362.1), ("L40", 181.0), ("L4", 121.0),
    ("RTX 4090", 165.2), ("RTX 6000 Ada", 364.2),
    ("MI300X", 1307.4), ("MI325X", 1307.4),
)


def peak_tflops(device_name: str) -> float | None:
    """The bf16 peak of a GPU by its name (`torch.cuda.get_device_name`), or None if it is not in the table."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", device_name):
            return tflops
    return None


class StepResult(NamedTuple):
    """What one training step returns (device tensors; those of a CUDA-graph replay are overwritten by the
    next one, so they are summed at once)."""

    loss: torch.Tensor  # [] weighted mean cross-entropy of the shard
    weight_sum: torch.Tensor  # [] sum of the slot weights: the loss's normaliser
    slot_correct: torch.Tensor  # [B-1] correct predictions among the trained slots
    slot_count: torch.Tensor  # [B-1] trained slots
    walk: torch.Tensor  # [4, A] the step's anchors, which are real, their documents, their accepted drafts
    visible_keys: torch.Tensor  # [] keys seen by all block queries together (the FLOP count's attention term)
    grad_norm: torch.Tensor  # [] global gradient norm, before clipping


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process: any growth after the first step is a recompile."""
    from torch._dynamo.utils import counters

    return counters["stats"].get("unique_graphs", 0)


def cudagraph_skips() -> int:
    """Compiled graphs that inductor ran without CUDA graphs (silently slower)."""
    from torch._dynamo.utils import counters

    return counters["inductor"].get("cudagraph_skips", 0)


class Metrics:
    """Sums of the step outputs since the last line, the timers and counters of the run, and its log file
    (written by rank 0 only: `path` None on the others)."""

    def __init__(self, path: Path | None, start: int, dcfg, token_budget: int, num_anchors: int, world: int,
                 device: torch.device):
        self.path, self.dcfg, self.T, self.A, self.world = path, dcfg, token_budget, num_anchors, world
        self.device, self.cuda = device, device.type == "cuda"
        self.peak = peak_tflops(torch.cuda.get_device_name(device)) if self.cuda else None
        if path is not None:
            truncate_metrics(path, start)
        z = lambda *s: torch.zeros(*s, device=device)  # noqa: E731
        self._zero = z
        self.bad_step = torch.full((), -1, dtype=torch.long, device=device)  # first non-finite step, -1: none
        self.bad_values = z(2)  # its loss and gradient norm
        self.first_step_s: float | None = None
        self.recompiles = 0
        self._graphs_after_first = 0
        self._skips_before = cudagraph_skips()  # a process-wide counter: this run's are the growth
        self._t_log, self._wait_log = time.perf_counter(), 0.0
        self._reset()

    def _reset(self) -> None:
        z, B = self._zero, self.dcfg.block_size
        self.loss, self.wsum, self.visible, self.grad_norm = z(()), z(()), z(()), z(())
        self.walks = []  # each step's walk inputs (clones: a CUDA-graph replay overwrites its outputs)
        self.correct, self.count, self.steps = z(B - 1), z(B - 1), 0

    def add(self, out: StepResult, step: int) -> None:
        """Sum step `step`'s outputs (no host sync)."""
        loss, wsum, gnorm = out.loss.detach().float(), out.weight_sum.detach(), out.grad_norm.detach().float()
        self.loss += loss * wsum
        self.wsum += wsum
        self.correct += out.slot_correct
        self.count += out.slot_count
        self.visible += out.visible_keys
        self.walks.append(out.walk.clone())
        self.grad_norm += gnorm
        self.steps += 1
        first_bad = ~(loss.isfinite() & gnorm.isfinite()) & (self.bad_step < 0)
        self.bad_step = torch.where(first_bad, step, self.bad_step)
        self.bad_values = torch.where(first_bad, torch.stack([loss, gnorm]), self.bad_values)

    def first_step(self, t0: float) -> None:
        """Time the first step, which compiles on GPU."""
        if self.cuda:
            torch.cuda.synchronize()  # host sync, once
        self.first_step_s = time.perf_counter() - t0
        self._graphs_after_first = compiled_graphs()

    def check_finite(self, last_good: Callable[[], str]) -> None:
        """Stop at a non-finite loss or gradient (host sync: call it where the loop syncs anyway);
        `last_good()` says what the stopped run leaves (read only when it stops)."""
        step = int(self.bad_step)
        if step >= 0:
            loss, gnorm = self.bad_values.tolist()
            raise DflashError(f"step {step}: the loss ({loss}) or the gradient norm ({gnorm}) is not finite; the run "
                              f"stops without saving ({last_good()}): lower --lr, or check the cache with "
                              f"`dflash cache verify`")

    def log(self, step: int, lr: float, epoch: int, input_wait_s: float) -> dict:
        """The line for the steps since the last one (host sync), appended to the log file."""
        now = time.perf_counter()
        dt, n = now - self._t_log, self.steps
        record = {"step": step, "loss": (self.loss / self.wsum.clamp(min=1e-6)).item(),
                  "slot_acc": [round(a, 4) for a in (self.correct / self.count.clamp(min=1)).tolist()],
                  "trained_slots_per_step": self.count.sum().item() / n,  # useful draft tokens
                  "tau_walk": self._tau_walk(),
                  "grad_norm": self.grad_norm.item() / n,
                  "lr": lr, "tokens_per_s": n * self.T * self.world / dt,
                  "input_wait": (input_wait_s - self._wait_log) / dt, "epoch": epoch}
        if self.cuda:
            if self.peak is not None:
                flops = flops_per_step(self.dcfg, self.T, self.A, self.visible.item() / n)
                record["mfu"] = n * flops / dt / (self.peak * 1e12)
            self.recompiles = compiled_graphs() - self._graphs_after_first
            record["recompiles"] = self.recompiles
            record["cudagraph_skips"] = self.cudagraph_skips()
            record["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9  # the allocator's count
        self._t_log, self._wait_log = now, input_wait_s
        self._reset()
        self._write(record)
        return record

    def _tau_walk(self) -> float:
        """SpecForge's walk over the anchors of the steps since the last line (host sync: a line is due)."""
        from dflash.evaluate import walk_tau

        total = visits = 0
        for walk in torch.stack(self.walks).tolist():
            t, v = walk_tau(*walk)
            total, visits = total + t, visits + v
        return total / max(visits, 1)

    def compiled(self, step: int, record: dict) -> None:
        """How the step compiled (`StepArtifacts.finish`'s record) at the first step of this process."""
        self._write({"step": step, **record})

    def tau(self, step: int, result: dict) -> None:
        self._write({"step": step, "tau": result["tau"], "tau_per_request": result["tau_per_request"],
                     "tau_anchors": result["tau_anchors"], "per_slot": result["per_slot"]})

    def cudagraph_skips(self) -> int:
        return cudagraph_skips() - self._skips_before

    def _write(self, record: dict) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


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
    write_text_atomic(path, "".join(line + "\n" for line in keep))
