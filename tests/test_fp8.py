"""fp8 storage on CPU: the quantiser against its naive reference and e4m3's precision; `extract --storage
fp8` against a bf16 extraction of the same rows; `cache convert`; verify and layer subsets; the loader,
the training step, eval and export reading fp8."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch

from conftest import (
    REPO,
    TINY_HIDDEN,
    assert_same_arrays,
    extract_args,
    fill_disk_after,
    read_arrays,
    rel_err,
    run_in_process,
)
from dflash import fp8
from dflash.cache import Cache, info, key_differences, read_manifest, verify
from dflash.naive import fp8_round_trip

LAYER_IDS = [1, 2, 3, 4, 5]  # the shipped tiny drafter's (1, 2, 4) among them
LAYERS = ",".join(map(str, LAYER_IDS))
slot = LAYER_IDS.index  # a target layer's place on the cache's layer axis


def states_with_outliers(N=64, H=320, seed=0) -> torch.Tensor:
    """Random non-zero states with a few large channels (as LLM hidden states have) and two zero rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g) * torch.exp(torch.randn(N, 1, generator=g))
    x[:, [7, 200]] *= 60.0
    x[[3, 40]] = 0.0
    return x.to(torch.bfloat16)


# -- the quantiser ------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [128, 32, 320, 1000])  # 320 = H (one scale per row); 1000 > H
def test_quantize_matches_the_naive_reference(block):
    x = states_with_outliers()  # H = 320: the last 128-block is ragged
    q, scale = fp8.quantize(x, block)
    assert q.dtype == torch.uint8 and q.shape == x.shape
    assert scale.dtype == torch.bfloat16 and scale.shape == (64, fp8.num_groups(320, block))
    want, want_scale = fp8_round_trip(x, block)
    assert torch.equal(scale.float(), want_scale)
    assert torch.equal(fp8.dequantize(q, scale, block, torch.float32), want)


@pytest.mark.parametrize("block", [128, 320])
def test_round_trip_error_is_e4m3_rounding_and_zeros_stay_zero(block):
    x = states_with_outliers().float()
    q, scale = fp8.quantize(x, block)
    y = fp8.dequantize(q, scale, block, torch.float32)
    s = scale.float().repeat_interleave(block, -1)[:, :320]
    # 3 mantissa bits: half an ulp is 2^-4 relative; below e4m3's normal range, half a step of 2^-9 scales
    assert ((y - x).abs() <= 2**-4 * x.abs() + 2**-10 * s + 1e-30).all()
    assert torch.equal(y[[3, 40]], torch.zeros(2, 320)) and not scale[[3, 40]].any()
    assert rel_err(y, x) < 0.04


