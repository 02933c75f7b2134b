"""`dflash regenerate`: the target's own responses for a dataset."""

from __future__ import annotations

import click

from dflash_cli.main import user_errors


@click.command()
@click.option("--target", required=True, help="The Hugging Face target (folder or hub id).")
@click.option("--data", multiple=True, required=True, help="Input JSONL/Parquet (repeatable).")
@click.option("--out", required=True, help="Output JSONL; the same command resumes it.")
@click.option("--max-new-tokens", type=int, default=512, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--prompt-tokens", type=int, default=32, show_default=True, help="Tokens of a text row kept as prompt.")
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--limit", type=int, help="Only the first N rows.")
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--device-map", help="Spread the target over the GPUs: auto, balanced, sequential or a JSON map.")
@user_errors
def regenerate(**options):
    """Rewrite responses (chat rows) or continue texts (text rows) with the target's own generations."""
    from dflash.regenerate import RegenerateConfig, regenerate as run

    options["data"] = list(options["data"])
    run(RegenerateConfig(**options))
