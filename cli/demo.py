"""`dflash demo`: the main job on the embedded default (tiny target + sample data, CPU): extract a
cache, train a drafter on it, measure its offline acceptance length."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_cli.main import user_errors

REPO = Path(__file__).resolve().parent.parent


@click.command()
@click.option("--out", default="runs/demo", show_default=True, help="Folder for the demo's cache and run.")
@click.option("--steps", default=120, show_default=True, help="Training steps.")
@click.option("--device", default="cpu", show_default=True)
@user_errors
def demo(out, steps, device):
    """Extract -> train -> eval on the tiny embedded target and the sample data."""
    from dflash.cache import info
    from dflash.config import ExtractConfig, TrainConfig, build_config
    from dflash.errors import DflashError
    from dflash.evaluate import evaluate
    from dflash.extract import extract
    from dflash.train import train

    preset = REPO / "configs" / "tiny.toml"
    if not preset.is_file():
        raise DflashError(f"the demo needs a source checkout (no {preset}); run it from a clone with `pip install -e .`")
    cache_dir, run_dir = Path(out) / "cache", Path(out) / "run"
    extract(build_config(ExtractConfig, preset, "extract", {"out": str(cache_dir), "device": device}))
    i = info(cache_dir)
    click.echo(f"cache {cache_dir}: {i['shards']['committed']} shards, {i['tokens']['committed']:,} tokens, "
               f"fill {i['fill_ratio']:.1%}, {i['shard_bytes_per_token'] / 1e3:.2f} KB/token")
    train(build_config(TrainConfig, preset, "train", {"cache": str(cache_dir), "out": str(run_dir),
                                                      "max_steps": steps, "device": device}))
    result = evaluate(str(run_dir), str(cache_dir), device=device, max_anchors=512)
    click.echo(f"tau (offline, {len(result['shards'])} held-out shards): {result['tau']:.3f}; "
               f"next: dflash plot {run_dir}, dflash export {run_dir} --out DIR")
