"""`dflash eval`: the offline acceptance length of a drafter on cached shards."""

from __future__ import annotations

import json

import click

from dflash.config import ExtractConfig
from dflash_cli.main import user_errors
from dflash_cli.options import IntList, field_option


@click.command(name="eval")
@click.option("--drafter", "drafter", required=True, help="A training run folder or an exported drafter.")
@click.option("--cache", required=True, help="A cache of the same target.")
@click.option("--shards", type=IntList(), help="Shards to evaluate (default: the run's held-out shards, else all).")
@click.option("--max-shards", type=int, help="Evaluate at most N of them.")
@field_option(ExtractConfig, "device")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (tau, per_slot, ...).")
@user_errors
def evaluate(drafter, cache, shards, max_shards, device, as_json):
    """Offline acceptance length tau of a drafter against the target's recorded predictions.

    tau replays decoding (a cycle per accepted block, as `dflash spec` counts); tau_anchors is the mean
    over every anchor."""
    from dflash.evaluate import evaluate as run

    result = run(drafter, cache, shards, device, max_shards)
    if as_json:
        click.echo(json.dumps(result))
        return
    slots = " ".join(f"{p:.2f}" for p in result["per_slot"])
    click.echo(f"tau {result['tau']:.3f} over {result['cycles']} decoding cycles of {result['block_size']} "
               f"({len(result['shards'])} shards; mean over all {result['blocks']} anchors: "
               f"{result['tau_anchors']:.3f})\nacceptance by slot: {slots}")
