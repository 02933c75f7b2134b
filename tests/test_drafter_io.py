"""The drafter's Hugging Face schema (`DrafterConfig.from_target_config` / `from_hf` / `to_hf`) and drafters
on disk: a run and its export read back as the same drafter; a full disk during an export is one line."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from conftest import TINY_TARGET
from dflash import checkpoint
from dflash.drafter import DrafterConfig
from dflash.drafter_io import export, read_drafter
from dflash.errors import DflashError
from test_objective import tiny_drafter

TINY = json.loads((TINY_TARGET / "config.json").read_text())


@pytest.mark.parametrize("cfg", [
    DrafterConfig(),  # Qwen3-8B's drafter
    DrafterConfig(num_layers=1, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1,
                  head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, block_size=2, target_layer_ids=[3],
                  mask_token_id=7, vocab_size=300, max_position_embeddings=2048),
])
def test_hf_config_round_trip(cfg):
    hf = cfg.to_hf(num_target_layers=36)
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["num_target_layers"] == 36
    assert hf["dflash_config"] == {"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layer_ids}
    assert DrafterConfig.from_hf(json.loads(json.dumps(hf))) == cfg


def test_hf_configs_without_optional_keys_get_qwen3s_choices():
    hf = DrafterConfig(hidden_size=256, num_attention_heads=4).to_hf(6)
    for key in ("head_dim", "rope_theta", "max_position_embeddings"):
        del hf[key]
    cfg = DrafterConfig.from_hf({**hf, "rope_parameters": {"rope_theta": 5e5}})
    assert cfg.head_dim == 64 and cfg.rope_theta == 5e5 and cfg.max_position_embeddings == 40960
    assert DrafterConfig.from_hf(hf).rope_theta == 1e6


def test_drafter_of_a_target_takes_the_targets_widths_unless_told():
    kw = dict(hidden_size=256, vocab_size=4096, num_layers=2, block_size=16, target_layer_ids=[1, 2, 3],
              mask_token_id=3)
    cfg = DrafterConfig.from_target_config(TINY, **kw)
    assert cfg == DrafterConfig(num_layers=2, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                                block_size=16, target_layer_ids=[1, 2, 3], mask_token_id=3, vocab_size=4096,
                                max_position_embeddings=4096)
    told = DrafterConfig.from_target_config({"text_config": TINY}, **kw, intermediate_size=512, num_attention_heads=8,
                                            num_key_value_heads=None, head_dim=None, rope_theta=1e6)
    assert (told.intermediate_size, told.num_attention_heads, told.head_dim, told.rope_theta) == (512, 8, 64, 1e6)
    assert told.num_key_value_heads == 2  # the target's, as its head_dim
    moe = {k: v for k, v in TINY.items() if k != "intermediate_size"}
    assert DrafterConfig.from_target_config(moe, **kw).intermediate_size == 3 * 256


def _run(tmp_path):
    drafter = tiny_drafter(0)
    run = tmp_path / "run"
    config = {"drafter": drafter.cfg.to_dict(), "holdout_shards": [1],
              "cache": {"path": str(tmp_path / "gone"), "cache_key": "k", "target": {"name": "tiny", "num_layers": 6}}}
    (run).mkdir()
    (run / "config.json").write_text(json.dumps(config))
    checkpoint.save(run, 3, drafter, torch.optim.AdamW(drafter.parameters()), {})
    return run, drafter


def test_a_run_and_its_export_read_back_as_the_same_drafter(tmp_path):
    run, drafter = _run(tmp_path)
    out = export(run, tmp_path / "export")
    from_run, from_export = read_drafter(run), read_drafter(out)
    assert from_run[0] == from_export[0] == drafter.cfg
    assert from_run[2] == {"holdout_shards": [1], "cache_key": "k"}
    for name, p in drafter.named_parameters():
        assert torch.equal(from_run[1][name], p.detach())
        assert torch.equal(from_export[1][name], p.detach().to(torch.bfloat16))
    assert json.loads((out / "config.json").read_text())["num_target_layers"] == 6


def test_a_full_disk_during_export_is_one_line(tmp_path, monkeypatch):
    run, _ = _run(tmp_path)

    def full(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr("dflash.drafter_io.save_file", full)
    with pytest.raises(DflashError) as e:
        export(run, tmp_path / "export")
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'export'}: no space left on the device")
    assert "model.safetensors" in message and f"the run {run} is untouched" in message
    assert "run the same command again" in message
    assert checkpoint.latest(run).name == "step-00000003"
