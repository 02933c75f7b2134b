"""`dflash export`: a trained run as the Hugging Face drafter SGLang and vLLM serve."""

from __future__ import annotations

import click

from dflash_cli.main import user_errors


@click.command(name="export")
@click.argument("run", type=click.Path(file_okay=False))
@click.option("--out", required=True, help="Folder for the Hugging Face drafter.")
@user_errors
def export(run, out):
    """Write RUN's latest checkpoint as a drafter SGLang and vLLM serve (DFlash reference format)."""
    from dflash.drafter_io import export as do_export

    path = do_export(run, out)
    click.echo(f"exported {run} -> {path} (config.json, model.safetensors, README.md)")
