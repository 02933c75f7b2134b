"""Damaged or hostile caches: every field of the manifest, the commit records and the shards' values are
checked when read; each problem is one line naming the field, shard or record, and a cache that cannot be
proven says so."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import REPO, extract_args, run_in_process
from dflash.cache import Cache, checksum
from dflash.manifest import Manifest

PRESET = str(REPO / "configs" / "tiny.toml")


@pytest.fixture(scope="module")
def good(tmp_path_factory, small_data):
    out = tmp_path_factory.mktemp("manifest") / "good"
    assert run_in_process(extract_args(small_data, out, layers="1,2,4")).exit_code == 0  # the shipped drafter's
    return out


@pytest.fixture
def cache(good, tmp_path):
    """A fresh copy of the good cache, to damage."""
    return shutil.copytree(good, tmp_path / "c")


def set_manifest(path, change) -> None:
    meta = path / "zarr.json"
    doc = json.loads(meta.read_text())
    change(doc["attributes"]["dflash"])
    meta.write_text(json.dumps(doc))


def one_line_error(result, *words) -> None:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    assert all(w in lines[-1] for w in words), (words, lines[-1])


def commands(path):
    """Every command that opens a cache."""
    return {"info": ["cache", "info", str(path)], "verify": ["cache", "verify", str(path)],
            "train": ["train", "--config", PRESET, "--cache", str(path), "--out", str(path.parent / "run"),
                      "--max-steps", "2", "--device", "cpu"],
            "eval": ["eval", "--drafter", str(REPO / "data" / "tiny-drafter"), "--cache", str(path), "--device", "cpu"]}


DAMAGE = {  # what is done to the manifest -> the words its one line must hold
    "a string where a number belongs": (lambda m: m.update(format_version="1"),
                                        ["format_version", "must be an integer", "'1'"]),
    "layer ids as a string": (lambda m: m.update(layer_ids="1,2,3"), ["layer_ids", "must be a list"]),
    "a list where an object belongs": (lambda m: m.update(target=[1, 2]), ["target", "must be an object"]),
    "a negative shard count": (lambda m: m.update(num_shards=-5), ["num_shards", "-5", "out of range"]),
    "an absurd size": (lambda m: m.update(token_budget=10**12), ["token_budget", "out of range"]),
    "a unicode digit": (lambda m: m.update(hidden_size="٣"), ["hidden_size", "must be an integer"]),
    "stats missing": (lambda m: m.pop("stats"), ["stats", "missing"]),
    "an unknown field": (lambda m: m.update(surprise=1), ["surprise", "unknown"]),
    "a layer the target lacks": (lambda m: m.update(layer_ids=[1, 2, 9]), ["layer_ids", "6 layers"]),
    "a newer format": (lambda m: m.update(format_version=7), ["format_version", "is 7", "reads cache formats"]),
    "a size the arrays do not have": (lambda m: m.update(max_docs=m["max_docs"] + 1), ["doc_lens", "the manifest"]),
    "a pad id outside the vocabulary": (lambda m: m.update(pad_id=m["vocab_size"]), ["pad_id", "vocabulary"]),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_manifest_is_one_line_naming_the_field_in_every_command(cache, damage):
    change, words = DAMAGE[damage]
    set_manifest(cache, change)
    for name, args in commands(cache).items():
        one_line_error(run_in_process(args), str(cache), *words)


def test_one_unreadable_cache_does_not_hide_the_others_from_ls(good, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(good, root / "a")
    shutil.copytree(good, root / "b")
    set_manifest(root / "b", lambda m: m.update(num_shards=-5))
    result = run_in_process(["cache", "ls", str(root)])
    assert result.exit_code == 0, result.output
    rows = result.stdout.strip().splitlines()[1:]
    assert len(rows) == 2 and "tiny-target" in rows[0] and "(unreadable: manifest field num_shards" in rows[1]


def test_the_manifest_round_trips_through_its_type(good):
    m = Cache(good).manifest
    assert Manifest.parse(m.to_dict(), "x") == m
    with pytest.raises(Exception):
        m.num_shards = 3  # frozen


def set_record(path, shard, change) -> None:
    p = path / "commits" / f"{shard:08d}.json"
    record = json.loads(p.read_text())
    change(record)
    p.write_text(json.dumps(record))


@pytest.mark.parametrize("change, words", [
    (lambda r: r.pop("crc32c"), "no checksums"),
    (lambda r: r["crc32c"].update(hidden=r["crc32c"]["hidden"][:1]), "checksums of hidden"),
    (lambda r: r["crc32c"].pop("doc_lens"), "checksum of doc_lens missing"),
    (lambda r: r.update(shard=7), "it is shard 7's"),
    (lambda r: r.update(tokens=-3), "tokens -3"),
])
def test_a_damaged_commit_record_is_named_and_its_shard_never_read_unverified(cache, change, words):
    set_record(cache, 3, change)
    result = run_in_process(["cache", "verify", str(cache)])
    assert result.exit_code == 1
    assert f"shard 3: commit record damaged: {words}" in result.stderr and "bad shards: [3]" in result.stderr
    c = Cache(cache)
    assert 3 not in c.committed() and c.commit_record(3) is None
    info = json.loads(run_in_process(["cache", "info", str(cache), "--json"]).stdout)
    assert info["shards"]["damaged_records"] == 1 and info["shards"]["committed"] == info["shards"]["total"] - 1
    with pytest.raises(Exception, match="shard 3 is corrupt"):
        c.read_shard(3)
    result = run_in_process(commands(cache)["eval"] + ["--max-shards", "1"])  # the warning is said on opening
    assert "1 commit record(s) damaged (shard 3)" in result.stderr


def test_records_of_no_shard_are_not_counted_and_are_named(cache):
    record = (cache / "commits" / "00000000.json").read_text()
    (cache / "commits" / "99999999.json").write_text(record)
    (cache / "commits" / "٠٠٠٠٠٠٠١.json").write_text(record)  # unicode digits: int() would take them
    c = Cache(cache)
    assert len(c.committed()) == c.num_shards
    result = run_in_process(["cache", "verify", str(cache)])
    assert result.exit_code == 1
    assert "commits/99999999.json: a commit record of no shard" in result.stderr
    assert "commits/٠٠٠٠٠٠٠١.json" in result.stderr


def rewrite(cache_path, shard, name, change) -> None:
    """Change a shard array's values and its checksum alike: the checksums hold, the values do not."""
    c = Cache(cache_path, mode="r+")
    values = c.arrays[name][shard]
    change(values)
    c.arrays[name][shard] = values
    set_record(cache_path, shard, lambda r: r["crc32c"].update({name: checksum(values)}))


