"""Stage one across processes: SIGKILL and resume, torchrun ranks, a GatedDeltaNet target, `python -m`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, assert_same_arrays, committed, extract_args, run_cli, sample_rows, start_cli, write_jsonl
from dflash.cache import read_manifest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def crash_data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("crash") / "d.jsonl", sample_rows(80, 80))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, crash_data):
    out = tmp_path_factory.mktemp("ref") / "c"
    result = run_cli(extract_args(crash_data, out))
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def fp8_reference(tmp_path_factory, reference):
    """The uninterrupted fp8 cache of the same rows: the conversion of the bf16 one, which holds the bytes
    `extract --storage fp8` writes (tests/test_fp8.py)."""
    out = tmp_path_factory.mktemp("ref8") / "c"
    result = run_cli(["cache", "convert", str(reference), "--storage", "fp8", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    return out


def _finished(proc) -> bool:
    """Whether `proc` has exited; one that exited with an error fails the test, showing its stderr (an
    interrupted run must resume, never stop)."""
    if proc.poll() is None:
        return False
    assert proc.returncode == 0, f"a resumed run failed (exit {proc.returncode}): {proc.stderr.read()[-3000:]}"
    return True


def _kill_when(proc, condition, timeout=120.0, extra_delay=0.0):
    """SIGKILL `proc` once `condition()` holds (plus a delay); False if it finished first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if _finished(proc):
            return False
        if condition():
            time.sleep(extra_delay)
            if _finished(proc):
                return False
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.005)
    raise TimeoutError


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_sigkill_at_any_moment_then_resume_gives_identical_arrays(tmp_path, crash_data, reference, fp8_reference,
                                                                  storage):
    """Kill during planning/creation, right after a commit (mid-write of the next window), and at random
    moments; every restart resumes; the finished cache equals an uninterrupted run bit for bit."""
    out = tmp_path / "c"
    args = extract_args(crash_data, out, storage=storage)
    reference = fp8_reference if storage == "fp8" else reference
    rng = np.random.default_rng(0)
    total = read_manifest(reference)["num_shards"]
    kills = 0
    moments = [
        lambda: (out / "zarr.json").exists(),  # creation in progress: no manifest yet, or just written
        lambda: len(committed(out)) >= 1,  # the first commit: the writer is inside the next shards
        lambda: len(committed(out)) >= total // 3,
        lambda: len(committed(out)) >= total // 2,
    ]
    for condition in moments:
        if _kill_when(start_cli(args), condition, extra_delay=float(rng.uniform(0, 0.3))):
            kills += 1
            assert read_manifest(out) is None or len(committed(out)) < total
    final = run_cli(args)
    assert final.returncode == 0, final.stderr
    assert kills >= 3, "the run finished before it could be killed: make the test data larger"
    assert len(committed(out)) == total
    assert_same_arrays(out, reference)
    assert read_manifest(out)["cache_key"] == read_manifest(reference)["cache_key"]
    assert run_cli(["cache", "verify", str(out)]).returncode == 0


def test_sigkill_during_convert_then_resume_gives_identical_arrays(tmp_path, reference, fp8_reference):
    out = tmp_path / "c"
    args = ["cache", "convert", str(reference), "--storage", "fp8", "--out", str(out)]
    total = read_manifest(reference)["num_shards"]
    kills = 0
    for condition in (lambda: (out / "zarr.json").exists(), lambda: len(committed(out)) >= 1,
                      lambda: len(committed(out)) >= total // 2):
        if _kill_when(start_cli(args, shard_delay=0.1), condition, extra_delay=0.01):
            kills += 1
            assert len(committed(out)) < total
    assert kills == 3, f"the conversion finished before it could be killed ({len(committed(out))}/{total} shards)"
    assert run_cli(args).returncode == 0
    assert_same_arrays(out, fp8_reference)
    assert read_manifest(out)["cache_key"] == read_manifest(fp8_reference)["cache_key"]
    assert run_cli(["cache", "verify", str(out)]).returncode == 0


def test_torchrun_two_ranks_write_one_cache_equal_to_one_process(tmp_path, crash_data, reference):
    out = tmp_path / "c"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dflash", *extract_args(crash_data, out)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_arrays(out, reference)
    # each rank wrote its own windows: window k (2 shards) belongs to rank k % 2
    assert "on rank 0 of 2" in result.stdout + result.stderr


def test_python_m_dflash_is_the_cli():
    result = run_cli(["--help"])
    assert result.returncode == 0 and "extract" in result.stdout and "cache" in result.stdout
