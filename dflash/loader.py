"""The shard loader: a reader thread fills a ring of (pinned) host buffers with the next shards while
the device trains on the current one; on GPU the host->device copy runs on a side stream into a
staging buffer, and one device-to-device copy moves it into the step's persistent input buffers.

Only the layers the drafter uses are read (one zarr chunk per layer per shard). States travel as they
are stored: bf16, or fp8 bytes and their scales (half the bytes), dequantised inside the step. The time
the step waits for its input is measured.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from dflash import fp8
from dflash.cache import Cache, CorruptShardError

log = logging.getLogger(__name__)

FIELDS = ("hidden", "input_ids", "loss_mask", "target_ids", "doc_lens", "hidden_scale")
SHARD_FIELDS = ("input_ids", "loss_mask", "target_ids", "doc_lens")  # one chunk per shard


@dataclass
class Inputs:
    """The tensors one step reads: fixed shapes, fixed addresses (the compiled graph's static inputs)."""

    hidden: torch.Tensor  # [L, T, H] bf16 or float8_e4m3fn: layer-major, as the cache's chunks are (one read per chunk)
    input_ids: torch.Tensor  # [T] int32 (as cached; the step widens it)
    loss_mask: torch.Tensor  # [T] uint8
    target_ids: torch.Tensor  # [T] int32
    doc_lens: torch.Tensor  # [D] int32
    hidden_scale: torch.Tensor | None = None  # fp8 storage: [L, T, G] bf16

    @staticmethod
    def empty(T: int, L: int, H: int, D: int, device, pin: bool = False, scale_block: int | None = None) -> "Inputs":
        """Buffers for bf16 states, or (scale_block given) for fp8 states and their scales."""
        def make(shape, dtype):
            t = torch.zeros(shape, dtype=torch.uint8 if dtype == torch.float8_e4m3fn else dtype, device=device)
            return (t.pin_memory() if pin else t).view(dtype)  # (fp8 as bytes: zero-filled on any build)
        fp8_storage = scale_block is not None
        return Inputs(make((L, T, H), torch.float8_e4m3fn if fp8_storage else torch.bfloat16), make(T, torch.int32),
                      make(T, torch.uint8), make(T, torch.int32), make(D, torch.int32),
                      make((L, T, fp8.num_groups(H, scale_block)), fp8.SCALE_DTYPE) if fp8_storage else None)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f: getattr(self, f) for f in FIELDS if getattr(self, f) is not None}

    def copy_(self, other: "Inputs", non_blocking: bool = False) -> None:
        for f, t in self.tensors().items():
            t.copy_(getattr(other, f), non_blocking=non_blocking)


def epoch_order(shards: list[int], seed: int, epoch: int) -> list[int]:
    """The shard order of one epoch: a permutation fixed by (seed, epoch)."""
    rng = np.random.default_rng([seed, epoch])
    return [shards[i] for i in rng.permutation(len(shards))]


