"""The compiled step's artifacts kept between runs: written by a cold run, handed to torch by the next run of
the same step (which reports warm), ignored with a warning when they are for another step, corrupt or cut
short, and never a reason to stop (an unwritable cache, a torch without the API)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_in_process
from dflash import compile_cache
from dflash.compile_cache import MAGIC, StepArtifacts, cache_root
from dflash.objective import ce_rows

PRESET = str(REPO / "configs" / "tiny.toml")
CPU = torch.device("cpu")


class FakeTorch:
    """torch.compiler's save/load of artifacts, recorded: what was saved and what each load was handed."""

    def __init__(self, monkeypatch, load_result=True):
        self.saved, self.loaded, self.load_result = [], [], load_result
        monkeypatch.setattr(torch.compiler, "save_cache_artifacts", self.save)
        monkeypatch.setattr(torch.compiler, "load_cache_artifacts", self.load)

    def save(self):
        payload = f"artifacts #{len(self.saved)} ".encode() * 100
        self.saved.append(payload)
        return payload, None

    def load(self, payload: bytes):
        self.loaded.append(payload)
        if isinstance(self.load_result, Exception):
            raise self.load_result
        return object() if self.load_result else None


def cold_then_saved(tmp_path, fields=None) -> StepArtifacts:
    art = StepArtifacts(fields or {"T": 1024}, CPU, root=tmp_path)
    assert art.load() == "cold"
    art.finish(2.0)
    return art


def test_a_cold_run_keeps_its_artifacts_and_the_next_one_hands_them_to_torch(tmp_path, monkeypatch, said):
    fake = FakeTorch(monkeypatch)
    art = cold_then_saved(tmp_path)
    assert fake.saved and not fake.loaded
    assert said() == [f"compiled the training step (cold) in 2.0s; kept for the next run: {art.path}"]
    assert art.path.parent == tmp_path / "compile" and art.path.read_bytes().startswith(MAGIC)
    header = json.loads(art.path.read_bytes()[len(MAGIC):].split(b"\n", 1)[0])
    assert header["fields"]["T"] == 1024 and header["fields"]["torch"] == torch.__version__
    assert header["fields"]["device"] == "cpu" and header["payload_bytes"] == len(fake.saved[0])

    again = StepArtifacts({"T": 1024}, CPU, root=tmp_path)
    said.clear()
    assert again.load() == "warm"
    assert fake.loaded == fake.saved  # exactly the saved bytes
    record = again.finish(1.5)
    assert said() == ["compiled the training step (warm) in 1.5s"]
    assert record["compile"] == "warm" and record["compile_s"] == 1.5
    assert len(fake.saved) == 1  # a warm run that compiled nothing anew writes nothing


def test_the_key_follows_the_fields_not_their_order(tmp_path):
    a = StepArtifacts({"T": 1024, "A": 128}, CPU, root=tmp_path)
    assert StepArtifacts({"A": 128, "T": 1024}, CPU, root=tmp_path).path == a.path
    assert StepArtifacts({"T": 1024, "A": 256}, CPU, root=tmp_path).path != a.path
    assert a.fields["torch"] == torch.__version__ and a.fields["python"] == "{}.{}".format(*sys.version_info)
    assert a.fields["device"] == "cpu" and "triton" in a.fields


def test_artifacts_for_another_step_are_ignored_with_a_warning(tmp_path, monkeypatch, said):
    """A file whose header names other fields (copied, or an older key scheme) never reaches torch."""
    fake = FakeTorch(monkeypatch)
    old = cold_then_saved(tmp_path, {"T": 1024, "A": 128})
    new = StepArtifacts({"T": 2048, "A": 128}, CPU, root=tmp_path)
    new.path.write_bytes(old.path.read_bytes())
    said.clear()
    assert new.load() == "cold" and fake.loaded == []
    assert said() == [f"warning: ignoring the compile artifacts in {new.path}: made for another step (differs in "
                      f"T); compiling cold"]
    new.finish(3.0)  # the cold run replaces them with its own
    assert StepArtifacts({"T": 2048, "A": 128}, CPU, root=tmp_path).load() == "warm"
    assert fake.loaded == [fake.saved[1]]


