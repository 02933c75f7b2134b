"""The drafter's shape resolved against a target (`resolve_drafter`), the export layouts (`to_zlab`,
`to_speculators`) read back by `from_hf` and checked against the serving engines' own rules, and drafters on
disk: a run and its export read back as the same drafter; a refused export or a full disk writes nothing."""

from __future__ import annotations

import dataclasses
import errno
import json

import pytest
import torch

from conftest import TINY_TARGET
from dflash import checkpoint
from dflash.config import DrafterConfig, resolve_drafter
from dflash.drafter import Drafter
from dflash.drafter_io import check_servable, export, from_hf, read_drafter, to_speculators, to_zlab
from dflash.errors import DflashError
from test_objective import tiny_drafter

TINY = json.loads((TINY_TARGET / "config.json").read_text())
QWEN3_8B = DrafterConfig(num_layers=5, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, block_size=16,
                         target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669, vocab_size=151936,
                         max_position_embeddings=40960)
# (sliding window, causal block) -> the formats that serve it as trained
ATTENTION = {(None, False): ("zlab", "speculators"), (2048, True): ("zlab", "speculators"),
             (2048, False): ("speculators",), (None, True): ("speculators",)}
VERIFIER = {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]}


def write(cfg: DrafterConfig, fmt: str) -> dict:
    hf = to_zlab(cfg, 36) if fmt == "zlab" else to_speculators(cfg, 36, VERIFIER)
    return json.loads(json.dumps(hf))


# -- what the serving engines read, transcribed from their loaders -----------------------------------------

def vllm_reads(hf: dict) -> dict:
    """vLLM (qwen3_dflash.py; speculators configs through transformers_utils/configs/speculators/algos.py
    update_dflash): per layer (window, causal), the aux layer ids it captures, the MASK token, the number of
    draft queries (1 + num_speculative_tokens)."""
    spec_tokens = None
    if "speculators_config" in hf and "model_type" not in hf:  # auto-detected
        spec_tokens = hf["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        aux = hf["aux_hidden_state_layer_ids"]
        layer = dict(hf["transformer_layer_config"], eagle_aux_hidden_state_layer_ids=aux,
                     dflash_config={"mask_token_id": hf["mask_token_id"], "target_layer_ids": [i - 1 for i in aux],
                                    "causal": not hf.get("sliding_window_non_causal", True)})
        hf = layer
    dflash = hf.get("dflash_config") or {}
    aux = hf.get("eagle_aux_hidden_state_layer_ids") or [i + 1 for i in dflash["target_layer_ids"]]
    layers = []
    for kind in hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]:
        sliding = kind == "sliding_attention" or (dflash.get("use_swa", False) and "layer_types" not in hf)
        window = dflash.get("swa_window_size", hf.get("sliding_window")) if sliding else None
        if hf.get("is_causal") is not None:
            causal = bool(hf["is_causal"])
        elif dflash.get("causal") is not None:
            causal = bool(dflash["causal"])
        else:
            causal = sliding
        layers.append((window, causal))
    return {"layers": layers, "aux": aux, "mask": dflash.get("mask_token_id", hf.get("mask_token_id")),
            "queries": None if spec_tokens is None else 1 + spec_tokens}


def sglang_reads(hf: dict) -> dict:
    """SGLang (models/dflash.py, speculative/dflash_utils.py): block size from dflash_config then the top
    level; full_attention layers attend the whole block, sliding_attention layers causally (no is_causal)."""
    dflash = hf.get("dflash_config") or {}
    layers = [(hf["sliding_window"], True) if kind == "sliding_attention" else (None, False)
              for kind in hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]]
    return {"layers": layers, "block_size": dflash.get("block_size", hf.get("block_size", 16)),
            "target_layer_ids": dflash.get("target_layer_ids"), "mask": dflash.get("mask_token_id")}


def zlab_reads(hf: dict) -> dict:
    """z-lab's DFlashDraftModel (dflash/model.py): every field from dflash_config, else the top level; a
    layer is causal when `is_causal` says so, else when it slides."""
    dflash = hf.get("dflash_config") or {}
    layers = []
    for kind in hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]:
        causal = kind == "sliding_attention" if hf.get("is_causal") is None else bool(hf["is_causal"])
        layers.append((hf["sliding_window"] if kind == "sliding_attention" else None, causal))
    return {"layers": layers, "block_size": int(dflash.get("block_size", hf.get("block_size", 16))),
            "target_layer_ids": dflash.get("target_layer_ids", hf.get("target_layer_ids"))}


