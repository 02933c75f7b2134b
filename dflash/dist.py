"""torchrun helpers: rank, world size, barriers. One process without torchrun is rank 0 of 1."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def init_dist(backend: str = "gloo") -> Dist:
    """Join the torchrun group if there is one. Rank 0 may plan a large dataset while the others wait,
    hence the long timeout."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(hours=4))
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def close_dist() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