def _cut(blob: bytes) -> bytes:
    return blob[:-10]


def _flip(blob: bytes) -> bytes:
    return blob[:-5] + bytes([blob[-5] ^ 0xFF]) + blob[-4:]


@pytest.mark.parametrize("damage,problem", [
    (_cut, "the payload is cut short ("),
    (_flip, "the payload is corrupt (its sha256 differs"),
    (lambda blob: blob[: len(MAGIC) + 20], "its header is unreadable"),
    (lambda blob: b"", "not a dflash compile-artifacts file"),
    (lambda blob: b"\x80\x04garbage" + blob, "not a dflash compile-artifacts file"),
])
def test_a_corrupt_or_truncated_file_is_ignored_with_a_warning(tmp_path, monkeypatch, damage, problem, said):
    fake = FakeTorch(monkeypatch)
    art = cold_then_saved(tmp_path)
    art.path.write_bytes(damage(art.path.read_bytes()))
    said.clear()
    assert StepArtifacts({"T": 1024}, CPU, root=tmp_path).load() == "cold"
    assert fake.loaded == []
    lines = said()
    assert len(lines) == 1 and lines[0].startswith(f"warning: ignoring the compile artifacts in {art.path}: {problem}")


@pytest.mark.parametrize("result,warning", [
    (RuntimeError("bad pickle"), "torch could not load the compile artifacts in {path} (RuntimeError: bad pickle)"),
    (None, "torch could not read the compile artifacts in {path}"),
])
def test_a_load_that_torch_refuses_is_cold_with_a_warning(tmp_path, monkeypatch, result, warning, said):
    fake = FakeTorch(monkeypatch)
    art = cold_then_saved(tmp_path)
    fake.load_result = result
    again = StepArtifacts({"T": 1024}, CPU, root=tmp_path)
    said.clear()
    assert again.load() == "cold" and fake.loaded == fake.saved
    assert said() == [f"warning: {warning.format(path=art.path)}; compiling cold"]
    assert again.finish(1.0)["compile"] == "cold" and len(fake.saved) == 2  # saved again


@pytest.mark.parametrize("how", ["not a folder", "disk full"])
def test_an_unwritable_cache_is_a_warning_and_the_run_goes_on(tmp_path, monkeypatch, how, said):
    fake = FakeTorch(monkeypatch)
    root = tmp_path / "cache"
    if how == "not a folder":
        root.write_text("a file where the cache folder should be")
    else:
        def full(path, data):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        monkeypatch.setattr(compile_cache, "write_bytes_atomic", full)
    art = StepArtifacts({"T": 1024}, CPU, root=root)
    assert art.load() == "cold"
    record = art.finish(4.0)
    assert record["compile"] == "cold" and fake.saved
    lines = said()
    assert len(lines) == 2 and lines[0].startswith(f"warning: cannot keep the compile artifacts in {art.path} (")
    assert "the next run compiles cold too" in lines[0] and lines[1] == "compiled the training step (cold) in 4.0s"
    assert not art.path.exists()


def test_a_torch_without_the_api_compiles_cold_with_one_note(tmp_path, monkeypatch, said):
    monkeypatch.delattr(torch.compiler, "save_cache_artifacts")
    art = StepArtifacts({"T": 1024}, CPU, root=tmp_path)
    assert art.load() == "cold"
    art.finish(5.0)
    lines = said()
    assert len(lines) == 2 and lines[0].startswith(f"note: torch {torch.__version__} cannot keep compile artifacts")
    assert lines[1] == "compiled the training step (cold) in 5.0s" and not (tmp_path / "compile").exists()


def test_disabled_reads_and_writes_nothing(tmp_path, monkeypatch, said):
    fake = FakeTorch(monkeypatch)
    cold_then_saved(tmp_path)
    off = StepArtifacts({"T": 1024}, CPU, root=tmp_path, enabled=False)
    said.clear()
    assert off.load() == "cold"
    off.finish(1.0)
    assert fake.loaded == [] and len(fake.saved) == 1 and said() == ["compiled the training step (cold) in 1.0s"]