@pytest.mark.parametrize("window, causal", list(ATTENTION))
@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_each_export_is_read_by_the_servers_as_trained(fmt, window, causal):
    cfg = dataclasses.replace(QWEN3_8B, sliding_window=window, causal_block=causal)
    if fmt not in ATTENTION[(window, causal)]:
        with pytest.raises(DflashError, match=f"--format {fmt}: .*SGLang serves"):
            check_servable(cfg, fmt, 36)
        return
    check_servable(cfg, fmt, 36)
    hf = write(cfg, fmt)
    trained = [(window, causal)] * cfg.num_layers
    vllm = vllm_reads(hf)
    assert vllm["layers"] == trained and vllm["mask"] == cfg.mask_token_id
    assert vllm["aux"] == [i + 1 for i in cfg.target_layer_ids]  # vLLM counts from the embeddings
    if fmt == "speculators":
        assert vllm["queries"] == cfg.block_size and hf["speculators_config"]["verifier"] == VERIFIER
        assert "model_type" not in hf  # how vLLM tells the layout apart
    else:
        for server in (sglang_reads(hf), zlab_reads(hf)):
            assert server["layers"] == trained and server["block_size"] == cfg.block_size
            assert server["target_layer_ids"] == cfg.target_layer_ids
        assert hf["block_size"] == cfg.block_size  # older loaders read it at the top level
    assert from_hf(hf) == cfg  # and dflash reads back what it wrote


def test_from_hf_reads_older_and_newer_reference_configs():
    newer = write(QWEN3_8B, "zlab")
    older = {k: v for k, v in newer.items() if k not in ("layer_types", "sliding_window", "use_sliding_window")}
    older["dflash_config"] = {k: v for k, v in newer["dflash_config"].items() if k != "block_size"}
    assert from_hf(older) == QWEN3_8B
    del newer["block_size"]  # a newer config: block_size in dflash_config only
    assert from_hf(newer) == QWEN3_8B
    windowed = dict(newer, layer_types=["sliding_attention"] * 5, sliding_window=4096)  # no is_causal: causal
    assert (from_hf(windowed).sliding_window, from_hf(windowed).causal_block) == (4096, True)
    assert from_hf(dict(windowed, is_causal=False)).causal_block is False
    for key in ("rope_theta", "head_dim", "max_position_embeddings"):
        del newer[key]
    cfg = from_hf({**newer, "rope_parameters": {"rope_theta": 5e5}})
    assert cfg.head_dim == 128 and cfg.rope_theta == 5e5 and cfg.max_position_embeddings == 40960


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 2048},
     "layers are all full_attention or all sliding_attention"),
    ({"layer_types": ["sliding_attention"] * 5, "sliding_window": None}, "without a sliding_window"),
    ({"dflash_config": {"mask_token_id": 3}}, "no dflash_config.target_layer_ids"),
    ({"num_hidden_layers": None}, "no num_hidden_layers"),
])
def test_from_hf_refuses_what_dflash_cannot_run_naming_the_file(change, message):
    hf = {k: v for k, v in {**write(QWEN3_8B, "zlab"), **change}.items() if v is not None}
    with pytest.raises(DflashError, match=f"x/config.json: .*{message}"):
        from_hf(hf, "x/config.json")


def test_an_export_of_the_targets_last_layer_is_refused():
    cfg = dataclasses.replace(QWEN3_8B, target_layer_ids=[1, 17, 35])
    for fmt in ("zlab", "speculators"):
        with pytest.raises(DflashError, match=r"last layer \(35\).*after the final norm"):
            check_servable(cfg, fmt, 36)


def test_drafter_of_a_target_takes_the_targets_widths_unless_told():
    kw = dict(hidden_size=256, vocab_size=4096, target_layer_ids=[1, 2, 3])
    cfg = resolve_drafter(DrafterConfig(num_layers=2, mask_token_id=3), TINY, **kw)
    assert cfg == DrafterConfig(num_layers=2, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                                block_size=16, target_layer_ids=[1, 2, 3], mask_token_id=3, vocab_size=4096,
                                max_position_embeddings=4096)
    told = resolve_drafter(DrafterConfig(num_layers=2, intermediate_size=512, num_attention_heads=8, rope_theta=1e6,
                                         sliding_window=64), {"text_config": TINY}, **kw)
    assert (told.intermediate_size, told.num_attention_heads, told.head_dim, told.rope_theta) == (512, 8, 64, 1e6)
    assert told.num_key_value_heads == 2 and told.sliding_window == 64  # the target's, as its head_dim
    assert told.mask_token_id == TINY["dflash_mask_token_id"]
    moe = {k: v for k, v in TINY.items() if k != "intermediate_size"}
    assert resolve_drafter(DrafterConfig(), moe, **kw).intermediate_size == 3 * 256
    with pytest.raises(DflashError, match="--mask-token-id is needed"):
        resolve_drafter(DrafterConfig(), {k: v for k, v in TINY.items() if k != "dflash_mask_token_id"}, **kw)
    with pytest.raises(DflashError, match="--mask-token-id 4096 is outside"):
        resolve_drafter(DrafterConfig(mask_token_id=4096), TINY, **kw)


