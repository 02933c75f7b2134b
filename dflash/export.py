"""`dflash export`: a trained run -> a Hugging Face folder in the DFlash reference format, which SGLang
(`--speculative-algorithm DFLASH`) and vLLM (`"method": "dflash"`) serve.

config.json: the Qwen3 fields + architectures ["DFlashDraftModel"], block_size, num_target_layers,
dflash_config {mask_token_id, target_layer_ids}, layer_types. model.safetensors: layers.{i}.*, fc,
hidden_norm, norm: no embeddings, no LM head (the target's are used).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash import checkpoint
from dflash.drafter import DrafterConfig
from dflash.errors import DflashError


def read_run(run: Path) -> tuple[dict, Path]:
    """(run config, latest checkpoint folder) of a training run."""
    try:
        config = json.loads((run / "config.json").read_text())
    except (OSError, ValueError):
        raise DflashError(f"{run}: not a training run (no config.json)") from None
    ckpt = checkpoint.latest(run)
    if ckpt is None:
        raise DflashError(f"{run}: no checkpoint yet")
    return config, ckpt


def hf_config(dcfg: DrafterConfig, num_target_layers: int) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": dcfg.hidden_size,
        "intermediate_size": dcfg.intermediate_size,
        "num_hidden_layers": dcfg.num_layers,
        "num_attention_heads": dcfg.num_attention_heads,
        "num_key_value_heads": dcfg.num_key_value_heads,
        "head_dim": dcfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": dcfg.rms_norm_eps,
        "rope_theta": dcfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": dcfg.max_position_embeddings,
        "vocab_size": dcfg.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "block_size": dcfg.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": dcfg.mask_token_id, "target_layer_ids": list(dcfg.target_layer_ids)},
        "layer_types": ["full_attention"] * dcfg.num_layers,
    }


def export(run: str | Path, out: str | Path) -> Path:
    run, out = Path(run), Path(out)
    config, ckpt = read_run(run)
    dcfg = DrafterConfig(**config["drafter"])
    target_info = config["cache"].get("target") or (_cache_manifest(config) or {}).get("target")
    if not target_info:
        raise DflashError(f"{run}: the run does not record its target's depth and its cache "
                          f"({config['cache']['path']}) is gone: cannot write num_target_layers")
    num_target_layers = target_info["num_layers"]
    weights = checkpoint.load_weights(ckpt)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sorted(weights.items())}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(dcfg, num_target_layers), indent=2))
    target = target_info.get("name") or target_info.get("path") or "TARGET"
    (out / "README.md").write_text(MODEL_CARD.format(target=target, block=dcfg.block_size, layers=dcfg.num_layers,
                                                     ids=dcfg.target_layer_ids, mask=dcfg.mask_token_id,
                                                     step=json.loads((ckpt / "state.json").read_text())["step"],
                                                     out=out, spec=dcfg.block_size - 1))
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
"""