class ShardLoader:
    """Yields `Inputs` (always the same device tensors, refilled) for a sequence of shard ids.

    `schedule` lists the shard ids to deliver, in order (epoch orders, cut to this rank and cursor).
    With `follow`, a shard that is not committed yet is waited for, and a later one that is goes first."""

    def __init__(self, cache: Cache, schedule, device: torch.device, prefetch: int = 3, follow: bool = False,
                 on_corrupt: str = "fail", poll_s: float = 2.0):
        m = cache.manifest
        T, D, H, L = m.token_budget, m.max_docs, m.hidden_size, len(cache.layer_ids)
        self.cache, self.device, self.follow, self.on_corrupt = cache, device, follow, on_corrupt
        self.poll_s = poll_s
        self.cuda = device.type == "cuda"
        block = cache.scale_block
        self.inputs = Inputs.empty(T, L, H, D, device, scale_block=block)  # the step's static inputs
        if self.cuda:
            for t in self.inputs.tensors().values():
                torch._dynamo.mark_static_address(t)
            self.staging = Inputs.empty(T, L, H, D, device, scale_block=block)
            self.stream = torch.cuda.Stream(device)
        self.free: queue.Queue = queue.Queue()  # (host buffer, CUDA event its last H2D copy recorded)
        for _ in range(prefetch):
            self.free.put((Inputs.empty(T, L, H, D, "cpu", pin=self.cuda, scale_block=block), None))
        self.full: queue.Queue = queue.Queue(maxsize=prefetch)
        self.wait_s = 0.0  # time the training loop waited for input
        self.skipped: list[int] = []
        self._stop = False
        self._thread = threading.Thread(target=self._read_all, args=(list(schedule),), daemon=True,
                                        name="dflash-reader")
        self._thread.start()

    # -- reader thread --------------------------------------------------------------------------

    def _read_all(self, schedule: list[int]):
        try:
            pending = list(schedule)
            while pending and not self._stop:
                i = self._next_committed(pending) if self.follow else 0
                if i is None:
                    time.sleep(self.poll_s)  # --follow: the extract has not committed these yet
                    continue
                self._read_one(pending.pop(i))
            self.full.put(None)
        except BaseException as e:  # handed to the training loop
            self.full.put(e)

    def _next_committed(self, pending: list[int], lookahead: int = 64) -> int | None:
        """Index of the first of the next `lookahead` scheduled shards that is committed."""
        for i, s in enumerate(pending[:lookahead]):
            if self.cache.commit_record(s) is not None:
                return i
        return None

    def _read_one(self, s: int) -> None:
        while True:  # a free buffer, or the loader is closing (the loop may hold every buffer)
            try:
                buf, copied = self.free.get(timeout=0.1)
                break
            except queue.Empty:
                if self._stop:
                    return
        if copied is not None:
            copied.synchronize()  # reader-thread sync: the last H2D copy out of this buffer is done
        try:  # straight from the chunk files into (pinned) memory, checked against the commit record
            self.cache.read_shard_into(s, fp8.to_bits(buf.hidden), {f: getattr(buf, f).numpy() for f in SHARD_FIELDS},
                                       hidden_scale=None if buf.hidden_scale is None else fp8.to_bits(buf.hidden_scale))
        except CorruptShardError as e:
            self.free.put((buf, None))
            if self.on_corrupt == "fail":
                raise
            log.warning(f"skipping shard {s}: {e.detail}")
            self.skipped.append(s)
            return
        self.full.put((s, buf))

    # -- training loop side ---------------------------------------------------------------------

    def _take(self):
        t0 = time.perf_counter()
        item = self.full.get()
        self.wait_s += time.perf_counter() - t0
        if isinstance(item, BaseException):
            raise item
        return item

    def _stage(self, consumed) -> tuple | None:
        """Start moving the next shard towards the device. CUDA: an H2D copy into the staging buffer on
        the side stream, after the previous staging contents were consumed (`consumed` event)."""
        item = self._take()
        if item is None:
            return None
        s, buf = item
        copied = None
        if self.cuda:
            with torch.cuda.stream(self.stream):
                if consumed is not None:
                    self.stream.wait_event(consumed)
                self.staging.copy_(buf, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.stream)
        return s, buf, copied

    def __iter__(self):
        staged = self._stage(None)
        while staged is not None:
            s, buf, copied = staged
            consumed = None
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(copied)  # device-side wait, no host sync
                self.inputs.copy_(self.staging, non_blocking=True)  # D2D into the static buffers
                consumed = torch.cuda.Event()
                consumed.record()
            else:
                self.inputs.copy_(buf)
            self.free.put((buf, copied))  # the reader waits for `copied` before refilling it
            yield s, self.inputs
            # the step is queued on the device: the next shard's H2D now overlaps it
            staged = self._stage(consumed)

    def close(self) -> None:
        self._stop = True
        while self._thread.is_alive():
            try:
                item = self.full.get(timeout=0.1)
                if isinstance(item, tuple):
                    self.free.put((item[1], None))
            except queue.Empty:
                pass
