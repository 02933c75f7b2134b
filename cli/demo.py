"""`dflash demo`: the main job on the embedded default (tiny target + sample data, CPU): extract a
cache, train a drafter on it, measure its offline and online acceptance length, then the online one of the
shipped, properly trained drafter (data/tiny-drafter) on the same prompts.

The embedded files come from wherever dflash is installed (`dflash.embedded`: the wheel's package data, or
the source checkout), so the demo runs from any folder; it writes only under --out."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_cli.main import user_errors


@click.command()
@click.option("--out", default="runs/demo", show_default=True,
              help="Folder for everything the demo writes (cache, run, drafter), relative to the current folder. "
                   "The same command again resumes (or finds it done); other options need another --out.")
@click.option("--steps", default=120, show_default=True, help="Training steps.")
@click.option("--prompts", default=8, show_default=True, help="Held-out prompts decoded speculatively at the end.")
@click.option("--device", default="cpu", show_default=True)
@user_errors
def demo(out, steps, prompts, device):
    """Extract -> train -> eval -> export -> speculative decoding on the tiny embedded target."""
    from dflash import embedded

    root = embedded.root()  # before the heavy imports: a broken install fails at once
    out = Path(out).resolve()
    click.echo(f"dflash demo: writing to {out} (embedded target, drafter and data: {root})")

    from dflash.cache import info
    from dflash.config import ExtractConfig, TrainConfig, build_config
    from dflash.drafter_io import export
    from dflash.evaluate import evaluate
    from dflash.extract import extract
    from dflash.spec import run_spec
    from dflash.train import train

    preset = root / embedded.PRESET
    cache_dir, run_dir, drafter_dir = out / "cache", out / "run", out / "drafter"
    extract(build_config(ExtractConfig, preset, "extract", {"out": str(cache_dir), "device": device}))
    i = info(cache_dir)
    click.echo(f"cache {cache_dir}: {i['shards']['committed']} shards, {i['tokens']['committed']:,} tokens, "
               f"fill {i['fill_ratio']:.1%}, {i['shard_bytes_per_token'] / 1e3:.2f} KB/token")
    train(build_config(TrainConfig, preset, "train", {"cache": str(cache_dir), "out": str(run_dir),
                                                      "max_steps": steps, "device": device}))
    offline = evaluate(str(run_dir), str(cache_dir), device=device)
    export(run_dir, drafter_dir)
    target, held_out = str(root / embedded.TINY_TARGET), str(root / embedded.HELD_OUT_PROMPTS)
    online = run_spec(target, str(drafter_dir), held_out, 64, limit=prompts, device=device)
    click.echo(f"tau offline {offline['tau']:.2f} ({len(offline['shards'])} held-out shards) | "
               f"tau online {online['tau']:.2f} ({online['prompts']} held-out prompts, lossless: {online['lossless']}; "
               f"n-gram copy baseline {online['ngram_tau']:.2f}) | speedup {online['speedup']:.2f}x; "
               f"curves: dflash plot {run_dir}")
    shipped = run_spec(target, str(root / embedded.TINY_DRAFTER), held_out, 64, limit=prompts, device=device)
    click.echo(f"({steps} steps: a smoke run. The shipped drafter data/tiny-drafter, trained on a GPU on 8 M tokens "
               f"of the target's own code, on the same prompts: tau online {shipped['tau']:.2f}, lossless: "
               f"{shipped['lossless']}, speedup {shipped['speedup']:.2f}x)")
    click.echo(f"dflash demo: done; everything it wrote is in {out} (cache/, run/, drafter/)")