def test_a_drafter_refuses_an_unresolved_config():
    with pytest.raises(ValueError, match=r"fields \['intermediate_size'.* are unresolved"):
        Drafter(DrafterConfig(), torch.zeros(4, 4), torch.zeros(4, 4))


def _run(tmp_path, **fields):
    drafter = tiny_drafter(0, **fields)
    run = tmp_path / "run"
    config = {"drafter": drafter.cfg.to_dict(), "holdout_shards": [1],
              "cache": {"path": str(tmp_path / "gone"), "cache_key": "k", "target": {"name": "tiny", "num_layers": 6}}}
    (run).mkdir()
    (run / "config.json").write_text(json.dumps(config))
    checkpoint.save(run, 3, drafter, torch.optim.AdamW(drafter.parameters()), {})
    return run, drafter


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_a_run_and_its_export_read_back_as_the_same_drafter(tmp_path, fmt):
    run, drafter = _run(tmp_path, sliding_window=16, causal_block=True)
    out = export(run, tmp_path / "export", fmt)
    from_run, from_export = read_drafter(run), read_drafter(out)
    assert from_run[0] == from_export[0] == drafter.cfg
    assert from_run[2] == {"holdout_shards": [1], "cache_key": "k"}
    for name, p in drafter.named_parameters():
        assert torch.equal(from_run[1][name], p.detach())
        assert torch.equal(from_export[1][name], p.detach().to(torch.bfloat16))
    config = json.loads((out / "config.json").read_text())
    assert config["num_target_layers"] == 6
    card = (out / "README.md").read_text()
    assert "a sliding window of 16 positions, causal inside the block" in card and "vllm serve" in card


def test_a_refused_export_writes_nothing(tmp_path):
    run, _ = _run(tmp_path, sliding_window=16)
    with pytest.raises(DflashError, match="--format zlab: --sliding-window without --causal-block"):
        export(run, tmp_path / "export", "zlab")
    assert not (tmp_path / "export").exists()
    with pytest.raises(DflashError, match="--format must be one of zlab, speculators, got 'onnx'"):
        export(run, tmp_path / "export", "onnx")


def test_a_full_disk_during_export_is_one_line(tmp_path, monkeypatch):
    run, _ = _run(tmp_path)

    def full(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr("dflash.files.save_file", full)
    with pytest.raises(DflashError) as e:
        export(run, tmp_path / "export")
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'export'}: no space left on the device")
    assert "model.safetensors" in message and f"the run {run} is untouched" in message
    assert "run the same command again" in message
    assert checkpoint.latest(run).name == "step-00000003"


def test_training_says_at_its_start_which_exports_will_be_refused(said):
    from dflash.train import note_exports

    note_exports(dataclasses.replace(QWEN3_8B, sliding_window=2048), 36)
    lines = said()
    assert len(lines) == 1 and lines[0].startswith("note: this drafter exports to speculators only: --format zlab")
    said.clear()
    note_exports(dataclasses.replace(QWEN3_8B, target_layer_ids=[1, 35]), 36)
    lines = said()
    assert len(lines) == 1 and lines[0].startswith("note: this drafter cannot be exported: the drafter reads the "
                                                   "target's last layer (35)")
    said.clear()
    note_exports(QWEN3_8B, 36)
    assert said() == []


def test_export_cli_takes_a_format_and_refuses_an_unknown_one(tmp_path):
    from conftest import run_in_process

    run, _ = _run(tmp_path)
    ok = run_in_process(["export", str(run), "--out", str(tmp_path / "s"), "--format", "speculators",
                         "--verifier", "Qwen/Qwen3-8B"])
    assert ok.exit_code == 0 and "speculators layout" in ok.output
    hf = json.loads((tmp_path / "s" / "config.json").read_text())
    assert hf["speculators_config"]["verifier"]["name_or_path"] == "Qwen/Qwen3-8B"
    bad = run_in_process(["export", str(run), "--out", str(tmp_path / "x"), "--format", "onnx"])
    assert bad.exit_code == 2 and "--format" in bad.output and not (tmp_path / "x").exists()
