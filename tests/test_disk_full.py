"""A full disk under every writer: the command ends with one line (the path, "no space left", what is committed,
that the same command resumes), exit 1, no traceback; what was committed stays intact, and the same command run
once there is room again gives what an uninterrupted run gives.

ENOSPC is raised where the system raises it, as it raises it: from the lowest write call each writer makes
(safetensors' `save_file`, with the SafetensorError safetensors turns it into; `Path.write_bytes` under the
atomic JSON/text writes; zarr's local store `_put`; `os.writev` of the cache's direct chunk writes)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import zarr.storage._local as zarr_local
from safetensors import SafetensorError
from safetensors.torch import load_file

from conftest import (
    REPO,
    TINY_TARGET,
    assert_same_cache,
    committed,
    extract_args,
    run_in_process,
    sample_rows,
    stderr_lines,
    write_jsonl,
)
from dflash import checkpoint, files
from dflash.cache import read_manifest, verify

PRESET = str(REPO / "configs" / "tiny.toml")
FULL = "No space left on device"


def enospc(filename=None) -> OSError:
    """The error a write to a full disk raises: from open(), naming the file; from write(), naming none."""
    return OSError(errno.ENOSPC, FULL, *([str(filename)] if filename else []))


def safetensors_full(tensors, filename, metadata=None):
    raise SafetensorError(f"Error while serializing: I/O error: {FULL} (os error 28)")  # safetensors 0.8's words


def full_after(monkeypatch, owner, name: str, hit, n: int = 1, error=lambda *args: enospc()):
    """From the n-th call of `owner.name` for which `hit(*args)` holds, that call raises `error(*args)` (the disk
    stays full); calls: what each hit was called with."""
    real, calls = getattr(owner, name), []

    def fake(*args, **kwargs):
        if hit(*args):
            calls.append(args)
            if len(calls) >= n:
                raise error(*args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, fake)
    return calls


def tmp_of(name: str):
    """Path.write_bytes of our atomic write of `name` (dflash.files writes .NAME.tmpPID, then renames it)."""
    return lambda path, *rest: Path(path).name.startswith(f".{name}.tmp")


def one_line(result, path, writing: Path | str | None = None) -> str:
    """The command failed with exactly one line, its last, naming `path` (and the file it was `writing`)."""
    lines = stderr_lines(result.stderr)
    errors = [x for x in lines if x.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1 and lines[-1] == errors[0], result.output
    assert "Traceback" not in result.output
    assert errors[0].startswith(f"error: {path}: no space left on the device"), errors[0]
    assert (f" (writing {writing});" in errors[0]) if writing else "(writing" not in errors[0], errors[0]
    assert "free some space and run the same command again: it " in errors[0]
    return errors[0]


# -- extract: the cache -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "rows.jsonl", sample_rows(8, 4))  # 8 shards


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> Path:
    """The cache an uninterrupted extract writes."""
    out = tmp_path_factory.mktemp("ref") / "cache"
    assert run_in_process(extract_args(data, out)).exit_code == 0
    return out


def _manifest(path, value, *rest):
    return Path(path).name == "zarr.json" and b'"dflash"' in bytes(value.as_buffer_like())


CREATION = {  # what the write is for: (how the disk fills, the file the line names)
    "weights": (lambda mp, out: mp.setattr(files, "save_file", safetensors_full), "target_weights.safetensors"),
    "target config": (lambda mp, out: full_after(mp, Path, "write_bytes", tmp_of("target_config.json")),
                      "target_config.json"),
    "manifest": (lambda mp, out: full_after(mp, zarr_local, "_put", _manifest,  # open() of zarr's temporary file
                                            error=lambda p, *_: enospc(p.with_suffix(f".{uuid.uuid4().hex}.partial"))),
                 "zarr.json"),
    "plan": (lambda mp, out: full_after(mp, zarr_local, "_put", lambda p, *_: "row_ids" in p.parts, n=3), None),
}


@pytest.mark.parametrize("what", CREATION)
def test_extract_while_creating_the_cache(tmp_path, monkeypatch, data, reference, what):
    """The cache's weights file (whose ENOSPC safetensors reports as a SafetensorError), its target config, its
    manifest, its plan: one line, nothing committed; the same command then creates the cache anew."""
    fill, name = CREATION[what]
    out = tmp_path / "cache"
    fill(monkeypatch, out)
    result = run_in_process(extract_args(data, out))
    message = one_line(result, out, name and out / name)
    assert message.endswith("no shard is committed yet; free some space and run the same command again: it resumes")
    assert read_manifest(out) is None and not committed(out)
    monkeypatch.undo()
    assert run_in_process(extract_args(data, out)).exit_code == 0
    assert_same_cache(reference, out)


def _direct_chunk(fd, buffers):
    return True


SHARDS = {  # (extra extract options, how the disk fills, the file the line names (relative to the cache))
    "chunk": ({}, lambda mp: full_after(mp, os, "writev", _direct_chunk, n=20), None),
    "zstd chunk": ({"compressor": "zstd"},
                   lambda mp: full_after(mp, zarr_local, "_put", lambda p, *_: "hidden" in p.parts and "c" in p.parts,
                                         n=10), None),
    "commit record": ({}, lambda mp: full_after(mp, Path, "write_bytes", lambda p, *_: p.parent.name == "commits",
                                                n=3), "commits/00000002.json"),
}


@pytest.mark.parametrize("what", SHARDS)
def test_extract_while_writing_shards(tmp_path, monkeypatch, data, reference, what):
    """A shard's chunks (written directly, or through zarr's codecs) or its commit record: one line saying how
    many shards are committed; those read back intact; the same command resumes to the uninterrupted cache."""
    options, fill, name = SHARDS[what]
    out = tmp_path / "cache"
    fill(monkeypatch)
    message = one_line(run_in_process(extract_args(data, out, **options)), out, name and out / name)
    done = committed(out)
    assert 0 < len(done) < 8 and done == list(range(len(done)))
    assert message.endswith(f"{len(done)} of 8 shards are committed and intact; free some space and run the same "
                            f"command again: it resumes")
    monkeypatch.undo()
    assert verify(out) == []  # what was committed is intact
    assert run_in_process(extract_args(data, out, **options)).exit_code == 0
    assert_same_cache(reference, out)


def test_zarrs_orphaned_writes_say_nothing_after_the_line(tmp_path):
    """When one of zarr's concurrent chunk writes fails, zarr raises it and leaves the others pending in its
    event loop: at exit asyncio would print "Task was destroyed but it is pending!" and "Exception ignored"
    tracebacks under the command's one line. The dflash command keeps them quiet (and only them)."""
    script = tmp_path / "orphans.py"
    script.write_text(f"""
import asyncio, errno, sys
from zarr.core.common import concurrent_map
from zarr.core.sync import sync
from dflash import logs
if sys.argv[1] == "dflash":
    logs.setup()

async def write(i):
    if i == 0:
        raise OSError(errno.ENOSPC, {FULL!r})
    await asyncio.sleep(3600)  # the writes still queued when the first fails

try:
    sync(concurrent_map([(i,) for i in range(8)], write, limit=2))
except OSError as e:
    print(f"error: {{e}}", file=sys.stderr)
""")
    runs = {how: subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, cwd=REPO)
            for how in ("plain", "dflash")}
    assert "Task was destroyed but it is pending!" in runs["plain"].stderr  # what it would say
    assert runs["dflash"].stderr == f"error: [Errno 28] {FULL}\n"


