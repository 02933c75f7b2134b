"""`dflash regenerate`: the target's own greedy answers, batched; resumable after SIGKILL."""

from __future__ import annotations

import errno
import json
import os
import signal
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import TINY_TARGET, run_cli, run_in_process, sample_rows, start_cli, write_jsonl
from dflash.spec import target_greedy
from dflash.target import Target


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_chat_rows_get_the_targets_greedy_answer_and_text_rows_its_continuation(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", sample_rows(3, 5))
    out = tmp_path / "out.jsonl"
    res = run_in_process(["regenerate", "--target", str(TINY_TARGET), "--data", str(data), "--out", str(out),
                          "--max-new-tokens", "20", "--batch-size", "3", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    rows, src = _rows(out), sample_rows(3, 5)
    assert [r["dflash_row"] for r in rows] == list(range(8))
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    target = Target(AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval(), [1])
    for new, old in zip(rows[3:], src[3:]):
        kept = old["messages"][:-1]
        assert new["messages"][:-1] == kept and new["messages"][-1]["role"] == "assistant"
        prompt = tok(tok.apply_chat_template(kept, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        want = target_greedy(target, prompt, 20, {tok.eos_token_id})
        assert new["messages"][-1]["content"] == tok.decode(want, skip_special_tokens=True)
    for new, old in zip(rows[:3], src[:3]):
        prefix = tok.decode(tok(old["text"])["input_ids"][:32])
        assert new["text"].startswith(prefix) and len(new["text"]) > len(prefix)
        assert new["source"] == old["source"]  # other fields are kept


def test_sigkill_then_resume_gives_the_same_file(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", sample_rows(40, 40))
    args = ["regenerate", "--target", str(TINY_TARGET), "--data", str(data), "--max-new-tokens", "24",
            "--batch-size", "2", "--temperature", "0.8", "--device", "cpu"]
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert run_cli(args + ["--out", str(ref)]).returncode == 0
    proc = start_cli(args + ["--out", str(out)])
    t0 = time.monotonic()
    while not (out.exists() and out.read_bytes().count(b"\n") >= 16):
        assert proc.poll() is None and time.monotonic() - t0 < 300, "finished before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert out.read_bytes().count(b"\n") < 80
    with out.open("ab") as f:
        f.write(b'{"messages": [{"role": "us')  # a torn row, as a crash mid-write leaves it
    assert run_cli(args + ["--out", str(out)]).returncode == 0
    assert out.read_bytes() == ref.read_bytes()  # sampled, resumed, and still identical
    again = run_cli(args + ["--out", str(out)])
    assert again.returncode == 0 and "nothing to do" in again.stdout + again.stderr
    other = run_cli(args + ["--out", str(out), "--max-new-tokens", "30"])
    assert other.returncode == 1 and "other settings (max_new_tokens)" in other.stderr


def test_a_full_disk_is_one_line_and_the_same_command_resumes(tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", sample_rows(20, 0))
    args = ["regenerate", "--target", str(TINY_TARGET), "--data", str(data), "--max-new-tokens", "4",
            "--batch-size", "1", "--device", "cpu"]  # chunks of 8 rows
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert run_in_process(args + ["--out", str(ref)]).exit_code == 0
    real, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    result = run_in_process(args + ["--out", str(out)])
    assert result.exit_code == 1, result.output
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert errors == [f"error: {out}: no space left on the device; its first 8 rows are written; free some space "
                      f"and run the same command again: it resumes"]
    monkeypatch.setattr(os, "fsync", real)
    assert run_in_process(args + ["--out", str(out)]).exit_code == 0
    assert out.read_bytes() == ref.read_bytes()
