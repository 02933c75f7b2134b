"""`dflash regenerate`: the target's own responses for a dataset."""

from __future__ import annotations

import click

from dflash.config import RegenerateConfig
from dflash_cli.main import user_errors
from dflash_cli.options import config_options


@click.command()
@config_options(RegenerateConfig, "regenerate")
@user_errors
def regenerate(preset, **options):
    """Rewrite responses (chat rows) or continue texts (text rows) with the target's own generations."""
    from dflash.config import build_config
    from dflash.regenerate import regenerate as run

    run(build_config(RegenerateConfig, preset, "regenerate", options))
