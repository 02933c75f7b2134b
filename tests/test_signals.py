"""Ctrl-C (SIGINT) and SIGTERM: the command closes its bar, finishes the writes in flight, and says in one line,
its last, where it stopped and that the same command resumes; exit 130 (SIGINT) or 143 (SIGTERM), as a shell
reports a process ended by the signal. The same command then resumes to what an uninterrupted run gives."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    REPO,
    assert_same_cache,
    committed,
    extract_args,
    run_in_process,
    sample_rows,
    stderr_lines,
    write_jsonl,
)
from dflash import checkpoint

PRESET = str(REPO / "configs" / "tiny.toml")
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


def start(args: list[str], patch: str = "") -> subprocess.Popen:
    """`python -m dflash ARGS` in the background, after `patch` (Python run first: slows a run this small
    down enough to be stopped mid-way on any machine). Ctrl-C's handler is set first: a shell starts its background
    jobs (a test suite run with `&`) with SIGINT ignored, and the child would inherit that."""
    code = (f"import signal, sys, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n{patch}\n"
            f"from dflash.__main__ import command\n"
            f"command()(sys.argv[1:], prog_name='dflash')")
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})


def stop_when(proc: subprocess.Popen, ready, signum) -> tuple[int, list[str]]:
    """Send `signum` once `ready()` holds; the exit status and the stderr lines."""
    t0 = time.monotonic()
    while not ready():
        assert proc.poll() is None, f"ended before it could be stopped: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() - t0 < 120, "never got there"
        time.sleep(0.02)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, stderr_lines(err)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "rows.jsonl", sample_rows(8, 4))  # 8 shards


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> Path:
    out = tmp_path_factory.mktemp("ref") / "cache"
    assert run_in_process(extract_args(data, out)).exit_code == 0
    return out


SLOW_SHARDS = ("from dflash.cache import Cache\nwrite = Cache.write_shard\n"
               "Cache.write_shard = lambda *a, **k: (time.sleep(0.4), write(*a, **k))[1]")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_extract_stops_in_one_line_and_resumes(tmp_path, data, reference, signum):
    out = tmp_path / "cache"
    proc = start(extract_args(data, out), SLOW_SHARDS)
    code, lines = stop_when(proc, lambda: bool(list(out.glob("commits/*.json"))), signum)
    done = committed(out)
    assert code == EXIT[signum] and 0 < len(done) < 8 and done == list(range(len(done)))
    assert lines[-1] == (f"stopped by {signum.name} at shard {len(done)} of 8 ({len(done)} committed); run the same "
                         f"command again: it resumes"), lines[-3:]
    assert not any("Traceback" in x or "Aborted" in x for x in lines)
    assert run_in_process(extract_args(data, out)).exit_code == 0
    assert_same_cache(reference, out)


def _train_args(cache, run) -> list[str]:
    return ["train", "--config", PRESET, "--cache", str(cache), "--out", str(run), "--device", "cpu",
            "--holdout-shards", "0", "--max-steps", "12", "--save-every", "3"]


SLOW_STEPS = ("import dflash.train as t\nstep = t.train_step\n"
              "t.train_step = lambda *a, **k: (time.sleep(0.2), step(*a, **k))[1]")


def test_train_stops_in_one_line_naming_the_step_and_checkpoint_and_resumes(tmp_path, reference):
    """Ctrl-C mid-run (SIGTERM takes the same path, as extract's test shows): the step reached, the checkpoint
    the same command resumes from, which then trains to the uninterrupted run's weights."""
    signum = signal.SIGINT
    run, ref = tmp_path / "run", tmp_path / "ref"
    proc = start(_train_args(reference, run), SLOW_STEPS)
    code, lines = stop_when(proc, lambda: (run / "checkpoints" / "latest.json").exists(), signum)
    last = checkpoint.latest(run).name
    m = re.fullmatch(rf"stopped by {signum.name} after step (\d+) of 12; its last good checkpoint, (step-\d+), is "
                     rf"intact; run the same command again: it resumes from there", lines[-1])
    assert code == EXIT[signum] and m, lines[-3:]
    assert m[2] == last and int(m[1]) >= int(last[5:]) and not list(run.glob("checkpoints/.tmp-*"))
    assert not (run / ".lock").read_text()  # the run is released
    again = run_in_process(_train_args(reference, run))
    assert again.exit_code == 0 and f"resuming {run} from step {int(last[5:])}" in again.output
    assert run_in_process(_train_args(reference, ref)).exit_code == 0
    got, want = (load_file(str(checkpoint.latest(r) / "model.safetensors")) for r in (run, ref))
    assert all(torch.equal(got[k], want[k]) for k in want)  # bit for bit the uninterrupted run


def test_a_stop_before_the_cache_exists_says_so_and_restores_sigterm(tmp_path, data, monkeypatch):
    """Ctrl-C while extract plans: nothing is created, the line says the same command starts over; the command
    leaves the process's SIGTERM handler as it found it."""
    import dflash.extract

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dflash.extract, "_plan", interrupted)
    before = signal.getsignal(signal.SIGTERM)
    result = run_in_process(extract_args(data, tmp_path / "cache"))
    assert result.exit_code == 130 and "Aborted" not in result.output
    assert stderr_lines(result.stderr)[-1] == ("stopped by SIGINT before the cache was created (nothing is committed); "
                                               "run the same command again: it starts over")
    assert signal.getsignal(signal.SIGTERM) is before
