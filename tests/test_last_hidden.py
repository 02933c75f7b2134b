"""`dflash extract --last-hidden`: the target's last hidden state after its final norm, cached beside `hidden`.
lm_head of it is the target's logits (dense and a hybrid MoE family), in either storage; the key, info, verify,
recompute, resume and convert cover it; caches without it keep their keys and open as before."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import (
    REPO,
    TINY_HIDDEN,
    TINY_TARGET,
    committed,
    extract_args,
    read_arrays,
    rel_err,
    run_in_process,
    sample_rows,
    write_jsonl,
)
from dflash import fp8
from dflash.cache import KEY_FIELDS, Cache, CorruptShardError, info, key_differences, read_manifest, verify
from dflash.errors import DflashError
from dflash.families import make_exact
from dflash.manifest import Manifest
from families import tiny_target

LAST = ("last_hidden", "last_hidden_scale")
# small shards of short documents: several shards, seconds per extraction on a slow CPU
SMALL = {"token-budget": 64, "max-docs": 4, "max-len": 32, "batch-tokens": 256, "limit": 6}
HEAD_TOL = 1e-2  # logits from a bf16-rounded state (relative rounding <= 2^-9 per value)


def extract(data, out, last_hidden=True, **options):
    args = extract_args(data, out, **{**SMALL, **options}) + (["--last-hidden"] if last_hidden else [])
    return run_in_process(args)


def all_arrays(path) -> dict[str, np.ndarray]:
    g = Cache(path).group
    return {**read_arrays(path), **{name: g[name][:] for name in LAST if name in g}}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("last") / "d.jsonl", sample_rows(3, 3))


@pytest.fixture(scope="module")
def caches(tmp_path_factory, data):
    """The same rows cached without last_hidden (bf16), and with it in bf16 and in fp8."""
    root = tmp_path_factory.mktemp("last-caches")
    for name, last, storage in (("plain", False, "bf16"), ("bf16", True, "bf16"), ("fp8", True, "fp8")):
        result = extract(data, root / name, last_hidden=last, storage=storage)
        assert result.exit_code == 0, result.output
    return root / "plain", root / "bf16", root / "fp8"


def documents(cache: Cache):
    """(input ids [1, n], stored last_hidden [n, H] fp32, target_ids [n]) of every cached document."""
    for s in cache.committed():
        shard = cache.read_shard(s, last_hidden=True)
        last = cache.last_states(shard, "cpu", torch.float32)
        start = 0
        for n in shard.doc_lens[shard.doc_lens > 0]:
            sl = slice(start, start + n)
            yield torch.from_numpy(shard.input_ids[sl].astype(np.int64))[None], last[sl], shard.target_ids[sl]
            start += n


def check_head_gives_logits(cache_path, target_path) -> None:
    """lm_head(stored last_hidden) is the target's own logits for every document (alone), the strongest check
    that the state is the one after the final norm; and target_ids are their argmax."""
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    make_exact(model)  # as dflash loads it (a causal top-k for GLM-5's indexer)
    checked = 0
    for ids, last, target_ids in documents(Cache(cache_path)):
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]  # [n, V]
            head = model.get_output_embeddings()(last)
        assert rel_err(head, logits) < HEAD_TOL
        assert (head.argmax(-1).numpy() == target_ids).mean() > 0.95
        checked += 1
    assert checked >= 3


def test_layout_manifest_records_and_padding(caches):
    _, bf16, f8 = caches
    for path, dtype in ((bf16, "uint16"), (f8, "uint8")):
        c = Cache(path)
        m = read_manifest(path)
        S, T, H = m["num_shards"], 64, TINY_HIDDEN
        assert m["last_hidden"] == {"state": "after the final norm", "storage_dtype": m["storage_dtype"]}
        a = c.group["last_hidden"]
        assert (a.shape, str(a.dtype), a.chunks) == ((S, T, H), dtype, (1, T, H))
        names = ("last_hidden", "last_hidden_scale") if c.fp8 else ("last_hidden",)
        assert c.last_hidden_arrays == names and ("last_hidden_scale" in c.group) == c.fp8
        if c.fp8:
            sc = c.group["last_hidden_scale"]
            assert (sc.shape, str(sc.dtype), sc.chunks) == ((S, T, H // 128), "uint16", (1, T, H // 128))
        record = json.loads((path / "commits" / "00000000.json").read_text())
        assert all(type(record["crc32c"][name]) is int for name in names)
        assert set(record["state_stats"]) == {*map(str, m["layer_ids"]), "last_hidden"}
        values = a[:]
        used = c.arrays["doc_lens"][:].sum(1)
        for s in range(S):
            assert not values[s, used[s]:].any() and values[s, : used[s]].any(-1).all()


def test_lm_head_of_last_hidden_is_the_targets_logits(caches):
    check_head_gives_logits(caches[1], TINY_TARGET)


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "gpt_oss", "glm_moe_dsa"])
def test_lm_head_of_last_hidden_is_the_logits_of_other_families(tmp_path, data, model_type):
    """A GatedDeltaNet hybrid with MoE layers (Qwen3.5-MoE), an MoE with sinks and windows (gpt-oss), MLA with a
    sparse-attention indexer (GLM-5): each one's final norm output is what its head reads."""
    target = tiny_target(model_type, tmp_path / "target")
    out = tmp_path / "c"
    result = extract(data, out, target=target, layers="0,2", limit=4)
    assert result.exit_code == 0, result.output
    check_head_gives_logits(out, target)


