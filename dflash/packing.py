"""Packing: assign documents to shards of T tokens and at most D documents, before the first forward.

Best-fit decreasing: documents longest first, each into the open shard with the least room that still
fits it. Deterministic (ties broken by row id), so the plan depends only on the document lengths.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

import numpy as np

PACKER = {"algorithm": "best-fit-decreasing", "version": 1}


@dataclass(frozen=True)
class Plan:
    row_ids: np.ndarray  # [S, D] int64, -1 = empty slot
    doc_lens: np.ndarray  # [S, D] int32, 0 = empty slot

    @property
    def num_shards(self) -> int:
        return len(self.row_ids)

    def shard_tokens(self) -> np.ndarray:  # [S] real tokens per shard
        return self.doc_lens.sum(1)


def plan_shards(row_ids: np.ndarray, lengths: np.ndarray, token_budget: int, max_docs: int) -> Plan:
    """Pack documents (row ids and lengths, every length <= token_budget) into shards."""
    assert len(row_ids) == len(lengths) and (lengths <= token_budget).all() and (lengths > 0).all()
    order = np.lexsort((row_ids, -lengths))  # longest first, then by row id
    shards: list[list[int]] = []  # document indices per shard
    room: list[int] = []  # free tokens per shard
    open_by_room: dict[int, deque[int]] = {}  # free tokens -> open shards with exactly that room
    rooms: list[int] = []  # sorted keys of open_by_room

    def push(shard: int) -> None:
        r = room[shard]
        if r == 0 or len(shards[shard]) == max_docs:
            return  # full: closed for good
        if r not in open_by_room:
            open_by_room[r] = deque()
            bisect.insort(rooms, r)
        open_by_room[r].append(shard)

    for doc in order:
        n = int(lengths[doc])
        i = bisect.bisect_left(rooms, n)
        if i < len(rooms):
            r = rooms[i]
            stack = open_by_room[r]
            shard = stack.popleft()  # the oldest shard with this room first
            if not stack:
                del open_by_room[r]
                rooms.pop(i)
        else:
            shard = len(shards)
            shards.append([])
            room.append(token_budget)
        shards[shard].append(doc)
        room[shard] -= n
        push(shard)

    out_rows = np.full((len(shards), max_docs), -1, np.int64)
    out_lens = np.zeros((len(shards), max_docs), np.int32)
    for s, docs in enumerate(shards):
        out_rows[s, : len(docs)] = row_ids[docs]
        out_lens[s, : len(docs)] = lengths[docs]
    return Plan(out_rows, out_lens)
