"""Drafters on disk: read one from a training run (its latest checkpoint) or from an exported folder, and
write the export (`dflash export`) in the DFlash reference format that SGLang
(`--speculative-algorithm DFLASH`) and vLLM (`"method": "dflash"`) serve.

    RUN/config.json, RUN/checkpoints/   a training run (`dflash.checkpoint`): the drafter's config under "drafter"
    EXPORT/config.json                  the Qwen3 fields + architectures ["DFlashDraftModel"], block_size,
                                        num_target_layers, dflash_config {mask_token_id, target_layer_ids},
                                        layer_types (`DrafterConfig.to_hf` / `from_hf`)
    EXPORT/model.safetensors            layers.{i}.*, fc, hidden_norm, norm: no embeddings, no LM head
                                        (the target's are used)
    EXPORT/README.md                    a model card: how to serve it
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash import checkpoint
from dflash.drafter import Drafter, DrafterConfig
from dflash.errors import DflashError
from dflash.files import disk_full_is_an_error


def read_run(run: Path, what: str = "") -> tuple[dict, Path]:
    """(run config, latest checkpoint folder) of a training run; `what` prefixes errors (e.g. "--drafter")."""
    where = f"{what} {run}".strip()
    try:
        config = json.loads((run / "config.json").read_text())
    except (OSError, ValueError):
        raise DflashError(f"{where}: not a training run (no config.json)") from None
    return config, latest_checkpoint(run, where)


def latest_checkpoint(run: Path, where: str) -> Path:
    ckpt = checkpoint.latest(run)
    if ckpt is None:
        raise DflashError(f"{where}: the run has no checkpoint yet")
    return ckpt


def read_drafter(path: str | Path, what: str = "--drafter") -> tuple[DrafterConfig, dict, dict]:
    """(config, weights, info) of a training run folder (latest checkpoint) or an exported folder; info
    names a run's held-out shards and cache key."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        raise DflashError(f"{what} {path}: no config.json (not a run or an exported drafter)") from None
    if "drafter" in config:  # a training run
        ckpt = latest_checkpoint(path, f"{what} {path}")
        info = {"holdout_shards": config.get("holdout_shards", []), "cache_key": config["cache"]["cache_key"]}
        return DrafterConfig(**config["drafter"]), checkpoint.load_weights(ckpt), info
    if "target_layer_ids" not in (config.get("dflash_config") or {}):
        raise DflashError(f"{what} {path}: config.json has no dflash_config (not a DFlash drafter)")
    return DrafterConfig.from_hf(config), load_file(str(path / "model.safetensors")), \
        {"holdout_shards": [], "cache_key": None}


def load_drafter(path: str | Path, embed: torch.Tensor, head: torch.Tensor, available_layers: list[int] | None = None,
                 device="cpu") -> tuple[Drafter, dict]:
    """A drafter from a training run folder or an exported folder (`read_drafter`), on the target's
    embeddings and head [V, H] (from a cache or from the target itself). Returns (drafter, info)."""
    dcfg, weights, info = read_drafter(path)
    vocab, hidden = embed.shape
    if dcfg.hidden_size != hidden or dcfg.vocab_size != vocab:
        raise DflashError(f"--drafter {path}: hidden {dcfg.hidden_size} / vocab {dcfg.vocab_size} do not match the "
                          f"cache's target (hidden {hidden}, vocab {vocab})")
    missing = [i for i in dcfg.target_layer_ids if available_layers is not None and i not in available_layers]
    if missing:
        raise DflashError(f"--drafter {path} reads target layers {missing} that the cache does not hold "
                          f"(it holds {available_layers})")
    drafter = Drafter(dcfg, embed, head).to(device)
    copy_weights(drafter, weights, f"--drafter {path}")
    return drafter.to(embed.dtype).eval(), info


@torch.no_grad()
def copy_weights(drafter: Drafter, weights: dict, what: str) -> None:
    for name, p in drafter.named_parameters():
        if name not in weights:
            raise DflashError(f"{what}: weights lack {name}")
        p.copy_(weights[name].to(p.dtype))


def export(run: str | Path, out: str | Path) -> Path:
    """Write RUN's latest checkpoint to `out` in the reference format; returns `out`."""
    run, out = Path(run), Path(out)
    config, ckpt = read_run(run)
    dcfg = DrafterConfig(**config["drafter"])
    target_info = config["cache"].get("target") or (_cache_manifest(config) or {}).get("target")
    if not target_info:
        raise DflashError(f"{run}: the run does not record its target's depth and its cache "
                          f"({config['cache']['path']}) is gone: cannot write num_target_layers")
    weights = checkpoint.load_weights(ckpt)
    target = target_info.get("name") or target_info.get("path") or "TARGET"
    card = MODEL_CARD.format(target=target, block=dcfg.block_size, layers=dcfg.num_layers, ids=dcfg.target_layer_ids,
                             mask=dcfg.mask_token_id, step=json.loads((ckpt / "state.json").read_text())["step"],
                             out=out, spec=dcfg.block_size - 1)
    with disk_full_is_an_error(out, f"the run {run} is untouched and the export in {out} incomplete",
                               then="it writes the export again"):
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sorted(weights.items())},
                  str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(dcfg.to_hf(target_info["num_layers"]), indent=2))
        (out / "README.md").write_text(card)
    return out


def _cache_manifest(config: dict) -> dict | None:
    from dflash.cache import read_manifest

    return read_manifest(config["cache"]["path"])


MODEL_CARD = """# DFlash drafter for {target}

A DFlash block-diffusion drafter ({layers} layers, block size {block}) trained with dflash
(step {step}). It reads the target's hidden states at layers {ids} and uses the target's own
embeddings and LM head; MASK token id {mask}.

Serve with SGLang:

    python -m sglang.launch_server --model-path {target} \\
        --speculative-algorithm DFLASH --speculative-draft-model-path {out}

Serve with vLLM:

    vllm serve {target} --speculative-config '{{"method": "dflash", "model": "{out}", "num_speculative_tokens": {spec}}}'
"""  # noqa: E501 (the command as a user pastes it)
