"""Table tests of the training loop's arithmetic: the learning-rate schedule, the shard split and each
rank's shard schedule, the FLOP count and the GPU peaks MFU is measured against."""

import pytest

from dflash.config import TrainConfig
from dflash.dist import Dist
from dflash.drafter import DrafterConfig
from dflash.errors import DflashError
from dflash.loader import epoch_order
from dflash.metrics import peak_tflops
from dflash.objective import flops_per_step
from dflash.train import lr_at, rank_schedule, split_shards


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(cache="c", out="o", **kw)


@pytest.mark.parametrize("lr,warmup,min_ratio,total,step,expected", [
    (1.0, 0.1, 0.0, 20, 0, 0.5),  # warmup: ceil(0.1 * 20) = 2 steps, linear from lr / 2
    (1.0, 0.1, 0.0, 20, 1, 1.0),
    (1.0, 0.1, 0.0, 20, 2, 1.0),  # the cosine starts at the peak
    (1.0, 0.1, 0.0, 20, 11, 0.5),  # half way through the cosine
    (1.0, 0.1, 0.0, 20, 20, 0.0),  # its end
    (1.0, 0.1, 0.0, 20, 25, 0.0),  # past the end (a resumed run with a shorter schedule): stays at the floor
    (1.0, 0.1, 0.1, 20, 11, 0.55),  # the cosine decays to lr * min_lr_ratio
    (1.0, 0.1, 0.1, 20, 20, 0.1),
    (6e-4, 0.0, 0.0, 10, 0, 6e-4),  # no warmup still takes one step: the first step runs at the peak
    (2.0, 0.04, 0.0, 100, 3, 2.0),  # ceil(4.0) = 4 warmup steps: step 3 reaches the peak
])
def test_learning_rate_schedule(lr, warmup, min_ratio, total, step, expected):
    cfg = _cfg(lr=lr, warmup=warmup, min_lr_ratio=min_ratio)
    assert lr_at(cfg, step, total) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("num_shards,holdout,seed,train,held", [
    (10, 3, 0, [0, 1, 2, 5, 6, 8, 9], [3, 4, 7]),
    (10, 3, 1, [0, 3, 4, 5, 6, 7, 8], [1, 2, 9]),
    (8, 1, 7, [0, 2, 3, 4, 5, 6, 7], [1]),
    (5, 0, 0, [0, 1, 2, 3, 4], []),
])
def test_shard_split_is_a_seeded_choice(num_shards, holdout, seed, train, held):
    assert split_shards(_cfg(holdout_shards=holdout, seed=seed), num_shards) == (train, held)


def test_a_holdout_of_every_shard_is_refused():
    with pytest.raises(DflashError, match="--holdout-shards 4 leaves no shard of 4 to train on"):
        split_shards(_cfg(holdout_shards=4), 4)


@pytest.mark.parametrize("world,rank,start,total,expected", [
    (1, 0, 0, 8, [2, 4, 3, 0, 1, 1, 4, 3]),  # epoch 0's order, then epoch 1's
    (1, 0, 5, 8, [1, 4, 3]),  # a resumed run continues the same schedule
    (2, 0, 0, 6, [2, 3, 1, 3, 4, 1]),  # 5 shards over 2 ranks: 2 steps an epoch, one shard left out of each
    (2, 1, 0, 6, [4, 0, 4, 0, 2, 0]),
    (2, 1, 2, 6, [4, 0, 2, 0]),
])
def test_rank_schedule_deals_each_epoch_order_out_across_ranks(world, rank, start, total, expected):
    cfg = _cfg(seed=0)
    assert rank_schedule([0, 1, 2, 3, 4], cfg, Dist(rank, world), start, total) == expected
    order = epoch_order([0, 1, 2, 3, 4], 0, 0)
    per_epoch = 5 // world
    first_epoch = rank_schedule([0, 1, 2, 3, 4], cfg, Dist(rank, world), 0, per_epoch)
    assert first_epoch == order[rank : world * per_epoch : world]


_SMALL = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, intermediate_size=16,
              target_layer_ids=[1, 2], vocab_size=10, block_size=4)


@pytest.mark.parametrize("num_layers,visible,expected", [
    # per layer 6[(Wq+Wo+Wmlp)AB + (Wk+Wv)(AB+T)] = 6[(128+384)16 + 64(16+32)] = 67584; fc 6 L H^2 T = 24576;
    # head 4 V H A(B-1) = 3840; attention 12 heads head_dim visible layers = 96 visible
    (1, 100, 67584 + 24576 + 3840 + 9600),
    (2, 100, 2 * 67584 + 24576 + 3840 + 2 * 9600),
    (1, None, 67584 + 24576 + 3840 + 96 * 16 * (32 / 2 + 4)),  # default: half a shard of context per query
])
def test_flop_count(num_layers, visible, expected):
    cfg = DrafterConfig(num_layers=num_layers, **_SMALL)
    assert flops_per_step(cfg, 32, 4, visible) == pytest.approx(expected)


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H200", 989.4), ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H20", 148.0),
    ("NVIDIA H200 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA A10", 125.0), ("NVIDIA L40S", 362.1), ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0),
    ("NVIDIA GeForce RTX 4090", 165.2), ("NVIDIA B200", 2250.0), ("NVIDIA GB200", 2500.0),
    ("AMD Instinct MI300X", 1307.4),
    ("NVIDIA A10G", None), ("Tesla T4", None), ("NVIDIA GeForce RTX 3060", None), ("NVIDIA H100X", None),
])
def test_mfu_uses_the_peak_of_the_gpu_it_runs_on(name, tflops):
    assert peak_tflops(name) == tflops
