"""Shared fixtures: the embedded tiny target, small slices of the sample data, CLI runners."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from dflash import fp8, logs

REPO = Path(__file__).resolve().parent.parent
TINY_TARGET = REPO / "data" / "tiny-target"
_TINY_CONFIG = json.loads((TINY_TARGET / "config.json").read_text())
TINY_HIDDEN, TINY_VOCAB = _TINY_CONFIG["hidden_size"], _TINY_CONFIG["vocab_size"]
SAMPLE_TEXT = REPO / "data" / "sample" / "text.jsonl"
SAMPLE_CHAT = REPO / "data" / "sample" / "chat.jsonl"
PRESET = REPO / "configs" / "tiny.toml"
CACHE_ARRAYS = ("hidden", "input_ids", "loss_mask", "target_ids", "doc_lens", "row_ids")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def compile_cache_dir(tmp_path_factory) -> Path:
    """Compiled test runs keep their compile artifacts in a folder of the session, not in the user's cache."""
    path = tmp_path_factory.mktemp("dflash-user-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_CACHE_DIR", str(path))
        yield path


@pytest.fixture
def said(caplog):
    """What dflash's log says from here on, as the dflash command prints its lines (`said()`; `said.clear()`)."""
    caplog.set_level(logging.INFO, logger="dflash")

    class Said:
        def __call__(self) -> list[str]:
            return [logs.line(r) for r in caplog.records if r.name.startswith("dflash")]

        def clear(self) -> None:
            caplog.clear()

    return Said()


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def sample_rows(n_text: int, n_chat: int) -> list[dict]:
    text = [json.loads(line) for line in SAMPLE_TEXT.read_text().splitlines()[:n_text]]
    chat = [json.loads(line) for line in SAMPLE_CHAT.read_text().splitlines()[:n_chat]]
    return text + chat


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    """60 rows: 30 text, 30 chat (some multi-turn, some with a system message)."""
    return write_jsonl(tmp_path_factory.mktemp("data") / "small.jsonl", sample_rows(30, 30))


@pytest.fixture(scope="session")
def small_cache(tmp_path_factory) -> Path:
    """A cache of the tiny preset's first 24 rows (`configs/tiny.toml`), read-only for the tests that share it."""
    out = tmp_path_factory.mktemp("preset") / "cache"
    result = run_in_process(["extract", "--config", str(PRESET), "--out", str(out), "--device", "cpu",
                             "--limit", "24"])
    assert result.exit_code == 0, result.output
    return out


def extract_args(data: Path, out: Path, **options) -> list[str]:
    """CLI arguments for a small, fast extraction on the tiny target."""
    opts = {"target": str(TINY_TARGET), "token-budget": 512, "max-docs": 8, "draft-layers": 3, "window": 2,
            "batch-size": 8, "batch-tokens": 2048, "device": "cpu",
            **{k.replace("_", "-"): v for k, v in options.items()}}
    args = ["extract", "--data", str(data), "--out", str(out)]
    for k, v in opts.items():
        args += [f"--{k}", str(v)]
    return args


def run_cli(args: list[str], env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`python -m dflash ARGS` in a subprocess (the real CLI, exit codes and all)."""
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run([sys.executable, "-m", "dflash", *args], capture_output=True, text=True, env=full_env,
                          cwd=REPO, **kwargs)


def start_cli(args: list[str], shard_delay: float = 0.0) -> subprocess.Popen:
    """`python -m dflash ARGS` in the background (to be killed). `shard_delay`: seconds each shard write
    waits first, so that a run this small lasts long enough to be killed mid-way on any machine."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "dflash", *args]
    if shard_delay:
        slow = (f"import sys, time\nfrom dflash.cache import Cache\nfrom dflash.__main__ import command\n"
                f"write = Cache.write_shard\n"
                f"Cache.write_shard = lambda *a, **k: (time.sleep({shard_delay}), write(*a, **k))[1]\n"
                f"command()(sys.argv[1:], prog_name='dflash')")
        cmd = [sys.executable, "-c", slow, *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def run_in_process(args: list[str]):
    """The CLI in this process (faster than a subprocess): click's result with exit code and output."""
    from click.testing import CliRunner

    from dflash_cli.main import main

    return CliRunner().invoke(main, args, catch_exceptions=False)


def fill_disk_after(monkeypatch, n: int) -> None:
    """From the n-th chunk a cache writes on, the write fails with ENOSPC, as on a full disk (until
    `monkeypatch.undo()`)."""
    from dflash.cache import Cache

    real, calls = Cache._write_chunk, []

    def write_chunk(self, name, coords, block):
        calls.append(name)
        if len(calls) >= n:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path / name))
        return real(self, name, coords, block)

    monkeypatch.setattr(Cache, "_write_chunk", write_chunk)


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    """Every shard array of a cache (with fp8 storage, `hidden_scale` too)."""
    group = zarr.open_group(path, mode="r")
    return {name: group[name][:] for name in (*CACHE_ARRAYS, "hidden_scale") if name in group}


def assert_same_arrays(got: Path, want: Path) -> None:
    """The caches at `got` and `want` hold the same shard arrays, bit for bit; else the first array that differs,
    which shards, and in which of them the first difference is (layer and token where the array has them)."""
    a, b = read_arrays(got), read_arrays(want)
    for name in b:
        if not np.array_equal(a[name], b[name]):
            where = np.argwhere(a[name] != b[name])
            shards = sorted({int(i) for i in where[:, 0]})
            raise AssertionError(f"{name} differs in {len(where)} values of shards {shards[:10]} (first at "
                                 f"{tuple(int(i) for i in where[0])} of {a[name].shape}): {got} vs {want}")


def committed(path: Path) -> list[int]:
    return sorted(int(p.stem) for p in (path / "commits").glob("*.json"))


def bf16_bits_to_float(a: np.ndarray) -> torch.Tensor:
    return fp8.bf16_from_bits(a).float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def assert_same_cache(a: Path, b: Path) -> None:
    """Two caches hold the same shards (every array), target weights and target config, all committed: what a
    resumed extract (or convert) must give beside an uninterrupted one."""
    from dflash.cache import TARGET_CONFIG_FILE, WEIGHTS_FILE, read_manifest, verify

    assert committed(a) == committed(b) == list(range(read_manifest(a)["num_shards"]))
    got, want = read_arrays(b), read_arrays(a)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    for name in (WEIGHTS_FILE, TARGET_CONFIG_FILE):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert verify(b) == []


def stderr_lines(text: str) -> list[str]:
    """A command's stderr as a terminal ends up showing it: lines split at newlines and a bar's carriage returns,
    blank ones dropped."""
    return [line for line in re.split(r"[\r\n]", text) if line.strip()]
