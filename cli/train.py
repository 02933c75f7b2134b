"""`dflash train`: stage two, the drafter."""

from __future__ import annotations

import click

from dflash.config import TrainConfig
from dflash_cli.main import user_errors
from dflash_cli.options import config_options


@click.command()
@config_options(TrainConfig, "train")
@user_errors
def train(preset, **options):
    """Train a DFlash drafter on a hidden-state cache.

    Checkpoints (safetensors) go to --out every --save-every steps; the same command on that folder
    resumes. Under `torchrun -m dflash train ...` ranks split the shards (DDP).
    """
    from dflash.config import build_config
    from dflash.train import train as run

    run(build_config(TrainConfig, preset, "train", options))