def test_the_folder_keeps_the_most_recently_used_files(tmp_path, monkeypatch):
    """Beyond KEEP files, a save deletes the least recently used ones; loading a file counts as using it."""
    monkeypatch.setattr(compile_cache, "KEEP", 3)
    FakeTorch(monkeypatch)
    arts = []
    for i in range(3):
        art = cold_then_saved(tmp_path, {"T": i})
        os.utime(art.path, (1000 + i, 1000 + i))  # written in the order 0, 1, 2
        arts.append(art)
    assert StepArtifacts({"T": 0}, CPU, root=tmp_path).load() == "warm"  # 0 used last now
    fourth = cold_then_saved(tmp_path, {"T": 3})  # the least recently used (1) goes
    kept = {f.name for f in (tmp_path / "compile").glob("*.bin")}
    assert kept == {arts[0].path.name, arts[2].path.name, fourth.path.name}


def test_the_cache_folder_is_dflash_cache_dir_else_xdg_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv("DFLASH_CACHE_DIR")
    assert cache_root() == tmp_path / "xdg" / "dflash"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "dflash"


# -- with torch's real artifacts: a second process starts warm from the first one's file ------------------

PROBE = r"""
import hashlib, json, logging, time, torch
from dflash.compile_cache import StepArtifacts
handed, real_load = [], torch.compiler.load_cache_artifacts
def load(payload):
    handed.append(hashlib.sha256(payload).hexdigest())
    return real_load(payload)
torch.compiler.load_cache_artifacts = load
lines = []
class Lines(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("dflash").addHandler(Lines())
logging.getLogger("dflash").setLevel(logging.INFO)
art = StepArtifacts({"probe": "x @ w, 4x8 @ 8x8, with backward"}, torch.device("cpu"))
state = art.load()
f = torch.compile(lambda x, w: x @ w, dynamic=False)  # extern matmuls only: no C++ to build, seconds
t0 = time.perf_counter()
f(torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)).sum().backward()
record = art.finish(time.perf_counter() - t0)
print(json.dumps({"state": state, "record": record, "handed": handed, "lines": lines, "path": str(art.path)}))
"""


