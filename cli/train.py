"""`dflash train`: stage two, the drafter."""

from __future__ import annotations

import click

from dflash_cli.extract import _int_list
from dflash_cli.main import user_errors


@click.command()
@click.option("--config", "preset", type=click.Path(dir_okay=False), help="TOML preset; its [train] table gives defaults.")
@click.option("--cache", help="The hidden-state cache (from dflash extract).")
@click.option("--out", help="Run folder; running the same command again resumes it.")
@click.option("--layers", callback=_int_list, help="Cached target layers the drafter reads (default: all).")
@click.option("--num-layers", type=int, help="Drafter depth (default 5).")
@click.option("--intermediate-size", type=int, help="Drafter MLP width (default: the target's).")
@click.option("--num-attention-heads", type=int, help="Query heads (default: the target's).")
@click.option("--num-key-value-heads", type=int, help="Key/value heads (default: the target's).")
@click.option("--head-dim", type=int, help="Head width (default: the target's).")
@click.option("--rope-theta", type=float, help="RoPE base (default: the target's).")
@click.option("--block-size", type=int, help="B: tokens per draft block (default 16).")
@click.option("--num-anchors", type=int, help="A: blocks per shard and step (default 512).")
@click.option("--gamma", type=float, help="Loss decay over block slots (default 7 for B=16).")
@click.option("--labels", type=click.Choice(["target", "data"]), help="Learn the target's predictions (default) or the data.")
@click.option("--mask-token-id", type=int, help="MASK token id (default: the target config's dflash_mask_token_id).")
@click.option("--lr", type=float, help="Peak learning rate (default 6e-4).")
@click.option("--warmup", type=float, help="Warmup fraction of all steps (default 0.04).")
@click.option("--weight-decay", type=float, help="AdamW weight decay (default 0).")
@click.option("--grad-clip", type=float, help="Gradient norm clip (default 1.0).")
@click.option("--epochs", type=int, help="Passes over the training shards (default 6).")
@click.option("--max-steps", type=int, help="Stop after N steps (sizes the schedule).")
@click.option("--holdout-shards", type=int, help="Shards kept out for eval (default 0).")
@click.option("--seed", type=int, help="Seed of shard order, anchors and init (default 0).")
@click.option("--init-from", help="Start from a run's or an exported drafter's weights (same shape) instead of random.")
@click.option("--save-every", type=int, help="Checkpoint every N steps (default 1000).")
@click.option("--log-every", type=int, help="Log every N steps (default 10).")
@click.option("--eval-every", type=int, help="Measure tau on held-out shards every N steps (default: at the end).")
@click.option("--eval-shards", type=int, help="Held-out shards per evaluation (default 4).")
@click.option("--device", help="auto (default), cpu, cuda, cuda:N.")
@click.option("--compile", type=click.Choice(["auto", "yes", "no"]), help="Compile the step (auto: on GPU).")
@click.option("--ce-chunk", type=int, help="Rows of logits per cross-entropy chunk (default 1024).")
@click.option("--prefetch", type=int, help="Shards read ahead (default 3).")
@click.option("--follow", is_flag=True, default=None, help="Train on shards as an extract commits them.")
@click.option("--on-corrupt", type=click.Choice(["fail", "skip"]), help="A corrupt shard: fail (default) or skip.")
@user_errors
def train(preset, **options):
    """Train a DFlash drafter on a hidden-state cache.

    Checkpoints (safetensors) go to --out every --save-every steps; the same command on that folder
    resumes. Under `torchrun -m dflash train ...` ranks split the shards (DDP).
    """
    from dflash.config import TrainConfig, build_config
    from dflash.train import train as run

    run(build_config(TrainConfig, preset, "train", options))
