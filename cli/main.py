"""The `dflash` command: a click group; each subcommand is a thin wrapper over a library function."""

from __future__ import annotations

import functools
import logging
import os
import sys

import click

from dflash import logs
from dflash.errors import DflashError


def user_errors(fn):
    """Turn a DflashError into one line on stderr and exit 1, with no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DflashError as e:
            rank = os.environ.get("RANK")
            prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
            click.echo(f"{prefix}error: {e}", err=True)
            sys.exit(1)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="dflash")
def main():
    """Train DFlash speculative-decoding drafters from an offline hidden-state cache."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logs.setup()  # dflash's log lines to stderr: stdout is for results (the JSON of --json)


def _register():
    from dflash_cli import cache, demo, eval, export, extract, plot, regenerate, spec, train

    main.add_command(extract.extract)
    main.add_command(train.train)
    main.add_command(export.export)
    main.add_command(eval.evaluate)
    main.add_command(plot.plot)
    main.add_command(spec.spec)
    main.add_command(regenerate.regenerate)
    main.add_command(cache.cache)
    main.add_command(demo.demo)


_register()