def _probe(tmp_path: Path, inductor_dir: str) -> dict:
    # a fresh Inductor cache per process: what the second one finds can only come from dflash's file
    env = {**os.environ, "DFLASH_CACHE_DIR": str(tmp_path / "user-cache"), "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / inductor_dir)}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torch_artifacts_make_a_second_process_warm(tmp_path):
    cold = _probe(tmp_path, "inductor-1")
    assert cold["state"] == "cold" and cold["handed"] == [] and cold["record"]["compile_cache_misses"] > 0
    assert cold["lines"][0].endswith(f"kept for the next run: {cold['path']}")
    blob = Path(cold["path"]).read_bytes()
    header = json.loads(blob[len(MAGIC):].split(b"\n", 1)[0])

    warm = _probe(tmp_path, "inductor-2")
    assert warm["state"] == "warm" and warm["path"] == cold["path"]
    assert warm["handed"] == [header["payload_sha256"]]
    assert hashlib.sha256(blob.split(b"\n", 2)[2]).hexdigest() == header["payload_sha256"]
    assert warm["record"]["compile_cache_hits"] > 0 and warm["record"]["compile_cache_misses"] == 0
    assert warm["record"]["autograd_cache_hits"] == 1 and warm["record"]["autograd_cache_bypasses"] == 0
    assert warm["lines"] == [f"compiled the training step (warm) in {warm['record']['compile_s']:.1f}s"]
    assert Path(cold["path"]).read_bytes() == blob  # not rewritten


# -- dflash train: the log lines and the metrics record ----------------------------------------------------

@pytest.fixture(scope="module")
def small_cache(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cc") / "cache"
    result = run_in_process(["extract", "--config", PRESET, "--out", str(out), "--device", "cpu", "--limit", "12"])
    assert result.exit_code == 0, result.output
    return out


def test_train_says_cold_or_warm_and_records_it(tmp_path, small_cache, monkeypatch):
    """The step compiled on CPU with torch.compile stubbed out (the real artifacts are tested above): the first
    run compiles cold and keeps the artifacts, a second run of the same step loads them, another shape does
    not, and --no-compile-cache neither reads nor writes."""
    fake = FakeTorch(monkeypatch)
    monkeypatch.setattr(torch, "compile", lambda module, **options: module)
    user_cache = tmp_path / "user-cache"
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(user_cache))

    def train(name, *extra):
        run = tmp_path / name
        result = run_in_process(["train", "--config", PRESET, "--cache", str(small_cache), "--out", str(run),
                                 "--device", "cpu", "--compile", "yes", "--max-steps", "1", "--holdout-shards", "0",
                                 *extra])
        assert result.exit_code == 0, result.output
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return result.output, [x for x in lines if "compile" in x]

    out, records = train("a")
    assert "compiling the training step (cold) …" in out and "compiled the training step (cold) in" in out
    assert records[0]["step"] == 1 and records[0]["compile"] == "cold" and records[0]["compile_s"] > 0
    files = list((user_cache / "compile").glob("*.bin"))
    assert len(files) == 1 and len(fake.saved) == 1 and fake.loaded == []

    out, records = train("b")
    assert "compiling the training step (warm) …" in out and "compiled the training step (warm) in" in out
    assert records[0]["compile"] == "warm" and fake.loaded == fake.saved

    out, records = train("c", "--num-anchors", "64")
    assert "compiling the training step (cold) …" in out and len(list((user_cache / "compile").glob("*.bin"))) == 2

    out, records = train("d", "--no-compile-cache")
    assert "compiling the training step (cold) …" in out and records[0]["compile"] == "cold"
    assert len(fake.loaded) == 1 and len(fake.saved) == 2

    out, records = train("e", "--ce-chunk", str(ce_rows(4096)))  # the default chunk at the tiny vocabulary, spelled out
    assert "compiling the training step (warm) …" in out and len(fake.loaded) == 2


def test_an_uncompiled_run_logs_no_compile(tmp_path, small_cache):
    run = tmp_path / "eager"
    result = run_in_process(["train", "--config", PRESET, "--cache", str(small_cache), "--out", str(run),
                             "--device", "cpu", "--max-steps", "1", "--holdout-shards", "0"])
    assert result.exit_code == 0 and "the training step" not in result.output
    assert all("compile" not in json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())


@pytest.mark.gpu
def test_a_second_compiled_run_on_the_gpu_starts_warm(tmp_path):
    """The tiny preset compiled on the GPU twice, each process with an empty Inductor cache: the second finds
    every graph in dflash's file and compiles faster."""
    from conftest import run_cli

    cache = tmp_path / "cache"
    assert run_in_process(["extract", "--config", PRESET, "--out", str(cache), "--limit", "40"]).exit_code == 0
    records = []
    for name in ("cold", "warm"):
        env = {"DFLASH_CACHE_DIR": str(tmp_path / "user-cache"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / name)}
        result = run_cli(["train", "--config", PRESET, "--cache", str(cache), "--out", str(tmp_path / f"run-{name}"),
                          "--max-steps", "3", "--holdout-shards", "0", "--compile", "yes"], env=env, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"compiling the training step ({name}) …" in result.stderr
        lines = (tmp_path / f"run-{name}" / "metrics.jsonl").read_text().splitlines()
        records.append(next(r for r in map(json.loads, lines) if "compile" in r))
    cold, warm = records
    assert cold["compile"] == "cold" and cold["compile_cache_misses"] > 0
    assert warm["compile"] == "warm" and warm["compile_cache_misses"] == 0 and warm["compile_cache_hits"] > 0
    assert warm["autograd_cache_hits"] == 1 and warm["autograd_cache_bypasses"] == 0  # the joint graph not retraced
    assert warm["compile_s"] < cold["compile_s"]
