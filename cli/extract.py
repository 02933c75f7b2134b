"""`dflash extract`: stage one, the hidden-state cache."""

from __future__ import annotations

import click

from dflash_cli.main import user_errors


def _int_list(ctx, param, value):
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers such as 1,9,17, got {value!r}") from None


@click.command()
@click.option("--config", "preset", type=click.Path(dir_okay=False), help="TOML preset; its [extract] table gives defaults.")
@click.option("--target", help="Hugging Face causal LM: local folder or hub id.")
@click.option("--data", multiple=True, help="Input JSONL/Parquet file (repeatable; replaces the preset's data).")
@click.option("--out", help="Cache folder; running again with the same inputs resumes it.")
@click.option("--layers", callback=_int_list, help="Target layer ids to capture, e.g. 1,9,17,25,33.")
@click.option("--draft-layers", type=int, help="Drafter depth the default layer ids are chosen for (default 5).")
@click.option("--token-budget", type=int, help="T: tokens per shard (default 8192).")
@click.option("--max-docs", type=int, help="D: most documents per shard (default 64).")
@click.option("--max-len", type=int, help="Truncate documents to this many tokens (default T).")
@click.option("--batch-size", type=int, help="Most documents per target forward (default 16).")
@click.option("--batch-tokens", type=int, help="Most padded tokens per target forward (default 32768).")
@click.option("--window", type=int, help="Shards per scheduling window (default 4).")
@click.option("--write-threads", type=int, help="Threads writing chunks in parallel (default 4).")
@click.option("--device", help="auto (default), cpu, cuda, cuda:N.")
@click.option("--dtype", help="Target compute dtype: auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32.")
@click.option("--limit", type=int, help="Use only the first N rows.")
@click.option("--compressor", type=click.Choice(["none", "zstd"]), help="Compression of hidden chunks (default none).")
@click.option("--storage", type=click.Choice(["bf16", "fp8"]),
              help="How states are stored: bf16 (default) or fp8 (e4m3 + scales, ~half the bytes).")
@click.option("--scale-block", type=int, help="fp8: channels per scale (default 128; 0: one per token and layer).")
@click.option("--attn-implementation", help="Passed to from_pretrained: sdpa, eager, flash_attention_2.")
@click.option("--device-map", help="Spread the target over the GPUs: auto, balanced, sequential or a JSON map.")
@click.option("--experts-implementation", type=click.Choice(["auto", "grouped_mm", "batched_mm", "eager"]),
              help="MoE targets: how experts run (default auto = grouped_mm).")
@click.option("--trust-remote-code", is_flag=True, default=None, help="Allow the target's own modeling code.")
@user_errors
def extract(preset, **options):
    """Run a frozen target over a dataset once and write its hidden-state cache.

    Resumes an interrupted run of the same command; refuses an --out that holds a cache made from
    other inputs. Under `torchrun -m dflash extract ...` every rank writes its own shards.
    """
    from dflash.config import ExtractConfig, build_config
    from dflash.extract import extract as run

    options["data"] = list(options["data"]) or None
    cfg = build_config(ExtractConfig, preset, "extract", options)
    run(cfg)
