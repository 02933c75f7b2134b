import numpy as np
import pytest

from dflash.extract import make_batches
from dflash.packing import plan_shards


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_places_every_document_once_within_budget(seed):
    rng = np.random.default_rng(seed)
    n, T, D = 3000, 4096, 16
    lengths = np.clip(rng.lognormal(np.log(500), 0.9, n), 2, T).astype(np.int64)
    row_ids = rng.permutation(10 * n)[:n]
    plan = plan_shards(row_ids, lengths, T, D)
    placed = plan.row_ids[plan.row_ids >= 0]
    assert sorted(placed) == sorted(row_ids), "every document exactly once"
    assert (plan.doc_lens.sum(1) <= T).all() and ((plan.row_ids >= 0).sum(1) <= D).all()
    by_row = dict(zip(row_ids, lengths))
    assert all(by_row[r] == n for r, n in zip(plan.row_ids.ravel(), plan.doc_lens.ravel()) if r >= 0)
    assert ((plan.row_ids >= 0) == (plan.doc_lens > 0)).all(), "empty slots: row -1 and length 0"
    # empty slots only after the documents of a shard
    filled = plan.row_ids >= 0
    assert (filled[:, :-1] | ~filled[:, 1:]).all()
    assert lengths.sum() / (plan.num_shards * T) > 0.97, "best-fit decreasing packs chat lengths tightly"


def test_plan_is_deterministic_and_respects_max_docs():
    lengths = np.full(100, 10, np.int64)
    a = plan_shards(np.arange(100), lengths, 1000, 8)
    b = plan_shards(np.arange(100), lengths, 1000, 8)
    assert np.array_equal(a.row_ids, b.row_ids) and a.num_shards == 13  # 100 docs / 8 per shard
    assert ((a.row_ids >= 0).sum(1) <= 8).all()


def test_make_batches_bounds_rows_and_padded_tokens():
    lengths = [500, 20, 480, 30, 100, 499, 10]
    batches = make_batches(lengths, batch_size=3, batch_tokens=1000)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3 and len(b) * max(lengths[i] for i in b) <= 1000
        assert lengths[b[0]] == max(lengths[i] for i in b)
    assert make_batches([], batch_size=4, batch_tokens=100) == []


def _padded(batches, lengths):
    return sum(len(b) * lengths[b[0]] for b in batches)


@pytest.mark.parametrize("seed", [0, 1])
def test_make_batches_is_the_cheapest_split_of_the_sorted_documents(seed):
    """Against every split of a small sorted list into consecutive batches (brute force)."""
    from itertools import combinations

    from dflash.extract import FORWARD_COST_TOKENS

    lengths = np.random.default_rng(seed).integers(100, 3000, 11).tolist()
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    best = None
    for k in range(len(order)):
        for cuts in combinations(range(1, len(order)), k):
            bs = [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))]
            if all(len(b) <= 4 and len(b) * lengths[b[0]] <= 6000 for b in bs):
                c = _padded(bs, lengths) + FORWARD_COST_TOKENS * len(bs)
                best = c if best is None else min(best, c)
    got = make_batches(lengths, batch_size=4, batch_tokens=6000)
    assert _padded(got, lengths) + FORWARD_COST_TOKENS * len(got) == best


def test_make_batches_pads_chat_lengths_less_than_filling_each_forward():
    """Chat-like lengths: cutting where lengths jump pads about half as much as filling every forward to
    its row or token limit, for a few more forwards."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(700), 0.8, 300), 64, 3072).astype(int).tolist()
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    greedy, i = [], 0
    while i < len(order):
        rows = min(32, 32768 // lengths[order[i]])
        greedy.append(order[i : i + rows])
        i += rows
    got = make_batches(lengths, batch_size=32, batch_tokens=32768)
    real = sum(lengths)
    assert _padded(got, lengths) / real - 1 < 0.6 * (_padded(greedy, lengths) / real - 1)
    assert len(got) < 1.5 * len(greedy)
    assert all(len(b) <= 32 and len(b) * lengths[b[0]] <= 32768 for b in got)
