"""Stage one end to end on CPU: contents, reuse by key, reader, verify, bad input."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import (
    CACHE_ARRAYS,
    SAMPLE_TEXT,
    TINY_HIDDEN,
    TINY_TARGET,
    TINY_VOCAB,
    assert_same_arrays,
    bf16_bits_to_float,
    committed,
    extract_args,
    fill_disk_after,
    read_arrays,
    rel_err,
    run_in_process,
    sample_rows,
    write_jsonl,
)
from dflash import fp8
from dflash.cache import Cache, CorruptShardError, info, read_manifest, verify
from dflash.data import DROP_REASONS


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, small_data):
    out = tmp_path_factory.mktemp("cache") / "c"
    result = run_in_process(extract_args(small_data, out))
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()


def test_arrays_and_manifest_follow_the_contract(cache_dir):
    m = read_manifest(cache_dir)
    S, T, D, L, H = m["num_shards"], 512, 8, 3, TINY_HIDDEN
    assert m["layer_ids"] == [1, 2, 3] and m["token_budget"] == T and m["max_docs"] == D and m["hidden_size"] == H
    expected = {"hidden": ((S, T, L, H), "uint16", (1, T, 1, H)), "input_ids": ((S, T), "int32", (1, T)),
                "loss_mask": ((S, T), "uint8", (1, T)), "target_ids": ((S, T), "int32", (1, T)),
                "doc_lens": ((S, D), "int32", (1, D)), "row_ids": ((S, D), "int64", (1, D))}
    cache = Cache(cache_dir)
    for name, (shape, dtype, chunks) in expected.items():
        arr = cache.group[name]
        assert (arr.shape, str(arr.dtype), arr.chunks) == (shape, dtype, chunks), name
    for field in ("cache_key", "target", "tokenizer_hash", "chat_template_hash", "data_sha256", "data_files",
                  "vocab_size", "storage_dtype", "pad_id", "dflash_version", "weights_sha256"):
        assert field in m, field
    assert m["vocab_size"] == 4096 and m["storage_dtype"] == "bfloat16"
    assert (cache_dir / "target_weights.safetensors").is_file()
    assert len(committed(cache_dir)) == S


def test_every_row_once_and_pad_after_documents(cache_dir):
    a = read_arrays(cache_dir)
    m = read_manifest(cache_dir)
    rows = a["row_ids"][a["row_ids"] >= 0]
    assert len(rows) == len(set(rows)) == m["stats"]["docs"]
    dropped = set(Cache(cache_dir).group["dropped_row_ids"][:])
    assert set(rows) | dropped == set(range(60)) and not set(rows) & dropped
    used = a["doc_lens"].sum(1)
    for s in range(len(used)):
        assert (a["input_ids"][s, used[s]:] == m["pad_id"]).all()
        assert not a["loss_mask"][s, used[s]:].any()
        assert not a["hidden"][s, used[s]:].any(), "hidden is zero at pad positions"
        assert a["hidden"][s, : used[s]].any(axis=(1, 2)).all(), "every real position has states"
    assert m["stats"]["tokens"] == int(used.sum())


def test_states_are_those_of_each_document_alone(cache_dir, model):
    """Each document's cached states and greedy predictions equal a forward of that document alone."""
    a = read_arrays(cache_dir)
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    checked = 0
    for s in (0, len(a["doc_lens"]) // 2, len(a["doc_lens"]) - 1):
        offset = 0
        for r, n in zip(a["row_ids"][s], a["doc_lens"][s]):
            if r < 0:
                continue
            ids = torch.from_numpy(a["input_ids"][s, offset:offset + n].astype(np.int64))[None]
            with torch.no_grad():
                ref = model(input_ids=ids, output_hidden_states=True)
            for slot, layer in enumerate([1, 2, 3]):
                cached = bf16_bits_to_float(a["hidden"][s, offset:offset + n, slot])
                expected = ref.hidden_states[layer + 1][0].to(torch.bfloat16).float()
                assert rel_err(cached, expected) < 4e-3, (s, r, layer)
            agree = (a["target_ids"][s, offset:offset + n] == ref.logits[0].argmax(-1).numpy()).mean()
            assert agree > 0.99
            checked += 1
            offset += n
    assert checked >= 3
    # and the tokens are the row's own
    row = [json.loads(x) for x in SAMPLE_TEXT.read_text().splitlines()][0]
    s, k = map(int, np.argwhere(a["row_ids"] == 0)[0])
    start = a["doc_lens"][s, :k].sum()
    assert tok.decode(a["input_ids"][s, start:start + a["doc_lens"][s, k]]) == row["text"][: len(tok.decode(
        a["input_ids"][s, start:start + a["doc_lens"][s, k]]))]


def test_chat_loss_mask_covers_only_assistant_tokens(cache_dir):
    a = read_arrays(cache_dir)
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    s, k = map(int, np.argwhere(a["row_ids"] == 45)[0])  # rows 30.. are chat rows
    start = int(a["doc_lens"][s, :k].sum())
    n = int(a["doc_lens"][s, k])
    ids, mask = a["input_ids"][s, start:start + n], a["loss_mask"][s, start:start + n]
    assert 0 < mask.sum() < n
    assert "<|im_start|>user" not in tok.decode(ids[mask == 1]) and tok.decode(ids[mask == 1]).endswith("<|im_end|>")


def test_second_run_does_nothing_and_says_so(cache_dir, small_data):
    before = {p: p.stat().st_mtime_ns for p in cache_dir.rglob("*") if p.is_file()}
    result = run_in_process(extract_args(small_data, cache_dir))
    assert result.exit_code == 0 and "nothing to do" in result.output
    assert before == {p: p.stat().st_mtime_ns for p in cache_dir.rglob("*") if p.is_file()}


@pytest.mark.parametrize("change,fields", [
    ({"layers": "1,4"}, ["layer_ids"]),
    ({"token_budget": 1024, "batch_tokens": 4096}, ["token_budget", "max_len"]),
    ({"data": "other"}, ["data_sha256"]),
    ({"target": "other"}, ["target_weights"]),
    ({"target": "template"}, ["chat_template_hash"]),
])
def test_other_inputs_into_the_same_out_are_refused(cache_dir, small_data, tmp_path, change, fields):
    data = small_data
    if change.get("data") == "other":
        data = write_jsonl(tmp_path / "other.jsonl", sample_rows(5, 0))
        change = {}
    if change.get("target") in ("other", "template"):
        target = tmp_path / "target"
        shutil.copytree(TINY_TARGET, target)
        if change["target"] == "other":  # same shapes, different weights
            from safetensors.torch import load_file, save_file
            w = load_file(target / "model.safetensors")
            w["lm_head.weight"] = w["lm_head.weight"] * 2
            save_file(w, target / "model.safetensors", metadata={"format": "pt"})
        else:
            (target / "chat_template.jinja").write_text((target / "chat_template.jinja").read_text() + " ")
        change = {"target": str(target)}
    before = {p: p.stat().st_mtime_ns for p in cache_dir.rglob("*") if p.is_file()}
    result = run_in_process(extract_args(data, cache_dir, **change))
    assert result.exit_code == 1
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: --out") and "another key" in line
    for f in fields:
        assert f in line, (f, line)
    assert before == {p: p.stat().st_mtime_ns for p in cache_dir.rglob("*") if p.is_file()}


def test_reader_opens_a_layer_subset_and_reads_only_its_chunks(cache_dir, tmp_path):
    copy = tmp_path / "c"
    shutil.copytree(cache_dir, copy)
    full = Cache(copy).read_shard(0)
    # delete layer slot 1 (target layer 2) of every shard: a reader of layers [1, 3] never touches it
    for p in (copy / "hidden" / "c").glob("*/0/1/0"):
        p.unlink()
    sub = Cache(copy, layers=[1, 3])
    shard = sub.read_shard(0)
    assert shard.hidden.shape == (512, 2, TINY_HIDDEN)
    assert np.array_equal(shard.hidden, full.hidden[:, [0, 2]])
    assert np.array_equal(shard.input_ids, full.input_ids) and np.array_equal(shard.row_ids, full.row_ids)
    with pytest.raises(CorruptShardError, match="shard 0 is corrupt .*hidden layer 2"):
        Cache(copy, layers=[2]).read_shard(0)
    with pytest.raises(Exception, match=r"layers \[4\] are not in the cache"):
        Cache(copy, layers=[1, 4])


def _chunk_files(path):
    return sorted(p for name in CACHE_ARRAYS for p in (path / name / "c").rglob("*") if p.is_file())


@pytest.mark.parametrize("which", ["hidden", "input_ids", "loss_mask", "target_ids", "doc_lens", "row_ids"])
def test_verify_catches_one_flipped_byte_in_any_chunk(cache_dir, tmp_path, which):
    copy = tmp_path / "c"
    shutil.copytree(cache_dir, copy)
    assert verify(copy) == []
    rng = np.random.default_rng(len(which))
    chunk = [p for p in _chunk_files(copy) if p.parts[-len(p.relative_to(copy).parts)] == which]
    victim = chunk[rng.integers(len(chunk))]
    shard = int(victim.relative_to(copy / which / "c").parts[0])
    data = bytearray(victim.read_bytes())
    data[rng.integers(len(data))] ^= 0x10
    victim.write_bytes(bytes(data))
    bad = verify(copy)
    assert [s for s, _ in bad] == [shard] and which in bad[0][1]
    result = run_in_process(["cache", "verify", str(copy)])
    assert result.exit_code == 1 and f"bad shards: [{shard}]" in result.output


def test_verify_catches_a_deleted_chunk_and_damaged_weights(cache_dir, tmp_path):
    copy = tmp_path / "c"
    shutil.copytree(cache_dir, copy)
    (copy / "target_ids" / "c" / "1" / "0").unlink()
    w = copy / "target_weights.safetensors"
    data = bytearray(w.read_bytes())
    data[-3] ^= 1
    w.write_bytes(bytes(data))
    assert sorted(s for s, _ in verify(copy)) == [-1, 1]


def test_cache_info_and_ls(cache_dir):
    i = info(cache_dir)
    m = i["manifest"]
    assert i["complete"] and i["shards"] == {"committed": m["num_shards"], "total": m["num_shards"],
                                             "damaged_records": 0}
    assert i["rows"]["total"] == 60 and i["tokens"]["committed"] == m["stats"]["tokens"]
    assert 0.5 < i["fill_ratio"] <= 1 and i["fill_ratio"] == m["stats"]["tokens"] / (m["num_shards"] * 512)
    hidden_bytes = 3 * TINY_HIDDEN * 2  # per position
    weights_bytes = 2 * TINY_VOCAB * TINY_HIDDEN * 2  # the target's embeddings + LM head, bf16
    assert hidden_bytes / i["fill_ratio"] < i["bytes_per_token"] < (
        1.5 * hidden_bytes / i["fill_ratio"] + 1.1 * weights_bytes / m["stats"]["tokens"])
    assert i["bytes_on_disk"] == sum(p.stat().st_size for p in cache_dir.rglob("*") if p.is_file())
    hidden_on_disk = sum(p.stat().st_size for p in (cache_dir / "hidden").rglob("*") if p.is_file())
    assert i["state_bytes_per_token"] == hidden_on_disk / i["tokens"]["committed"]
    out = run_in_process(["cache", "info", str(cache_dir), "--json"])
    assert out.exit_code == 0 and json.loads(out.stdout)["cache_key"] == m["cache_key"]
    text = run_in_process(["cache", "info", str(cache_dir)]).output
    assert "fill ratio" in text and "per token" in text
    listing = run_in_process(["cache", "ls", str(cache_dir.parent.parent)]).output
    assert str(cache_dir) in listing and m["cache_key"] in listing


def test_truncated_and_dropped_rows_are_counted(tmp_path):
    long = " ".join(f"token{i}" for i in range(2000))
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": long}, {"text": ""}, {"text": "short one"},
                                              {"messages": [{"role": "user", "content": "no reply"}]}])
    out = tmp_path / "c"
    result = run_in_process(extract_args(data, out))
    assert result.exit_code == 0, result.output
    m = read_manifest(out)
    assert m["stats"]["truncated"] == 1 and m["stats"]["dropped"] == {"empty text": 1, "no supervised tokens": 1}
    a = read_arrays(out)
    assert a["doc_lens"].max() == 512 and sorted(a["row_ids"][a["row_ids"] >= 0]) == [0, 2]
    c = Cache(out)
    assert list(c.group["truncated_row_ids"][:]) == [0]
    assert [DROP_REASONS[x] for x in c.group["dropped_reasons"][:]] == ["empty text", "no supervised tokens"]
    assert list(c.group["dropped_row_ids"][:]) == [1, 3]
    assert "1 of 4 rows were longer than 512 tokens" in result.output


