"""`dflash cache info|verify|ls|convert`: look into caches, shrink one to fp8."""

from __future__ import annotations

import json
import sys

import click

from dflash.config import ExtractConfig, RecomputeConfig
from dflash.errors import DflashError
from dflash_cli.main import user_errors
from dflash_cli.options import field_option


@click.group()
def cache():
    """Inspect, check and convert hidden-state caches."""


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000


@cache.command()
@click.argument("path", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@user_errors
def info(path, as_json):
    """Manifest and progress of the cache at PATH."""
    from dflash.cache import info as cache_info

    i = cache_info(path)
    if as_json:
        click.echo(json.dumps(i, indent=2))
        return
    m = i["manifest"]
    dropped = ", ".join(f"{n} {r}" for r, n in i["rows"]["dropped"].items()) or "none"
    lines = [
        f"cache        {i['path']}",
        f"key          {i['cache_key']}  (format {m['format_version']}, dflash {m['dflash_version']})",
        f"target       {m['target']['name'] or m['target']['path']}  ({m['target']['model_type']}, "
        f"{m['target']['num_layers']} layers, hidden {m['hidden_size']}, vocab {m['vocab_size']})",
        f"layers       {m['layer_ids']}" + (f": {m['layer_convention']}" if m.get("layer_convention") else ""),
        f"shards       {i['shards']['committed']}/{i['shards']['total']} committed"
        + ("  (complete)" if i["complete"] else "") + f"; T = {m['token_budget']}, D = {m['max_docs']}"
        + (f"; {i['shards']['damaged_records']} damaged commit record(s): run `dflash cache verify`"
           if i["shards"]["damaged_records"] else ""),
        f"rows         {i['rows']['total']} read, {i['rows']['planned']} planned, "
        f"{i['rows']['in_committed_shards']} in committed shards; {i['rows']['truncated']} truncated; "
        f"dropped: {dropped}",
        f"tokens       {i['tokens']['planned']:,} planned ({i['tokens']['loss']:,} with loss), "
        f"{i['tokens']['committed']:,} committed",
        f"fill ratio   {i['fill_ratio']:.1%}",
        f"on disk      {_size(i['bytes_on_disk'])}"
        + (f"  ({_size(i['bytes_per_token'])} per token; {_size(i['shard_bytes_per_token'])} without the "
           f"target's embeddings and head; {_size(i['state_bytes_per_token'])} of states)"
           if i["bytes_per_token"] else ""),
        f"storage      {m['storage_dtype']}"
        + (f", one bf16 scale per {m['scale_block']} channels" if m.get("scale_block") else "")
        + (" (one per token and layer)" if m.get("scale_block") == m["hidden_size"] else "")
        + f" (computed in {m['compute_dtype']})",
    ]
    last = i["last_hidden"]
    if last:
        lines.append(f"last_hidden  the target's last hidden state {last['state']} (the LM head's input: row i "
                     f"predicts token i+1), {last['storage_dtype']}"
                     + (f", {_size(last['bytes_per_token'])} per token" if last["bytes_per_token"] else ""))
    for name, st in i["states"].items():
        head = "states" if name == next(iter(i["states"])) else ""
        label = name if name == "last_hidden" else f"layer {name}"
        lines.append(f"{head:<13}{label}: " + (
            f"rms {st['rms']:.4g}, |max| {st['abs_max']:.4g}, zeros {st['zero_fraction']:.2%}, non-finite "
            f"{st['nonfinite']} ({st['shards']} shards)" if st["shards"] else "no statistics (an older cache)"))
    click.echo("\n".join(lines))


def _recompute_options(fn):
    for name in reversed(["recompute", "target", "device", "dtype", "tolerance", "seed", "device_map",
                          "experts_implementation", "trust_remote_code"]):
        fn = field_option(RecomputeConfig, name)(fn)
    return fn


@cache.command()
@click.argument("path", type=click.Path(file_okay=False))
@_recompute_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@user_errors
def verify(path, as_json, **options):
    """Check every committed shard against its checksums; with --recompute N, also rerun the target on N
    documents and compare their states with the cache's. Exit 1 naming every shard, document and layer that
    fails."""
    from tqdm.auto import tqdm

    from dflash.cache import verify as cache_verify
    from dflash.recompute import TARGET_IDS_AGREE, describe, recompute

    cfg = RecomputeConfig(**options)
    bad = cache_verify(path, progress=lambda it: tqdm(it, desc="verify", unit="shard", leave=False))
    problems = [f"shard {shard}: {problem}" if shard >= 0 else problem for shard, problem in bad]
    result = {"path": path, "checksums": [{"shard": s, "problem": p} for s, p in bad]}
    if cfg.recompute and not bad:  # states are only compared once the bytes are known to be the written ones
        r = recompute(path, cfg, progress=lambda it: tqdm(it, desc="recompute", unit="doc", leave=False))
        result["recompute"] = r
        problems += [describe(x, cfg.tolerance) for x in r["mismatches"]]
        if r["target_ids_agree"] < TARGET_IDS_AGREE:
            problems.append(f"target_ids: only {r['target_ids_agree']:.1%} of the cached greedy predictions are "
                            f"the target's")
    result["ok"] = not problems
    if as_json:
        click.echo(json.dumps(result, indent=2))
    for line in problems:
        click.echo(f"{path}: {line}", err=True)
    if problems:
        shards = sorted({s for s, _ in bad if s >= 0} | {x["shard"] for x in result.get("recompute", {})
                                                          .get("mismatches", [])})
        click.echo(f"error: {len(problems)} problem(s); bad shards: {shards}", err=True)
        sys.exit(1)
    if as_json:
        return
    click.echo(f"{path}: all committed shards verified")
    if "recompute" in result:
        r = result["recompute"]
        worst = ", ".join(f"{layer} {err:.2g}" for layer, err in r["layers"].items())
        click.echo(f"{path}: {len(r['documents'])} documents recomputed on {r['device']} ({r['dtype']}) match the "
                   f"target {r['target']}: largest relative error per layer {worst} (tolerance {cfg.tolerance:g}); "
                   f"target_ids agree {r['target_ids_agree']:.2%}")


@cache.command(name="ls")
@click.argument("root", type=click.Path(file_okay=False), default=".")
@user_errors
def ls(root):
    """List the caches under ROOT."""
    from dflash.cache import find_caches, info as cache_info

    rows = []
    for p in find_caches(root):
        try:
            i = cache_info(p)
        except DflashError as e:  # one damaged cache does not hide the others
            rows.append((str(p), f"(unreadable: {str(e).removeprefix(str(p) + ': ')})", *[""] * 6))
            continue
        m = i["manifest"]
        rows.append((str(p), m["target"]["name"] or m["target"]["path"], ",".join(map(str, m["layer_ids"])),
                     str(m["token_budget"]), f"{i['shards']['committed']}/{i['shards']['total']}",
                     f"{i['tokens']['committed']:,}", _size(i["bytes_on_disk"]), m["cache_key"]))
    if not rows:
        click.echo(f"no caches under {root}")
        return
    header = ("path", "target", "layers", "T", "shards", "tokens", "size", "key")
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    for r in [header, *rows]:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


@cache.command()
@click.argument("src", type=click.Path(file_okay=False))
@click.option("--storage", type=click.Choice(["fp8"]), required=True, help="The new storage of the states.")
@click.option("--out", required=True, help="The new cache folder; running the same command again resumes it.")
@field_option(ExtractConfig, "scale_block")
@field_option(ExtractConfig, "device")
@field_option(ExtractConfig, "write_threads")
@user_errors
def convert(src, storage, out, scale_block, device, write_threads):
    """Rewrite the bf16 cache SRC with fp8 storage at --out (~half the disk), without the target.

    SRC is only read, each shard checked against its checksums; the new cache has its own key."""
    from dflash.convert import convert as run

    run(src, out, storage=storage, scale_block=scale_block, device=device, write_threads=write_threads)