def test_blocks_keep_precision_beside_a_massive_activation_where_one_scale_per_row_does_not():
    """e4m3 spans 2^-6..448 in normal numbers, so a row's scale only costs precision once its largest value
    is ~10^4 times its typical one (a "massive activation"): then the rest of the row falls into e4m3's
    subnormals, while the blocks without the outlier keep their own scales."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 320, generator=g)
    x[:8, 7] = 1e5  # rows 0-7 carry one massive channel, in the first block of 128
    x = x.to(torch.bfloat16).float()
    err = {}
    for block in (128, 320):
        q, scale = fp8.quantize(x, block)
        err[block] = rel_err(fp8.dequantize(q, scale, block, torch.float32)[:8, 128:], x[:8, 128:])
    assert err[128] < 0.03 < 0.08 < err[320]


def test_dequantize_reads_fp8_tensors_and_bits_alike():
    x = states_with_outliers()
    q, scale = fp8.quantize(x, 128)
    a = fp8.dequantize(q, scale, 128, torch.bfloat16)
    b = fp8.dequantize(q.view(torch.float8_e4m3fn), scale, 128, torch.bfloat16)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    assert rel_err(a.float(), x.float()) < 0.04


# -- caches -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def caches(tmp_path_factory, small_data):
    """The same 60 rows cached in bf16 and in fp8 (layers 1-5)."""
    root = tmp_path_factory.mktemp("fp8")
    for storage in ("bf16", "fp8"):
        result = run_in_process(extract_args(small_data, root / storage, layers=LAYERS, storage=storage))
        assert result.exit_code == 0, result.output
    return root / "bf16", root / "fp8"


def test_fp8_cache_layout_manifest_and_key(caches):
    bf16, f8 = caches
    m, m16 = read_manifest(f8), read_manifest(bf16)
    S, T, L, H, G = m["num_shards"], 512, len(LAYER_IDS), TINY_HIDDEN, TINY_HIDDEN // 128
    assert (m["format_version"], m["storage_dtype"], m["scale_block"]) == (2, "float8_e4m3fn", 128)
    c = Cache(f8)
    for name, shape, dtype, chunks in (("hidden", (S, T, L, H), "uint8", (1, T, 1, H)),
                                       ("hidden_scale", (S, T, L, G), "uint16", (1, T, 1, G))):
        arr = c.group[name]
        assert (arr.shape, str(arr.dtype), arr.chunks) == (shape, dtype, chunks), name
    assert m["cache_key"] != m16["cache_key"]
    diffs = key_differences(m16, m)
    assert [d.split(" ")[0] for d in diffs] == ["format_version", "storage_dtype", "scale_block"]
    record = json.loads((f8 / "commits" / "00000000.json").read_text())
    assert len(record["crc32c"]["hidden"]) == len(record["crc32c"]["hidden_scale"]) == L
    # everything but the states is the bf16 cache's
    a, b = read_arrays(f8), read_arrays(bf16)
    for name in ("input_ids", "loss_mask", "target_ids", "doc_lens", "row_ids"):
        assert np.array_equal(a[name], b[name]), name
    assert "hidden_scale" not in Cache(bf16).arrays


def test_fp8_states_are_the_bf16_states_within_e4m3_precision(caches):
    bf16, f8 = caches
    a, b = Cache(f8), Cache(bf16)
    padded = 0
    for s in (0, a.num_shards - 1):
        shard8, shard16 = a.read_shard(s), b.read_shard(s)
        x8, x16 = a.states(shard8, "cpu", torch.float32), b.states(shard16, "cpu", torch.float32)  # [T, L, H]
        used = int(shard8.doc_lens.sum())
        assert torch.equal(x8[used:], torch.zeros_like(x8[used:]))  # padding reads back as exactly 0
        padded += 512 - used
        for layer in range(len(LAYER_IDS)):
            assert rel_err(x8[:used, layer], x16[:used, layer]) < 0.04, (s, layer)
        assert (x8[:used].abs().amax(-1) > 0).all()
    assert padded > 0


def test_a_bf16_cache_and_an_fp8_cache_never_share_a_folder(caches, small_data):
    bf16, _ = caches
    before = {p: p.stat().st_mtime_ns for p in bf16.rglob("*") if p.is_file()}
    result = run_in_process(extract_args(small_data, bf16, layers=LAYERS, storage="fp8"))
    assert result.exit_code == 1 and "another key" in result.output and "storage_dtype" in result.output
    assert before == {p: p.stat().st_mtime_ns for p in bf16.rglob("*") if p.is_file()}


def test_cache_info_reports_about_half_the_bytes(caches):
    bf16, f8 = caches
    i8, i16 = info(f8), info(bf16)
    assert i8["storage"] == {"dtype": "float8_e4m3fn", "scale_block": 128}
    ratio = i8["state_bytes_per_token"] / i16["state_bytes_per_token"]
    assert 0.5 < ratio <= (1 + 2 / 128) / 2 + 0.001  # e4m3 bytes + a bf16 scale per 128 values (+ crc32c)
    assert i8["shard_bytes_per_token"] / i16["shard_bytes_per_token"] <= 0.52
    text = run_in_process(["cache", "info", str(f8)]).output
    assert "float8_e4m3fn, one bf16 scale per 128 channels" in text


def _file_digests(path):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def test_convert_gives_the_fp8_extraction_and_leaves_the_source_alone(caches, tmp_path):
    bf16, f8 = caches
    before = _file_digests(bf16)
    mtimes = {p: p.stat().st_mtime_ns for p in before}
    out = tmp_path / "conv"
    result = run_in_process(["cache", "convert", str(bf16), "--storage", "fp8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert _file_digests(bf16) == before and mtimes == {p: p.stat().st_mtime_ns for p in before}
    # extract quantises the same bf16 states the same way: the same bytes, hence the same key
    assert read_manifest(out)["cache_key"] == read_manifest(f8)["cache_key"]
    assert "hidden_scale" in read_arrays(f8)
    assert_same_arrays(out, f8)
    assert read_manifest(out)["converted_from"]["cache_key"] == read_manifest(bf16)["cache_key"]
    assert verify(out) == []
    again = run_in_process(["cache", "convert", str(bf16), "--storage", "fp8", "--out", str(out)])
    assert again.exit_code == 0 and "converted 0 shards" in again.output


def test_a_full_disk_during_convert_is_one_line_and_the_same_command_resumes(caches, tmp_path, monkeypatch):
    bf16, f8 = caches
    out = tmp_path / "conv"
    fill_disk_after(monkeypatch, 20)
    result = run_in_process(["cache", "convert", str(bf16), "--storage", "fp8", "--out", str(out)])
    assert result.exit_code == 1
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    done, total = len(list((out / "commits").glob("*.json"))), read_manifest(out)["num_shards"]
    assert len(errors) == 1 and 0 < done < total
    assert errors[0].startswith(f"error: {out}: no space left on the device (writing {out}/")
    assert errors[0].endswith(f"{done} of {total} shards are committed and intact; free some space and run the "
                              f"same command again: it resumes")
    monkeypatch.undo()
    assert run_in_process(["cache", "convert", str(bf16), "--storage", "fp8", "--out", str(out)]).exit_code == 0
    got, want = read_arrays(out), read_arrays(f8)
    assert all(np.array_equal(got[name], want[name]) for name in want)


@pytest.mark.parametrize("case,message", [
    ("other_layout", r"--out .* holds a cache with another key .*scale_block \(128 in the cache, 256 now\)"),
    ("fp8_source", r"already an fp8 cache"),
    ("same_folder", r"is the source cache"),
    ("not_a_cache", r"not a dflash cache"),
])
def test_convert_refuses_bad_input_with_one_line(caches, tmp_path, case, message):
    bf16, f8 = caches
    src, out, opts = bf16, tmp_path / "out", []
    if case == "other_layout":
        shutil.copytree(f8, out)
        opts = ["--scale-block", "0"]
    elif case == "fp8_source":
        src = f8
    elif case == "same_folder":
        out = bf16
    elif case == "not_a_cache":
        src = tmp_path
    before = _file_digests(out) if out.exists() else {}
    result = run_in_process(["cache", "convert", str(src), "--storage", "fp8", "--out", str(out), *opts])
    assert result.exit_code == 1
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    import re
    assert len(errors) == 1 and re.search(message, errors[0]), result.output
    assert (_file_digests(out) if out.exists() else {}) == before


def test_convert_stops_at_a_corrupt_source_shard_naming_it(caches, tmp_path):
    bf16, _ = caches
    src = tmp_path / "src"
    shutil.copytree(bf16, src)
    chunk = src / "hidden" / "c" / "2" / "0" / str(slot(3)) / "0"  # shard 2, target layer 3
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x04
    chunk.write_bytes(bytes(data))
    out = tmp_path / "out"
    result = run_in_process(["cache", "convert", str(src), "--storage", "fp8", "--out", str(out)])
    assert result.exit_code == 1 and "shard 2 is corrupt (hidden layer 3" in result.output
    assert sorted(int(p.stem) for p in (out / "commits").glob("*.json")) == [0, 1]  # committed shards stay
    assert verify(out) == []


def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x20
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("which", ["hidden", "hidden_scale"])
def test_verify_and_the_reader_catch_a_flipped_byte_in_states_or_scales(caches, tmp_path, which):
    _, f8 = caches
    copy = tmp_path / "c"
    shutil.copytree(f8, copy)
    chunk = copy / which / "c" / "1" / "0" / str(slot(5)) / "0"  # shard 1, target layer 5
    _flip(chunk, len(chunk.read_bytes()) // 3)
    bad = verify(copy)
    assert [s for s, _ in bad] == [1] and bad[0][1].startswith(f"{which} layer 5")
    result = run_in_process(["cache", "verify", str(copy)])
    assert result.exit_code == 1 and "bad shards: [1]" in result.output
    from dflash.cache import CorruptShardError
    with pytest.raises(CorruptShardError, match=f"shard 1 is corrupt \\({which} layer 5"):
        Cache(copy, layers=[5]).read_shard(1)
    Cache(copy, layers=[1, 3]).read_shard(1)  # the other layers' chunks are fine and read alone


def test_a_layer_subset_reads_only_its_states_and_scales(caches, tmp_path):
    _, f8 = caches
    copy = tmp_path / "c"
    shutil.copytree(f8, copy)
    full = Cache(copy).read_shard(0)
    for name in ("hidden", "hidden_scale"):  # target layer 3 of every shard
        for p in (copy / name / "c").glob(f"*/0/{slot(3)}/0"):
            p.unlink()
    shard = Cache(copy, layers=[1, 5]).read_shard(0)
    assert shard.hidden.dtype == np.uint8 and shard.hidden.shape == (512, 2, TINY_HIDDEN)
    assert np.array_equal(shard.hidden, full.hidden[:, [slot(1), slot(5)]])
    assert np.array_equal(shard.hidden_scale, full.hidden_scale[:, [slot(1), slot(5)]])


# -- training, eval, export ---------------------------------------------------------------------------


def test_loader_moves_fp8_bytes_and_scales(caches):
    from dflash.loader import ShardLoader

    _, f8 = caches
    cache = Cache(f8, layers=[3, 5])
    loader = ShardLoader(cache, [1], torch.device("cpu"), prefetch=1)
    (shard, inputs), = list(loader)
    ref = cache.read_shard(1)
    assert inputs.hidden.dtype == torch.float8_e4m3fn and inputs.hidden.shape == (2, 512, TINY_HIDDEN)
    assert inputs.hidden_scale.shape == (2, 512, TINY_HIDDEN // 128)
    assert np.array_equal(inputs.hidden.view(torch.uint8).numpy(), ref.hidden.transpose(1, 0, 2))
    assert np.array_equal(fp8.to_bits(inputs.hidden_scale), ref.hidden_scale.transpose(1, 0, 2))


def test_the_step_on_fp8_inputs_matches_the_step_on_bf16_states(caches):
    """The same shard through the training step: from the fp8 cache (dequantised in the step) and from the
    bf16 cache: loss and gradients agree to fp8's precision."""
    from dflash.config import DrafterConfig, TrainConfig
    from dflash.drafter import Drafter
    from dflash.loader import ShardLoader
    from dflash.train import LossModule, drafter_config

    bf16, f8 = caches
    results = {}
    for name, path in (("bf16", bf16), ("fp8", f8)):
        cache = Cache(path)
        cfg = TrainConfig(cache=str(path), out="unused", num_anchors=64,
                          drafter=DrafterConfig(num_layers=1, block_size=8))
        embed, head = cache.target_weights("cpu", torch.float32)
        drafter = Drafter(drafter_config(cfg, cache), embed, head)
        drafter.reset_parameters(seed=0)
        module = LossModule(drafter, cfg, "eager", autocast=False, scale_block=cache.scale_block)
        (_, inputs), = list(ShardLoader(cache, [0], torch.device("cpu"), prefetch=1))
        torch.manual_seed(0)  # the same anchors
        loss = module(**inputs.tensors(), anchor_scores=torch.rand(cache.token_budget))[0]
        loss.backward()
        results[name] = loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}
    assert rel_err(results["fp8"][0], results["bf16"][0]) < 5e-3
    for n, g in results["bf16"][1].items():
        assert rel_err(results["fp8"][1][n], g) < 0.05, n


