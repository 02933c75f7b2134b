"""`dflash extract`: stage one, the hidden-state cache."""

from __future__ import annotations

import click

from dflash.config import ExtractConfig
from dflash_cli.main import user_errors
from dflash_cli.options import config_options


@click.command()
@config_options(ExtractConfig, "extract")
@user_errors
def extract(preset, **options):
    """Run a frozen target over a dataset once and write its hidden-state cache.

    Resumes an interrupted run of the same command; refuses an --out that holds a cache made from
    other inputs. Under `torchrun -m dflash extract ...` every rank writes its own shards.
    """
    from dflash.config import build_config
    from dflash.extract import extract as run

    run(build_config(ExtractConfig, preset, "extract", options))
