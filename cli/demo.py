"""`dflash demo`: the main job on the embedded default (tiny target + sample data, CPU)."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_cli.main import user_errors

REPO = Path(__file__).resolve().parent.parent


@click.command()
@click.option("--out", default="runs/demo", show_default=True, help="Folder for the demo's cache.")
@click.option("--device", default="cpu", show_default=True)
@user_errors
def demo(out, device):
    """Extract a cache from the tiny embedded target on the sample data and describe it."""
    from dflash.cache import info
    from dflash.config import ExtractConfig, build_config
    from dflash.errors import DflashError
    from dflash.extract import extract

    preset = REPO / "configs" / "tiny.toml"
    if not preset.is_file():
        raise DflashError(f"the demo needs a source checkout (no {preset}); run it from a clone with `pip install -e .`")
    cache_dir = Path(out) / "cache"
    extract(build_config(ExtractConfig, preset, "extract", {"out": str(cache_dir), "device": device}))
    i = info(cache_dir)
    click.echo(f"cache {cache_dir}: {i['shards']['committed']} shards, {i['tokens']['committed']:,} tokens, "
               f"fill {i['fill_ratio']:.1%}, {i['bytes_per_token'] / 1e3:.1f} KB/token; "
               f"inspect it with `dflash cache info {cache_dir}`")
