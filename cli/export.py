"""`dflash export`: a trained run as the Hugging Face drafter SGLang and vLLM serve."""

from __future__ import annotations

import click

from dflash_cli.main import user_errors


@click.command(name="export")
@click.argument("run", type=click.Path(file_okay=False))
@click.option("--out", required=True, help="Folder for the Hugging Face drafter.")
@click.option("--format", "fmt", type=click.Choice(["zlab", "speculators"]), default="zlab", show_default=True,
              help="zlab: the reference DFlash layout (SGLang, vLLM, z-lab's model); speculators: the layout vLLM "
                   "detects by itself (`vllm serve DRAFTER`).")
@click.option("--verifier", help="speculators: the target's hub id recorded as the verifier (default: the name the "
                                 "cache was extracted from).")
@user_errors
def export(run, out, fmt, verifier):
    """Write RUN's latest checkpoint as a drafter SGLang and vLLM serve as it was trained.

    An export a server would attend differently from training (a window's causality, the target's last
    layer) is refused, naming why."""
    from dflash.drafter_io import export as do_export

    path = do_export(run, out, fmt, verifier)
    click.echo(f"exported {run} -> {path} ({fmt} layout: config.json, model.safetensors, README.md)")