def test_fp8_last_hidden_is_the_bf16_one_quantised(caches):
    """The fp8 cache holds exactly the bf16 states quantised with the same scale_block, within e4m3's rounding."""
    _, bf16, f8 = caches
    a, b = all_arrays(bf16), all_arrays(f8)
    q, scale = fp8.quantize(fp8.bf16_from_bits(a["last_hidden"]), read_manifest(f8)["scale_block"])
    assert np.array_equal(q.numpy(), b["last_hidden"]) and np.array_equal(fp8.to_bits(scale), b["last_hidden_scale"])
    c8, c16 = Cache(f8), Cache(bf16)
    x8 = c8.last_states(c8.read_shard(0, last_hidden=True), "cpu", torch.float32)
    x16 = c16.last_states(c16.read_shard(0, last_hidden=True), "cpu", torch.float32)
    assert 0 < rel_err(x8, x16) < 0.04


def test_the_key_changes_with_it_and_only_with_it(caches, data):
    plain, bf16, f8 = caches
    p, b = read_manifest(plain), read_manifest(bf16)
    # a cache without last_hidden keeps the key it had before the field existed
    before = hashlib.sha256(json.dumps({k: p[k] for k in KEY_FIELDS}, sort_keys=True).encode()).hexdigest()[:20]
    assert "last_hidden" not in p and p["cache_key"] == before
    assert b["cache_key"] != p["cache_key"]
    assert [d.split(" ")[0] for d in key_differences(p, b)] == ["last_hidden"]
    mtimes = {q: q.stat().st_mtime_ns for q in plain.rglob("*") if q.is_file()}
    result = extract(data, plain)  # the same inputs with --last-hidden, into the cache without it
    assert result.exit_code == 1 and "another key" in result.output
    assert "last_hidden (null in the cache" in result.output
    assert mtimes == {q: q.stat().st_mtime_ns for q in plain.rglob("*") if q.is_file()}


