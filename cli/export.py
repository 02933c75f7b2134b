"""`dflash export` and `dflash eval`: use a trained drafter."""

from __future__ import annotations

import json

import click

from dflash_cli.extract import _int_list
from dflash_cli.main import user_errors


@click.command(name="export")
@click.argument("run", type=click.Path(file_okay=False))
@click.option("--out", required=True, help="Folder for the Hugging Face drafter.")
@user_errors
def export(run, out):
    """Write RUN's latest checkpoint as a drafter SGLang and vLLM serve (DFlash reference format)."""
    from dflash.export import export as do_export

    path = do_export(run, out)
    click.echo(f"exported {run} -> {path} (config.json, model.safetensors, README.md)")


@click.command(name="eval")
@click.option("--drafter", "drafter", required=True, help="A training run folder or an exported drafter.")
@click.option("--cache", required=True, help="A cache of the same target.")
@click.option("--shards", callback=_int_list, help="Shards to evaluate (default: the run's held-out shards, else all).")
@click.option("--max-shards", type=int, help="Evaluate at most N of them.")
@click.option("--device", default="auto", show_default=True)
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


@click.command(name="plot")
@click.argument("run", type=click.Path(file_okay=False))
@click.option("--out", help="PNG path (default RUN/curves.png).")
@user_errors
def plot(run, out):
    """Draw RUN's loss and tau curves to a PNG."""
    from dflash.plot import plot as draw

    click.echo(f"wrote {draw(run, out)}")


@click.command(name="spec")
@click.option("--target", required=True, help="The Hugging Face target (folder or hub id).")
@click.option("--drafter", required=True, help="An exported drafter (or a training run folder).")
@click.option("--prompts", required=True, type=click.Path(dir_okay=False), help="JSONL of messages or prompt rows.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--limit", type=int, help="Use only the first N prompts.")
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True, help="auto (bf16 on GPU, fp32 on CPU), bf16, fp32.")
@click.option("--save-outputs", type=click.Path(dir_okay=False),
              help="Write the target's answers as prompt/completion JSONL (extract it for the offline tau).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (tau, lossless, speedup, ...).")
@user_errors
def spec(target, drafter, prompts, max_new_tokens, limit, device, dtype, save_outputs, as_json):
    """Greedy speculative decoding: tau, per-position acceptance, speedup, and a lossless check; beside
    tau, the tau of prompt-lookup (n-gram copy) decoding on the same outputs, the baseline to beat."""
    from dflash.spec import run_spec

    r = run_spec(target, drafter, prompts, max_new_tokens, limit, device, dtype, save_outputs)
    if as_json:
        click.echo(json.dumps(r))
        return
    click.echo(f"tau {r['tau']:.3f} over {r['cycles']} cycles ({r['prompts']} prompts, {r['new_tokens']} tokens; "
               f"n-gram copy baseline {r['ngram_tau']:.3f}); "
               f"lossless: {'yes' if r['lossless'] else 'NO, prompts ' + str(r['mismatched_prompts'])}; "
               f"speedup {r['speedup']:.2f}x ({r['spec_tokens_per_s']:.0f} vs {r['target_tokens_per_s']:.0f} tok/s)")
    click.echo("acceptance by position: " + " ".join(f"{p:.2f}" for p in r["per_position"]))
