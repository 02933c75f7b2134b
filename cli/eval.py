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

    Decoding is replayed document by document (a verify step per block, as `dflash spec` counts): tau is
    pooled over all verify steps (as vLLM and SGLang log it), tau_per_request the mean of each document's;
    tau_anchors is the mean over every anchor, decoding order playing no part."""
    from dflash.evaluate import evaluate as run

    result = run(drafter, cache, shards, device, max_shards)
    if as_json:
        click.echo(json.dumps(result))
        return
    slots = " ".join(f"{p:.2f}" for p in result["per_slot"])
    click.echo(f"tau {result['tau']:.3f} pooled over {result['cycles']} verify steps of {result['block_size']} "
               f"({len(result['shards'])} shards); {result['tau_per_request']:.3f} mean over {result['documents']} "
               f"documents; mean over all {result['blocks']} anchors {result['tau_anchors']:.3f}\n"
               f"acceptance by slot: {slots}")