def test_info_shows_it_and_its_statistics(caches):
    plain, bf16, f8 = caches
    for path, per_token in ((bf16, TINY_HIDDEN * 2), (f8, TINY_HIDDEN + 2 * TINY_HIDDEN // 128)):
        i = json.loads(run_in_process(["cache", "info", str(path), "--json"]).stdout)
        last = i["last_hidden"]
        assert last["state"] == "after the final norm" and last["storage_dtype"] == i["storage"]["dtype"]
        on_disk = sum(q.stat().st_size for name in LAST if (path / name).exists() for q in (path / name).rglob("*")
                      if q.is_file())
        assert last["bytes_per_token"] == on_disk / i["tokens"]["committed"]
        assert per_token < last["bytes_per_token"] < 1.5 * per_token / i["fill_ratio"]  # + padding, crc32c
        text = run_in_process(["cache", "info", str(path)]).output
        assert "last_hidden  the target's last hidden state after the final norm" in text
        assert re.search(r"last_hidden: rms [0-9.]+, \|max\|", text)
    # the statistics are those of the stored states' real tokens
    a, st = all_arrays(bf16), info(bf16)["states"]["last_hidden"]
    real = np.arange(a["input_ids"].shape[1])[None, :] < a["doc_lens"].sum(1)[:, None]  # [S, T]
    x = fp8.bf16_from_bits(a["last_hidden"]).double()[torch.from_numpy(real)]  # [tokens, H]
    assert st["rms"] == pytest.approx(x.pow(2).mean().sqrt().item(), rel=1e-6) and st["nonfinite"] == 0
    assert st["abs_max"] == pytest.approx(x.abs().max().item(), rel=1e-9)
    assert info(plain)["last_hidden"] is None and "last_hidden" not in info(plain)["states"]


@pytest.mark.parametrize("which", ["bf16:last_hidden", "fp8:last_hidden_scale"])
def test_verify_and_the_reader_catch_a_flipped_byte_in_it(caches, tmp_path, which):
    storage, name = which.split(":")
    copy = shutil.copytree(caches[1 if storage == "bf16" else 2], tmp_path / "c")
    assert verify(copy) == []
    victim = copy / name / "c" / "1" / "0" / "0"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 3] ^= 0x10
    victim.write_bytes(bytes(raw))
    bad = verify(copy)
    assert [s for s, _ in bad] == [1] and name in bad[0][1]
    result = run_in_process(["cache", "verify", str(copy)])
    assert result.exit_code == 1 and "bad shards: [1]" in result.output
    with pytest.raises(CorruptShardError, match=f"shard 1 is corrupt .*{name}"):
        Cache(copy).read_shard(1, last_hidden=True)
    Cache(copy).read_shard(1)  # a reader that does not ask for it (training) reads the shard


def test_a_record_without_its_checksum_is_damaged(caches, tmp_path):
    copy = shutil.copytree(caches[1], tmp_path / "c")
    p = copy / "commits" / "00000002.json"
    record = json.loads(p.read_text())
    del record["crc32c"]["last_hidden"]
    p.write_text(json.dumps(record))
    assert verify(copy) == [(2, "commit record damaged: checksum of last_hidden missing")]


def test_recompute_compares_it_with_the_final_norm_output(caches):
    result = run_in_process(["cache", "verify", str(caches[2]), "--device", "cpu", "--recompute", "2", "--json"])
    assert result.exit_code == 0, result.output
    layers = json.loads(result.stdout)["recompute"]["layers"]
    assert "last_hidden" in layers and max(layers.values()) < 1e-3  # fp32 as extracted, then the same fp8 rounding


def test_a_last_hidden_before_the_final_norm_is_named_by_recompute(tmp_path, data, monkeypatch):
    import dflash.extract
    from dflash.recompute import _PreNormHook
    from dflash.target import Target

    class PreNorm(Target):  # hands the state before the final norm over as the last hidden state
        def __init__(self, model, layer_ids, **kw):
            super().__init__(model, layer_ids, **kw)
            self.pre = _PreNormHook(model, self.num_layers)

        def forward(self, input_ids, cache=None):
            hidden, _ = super().forward(input_ids, cache)
            return hidden, self.pre.state

    monkeypatch.setattr(dflash.extract, "Target", PreNorm)
    out = tmp_path / "c"
    assert extract(data, out, limit=3).exit_code == 0
    monkeypatch.undo()
    result = run_in_process(["cache", "verify", str(out), "--device", "cpu", "--recompute", "2"])
    assert result.exit_code == 1
    named = [line for line in result.stderr.splitlines() if "last_hidden: relative error" in line]
    assert len(named) == 2 and all("before the final norm" in line for line in named), result.stderr


def test_a_crash_mid_extraction_resumes_to_the_same_arrays(caches, data, tmp_path, monkeypatch):
    """The writer dies on shard 2's last_hidden chunk: shards before it stay committed, the same command
    resumes and the cache is the one an uninterrupted run wrote."""
    real, seen = Cache._write_chunk, []

    def write_chunk(self, name, coords, block):
        if name == "last_hidden":
            seen.append(coords)
            if coords[0] == 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(self.path / name))
        return real(self, name, coords, block)

    monkeypatch.setattr(Cache, "_write_chunk", write_chunk)
    out = tmp_path / "c"
    assert extract(data, out).exit_code == 1
    assert 2 not in committed(out) and committed(out) and (2, 0, 0) in seen
    monkeypatch.undo()
    assert extract(data, out).exit_code == 0
    got, want = all_arrays(out), all_arrays(caches[1])
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    assert verify(out) == [] and read_manifest(out)["cache_key"] == read_manifest(caches[1])["cache_key"]