def test_train_eval_and_export_on_an_fp8_cache(caches, tmp_path):
    bf16, f8 = caches
    run = tmp_path / "run"
    preset = str(REPO / "configs" / "tiny.toml")
    result = run_in_process(["train", "--config", preset, "--cache", str(f8), "--out", str(run), "--device", "cpu",
                             "--max-steps", "30", "--num-anchors", "64", "--holdout-shards", "2", "--log-every", "10",
                             "--layers", "1,3"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert [x["tau"] for x in lines if "tau" in x][0] >= 1.0  # training-time eval read the fp8 held-out shards
    export = tmp_path / "export"
    assert run_in_process(["export", str(run), "--out", str(export)]).exit_code == 0
    assert json.loads((export / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 3]


def test_eval_of_the_shipped_drafter_reads_either_storage_alike(caches):
    """The H200-trained tiny drafter (bf16 states) on the same rows from both caches: tau within 2 %."""
    from dflash.evaluate import evaluate

    bf16, f8 = caches
    drafter = str(REPO / "data" / "tiny-drafter")
    shards = list(range(4))
    a, b = evaluate(drafter, str(bf16), shards, "cpu"), evaluate(drafter, str(f8), shards, "cpu")
    assert a["tau"] > 1.2 and a["blocks"] == b["blocks"]
    assert abs(b["tau"] - a["tau"]) / a["tau"] < 0.02


def test_the_data_readme_fp8_reader_snippet_runs(caches):
    """data/README.md shows how to read an fp8 cache without dflash: that code must give dflash's states."""
    _, f8 = caches
    readme = (REPO / "data" / "README.md").read_text()
    part = readme.split("### Reading a cache without dflash")[1]
    scope = {}
    for snippet in [b.split("```")[0] for b in part.split("```python")[1:3]]:
        exec(snippet.replace("CACHE", str(f8)).replace("index(17)", "index(3)"), scope)
    cache = Cache(f8, layers=[3])
    assert torch.equal(scope["h"], cache.states(cache.read_shard(0), "cpu", torch.float32)[:, 0])