@pytest.mark.parametrize("name, change, words", [
    ("doc_lens", lambda v: v.__setitem__(slice(0, 2), [v[0] + v[1] + 5, -5]), "doc_lens negative"),
    ("input_ids", lambda v: v.__setitem__(0, 10**6), "input_ids outside the vocabulary"),
    ("target_ids", lambda v: v.__setitem__(1, -2), "target_ids outside the vocabulary"),
])
def test_values_no_extraction_writes_stop_train_and_eval_naming_the_shard(cache, name, change, words):
    rewrite(cache, 2, name, change)
    result = run_in_process(["cache", "verify", str(cache)])
    assert result.exit_code == 1 and f"shard 2: {words}" in result.stderr
    one_line_error(run_in_process(commands(cache)["eval"]), "shard 2", words)
    every_shard = ["--holdout-shards", "0", "--max-steps", str(Cache(cache).num_shards)]  # one epoch
    one_line_error(run_in_process(commands(cache)["train"] + every_shard), "shard 2", words)


def test_a_missing_or_cut_weights_file_is_one_line(cache):
    weights = cache / "target_weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    result = run_in_process(["cache", "verify", str(cache)])
    assert result.exit_code == 1 and "target_weights.safetensors: checksum mismatch" in result.stderr
    one_line_error(run_in_process(commands(cache)["train"]), "target_weights.safetensors", "unreadable")
    weights.unlink()
    result = run_in_process(["cache", "verify", str(cache)])
    assert result.exit_code == 1 and "target_weights.safetensors: unreadable" in result.stderr
    one_line_error(run_in_process(commands(cache)["eval"]), "target_weights.safetensors", "missing")


def test_hostile_zarr_metadata_is_one_line(cache):
    meta = cache / "loss_mask" / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["codecs"] = [{"name": "pickle", "configuration": {}}]
    meta.write_text(json.dumps(doc))
    for args in commands(cache).values():
        one_line_error(run_in_process(args), str(cache), "zarr metadata")