@pytest.mark.parametrize("case,message", [
    ("malformed", r"bad.jsonl:2: malformed JSON"),
    ("missing_key", r"bad.jsonl:1: row has none of 'text', 'messages', 'prompt'\+'completion' \(keys: content\)"),
    ("empty", r"no rows \(empty dataset\)"),
    ("layer", r"--layers: layer id 6 is beyond the target's depth"),
    ("unwritable", r"--out .*: cannot write there"),
    ("missing_target", r"--target .*no-such-model: not a model folder"),
    ("not_a_cache", r"folder is not empty and is not a dflash cache"),
])
def test_bad_input_gives_one_line_error_and_commits_nothing(tmp_path, small_data, case, message):
    data, out, opts = small_data, tmp_path / "out", {}
    if case == "malformed":
        data = tmp_path / "bad.jsonl"
        data.write_text('{"text": "fine"}\n{"text": "broken\n')
    elif case == "missing_key":
        data = write_jsonl(tmp_path / "bad.jsonl", [{"content": "x"}])
    elif case == "empty":
        data = tmp_path / "empty.jsonl"
        data.write_text("\n")
    elif case == "layer":
        opts = {"layers": "1,6"}
    elif case == "unwritable":
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "out"
    elif case == "missing_target":
        opts = {"target": str(tmp_path / "no-such-model")}
    elif case == "not_a_cache":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    result = run_in_process(extract_args(data, out, **opts))
    assert result.exit_code == 1
    lines = [x for x in result.output.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1, result.output
    import re
    assert re.search(message, lines[0]), lines[0]
    assert not (out / "commits").exists() or not list((out / "commits").iterdir())
    if case == "not_a_cache":
        assert (out / "notes.txt").read_text() == "mine"


def test_the_data_readme_reader_snippet_runs(cache_dir):
    """data/README.md shows how to read a cache without dflash: that code must work."""
    readme = (Path(__file__).resolve().parent.parent / "data" / "README.md").read_text()
    snippet = readme.split("### Reading a cache without dflash")[1].split("```python")[1].split("```")[0]
    scope = {}
    exec(snippet.replace("CACHE", str(cache_dir)).replace("index(17)", "index(2)"), scope)
    assert scope["h"].shape == (512, TINY_HIDDEN) and scope["h"].dtype == torch.bfloat16
    expected = Cache(cache_dir, layers=[2]).read_shard(0).hidden[:, 0]
    assert np.array_equal(fp8.to_bits(scope["h"]), expected)


def test_zstd_cache_holds_the_same_values_and_verifies(cache_dir, small_data, tmp_path):
    """--compressor zstd: chunks go through zarr's codecs (not the direct path), same contents."""
    out = tmp_path / "z"
    assert run_in_process(extract_args(small_data, out, compressor="zstd")).exit_code == 0
    assert json.loads((out / "hidden" / "zarr.json").read_text())["codecs"][1]["name"] == "zstd"
    assert_same_arrays(out, cache_dir)
    want_hidden = Cache(cache_dir, layers=[3]).read_shard(1).hidden
    assert np.array_equal(Cache(out, layers=[3]).read_shard(1).hidden, want_hidden)
    assert verify(out) == []
    chunk = out / "hidden" / "c" / "0" / "0" / "1" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    assert [s for s, _ in verify(out)] == [0]


def test_a_full_disk_is_one_line_and_the_same_command_resumes(cache_dir, small_data, tmp_path, monkeypatch):
    """The writer thread hits ENOSPC on its 30th chunk: one line naming the cache, what is committed and that
    the same command resumes; once there is room again it does, to the cache an uninterrupted run writes."""
    out = tmp_path / "c"
    fill_disk_after(monkeypatch, 30)
    result = run_in_process(extract_args(small_data, out))
    assert result.exit_code == 1
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    done = len(committed(out))
    assert 0 < done < read_manifest(out)["num_shards"]
    assert errors[0].startswith(f"error: {out}: no space left on the device (writing {out}/")
    assert f"{done} of {read_manifest(out)['num_shards']} shards are committed and intact" in errors[0]
    assert errors[0].endswith("run the same command again: it resumes")
    monkeypatch.undo()
    assert run_in_process(extract_args(small_data, out)).exit_code == 0
    a, b = read_arrays(cache_dir), read_arrays(out)
    assert all(np.array_equal(a[k], b[k]) for k in a)


# -- the cache proves its states -------------------------------------------------------------------------

def test_the_states_statistics_are_those_of_the_cached_states(cache_dir):
    """`cache info`'s per-layer RMS, largest |value|, zero share and non-finite count equal what the arrays
    hold in the real tokens; the manifest says what a layer id means."""
    arrays, m = read_arrays(cache_dir), read_manifest(cache_dir)
    real = np.arange(arrays["input_ids"].shape[1])[None, :] < arrays["doc_lens"].sum(1)[:, None]  # [S, T]
    states = info(cache_dir)["states"]
    for slot, layer in enumerate(m["layer_ids"]):
        x = bf16_bits_to_float(arrays["hidden"][:, :, slot])[torch.from_numpy(real)].double()  # [tokens, H]
        st = states[str(layer)]
        assert st["shards"] == m["num_shards"] and st["nonfinite"] == 0
        assert st["rms"] == pytest.approx(x.pow(2).mean().sqrt().item(), rel=1e-6)  # per-token sums in fp32
        assert st["abs_max"] == pytest.approx(x.abs().max().item(), rel=1e-9)
        assert st["zero_fraction"] == pytest.approx((x == 0).double().mean().item(), abs=1e-12)
    assert "output_hidden_states[i + 1]" in m["layer_convention"] and "after the" in m["layer_convention"]
    assert m["target"]["config_hash"] == m["target_config_hash"]
    text = run_in_process(["cache", "info", str(cache_dir)]).output
    assert f"layer {m['layer_ids'][0]}: rms " in text


def _spoil_layer(monkeypatch, layer_slot: int, value: float, at_call: int = 2):
    """From the target's `at_call`-th forward on, the states of one captured layer are replaced by `value`
    (zeros: a layer that was not captured; inf: an overflow)."""
    from dflash.target import Target

    real, calls = Target.forward, []

    def forward(self, input_ids, cache=None):
        hidden, last = real(self, input_ids, cache)
        calls.append(1)
        if len(calls) >= at_call:
            hidden[layer_slot] = torch.full_like(hidden[layer_slot], value)
        return hidden, last

    monkeypatch.setattr(Target, "forward", forward)


@pytest.mark.parametrize("value, what", [(0.0, "are all zero"), (float("inf"), "hold .* non-finite values")])
def test_a_dead_or_overflowing_layer_stops_extraction_naming_layer_and_shard(tmp_path, small_data, monkeypatch,
                                                                             value, what):
    out = tmp_path / "c"
    _spoil_layer(monkeypatch, 1, value)
    result = run_in_process(extract_args(small_data, out, layers="1,3,5", **{"batch-size": 4}))
    assert result.exit_code == 1
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and re.match(rf"error: layer 3's states in shard \d+ {what}", errors[0]), errors
    bad = int(re.search(r"shard (\d+)", errors[0]).group(1))
    assert bad not in committed(out)  # nothing of it was committed
    assert "nothing of the shard was committed" in errors[0]


def test_nonfinite_warn_keeps_the_states_and_says_so(tmp_path, small_data, monkeypatch):
    out = tmp_path / "c"
    _spoil_layer(monkeypatch, 0, float("nan"), at_call=1)
    result = run_in_process(extract_args(small_data, out, nonfinite="warn"))
    assert result.exit_code == 0, result.output
    assert "warning: layer " in result.output and "kept (--nonfinite warn)" in result.output
    first = str(read_manifest(out)["layer_ids"][0])
    assert info(out)["states"][first]["nonfinite"] > 0