def test_zarrs_teardown_filter_keeps_every_other_record():
    import logging

    from dflash.logs import _ZarrLoop

    record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Task was destroyed but it is pending!\n"
                               "task: <Task pending coro=<main() running at /srv/app/main.py:3>>", None, None)
    assert _ZarrLoop().filter(record)


# -- train: the run folder and its checkpoints --------------------------------------------------------------

def _train(cache, run):
    return run_in_process(["train", "--config", PRESET, "--cache", str(cache), "--out", str(run), "--device", "cpu",
                           "--holdout-shards", "0", "--max-steps", "4", "--save-every", "2"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference) -> Path:
    """The run an uninterrupted train writes."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert _train(reference, run).exit_code == 0
    return run


def _weights(run: Path) -> dict:
    return load_file(str(checkpoint.latest(run) / "model.safetensors"))


TRAIN = {  # (how the disk fills, the file the line names (relative to the run), the checkpoint left)
    "run config": (lambda mp: full_after(mp, Path, "write_bytes", tmp_of("config.json")), "config.json", None),
    "checkpoint weights": (lambda mp: full_after(mp, files, "save_file", lambda *a: True, n=4,
                                                 error=lambda *a: SafetensorError(
                                                     f"Error while serializing: I/O error: {FULL} (os error 28)")),
                           "checkpoints/.tmp-step-00000004/model.safetensors", "step-00000002"),
    "checkpoint state": (lambda mp: full_after(mp, Path, "write_bytes", tmp_of("state.json"), n=2),
                         "checkpoints/.tmp-step-00000004/state.json", "step-00000002"),
    "latest.json": (lambda mp: full_after(mp, Path, "write_bytes", tmp_of("latest.json"), n=2),
                    "checkpoints/latest.json", "step-00000002"),
}


@pytest.mark.parametrize("what", TRAIN)
def test_train(tmp_path, monkeypatch, reference, trained, what):
    """The run's config, a checkpoint's weights (a SafetensorError from safetensors) or state, latest.json: one
    line naming the last good checkpoint, which stays the latest; the same command resumes from it to the
    uninterrupted run's weights, bit for bit."""
    fill, name, left = TRAIN[what]
    run = tmp_path / "run"
    fill(monkeypatch)
    message = one_line(_train(reference, run), run, run / name)
    good = f"its last good checkpoint, {left}, is intact" if left else "no checkpoint was saved yet"
    assert message.endswith(f"{good}; free some space and run the same command again: it resumes from there")
    assert (checkpoint.latest(run).name if left else checkpoint.latest(run)) == left
    assert not list(run.glob("checkpoints/.tmp-*"))  # no partial checkpoint left
    monkeypatch.undo()
    assert _train(reference, run).exit_code == 0
    got, want = _weights(run), _weights(trained)
    assert checkpoint.latest(run).name == "step-00000004" and all(torch.equal(got[k], want[k]) for k in want)


# -- export ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "README.md"])
def test_export(tmp_path, monkeypatch, trained, name):
    ref, out = tmp_path / "ref", tmp_path / "export"
    assert run_in_process(["export", str(trained), "--out", str(ref)]).exit_code == 0
    if name == "model.safetensors":
        monkeypatch.setattr(files, "save_file", safetensors_full)
    else:
        full_after(monkeypatch, Path, "write_bytes", tmp_of(name))
    message = one_line(run_in_process(["export", str(trained), "--out", str(out)]), out, out / name)
    assert f"the run {trained} is untouched" in message and message.endswith("it writes the export again")
    monkeypatch.undo()
    assert run_in_process(["export", str(trained), "--out", str(out)]).exit_code == 0
    want = {p.name: p.read_bytes().replace(str(ref).encode(), str(out).encode()) for p in ref.iterdir()}  # the card
    assert {p.name: p.read_bytes() for p in out.iterdir()} == want  # names the export's folder


# -- cache convert --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["weights", "chunk"])
def test_cache_convert(tmp_path, monkeypatch, reference, what):
    ref, out = tmp_path / "ref", tmp_path / "fp8"
    convert = ["cache", "convert", str(reference), "--storage", "fp8", "--out"]
    assert run_in_process(convert + [str(ref)]).exit_code == 0
    if what == "weights":
        monkeypatch.setattr(files, "save_file", safetensors_full)
    else:
        full_after(monkeypatch, os, "writev", _direct_chunk, n=20)
    message = one_line(run_in_process(convert + [str(out)]), out,
                       out / "target_weights.safetensors" if what == "weights" else None)
    done = committed(out)
    said = f"{len(done)} of 8 shards are committed and intact" if done else "no shard is committed yet"
    assert message.endswith(f"{said}; free some space and run the same command again: it resumes")
    assert (0 < len(done) < 8) == (what == "chunk")
    monkeypatch.undo()
    assert run_in_process(convert + [str(out)]).exit_code == 0
    assert_same_cache(ref, out)


# -- regenerate -----------------------------------------------------------------------------------------------

def test_regenerate_settings_file(tmp_path, monkeypatch):
    """OUT.meta.json (the settings a resume checks), written first: one line naming it; the output of the run
    that follows is the uninterrupted one. (The output's own writes: test_regenerate.py.)"""
    rows = write_jsonl(tmp_path / "rows.jsonl", sample_rows(4, 0))
    args = ["regenerate", "--target", str(TINY_TARGET), "--data", str(rows), "--max-new-tokens", "2",
            "--batch-size", "1", "--device", "cpu"]
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert run_in_process(args + ["--out", str(ref)]).exit_code == 0
    full_after(monkeypatch, Path, "write_bytes", tmp_of("out.jsonl.meta.json"))
    message = one_line(run_in_process(args + ["--out", str(out)]), out, f"{out}.meta.json")
    assert "its first 0 rows are written" in message
    monkeypatch.undo()
    assert run_in_process(args + ["--out", str(out)]).exit_code == 0
    assert out.read_bytes() == ref.read_bytes()


# -- the compile cache: a full disk there is a warning, and the run goes on ---------------------------------------

def test_compile_cache_is_one_warning(tmp_path, monkeypatch, said):
    from dflash.compile_cache import StepArtifacts

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts" * 100, None))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda payload: object())
    full_after(monkeypatch, Path, "write_bytes", lambda p, *_: p.parent.name == "compile")
    art = StepArtifacts({"T": 512}, torch.device("cpu"), root=tmp_path)
    assert art.load() == "cold" and art.finish(1.0)["compile"] == "cold"
    lines = said()
    assert len(lines) == 2 and lines[0] == (f"warning: cannot keep the compile artifacts in {art.path} ({FULL}); the "
                                            f"next run compiles cold too (set DFLASH_CACHE_DIR to a writable folder)")
    assert not list((tmp_path / "compile").iterdir())  # no temporary file left


# -- any other writer: the command's own net -------------------------------------------------------------------

def test_a_writer_without_its_own_account_is_still_one_line(tmp_path, monkeypatch, trained):
    """`dflash plot` (as `spec --save-outputs`) does not say what it leaves; a full disk under it is still one
    line, from the command."""
    import PIL.Image

    def save(self, fp, *args, **kwargs):  # the PNG's write()
        raise enospc()

    monkeypatch.setattr(PIL.Image.Image, "save", save)
    result = run_in_process(["plot", str(trained), "--out", str(tmp_path / "curves.png")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert stderr_lines(result.stderr) == ["error: no space left on the device; free some space and run the same "
                                           "command again"]
