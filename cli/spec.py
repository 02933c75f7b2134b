"""`dflash spec`: speculative decoding with a target and a drafter, measured."""

from __future__ import annotations

import json

import click

from dflash.config import ExtractConfig
from dflash_cli.main import user_errors
from dflash_cli.options import field_option


@click.command(name="spec")
@click.option("--target", required=True, help="The Hugging Face target (folder or hub id).")
@click.option("--drafter", required=True, help="An exported drafter (or a training run folder).")
@click.option("--prompts", required=True, type=click.Path(dir_okay=False), help="JSONL of messages or prompt rows.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--limit", type=int, help="Use only the first N prompts.")
@field_option(ExtractConfig, "device")
@field_option(ExtractConfig, "dtype")
@click.option("--save-outputs", type=click.Path(dir_okay=False),
              help="Write the target's answers as prompt/completion JSONL (extract it for the offline tau).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (tau, lossless, speedup, ...).")
@user_errors
def spec(target, drafter, prompts, max_new_tokens, limit, device, dtype, save_outputs, as_json):
    """Greedy speculative decoding: tau, per-position acceptance, speedup, and a lossless check; beside
    tau, the tau of prompt-lookup (n-gram copy) decoding on the same outputs, the baseline to beat.

    tau is pooled over verify steps (1 + accepted drafts / steps, as vLLM and SGLang log it);
    tau_per_request is the mean of each prompt's own tau (as per-request benchmarks report it)."""
    from dflash.spec import run_spec

    r = run_spec(target, drafter, prompts, max_new_tokens, limit, device, dtype, save_outputs)
    if as_json:
        click.echo(json.dumps(r))
        return
    click.echo(f"tau {r['tau']:.3f} pooled over {r['cycles']} verify steps, {r['tau_per_request']:.3f} mean over "
               f"{r['prompts']} requests ({r['new_tokens']} tokens; n-gram copy baseline {r['ngram_tau']:.3f}); "
               f"lossless: {'yes' if r['lossless'] else 'NO, prompts ' + str(r['mismatched_prompts'])}; "
               f"speedup {r['speedup']:.2f}x ({r['spec_tokens_per_s']:.0f} vs {r['target_tokens_per_s']:.0f} tok/s)")
    click.echo("acceptance by position: " + " ".join(f"{p:.2f}" for p in r["per_position"]))
