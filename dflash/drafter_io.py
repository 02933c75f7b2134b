"""Drafters on disk: read one from a training run (its latest checkpoint) or from an exported folder in any of
the layouts the serving engines load, and write the export (`dflash export`) in either of them.

    RUN/config.json, RUN/checkpoints/   a training run (`dflash.checkpoint`): the drafter's config under "drafter"
    EXPORT/config.json                  `--format zlab` (the reference DFlash layout SGLang, vLLM and z-lab's
                                        DFlashDraftModel load): the Qwen3 fields + architectures
                                        ["DFlashDraftModel"], block_size (top level and in dflash_config),
                                        num_target_layers, dflash_config {mask_token_id, target_layer_ids},
                                        layer_types, sliding_window. A DFlash2 drafter: architectures
                                        ["DFlash2DraftModel"], dflash_config also {conv_kernel_size,
                                        conv_group_size, selector_rank, selector_top_k}, is_causal always.
                                        `--format speculators` (what vLLM auto-detects): speculators_model_type,
                                        speculators_config {algorithm, proposal_methods, verifier, ...},
                                        transformer_layer_config (the Qwen3 fields), aux_hidden_state_layer_ids
                                        (our layer ids + 1), mask_token_id, block_size, sliding_window_non_causal
    EXPORT/model.safetensors            layers.{i}.*, fc, hidden_norm, norm (DFlash2: layers.{i}.attention_conv /
                                        mlp_conv.*, candidate_selector.*): no embeddings, no LM head
                                        (the target's are used)
    EXPORT/README.md                    a model card: how to serve it

How the servers attend (read from their loaders): a layer listed as `full_attention` sees the whole block
(SGLang always; vLLM and the reference unless `is_causal` / `dflash_config.causal` say otherwise); a
`sliding_attention` layer sees keys p > q - W from each query q, and the block causally (SGLang always: it
reads no `is_causal`; vLLM and the reference unless told otherwise). An export that a server would attend
differently from how the drafter was trained is refused (`check_servable`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash import checkpoint
from dflash.config import DrafterConfig, hf_widths
from dflash.drafter import Drafter, architectures, build_drafter, drafter_class
from dflash.errors import DflashError
from dflash.files import disk_full_is_an_error, load_tensors, save_tensors, write_text_atomic

FORMATS = ("zlab", "speculators")


# -- config.json of each layout -------------------------------------------------------------------------


def qwen3_fields(cfg: DrafterConfig) -> dict:
    """The Qwen3 decoder fields every layout carries (what the servers build the layers from)."""
    sliding = cfg.sliding_window is not None
    return {
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "layer_types": ["sliding_attention" if sliding else "full_attention"] * cfg.num_layers,
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": sliding,
        "max_window_layers": cfg.num_layers if sliding else 0,
    }


def to_zlab(cfg: DrafterConfig, num_target_layers: int) -> dict:
    """The reference layout. `block_size` sits at the top level (what older loaders read) and in
    dflash_config (what newer ones prefer); the architecture's own keys (`Drafter.export_keys`) in dflash_config.
    DFlash writes `is_causal` only where it says what the layer types alone would not (SGLang reads none:
    `check_servable` refuses those exports); DFlash2 always, as its released config does."""
    arch = drafter_class(cfg)
    hf = {"architectures": [arch.architecture], **qwen3_fields(cfg), "block_size": cfg.block_size,
          "num_target_layers": num_target_layers,
          "dflash_config": {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
                            "target_layer_ids": list(cfg.target_layer_ids),
                            **{k: getattr(cfg, k) for k in arch.export_keys}}}
    if arch.explicit_causality or cfg.causal_block != (cfg.sliding_window is not None):
        hf["is_causal"] = cfg.causal_block
    return hf


def to_speculators(cfg: DrafterConfig, num_target_layers: int, verifier: dict) -> dict:
    """The speculators layout (vLLM detects it by `speculators_config` and no top-level model_type).
    vLLM counts target layers from the embeddings (its aux id i = our id i - 1) and takes the causality of
    every layer from `sliding_window_non_causal` (absent or true: the whole block)."""
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
        "transformer_layer_config": qwen3_fields(cfg),
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "target_hidden_size": cfg.hidden_size,
        "draft_vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": not cfg.causal_block,
        "sample_from_anchor": False,
        "num_target_layers": num_target_layers,
    }


def from_hf(hf: dict, where: str = "config.json") -> DrafterConfig:
    """The drafter of an exported config.json in any layout: the speculators one (`speculators_model_type`),
    the reference one with `block_size` in dflash_config (newer) or at the top level (older). Causality as
    the servers resolve it: `is_causal`, else dflash_config.causal, else causal where sliding (speculators:
    as vLLM reads `sliding_window_non_causal`)."""
    if "speculators_model_type" in hf:
        if hf["speculators_model_type"] != "dflash":
            raise DflashError(f"{where}: a {hf['speculators_model_type']!r} speculator, not a DFlash drafter (dflash "
                              f"reads DFlash2 drafters in the zlab layout, as vLLM serves them)")
        layer = hf["transformer_layer_config"]
        window = _window(layer, {}, where)
        causal = not hf.get("sliding_window_non_causal", True)  # as vLLM serves it: one causality for all layers
        return _drafter(layer, where, block_size=hf["block_size"], mask_token_id=hf["mask_token_id"],
                        target_layer_ids=[i - 1 for i in hf["aux_hidden_state_layer_ids"]], sliding_window=window,
                        causal_block=causal)
    dflash = hf.get("dflash_config") or {}
    if "target_layer_ids" not in dflash:
        raise DflashError(f"{where}: no dflash_config.target_layer_ids (not a DFlash drafter)")
    arch, cls = next(((a, c) for a, c in architectures().items() if c.architecture in (hf.get("architectures") or [])),
                     ("dflash", Drafter))
    missing = [k for k in cls.export_keys if k not in dflash]
    if missing:
        raise DflashError(f"{where}: a {cls.architecture} without dflash_config.{missing[0]}")
    for key, neutral in UNSUPPORTED.items():
        if dflash.get(key) is not None and not neutral(dflash[key]):
            raise DflashError(f"{where}: dflash_config.{key} {dflash[key]}: dflash's drafters apply none (they would "
                              f"draft otherwise than the servers)")
    window = _window(hf, dflash, where)
    causal = hf.get("is_causal", dflash.get("causal", window is not None))
    return _drafter(hf, where, block_size=dflash.get("block_size", hf.get("block_size", 16)),
                    mask_token_id=dflash.get("mask_token_id", hf.get("mask_token_id")),
                    target_layer_ids=dflash["target_layer_ids"], sliding_window=window, causal_block=bool(causal),
                    arch=arch, **{k: dflash[k] for k in cls.export_keys})


# dflash_config keys the servers read that change the draft (the logits' scale and soft cap, the block embeddings'
# scale), and when they change nothing
UNSUPPORTED = {"output_multiplier": lambda v: v == 1, "final_logit_softcapping": lambda v: v <= 0,
               "input_embedding_scale": lambda v: v == 1}


def _window(hf: dict, dflash: dict, where: str) -> int | None:
    """The sliding window of every layer, or None; a drafter that mixes layer kinds is refused (dflash trains
    one kind for all layers)."""
    kinds = set(hf.get("layer_types") or ["full_attention"])
    if dflash.get("use_swa"):
        kinds = {"sliding_attention"}
    if kinds - {"full_attention", "sliding_attention"} or len(kinds) > 1:
        raise DflashError(f"{where}: layer_types {sorted(kinds)}: dflash reads drafters whose layers are all "
                          f"full_attention or all sliding_attention")
    if kinds == {"full_attention"}:
        return None
    window = dflash.get("swa_window_size", hf.get("sliding_window"))
    if not window:
        raise DflashError(f"{where}: sliding_attention layers without a sliding_window")
    return int(window)


def _drafter(hf: dict, where: str, **fields) -> DrafterConfig:
    if fields["mask_token_id"] is None:
        raise DflashError(f"{where}: no mask_token_id")
    try:
        cfg = DrafterConfig(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                            vocab_size=hf["vocab_size"], **hf_widths(hf), **fields)
    except KeyError as e:
        raise DflashError(f"{where}: no {e.args[0]}") from None
    except DflashError as e:  # a value out of range, named by the option it would be
        raise DflashError(f"{where}: {e}") from None
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise DflashError(f"{where}: mask_token_id {cfg.mask_token_id} is outside the vocabulary ({cfg.vocab_size})")
    if not cfg.target_layer_ids or min(cfg.target_layer_ids) < 0:
        raise DflashError(f"{where}: target layer ids {cfg.target_layer_ids} are not layers of a target")
    return cfg


def check_servable(cfg: DrafterConfig, fmt: str, num_target_layers: int) -> None:
    """Refuse, in one line, an export a server would run differently from how the drafter was trained."""
    last = num_target_layers - 1
    if last in cfg.target_layer_ids:
        raise DflashError(f"the drafter reads the target's last layer ({last}), which dflash caches after the final "
                          f"norm (as Hugging Face's hidden_states[{num_target_layers}]) while vLLM and SGLang capture "
                          f"it before: train on other --layers to serve it")
    if list(cfg.target_layer_ids) != sorted(set(cfg.target_layer_ids)):
        raise DflashError(f"target layers {cfg.target_layer_ids} are not increasing: servers concatenate the "
                          f"target's states in layer order")
    refusal = drafter_class(cfg).format_refusal(cfg, fmt)
    if refusal:
        raise DflashError(refusal)


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
    return from_hf(config, f"{what} {path}/config.json"), load_tensors(path / "model.safetensors", what), \
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
    drafter = build_drafter(dcfg, embed, head).to(device)
    copy_weights(drafter, weights, f"--drafter {path}")
    return drafter.to(embed.dtype).eval(), info


def check_weights(cfg: DrafterConfig, weights: dict, what: str) -> dict:
    """`weights` by the drafter's parameter names (a `model.` prefix some checkpoints carry dropped, a `.weight`
    suffix too where the drafter's parameter has none: DFlash2's codebooks saved as embeddings), each of the shape
    the drafter of `cfg` has and finite; otherwise one line naming the first that is not."""
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    with torch.device("meta"):  # shapes only: nothing allocated
        V, H = cfg.vocab_size, cfg.hidden_size
        expected = {n: p.shape for n, p in build_drafter(cfg, torch.empty(V, H), torch.empty(V, H)).named_parameters()}
    for name in expected:
        if name not in weights and f"{name}.weight" in weights:
            weights[name] = weights.pop(f"{name}.weight")
    for name, shape in expected.items():
        if name not in weights:
            raise DflashError(f"{what}: the weights lack {name}")
        if weights[name].shape != shape:
            raise DflashError(f"{what}: {name} has shape {tuple(weights[name].shape)}, this drafter's is "
                              f"{tuple(shape)}")
        if not torch.isfinite(weights[name]).all():
            raise DflashError(f"{what}: {name} holds non-finite values")
    return weights


@torch.no_grad()
def copy_weights(drafter: Drafter, weights: dict, what: str) -> None:
    weights = check_weights(drafter.cfg, weights, what)
    for name, p in drafter.named_parameters():
        p.copy_(weights[name].to(p.dtype))


def export(run: str | Path, out: str | Path, fmt: str = "zlab", verifier: str | None = None) -> Path:
    """Write RUN's latest checkpoint to `out` in layout `fmt` (`FORMATS`); returns `out`. `verifier`: the
    target's name recorded in a speculators export (default: the cache's target name or path)."""
    run, out = Path(run), Path(out)
    if fmt not in FORMATS:
        raise DflashError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    config, ckpt = read_run(run)
    dcfg = DrafterConfig(**config["drafter"])
    target_info = config["cache"].get("target") or (_cache_manifest(config) or {}).get("target")
    if not target_info:
        raise DflashError(f"{run}: the run does not record its target's depth and its cache "
                          f"({config['cache']['path']}) is gone: cannot write num_target_layers")
    check_servable(dcfg, fmt, target_info["num_layers"])
    target = verifier or target_info.get("name") or target_info.get("path") or "TARGET"
    if fmt == "zlab":
        hf = to_zlab(dcfg, target_info["num_layers"])
    else:
        hf = to_speculators(dcfg, target_info["num_layers"],
                            {"name_or_path": target, "architectures": target_info.get("architectures") or []})
    weights = check_weights(dcfg, checkpoint.load_weights(ckpt), f"{ckpt}")
    step = json.loads((ckpt / "state.json").read_text())["step"]
    card = model_card(dcfg, fmt, target, out, step)
    with disk_full_is_an_error(out, f"the run {run} is untouched and the export in {out} incomplete",
                               then="it writes the export again"):
        out.mkdir(parents=True, exist_ok=True)
        save_tensors({k: v.to(torch.bfloat16).contiguous() for k, v in sorted(weights.items())},
                     out / "model.safetensors", metadata={"format": "pt"})
        write_text_atomic(out / "config.json", json.dumps(hf, indent=2))
        write_text_atomic(out / "README.md", card)
    return out


def _cache_manifest(config: dict) -> dict | None:
    from dflash.cache import read_manifest

    return read_manifest(config["cache"]["path"])


def model_card(cfg: DrafterConfig, fmt: str, target: str, out: Path, step: int) -> str:
    attention = ("full attention over the target's context" if cfg.sliding_window is None else
                 f"a sliding window of {cfg.sliding_window} positions") + \
        (", causal inside the block" if cfg.causal_block else "")
    serve = {"zlab": ZLAB_SERVE, "speculators": SPECULATORS_SERVE}[fmt]
    kind = drafter_class(cfg).architecture.removesuffix("DraftModel")  # DFlash, DFlash2
    return MODEL_CARD.format(kind=kind, target=target, block=cfg.block_size, layers=cfg.num_layers,
                             ids=cfg.target_layer_ids, mask=cfg.mask_token_id, step=step, attention=attention, fmt=fmt,
                             serve=serve.format(target=target, out=out, spec=cfg.block_size - 1))


MODEL_CARD = """# {kind} drafter for {target}

A {kind} block-diffusion drafter ({layers} layers, block size {block}, {attention}) trained with dflash
(step {step}), in the {fmt} layout. It reads the target's hidden states at layers {ids} and uses the
target's own embeddings and LM head; MASK token id {mask}.
{serve}"""

ZLAB_SERVE = """
Serve with SGLang:

    python -m sglang.launch_server --model-path {target} \\
        --speculative-algorithm DFLASH --speculative-draft-model-path {out}

Serve with vLLM:

    vllm serve {target} --speculative-config '{{"method": "dflash", "model": "{out}", "num_speculative_tokens": {spec}}}'
"""  # noqa: E501 (the command as a user pastes it)

SPECULATORS_SERVE = """
Serve with vLLM, which detects the layout (the target is `speculators_config.verifier.name_or_path`, a
hub id):

    vllm serve {out}

or name the target yourself:

    vllm serve {target} --speculative-config '{{"method": "dflash", "model": "{out}", "num_speculative_tokens": {spec}}}'
"""  # noqa: E501
