"""Failure paths of the training side: checkpoints with a tensor lr, a lost latest.json, a torn metrics
line, a loader closed while the loop holds its only buffer."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from dflash import checkpoint
from dflash.cache import Cache
from dflash.loader import ShardLoader
from dflash.metrics import truncate_metrics


def _model_and_optimizer(lr):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_checkpoint_round_trip_keeps_a_tensor_lr_a_tensor(tmp_path):
    """On GPU the lr is a tensor (changing it never recompiles): it is saved as a number and restored into
    the very tensor the resumed optimizer was built with."""
    model, opt = _model_and_optimizer(torch.tensor(0.01))
    opt.param_groups[0]["lr"].fill_(0.005)
    checkpoint.save(tmp_path, 7, model, opt, {})
    model2, opt2 = _model_and_optimizer(torch.tensor(0.01))
    lr_tensor = opt2.param_groups[0]["lr"]
    state = checkpoint.load(checkpoint.latest(tmp_path), model2, opt2)
    assert state["step"] == 7
    assert opt2.param_groups[0]["lr"] is lr_tensor and lr_tensor.item() == pytest.approx(0.005)
    assert torch.equal(model2.weight, model.weight)
    s1, s2 = opt.state_dict()["state"][0], opt2.state_dict()["state"][0]
    assert torch.equal(s1["exp_avg"], s2["exp_avg"]) and torch.equal(s1["exp_avg_sq"], s2["exp_avg_sq"])


def test_a_lost_latest_json_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    model, opt = _model_and_optimizer(0.01)
    for step in (4, 8):
        checkpoint.save(tmp_path, step, model, opt, {}, keep=3)
    (tmp_path / "checkpoints" / "latest.json").write_text('{"step": 8, "di')  # torn
    (tmp_path / "checkpoints" / "step-00000012").mkdir()  # an incomplete folder is never chosen
    assert checkpoint.latest(tmp_path).name == "step-00000008"


def test_truncate_metrics_drops_later_and_torn_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    truncate_metrics(path, 1)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1]


def test_loader_closes_while_the_loop_holds_its_only_buffer(tmp_path):
    from conftest import extract_args, run_in_process, sample_rows, write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", sample_rows(20, 0))
    assert run_in_process(extract_args(data, tmp_path / "c")).exit_code == 0
    cache = Cache(tmp_path / "c")
    loader = ShardLoader(cache, [0, 1, 0, 1], torch.device("cpu"), prefetch=1)
    it = iter(loader)
    shard, inputs = next(it)  # the loop holds the one buffer; the reader waits for it
    assert shard == 0 and inputs.input_ids.shape == (512,)
    done = threading.Event()
    threading.Thread(target=lambda: (loader.close(), done.set()), daemon=True).start()
    assert done.wait(10), "close() hung"
