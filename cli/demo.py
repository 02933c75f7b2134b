"""`dflash demo`: the main job on the embedded default (tiny target + sample data, CPU): extract a
cache, train a drafter on it, measure its offline and online acceptance length, then the online one of the
shipped, properly trained drafter (data/tiny-drafter) on the same prompts."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_cli.main import user_errors

REPO = Path(__file__).resolve().parent.parent


@click.command()
@click.option("--out", default="runs/demo", show_default=True, help="Folder for the demo's cache and run.")
@click.option("--steps", default=120, show_default=True, help="Training steps.")
@click.option("--prompts", default=8, show_default=True, help="Held-out prompts decoded speculatively at the end.")
@click.option("--device", default="cpu", show_default=True)
@user_errors
def demo(out, steps, prompts, device):
    """Extract -> train -> eval -> export -> speculative decoding on the tiny embedded target."""
    from dflash.cache import info
    from dflash.config import ExtractConfig, TrainConfig, build_config
    from dflash.drafter_io import export
    from dflash.errors import DflashError
    from dflash.evaluate import evaluate
    from dflash.extract import extract
    from dflash.spec import run_spec
    from dflash.train import train

    preset = REPO / "configs" / "tiny.toml"
    if not preset.is_file():
        raise DflashError(f"the demo needs a source checkout (no {preset}); run it from a clone with "
                          f"`pip install -e .`")
    cache_dir, run_dir = Path(out) / "cache", Path(out) / "run"
    extract(build_config(ExtractConfig, preset, "extract", {"out": str(cache_dir), "device": device}))
    i = info(cache_dir)
    click.echo(f"cache {cache_dir}: {i['shards']['committed']} shards, {i['tokens']['committed']:,} tokens, "
               f"fill {i['fill_ratio']:.1%}, {i['shard_bytes_per_token'] / 1e3:.2f} KB/token")
    train(build_config(TrainConfig, preset, "train", {"cache": str(cache_dir), "out": str(run_dir),
                                                      "max_steps": steps, "device": device}))
    offline = evaluate(str(run_dir), str(cache_dir), device=device)
    export(run_dir, Path(out) / "drafter")
    target, held_out = str(REPO / "data" / "tiny-target"), str(REPO / "data" / "sample" / "code_prompts.jsonl")
    online = run_spec(target, str(Path(out) / "drafter"), held_out, 64, limit=prompts, device=device)
    click.echo(f"tau offline {offline['tau']:.2f} ({len(offline['shards'])} held-out shards) | "
               f"tau online {online['tau']:.2f} ({online['prompts']} held-out prompts, lossless: {online['lossless']}; "
               f"n-gram copy baseline {online['ngram_tau']:.2f}) | speedup {online['speedup']:.2f}x; "
               f"curves: dflash plot {run_dir}")
    shipped = run_spec(target, str(REPO / "data" / "tiny-drafter"), held_out, 64, limit=prompts, device=device)
    click.echo(f"({steps} steps: a smoke run. The shipped drafter data/tiny-drafter, trained on a GPU on 8 M tokens "
               f"of the target's own code, on the same prompts: tau online {shipped['tau']:.2f}, lossless: "
               f"{shipped['lossless']}, speedup {shipped['speedup']:.2f}x)")
