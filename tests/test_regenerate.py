"""`dflash regenerate` in-process: the target's own greedy answers, batched, turn by turn; resumable after SIGKILL."""

from __future__ import annotations

import errno
import json
import os
import signal
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import SAMPLE_CHAT, TINY_TARGET, run_cli, run_in_process, sample_rows, start_cli, write_jsonl
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
    data = write_jsonl(tmp_path / "d.jsonl", sample_rows(16, 16))
    args = ["regenerate", "--target", str(TINY_TARGET), "--data", str(data), "--max-new-tokens", "16",
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
    assert out.read_bytes().count(b"\n") < 32  # two chunks of 16 rows: killed inside the second
    with out.open("ab") as f:
        f.write(b'{"messages": [{"role": "us')  # a torn row, as a crash mid-write leaves it
    assert run_cli(args + ["--out", str(out)]).returncode == 0
    assert out.read_bytes() == ref.read_bytes()  # sampled, resumed, and still identical
    again = run_cli(args + ["--out", str(out)])
    assert again.returncode == 0 and "nothing to do" in again.stdout + again.stderr
    other = run_cli(args + ["--out", str(out), "--max-new-tokens", "20"])
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


def test_every_assistant_turn_given_the_conversation_so_far_or_only_the_last(tmp_path):
    chat = [json.loads(x) for x in SAMPLE_CHAT.read_text().splitlines()]
    src = [chat[7], {"messages": [{"role": "user", "content": "What is a list?"}]}]  # two turns; none yet
    data = write_jsonl(tmp_path / "d.jsonl", src)
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    target = Target(AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval(), [1])

    def greedy(msgs):
        prompt = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        return tok.decode(target_greedy(target, prompt, 12, {tok.eos_token_id}), skip_special_tokens=True)

    for turns in ("all", "last"):
        out = tmp_path / f"{turns}.jsonl"
        res = run_in_process(["regenerate", "--target", str(TINY_TARGET), "--data", str(data), "--out", str(out),
                              "--max-new-tokens", "12", "--device", "cpu", "--turns", turns, "--json"])
        assert res.exit_code == 0, res.output
        (conv, fresh), old = _rows(out), src[0]["messages"]
        msgs = conv["messages"]
        assert [m["role"] for m in msgs] == [m["role"] for m in old] and msgs[0] == old[0] and msgs[2] == old[2]
        assert msgs[1] == ({"role": "assistant", "content": greedy(old[:1])} if turns == "all" else old[1])
        assert msgs[3]["content"] == greedy(msgs[:3])  # the second turn answers the conversation so far
        assert len(conv["dflash_finish_reasons"]) == (2 if turns == "all" else 1)
        assert fresh["messages"][1]["content"] == greedy(src[1]["messages"]) and len(fresh["messages"]) == 2
        cut = sum("length" in r["dflash_finish_reasons"] for r in (conv, fresh))
        assert f'"cut_by_length": {cut}' in res.output


def test_a_row_with_no_user_turn_stops_before_any_generation(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]},
                                              {"messages": [{"role": "system", "content": "x"},
                                                            {"role": "assistant", "content": "y"}]}])
    out = tmp_path / "out.jsonl"
    res = run_in_process(["regenerate", "--target", str(TINY_TARGET), "--data", str(data), "--out", str(out),
                          "--device", "cpu"])
    assert res.exit_code == 1 and f"error: {data}:2: no user turn to answer" in res.output
    assert not out.exists()
