"""Stage two on CPU: the tiny preset trains, resumes exactly after SIGKILL, exports, evaluates, and
refuses mismatches early."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO, rel_err, run_cli, run_in_process, start_cli
from dflash import checkpoint

PRESET = str(REPO / "configs" / "tiny.toml")


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory) -> Path:
    """The tiny preset's cache, on the first 300 rows (about 80 shards of 1024 tokens)."""
    out = tmp_path_factory.mktemp("tiny") / "cache"
    result = run_in_process(["extract", "--config", PRESET, "--out", str(out), "--device", "cpu", "--limit", "300"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_cache) -> Path:
    """120 steps of the tiny preset, a checkpoint every 20."""
    run = tmp_path_factory.mktemp("runs") / "tiny"
    result = run_in_process(["train", "--config", PRESET, "--cache", str(tiny_cache), "--out", str(run),
                             "--max-steps", "120", "--save-every", "20", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    return run


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_training_lowers_the_loss(trained_run):
    losses = [m["loss"] for m in metrics(trained_run) if "loss" in m]
    assert len(losses) == 12  # a line every 10 steps
    walks = [m["tau_walk"] for m in metrics(trained_run) if "loss" in m]  # SpecForge's walk on the step's anchors
    assert all(w >= 1 for w in walks) and sum(walks[-3:]) > sum(walks[:3])
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    steps = sorted(p.name for p in (trained_run / "checkpoints").glob("step-*"))
    assert steps == ["step-00000100", "step-00000120"]  # the newest two are kept
    config = json.loads((trained_run / "config.json").read_text())
    assert config["drafter"]["num_layers"] == 2 and config["drafter"]["mask_token_id"] == 3
    assert len(config["holdout_shards"]) == 4
    evals = [m for m in metrics(trained_run) if "tau" in m]
    assert len(evals) == 1 and evals[0]["tau"] > 1.0 and evals[0]["tau_anchors"] > 1.0
    assert evals[0]["tau_per_request"] > 1.0


def test_same_command_resumes_and_other_config_is_refused(trained_run, tiny_cache):
    again = run_in_process(["train", "--config", PRESET, "--cache", str(tiny_cache), "--out", str(trained_run),
                            "--max-steps", "120", "--device", "cpu"])
    assert again.exit_code == 0 and "nothing to do" in again.output
    other = run_in_process(["train", "--config", PRESET, "--cache", str(tiny_cache), "--out", str(trained_run),
                            "--max-steps", "120", "--lr", "1e-3", "--device", "cpu"])
    assert other.exit_code == 1 and "another config (differs in lr)" in other.output


def test_sigkill_then_resume_logs_the_same_loss_at_every_step(tmp_path, tiny_cache):
    args = ["train", "--config", PRESET, "--cache", str(tiny_cache), "--max-steps", "24", "--save-every", "4",
            "--log-every", "1", "--device", "cpu", "--holdout-shards", "0"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert run_cli(args + ["--out", str(ref)]).returncode == 0
    proc = start_cli(args + ["--out", str(run)])
    latest = run / "checkpoints" / "latest.json"
    t0 = time.monotonic()
    while not (latest.exists() and json.loads(latest.read_text())["step"] >= 8):
        assert proc.poll() is None and time.monotonic() - t0 < 300, "finished before it could be killed"
        time.sleep(0.02)
    time.sleep(0.3)  # past the checkpoint, into the next steps
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(latest.read_text())["step"]
    assert killed_at < 24
    assert run_cli(args + ["--out", str(run)]).returncode == 0
    want = [(m["step"], m["loss"]) for m in metrics(ref) if "loss" in m]
    got = [(m["step"], m["loss"]) for m in metrics(run) if "loss" in m]
    assert len(want) == 24 and got == want  # bit-identical losses, each step logged once


def test_export_writes_the_reference_format(trained_run, tmp_path):
    out = tmp_path / "export"
    assert run_in_process(["export", str(trained_run), "--out", str(out)]).exit_code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 16
    assert config["num_target_layers"] == 6 and config["layer_types"] == ["full_attention"] * 2
    assert config["dflash_config"] == {"block_size": 16, "mask_token_id": 3, "target_layer_ids": [1, 2, 3]}
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "rope_theta", "vocab_size", "num_hidden_layers"):
        assert field in config
    names = set(load_file(out / "model.safetensors"))
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
                 "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                 "post_attention_layernorm"]
    expected = {f"layers.{i}.{n}.weight" for i in range(2) for n in per_layer} | {
        "fc.weight", "hidden_norm.weight", "norm.weight"}
    assert names == expected  # no embeddings, no LM head
    card = (out / "README.md").read_text()
    assert "--speculative-algorithm DFLASH" in card and '"method": "dflash"' in card


def test_eval_trained_beats_untrained(trained_run, tiny_cache, tmp_path):
    untrained = tmp_path / "untrained"
    assert run_in_process(["train", "--config", PRESET, "--cache", str(tiny_cache), "--out", str(untrained),
                           "--max-steps", "1", "--lr", "1e-12", "--device", "cpu"]).exit_code == 0
    results = {}
    for name, run in (("trained", trained_run), ("untrained", untrained)):
        out = run_in_process(["eval", "--drafter", str(run), "--cache", str(tiny_cache), "--json", "--device", "cpu"])
        assert out.exit_code == 0, out.output
        results[name] = json.loads(out.stdout)
    held_out = json.loads((trained_run / "config.json").read_text())["holdout_shards"]
    assert results["trained"]["shards"] == held_out  # a run is evaluated on its held-out shards
    assert len(results["trained"]["per_slot"]) == 15
    assert results["trained"]["tau"] > results["untrained"]["tau"] + 0.05
    # an export evaluates like its run (bf16 weights: close, not equal)
    exported = tmp_path / "export"
    run_in_process(["export", str(trained_run), "--out", str(exported)])
    out = run_in_process(["eval", "--drafter", str(exported), "--cache", str(tiny_cache), "--json", "--device", "cpu",
                          "--shards", ",".join(map(str, held_out))])
    assert abs(json.loads(out.stdout)["tau"] - results["trained"]["tau"]) < 0.05


def test_init_from_starts_from_those_weights_and_refuses_another_shape(trained_run, tiny_cache, tmp_path):
    from dflash import checkpoint

    exported, tuned = tmp_path / "export", tmp_path / "tuned"
    assert run_in_process(["export", str(trained_run), "--out", str(exported)]).exit_code == 0
    base = ["train", "--config", PRESET, "--cache", str(tiny_cache), "--device", "cpu", "--max-steps", "1",
            "--lr", "1e-12", "--init-from", str(exported)]
    assert run_in_process([*base, "--out", str(tuned)]).exit_code == 0
    start = checkpoint.load_weights(checkpoint.latest(trained_run))
    after = checkpoint.load_weights(checkpoint.latest(tuned))
    assert set(after) == set(start)
    for name, w in after.items():  # the export is bf16: equal up to its rounding
        assert rel_err(w, start[name]) < 1e-2, name
    other = run_in_process([*base, "--out", str(tmp_path / "deeper"), "--num-layers", "3"])
    assert other.exit_code == 1 and "another drafter shape (num_layers 2 vs 3)" in other.output
    assert not (tmp_path / "deeper" / "checkpoints").exists()


def test_plot_draws_a_png(trained_run):
    out = run_in_process(["plot", str(trained_run)])
    assert out.exit_code == 0
    png = trained_run / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize("case,message", [
    ("layers", r"layers \[4\] are not in the cache"),
    ("block", r"--block-size 4096 does not fit shards of 1024 tokens"),
    ("anchors", r"--num-anchors 3000 is more than the 1024 positions"),
    ("mask", r"--mask-token-id 99999 is outside the target's vocabulary"),
    ("empty", r"no committed shard yet"),
    ("not_a_cache", r"not a dflash cache"),
])
def test_mismatches_fail_fast_with_one_line(tmp_path, tiny_cache, case, message):
    cache, opts = tiny_cache, []
    if case == "layers":
        opts = ["--layers", "1,4"]
    elif case == "block":
        opts = ["--block-size", "4096"]
    elif case == "anchors":
        opts = ["--num-anchors", "3000"]
    elif case == "mask":
        opts = ["--mask-token-id", "99999"]
    elif case == "empty":
        cache = tmp_path / "cache"
        shutil.copytree(tiny_cache, cache)
        shutil.rmtree(cache / "commits")
        (cache / "commits").mkdir()
    elif case == "not_a_cache":
        cache = tmp_path
    run = tmp_path / "run"
    out = run_in_process(["train", "--config", PRESET, "--cache", str(cache), "--out", str(run), "--device", "cpu",
                          "--max-steps", "2", *opts])
    assert out.exit_code == 1
    errors = [x for x in out.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 1
    import re
    assert re.search(message, errors[0]), errors[0]
    assert not (run / "checkpoints").exists()


def test_corrupt_shard_fails_naming_it_or_is_skipped(tmp_path, tiny_cache):
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    for record in sorted((cache / "commits").glob("*.json"))[12:]:  # a short epoch: the first 12 shards committed
        record.unlink()
    chunk = cache / "input_ids" / "c" / "5" / "0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    args = ["train", "--config", PRESET, "--cache", str(cache), "--device", "cpu", "--holdout-shards", "0",
            "--epochs", "1", "--save-every", "1000"]
    fail = run_in_process(args + ["--out", str(tmp_path / "a")])
    assert fail.exit_code == 1 and "shard 5 is corrupt" in fail.output
    skip = run_in_process(args + ["--out", str(tmp_path / "b"), "--on-corrupt", "skip"])
    assert skip.exit_code == 0 and "skipping shard 5" in skip.output
    shards = len(list((cache / "commits").glob("*.json")))
    latest = json.loads((tmp_path / "b" / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == shards - 1  # one shard fewer, and the run still ends with a checkpoint


@pytest.mark.slow
def test_torchrun_two_ranks_train_with_ddp(tmp_path, tiny_cache):
    run = tmp_path / "ddp"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dflash",
           "train", "--config", PRESET, "--cache", str(tiny_cache), "--out", str(run), "--device", "cpu",
           "--max-steps", "12", "--save-every", "6", "--log-every", "3", "--holdout-shards", "0"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = metrics(run)
    assert [m["step"] for m in lines] == [3, 6, 9, 12] and all(m["loss"] == m["loss"] for m in lines)
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 12


def test_follow_trains_on_shards_as_they_are_committed(tmp_path, tiny_cache):
    """10 shards are committed when a 20-step run starts; with --follow it waits for the rest."""
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    hidden = tmp_path / "later"
    hidden.mkdir()
    records = sorted((cache / "commits").glob("*.json"))
    for p in records[10:]:
        p.rename(hidden / p.name)
    args = ["train", "--config", PRESET, "--cache", str(cache), "--out", str(tmp_path / "run"), "--device", "cpu",
            "--epochs", "1", "--max-steps", "20", "--holdout-shards", "0", "--follow", "--log-every", "1"]
    proc = start_cli(args)
    time.sleep(8)
    assert proc.poll() is None, "with 10 of 20 steps' shards committed, the run cannot have finished"
    for p in hidden.iterdir():  # "the extract commits the rest"
        p.rename(cache / "commits" / p.name)
    assert proc.wait(timeout=600) == 0, proc.stderr.read()[-2000:]
    steps = [m["step"] for m in metrics(tmp_path / "run") if "loss" in m]
    assert steps == list(range(1, 21))


def test_eval_refuses_a_drafter_of_another_target(trained_run, tmp_path):
    from conftest import extract_args, sample_rows, write_jsonl
    from families import tiny_target

    target = tiny_target("qwen3_next", tmp_path / "other-target")  # hidden 64, not the tiny target's 256
    data = write_jsonl(tmp_path / "d.jsonl", sample_rows(4, 0))
    other = tmp_path / "other-cache"
    assert run_in_process(extract_args(data, other, target=target, layers="0,1,2")).exit_code == 0
    out = run_in_process(["eval", "--drafter", str(trained_run), "--cache", str(other), "--device", "cpu"])
    assert out.exit_code == 1 and "do not match the cache's target (hidden 64" in out.output


def _train_args(cache, run, *extra):
    return ["train", "--config", PRESET, "--cache", str(cache), "--out", str(run), "--device", "cpu",
            "--holdout-shards", "0", *extra]


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_keeps_the_last_checkpoint(tmp_path, tiny_cache,
                                                                                      monkeypatch):
    """A NaN injected into step 7's loss: the run stops at the next sync point (step 8's save) with one line
    naming step 7, saves nothing, and the checkpoint of step 4 stays the latest; the same command resumes."""
    import dflash.train as trainlib

    real, calls = trainlib.drafter_loss, []

    def nan_at_step_7(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 7:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(trainlib, "drafter_loss", nan_at_step_7)
    run = tmp_path / "run"
    result = run_in_process(_train_args(tiny_cache, run, "--max-steps", "10", "--save-every", "4", "--log-every", "5"))
    assert result.exit_code == 1
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: step 7: the loss (nan) or the gradient norm"), errors
    assert "its last good checkpoint, step-00000004, is intact" in errors[0]
    assert checkpoint.latest(run).name == "step-00000004"
    assert not list((run / "checkpoints").glob("*08"))
    assert all(torch.isfinite(w).all() for w in load_file(str(checkpoint.latest(run) / "model.safetensors")).values())
    lines = metrics(run)
    assert [m["step"] for m in lines] == [5] and math.isfinite(lines[0]["grad_norm"]) and lines[0]["grad_norm"] > 0
    monkeypatch.setattr(trainlib, "drafter_loss", real)
    again = run_in_process(_train_args(tiny_cache, run, "--max-steps", "10", "--save-every", "4", "--log-every", "5"))
    assert again.exit_code == 0 and "resuming" in again.output and checkpoint.latest(run).name == "step-00000010"


def test_a_full_disk_while_saving_keeps_the_last_checkpoint(tmp_path, tiny_cache, monkeypatch):
    """ENOSPC in the second checkpoint's first file: one line naming the run and the intact checkpoint;
    no partial folder is left, and the latest checkpoint is still the first."""
    from dflash import files

    real, calls = files.save_file, []

    def save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 4:  # a checkpoint is 3 safetensors files
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real(tensors, filename, metadata)

    monkeypatch.setattr(files, "save_file", save_file)
    run = tmp_path / "run"
    result = run_in_process(_train_args(tiny_cache, run, "--max-steps", "4", "--save-every", "2"))
    assert result.exit_code == 1
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 1
    assert errors[0] == (f"error: {run}: no space left on the device (writing {calls[3]}); its last good checkpoint, "
                         f"step-00000002, is intact; free some space and run the same command again: it resumes "
                         f"from there")
    assert checkpoint.latest(run).name == "step-00000002"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest.json", "step-00000002"]


# -- run folders and checkpoints that are damaged, shared or contended ------------------------------------

def test_a_rejected_option_writes_nothing(tmp_path, tiny_cache):
    run = tmp_path / "run"
    bad = run_in_process(_train_args(tiny_cache, run, "--lr", "-1", "--max-steps", "2"))
    assert bad.exit_code == 1 and bad.output.strip() == "error: --lr must be > 0, got -1.0" and not run.exists()
    assert run_in_process(_train_args(tiny_cache, run, "--max-steps", "2")).exit_code == 0  # the corrected command


def test_a_second_train_into_a_held_run_is_refused(tmp_path, tiny_cache):
    run = tmp_path / "run"
    first = start_cli(_train_args(tiny_cache, run, "--max-steps", "100000", "--save-every", "100000"))
    try:
        deadline = time.monotonic() + 120
        while not (run / ".lock").exists() or "pid" not in (run / ".lock").read_text():
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took the folder"
            time.sleep(0.2)
        second = run_in_process(_train_args(tiny_cache, run, "--max-steps", "100000", "--save-every", "100000"))
        assert second.exit_code == 1
        assert second.output.strip() == f"error: {run}: dflash (pid {first.pid}) is using this training run; wait " \
                                        f"for it to end or use another folder"
    finally:
        first.kill()
        first.wait()
    from dflash.files import held

    with held(run, "training run"):  # SIGKILL leaves no stuck lock: the folder can be taken again
        pass


def test_latest_json_never_leads_outside_the_run(tmp_path, tiny_cache):
    run = tmp_path / "run"
    assert run_in_process(_train_args(tiny_cache, run, "--max-steps", "4", "--save-every", "2")).exit_code == 0
    (run / "checkpoints" / "latest.json").write_text(json.dumps({"step": 99, "dir": "../../../../etc"}))
    assert checkpoint.latest(run) == run / "checkpoints" / "step-00000004"  # the newest complete folder instead
    again = run_in_process(_train_args(tiny_cache, run, "--max-steps", "4", "--save-every", "2"))
    assert again.exit_code == 0 and "already trained for 4 steps" in again.output


@pytest.mark.parametrize("damage", ["optimizer missing", "model cut short"])
def test_a_damaged_latest_checkpoint_resumes_from_the_one_before(tmp_path, tiny_cache, damage):
    run = tmp_path / "run"
    assert run_in_process(_train_args(tiny_cache, run, "--max-steps", "4", "--save-every", "2")).exit_code == 0
    newest = run / "checkpoints" / "step-00000004"
    if damage == "optimizer missing":
        (newest / "optimizer.safetensors").unlink()
    else:
        blob = (newest / "model.safetensors").read_bytes()
        (newest / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    again = run_in_process(_train_args(tiny_cache, run, "--max-steps", "4", "--save-every", "2"))
    assert again.exit_code == 0, again.output
    assert f"warning: checkpoint {newest}" in again.output and "resuming from the one before, step-00000002" \
        in again.output and f"resuming {run} from step 2" in again.output
    assert checkpoint.latest(run).name == "step-00000004"  # trained again from step 2 and saved


def test_export_refuses_non_finite_or_misshapen_weights_and_writes_nothing(tmp_path, trained_run):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    ckpt = checkpoint.latest(run)
    weights = load_file(str(ckpt / "model.safetensors"))
    for change, message in ((lambda w: w["norm.weight"].fill_(float("nan")), "norm.weight holds non-finite values"),
                            (lambda w: w.__setitem__("fc.weight", w["fc.weight"][:, :10].contiguous()),
                             r"fc.weight has shape \(256, 10\), this drafter's is \(256, 768\)")):
        broken = {k: v.clone() for k, v in weights.items()}
        change(broken)
        save_file(broken, str(ckpt / "model.safetensors"))
        out = run_in_process(["export", str(run), "--out", str(tmp_path / "export")])
        assert out.exit_code == 1 and out.output.count("\n") == 1, out.output
        assert re.search(message, out.output) and not (tmp_path / "export").exists()


def test_safetensors_files_follow_the_umask(tmp_path, trained_run, tiny_cache):
    """A teammate can read a shared cache, run and export: no file is 0600 while the umask allows more."""
    files = [*checkpoint.latest(trained_run).glob("*.safetensors"), tiny_cache / "target_weights.safetensors"]
    exported = tmp_path / "export"
    assert run_in_process(["export", str(trained_run), "--out", str(exported)]).exit_code == 0
    files.append(exported / "model.safetensors")
    umask = os.umask(0)
    os.umask(umask)
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f