def test_convert_to_fp8_keeps_it(caches, tmp_path):
    _, bf16, f8 = caches
    out = tmp_path / "conv"
    result = run_in_process(["cache", "convert", str(bf16), "--storage", "fp8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert read_manifest(out)["last_hidden"] == read_manifest(f8)["last_hidden"]
    assert read_manifest(out)["cache_key"] == read_manifest(f8)["cache_key"]  # the fp8 extraction's bytes
    got, want = all_arrays(out), all_arrays(f8)
    assert "last_hidden_scale" in want and sorted(got) == sorted(want)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    assert verify(out) == []


def test_the_training_loader_reads_such_a_cache_without_it(caches):
    from dflash.loader import ShardLoader

    _, bf16, _ = caches
    cache = Cache(bf16)
    loader = ShardLoader(cache, [0, 1], torch.device("cpu"), prefetch=1)
    try:
        seen = []
        for s, inputs in loader:
            seen.append(s)
            want = cache.read_shard(s)
            assert np.array_equal(fp8.to_bits(inputs.hidden), want.hidden.transpose(1, 0, 2))
            assert np.array_equal(inputs.target_ids.numpy(), want.target_ids)
        assert seen == [0, 1]
    finally:
        loader.close()


def test_a_cache_without_it_opens_as_before(caches, tmp_path):
    plain, bf16, _ = caches
    c = Cache(plain)
    assert not c.has_last_hidden and c.last_hidden_arrays == () and "last_hidden" not in c.group
    shard = c.read_shard(0)
    assert shard.last_hidden is None and shard.hidden.shape[1] == 3
    with pytest.raises(DflashError, match="holds no last_hidden .*--last-hidden"):
        c.read_shard(0, last_hidden=True)
    with pytest.raises(DflashError, match="read without last_hidden"):
        Cache(bf16).last_states(Cache(bf16).read_shard(0), "cpu", torch.float32)
    m = Cache(bf16).manifest
    assert Manifest.parse(m.to_dict(), "x") == m and "last_hidden" not in Cache(plain).manifest.to_dict()
    # a manifest naming a state this dflash does not know is one line naming the field
    copy = shutil.copytree(bf16, tmp_path / "c")
    meta = copy / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["dflash"]["last_hidden"]["state"] = "before the final norm"
    meta.write_text(json.dumps(doc))
    result = run_in_process(["cache", "info", str(copy)])
    assert result.exit_code == 1 and "manifest field last_hidden.state" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("value, what", [(0.0, "are all zero: the target's final norm"),
                                         (float("inf"), "hold .* non-finite values")])
def test_a_dead_or_overflowing_last_hidden_stops_extraction(tmp_path, data, monkeypatch, value, what):
    from dflash.target import Target

    real = Target.forward
    monkeypatch.setattr(Target, "forward", lambda self, ids, cache=None: (real(self, ids, cache)[0],
                                                                          torch.full((*ids.shape, TINY_HIDDEN), value)))
    out = tmp_path / "c"
    result = extract(data, out, limit=2)
    assert result.exit_code == 1
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and re.match(rf"error: last_hidden's states in shard 0 {what}", errors[0]), errors
    assert committed(out) == []


def test_the_data_readme_last_hidden_snippet_runs(caches):
    _, bf16, _ = caches
    part = (REPO / "data" / "README.md").read_text().split("### Reading a cache without dflash")[1]
    scope = {}
    for snippet in [b.split("```")[0] for b in part.split("```python")[1:4:2]]:  # the bf16 reader, then last_hidden
        exec(snippet.replace("CACHE", str(bf16)).replace("index(17)", "index(2)"), scope)
    c = Cache(bf16)
    assert torch.equal(scope["last"].float(), c.last_states(c.read_shard(0, last_hidden=True), "cpu", torch.float32))
