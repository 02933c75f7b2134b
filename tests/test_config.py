"""The run configs: presets, type checks, validation on construction, and the CLI options generated from
them (every field an option, its docstring the help)."""

from pathlib import Path

import pytest

from conftest import run_in_process
from dflash.config import (
    DrafterConfig,
    ExtractConfig,
    RegenerateConfig,
    TrainConfig,
    build_config,
    field_docs,
    load_preset,
    option,
    option_fields,
)
from dflash.errors import DflashError

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.toml"))
COMMANDS = {"extract": ExtractConfig, "train": TrainConfig, "regenerate": RegenerateConfig}
REQUIRED = {"extract": {"out": "/tmp/unused"}, "train": {"cache": "/tmp/unused", "out": "/tmp/unused"},
            "regenerate": {"data": ["/tmp/unused.jsonl"], "out": "/tmp/unused.jsonl"}}


@pytest.mark.parametrize("preset", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_table_of_every_preset_loads(preset):
    tables = load_preset(preset)
    assert {"extract", "train"} <= set(tables) and set(tables) <= set(COMMANDS)
    for section in tables:
        cfg = build_config(COMMANDS[section], preset, section, REQUIRED[section])
        if hasattr(cfg, "target") and cfg.target:
            assert Path(cfg.target).is_dir(), "preset paths resolve against the preset's folder"
    assert all(Path(p).is_file() for p in build_config(ExtractConfig, preset, "extract", REQUIRED["extract"]).data)


def test_cli_values_override_the_preset():
    cfg = build_config(ExtractConfig, CONFIGS[0], "extract",
                       {"token_budget": 1024, "data": ("x.jsonl",), "layers": None, "out": "o"})
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
    bad.write_text("[extract]\ndata = ['a.jsonl', 3]\n")
    with pytest.raises(DflashError, match=r"bad.toml: data = \['a.jsonl', 3\] has the wrong type"):
        build_config(ExtractConfig, bad, "extract", {})
    bad.write_text("[train]\nlabels = 'both'\n")
    with pytest.raises(DflashError, match="bad.toml: labels must be one of target, data, got 'both'"):
        build_config(TrainConfig, bad, "train", {})
    bad.write_text("[extract\n")
    with pytest.raises(DflashError, match="invalid TOML"):
        build_config(ExtractConfig, bad, "extract", {})


def test_a_toml_integer_is_a_float_and_a_bool_is_no_integer(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text("[train]\nlr = 1\nwarmup = 0\n")
    cfg = build_config(TrainConfig, preset, "train", REQUIRED["train"])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and isinstance(cfg.warmup, float)
    preset.write_text("[train]\nepochs = true\n")
    with pytest.raises(DflashError, match="epochs = True has the wrong type"):
        build_config(TrainConfig, preset, "train", REQUIRED["train"])


@pytest.mark.parametrize("cls,values,message", [
    (ExtractConfig, {"token_budget": 0}, "--token-budget must be >= 1"),
    (ExtractConfig, {"max_len": 1}, "--max-len must be in"),
    (ExtractConfig, {"dtype": "fp8"}, "--dtype must be one of auto, bf16, fp16, fp32, got 'fp8'"),
    (ExtractConfig, {"batch_tokens": 10}, "--batch-tokens 10 is below"),
    (ExtractConfig, {"storage": "int4"}, "--storage must be one of bf16, fp8"),
    (ExtractConfig, {"experts_implementation": "loop"}, "--experts-implementation must be one of"),
    (ExtractConfig, {"out": ""}, "no output: pass --out"),
    (TrainConfig, {"block_size": 1}, "--block-size must be >= 2"),
    (TrainConfig, {"dpace_alpha": 0.0}, r"--dpace-alpha must be in \(0, 1\], got 0.0"),
    (TrainConfig, {"dpace_alpha": 1.5}, r"--dpace-alpha must be in \(0, 1\], got 1.5"),
    (TrainConfig, {"sliding_window": 0}, "--sliding-window must be >= 1"),
    (TrainConfig, {"sliding_window": 8}, "--sliding-window 8 is shorter than the block"),
    (TrainConfig, {"layers": [3, 1]}, r"--layers must be increasing and distinct, got \[3, 1\]"),
    (TrainConfig, {"loss": "focal"}, "--loss must be one of dpace, decay"),
    (TrainConfig, {"lr": -1.0}, "--lr must be > 0, got -1.0"),
    (TrainConfig, {"seed": -1}, "--seed must be >= 0, got -1"),
    (TrainConfig, {"holdout_shards": -1}, "--holdout-shards must be >= 0"),
    (TrainConfig, {"max_steps": 0}, "--max-steps must be >= 1, got 0"),
    (TrainConfig, {"max_steps": -5}, "--max-steps must be >= 1"),
    (TrainConfig, {"grad_clip": 0.0}, "--grad-clip must be > 0"),
    (TrainConfig, {"min_lr_ratio": 2.0}, r"--min-lr-ratio must be in \[0, 1\]"),
    (TrainConfig, {"ce_chunk": -1}, "--ce-chunk must be >= 0"),
    (TrainConfig, {"warmup": 1.5}, "--warmup is a fraction"),
    (TrainConfig, {"compile": "maybe"}, "--compile must be one of auto, yes, no"),
    (RegenerateConfig, {"batch_size": 0}, "--batch-size must be >= 1"),
    (RegenerateConfig, {"data": []}, "no data: pass --data"),
])
def test_construction_validates_naming_the_option(cls, values, message):
    base = {ExtractConfig: {"target": "t", "data": ["d"], "out": "o"}, TrainConfig: {"cache": "c", "out": "o"},
            RegenerateConfig: {"target": "t", "data": ["d"], "out": "o"}}[cls]
    with pytest.raises(DflashError, match=message):
        build_config(cls, None, "", {**base, **values})


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_field_is_an_option_with_its_docstring_as_help(command):
    result = run_in_process([command, "--help"])
    assert result.exit_code == 0
    text = "".join(result.output.split())  # click wraps help text at any space (and after hyphens)
    for name, (owner, _) in option_fields(COMMANDS[command]).items():
        doc = field_docs(owner).get(name)
        assert f"{option(name)} " in result.output, name
        assert doc, f"{name} has no docstring"
        assert "".join(doc.split()) in text, name
    if command == "train":  # the drafter's fields are options; those the target fixes are not
        assert "--num-layers " in result.output and "--sliding-window " in result.output
        assert "--hidden-size" not in result.output and "--drafter " not in result.output


def test_the_drafters_fields_nest_into_train_config_and_its_record_is_flat(tmp_path):
    """Preset keys and options of the drafter fill TrainConfig.drafter; the run's record (and what a resumed
    run must share) is one flat table, as the options are."""
    from dflash.config import flat_dict

    preset = tmp_path / "p.toml"
    preset.write_text("[train]\nnum_layers = 3\nsliding_window = 64\nlr = 1e-3\n")
    cfg = build_config(TrainConfig, preset, "train", {**REQUIRED["train"], "block_size": 8, "causal_block": True})
    assert cfg.drafter == DrafterConfig(num_layers=3, block_size=8, sliding_window=64, causal_block=True)
    assert cfg.lr == 1e-3
    flat = flat_dict(cfg)
    assert flat["num_layers"] == 3 and flat["block_size"] == 8 and "drafter" not in flat and "hidden_size" not in flat
    assert TrainConfig(**{**REQUIRED["train"], "drafter": cfg.drafter.to_dict()}).drafter == cfg.drafter
    preset.write_text("[train]\nhidden_size = 64\n")
    with pytest.raises(DflashError, match="unknown key 'hidden_size' in \\[train\\]"):
        build_config(TrainConfig, preset, "train", REQUIRED["train"])


def test_generated_options_parse_like_the_fields(tmp_path, monkeypatch):
    """A comma list, a repeatable option, a choice and a flag reach the config typed; unset options leave
    the preset's values alone."""
    seen = {}
    monkeypatch.setattr("dflash.extract.extract", lambda cfg: seen.setdefault("cfg", cfg))
    result = run_in_process(["extract", "--config", str(CONFIGS[0]), "--out", str(tmp_path), "--layers", "1,3",
                             "--data", "a.jsonl", "--data", "b.jsonl", "--storage", "fp8", "--trust-remote-code"])
    assert result.exit_code == 0, result.output
    cfg = seen["cfg"]
    assert cfg.layers == [1, 3] and cfg.data == ["a.jsonl", "b.jsonl"] and cfg.storage == "fp8"
    assert cfg.trust_remote_code is True and cfg.token_budget == 1024  # the preset's
    result = run_in_process(["extract", "--out", str(tmp_path), "--target", "t", "--data", "d", "--layers", "1,x"])
    assert result.exit_code == 2 and "comma-separated integers" in result.output
