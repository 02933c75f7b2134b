from pathlib import Path

import pytest

from dflash.config import ExtractConfig, build_config
from dflash.errors import DflashError

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.toml"))


@pytest.mark.parametrize("preset", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_preset_loads_and_validates(preset):
    cfg = build_config(ExtractConfig, preset, "extract", {"out": "/tmp/unused"})
    cfg.validate()
    assert Path(cfg.target).is_dir(), "preset paths resolve against the preset's folder"
    assert all(Path(p).is_file() for p in cfg.data)


def test_cli_values_override_the_preset():
    cfg = build_config(ExtractConfig, CONFIGS[0], "extract", {"token_budget": 1024, "data": ["x.jsonl"], "layers": None})
    assert cfg.token_budget == 1024 and cfg.data == ["x.jsonl"]
    assert cfg.layers is None and cfg.resolved_max_len() == 1024


def test_unknown_key_and_wrong_type_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[extract]\ntoken_budgett = 5\n")
    with pytest.raises(DflashError, match=r"bad.toml: unknown key 'token_budgett' in \[extract\]"):
        build_config(ExtractConfig, bad, "extract", {})
    bad.write_text("[extract]\ntoken_budget = '5'\n")
    with pytest.raises(DflashError, match="bad.toml: token_budget = '5' has the wrong type"):
        build_config(ExtractConfig, bad, "extract", {})
    bad.write_text("[extract\n")
    with pytest.raises(DflashError, match="invalid TOML"):
        build_config(ExtractConfig, bad, "extract", {})


@pytest.mark.parametrize("field,value,message", [
    ("token_budget", 0, "--token-budget must be >= 1"),
    ("max_len", 1, "--max-len must be in"),
    ("dtype", "fp8", "--dtype must be"),
    ("batch_tokens", 10, "--batch-tokens 10 is below"),
])
def test_validate_names_the_option(field, value, message):
    cfg = ExtractConfig(target="t", data=["d"], out="o", **{field: value})
    with pytest.raises(DflashError, match=message):
        cfg.validate()
