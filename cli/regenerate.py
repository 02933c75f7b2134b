"""`dflash regenerate`: the target's own responses for a dataset."""

from __future__ import annotations

import json

import click

from dflash.config import RegenerateConfig
from dflash_cli.main import user_errors
from dflash_cli.options import config_options


@click.command()
@config_options(RegenerateConfig, "regenerate")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (rows, written, cut_by_length, ...).")
@user_errors
def regenerate(preset, as_json, **options):
    """Rewrite responses (chat rows: every assistant turn, or the last) or continue texts (text rows) with the
    target's own generations: in this process, or from the target's OpenAI-compatible server (--server URL:
    vLLM, SGLang, `transformers serve`), requests in flight concurrently.

    The output is in input order; the same command resumes an interrupted run (no finished row is generated
    twice) and refuses an --out written with other settings.
    """
    from dflash.config import build_config
    from dflash.regenerate import regenerate as run

    result = run(build_config(RegenerateConfig, preset, "regenerate", options))
    if as_json:
        click.echo(json.dumps(result))
