"""`dflash cache verify --recompute`: the cache's states against the target rerun, on CPU."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import TINY_TARGET, extract_args, run_in_process
from dflash.cache import Cache
from dflash.recompute import sample_documents


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, small_data):
    out = tmp_path_factory.mktemp("recompute") / "c"
    result = run_in_process(extract_args(small_data, out, layers="1,3,4"))
    assert result.exit_code == 0, result.output
    return out


def target_copy(dest, change) -> str:
    """A copy of the tiny target with `change(model)` applied to its fp32 weights."""
    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32)
    change(model)
    model.save_pretrained(dest)
    for f in TINY_TARGET.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, dest)
    return str(dest)


def verify(cache, *options):
    return run_in_process(["cache", "verify", str(cache), "--device", "cpu", *map(str, options)])


def test_the_target_itself_matches_every_layer(cache_dir):
    result = verify(cache_dir, "--recompute", 6, "--json")
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert r["ok"] and not r["checksums"] and not r["recompute"]["mismatches"]
    docs = r["recompute"]["documents"]
    assert len(docs) == 6 and len({(d["shard"], d["document"]) for d in docs}) == 6
    assert set(r["recompute"]["layers"]) == {"1", "3", "4"}
    assert max(r["recompute"]["layers"].values()) < 1e-3  # fp32 as extracted, then the same bf16 rounding
    assert r["recompute"]["target_ids_agree"] > 0.99


def test_bf16_recompute_of_an_fp32_cache_is_within_the_default_tolerance(cache_dir):
    result = verify(cache_dir, "--recompute", 3, "--dtype", "bf16", "--json")
    assert result.exit_code == 0, result.output
    worst = json.loads(result.stdout)["recompute"]["layers"].values()
    assert 1e-4 < max(worst) < 0.05  # not the same numbers, the same states


def test_a_target_with_one_changed_layer_is_named_from_that_layer_on(cache_dir, tmp_path):
    def change(model):
        with torch.no_grad():
            model.model.layers[2].mlp.down_proj.weight.mul_(1.5)

    result = verify(cache_dir, "--recompute", 4, "--target", target_copy(tmp_path / "t", change))
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    named = [line for line in lines if ", layer " in line]
    assert named and all("no layer of this target matches" in line for line in named)
    assert {line.split(", layer ")[1].split(":")[0] for line in named} == {"3", "4"}  # layer 1 comes before it
    assert all("shard " in line and "document " in line and "(row " in line for line in named)
    assert lines[-1].startswith("error: ") and "bad shards: [" in lines[-1]


def test_a_cache_captured_one_layer_off_says_so(cache_dir, tmp_path):
    """Against a target whose layer i+1 is this one's layer i (an identity layer in front), every cached
    layer matches the next one."""
    def shift(model):
        first = copy.deepcopy(model.model.layers[0])
        with torch.no_grad():
            first.self_attn.o_proj.weight.zero_()
            first.mlp.down_proj.weight.zero_()  # residual + 0: the identity
        model.model.layers.insert(0, first)
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.layer_idx = i
        model.config.num_hidden_layers += 1
        model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers

    result = verify(cache_dir, "--recompute", 2, "--target", target_copy(tmp_path / "t", shift))
    assert result.exit_code == 1
    named = [line for line in result.stderr.splitlines() if ", layer " in line]
    assert len(named) == 2 * 3
    for line in named:
        layer = int(line.split(", layer ")[1].split(":")[0])
        assert f"it matches layer {layer + 1} " in line and "+1 layer(s) off" in line


def test_a_last_layer_cached_before_the_final_norm_says_so(tmp_path, small_data, monkeypatch):
    """A cache whose last layer holds the pre-norm output (what servers capture) is told apart."""
    import dflash.extract
    from dflash.recompute import _PreNormHook
    from dflash.target import Target

    class PreNorm(Target):
        def __init__(self, model, layer_ids, **kw):
            super().__init__(model, layer_ids, **kw)
            self.pre = _PreNormHook(model, self.num_layers)

        def forward(self, input_ids, cache=None):
            hidden, last = super().forward(input_ids, cache)
            return [*hidden[:-1], self.pre.state], last

    monkeypatch.setattr(dflash.extract, "Target", PreNorm)
    out = tmp_path / "c"
    assert run_in_process(extract_args(small_data, out, layers="1,5", limit=12)).exit_code == 0
    monkeypatch.undo()
    result = verify(out, "--recompute", 2)
    assert result.exit_code == 1
    named = [line for line in result.stderr.splitlines() if ", layer " in line]
    assert len(named) == 2 and all(", layer 5:" in line and "before the final norm" in line for line in named)


def test_an_fp8_cache_is_compared_after_the_same_quantisation(tmp_path, small_data):
    out = tmp_path / "c"
    assert run_in_process(extract_args(small_data, out, storage="fp8", limit=12)).exit_code == 0
    result = verify(out, "--recompute", 3, "--json")
    assert result.exit_code == 0, result.output
    assert max(json.loads(result.stdout)["recompute"]["layers"].values()) < 1e-3


def test_documents_are_sampled_across_the_shards(cache_dir):
    cache = Cache(cache_dir)
    shards = cache.committed()
    picked = sample_documents(cache, 4, seed=0)
    assert picked == sample_documents(cache, 4, seed=0) != sample_documents(cache, 4, seed=1)
    assert len(set(picked)) == 4
    quarter = len(shards) // 4
    assert sorted(shards.index(s) // quarter for s, _ in picked) == [0, 1, 2, 3]  # one per stratum
    _, doc_lens = cache.plan()
    every = sum(int((doc_lens[s] > 0).sum()) for s in shards)
    assert len(set(sample_documents(cache, 10 * every, seed=0))) == every  # more than there are: each once


@pytest.mark.parametrize("options, message", [
    (["--tolerance", "0"], "--tolerance must be in (0, 1)"),
    (["--recompute", "-1"], "--recompute must be >= 0"),
    (["--target", "/nonexistent/target"], "/nonexistent/target"),
])
def test_bad_options_are_one_line(cache_dir, options, message):
    result = verify(cache_dir, "--recompute", 2, *options)
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: ") and message in result.stderr


def test_a_target_of_another_width_is_refused(cache_dir, tmp_path):
    dest = tmp_path / "wide"
    shutil.copytree(TINY_TARGET, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}))
    result = verify(cache_dir, "--recompute", 2, "--target", dest)
    assert result.exit_code == 1 and "not the target of this cache" in result.stderr
