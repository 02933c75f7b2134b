"""GPU checks of stage two (run on the H200; skipped without CUDA): the flex_attention step against the
naive reference (forward and backward), compiled against eager, and a compiled run that never
recompiles after its first step, from a bf16 cache and from an fp8 one."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, rel_err, run_in_process
from dflash.naive import naive_loss
from dflash.objective import drafter_loss
from test_objective import random_shard, tiny_drafter

pytestmark = pytest.mark.gpu


def _to(shard, device):
    return {k: v.to(device) for k, v in shard.items()}


def _grads(model):
    return {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss, window, causal", [("decay", None, False), ("dpace", 16, False), ("dpace", 24, True)])
@pytest.mark.parametrize("compiled", [False, True])
def test_flex_step_on_gpu_matches_the_naive_reference(compiled, loss, window, causal):
    """Forward and backward of the flex_attention step, eager and compiled, with each loss, a sliding
    window shorter than the documents and a causal block."""
    torch.backends.cuda.matmul.allow_tf32 = False
    fields = dict(sliding_window=window, causal_block=causal)
    model, shard = tiny_drafter(5, **fields), random_shard(5, T=128, doc_lens=(50, 40, 30))
    gpu_model = tiny_drafter(5, **fields).cuda()
    loss_fn = torch.compile(drafter_loss, dynamic=False) if compiled else drafter_loss
    kw = dict(gamma=4.0, loss=loss, dpace_alpha=0.5)
    out = loss_fn(gpu_model, **_to(shard, "cuda"), num_anchors=12, attention="flex", ce_chunk=16, **kw)
    out.loss.backward()
    ref, _, _ = naive_loss(model, **shard, anchors=out.anchors.cpu(), **kw)
    ref.backward()
    assert out.anchor_ok.sum() >= 8
    assert rel_err(out.loss.detach().cpu(), ref.detach()) < 1e-4
    fast, slow = _grads(gpu_model), _grads(model)
    for name in slow:
        assert rel_err(fast[name], slow[name]) < 1e-3, name


def test_bf16_autocast_step_is_close_to_fp32():
    model, shard = tiny_drafter(6).cuda(), _to(random_shard(6, T=128, doc_lens=(70, 50)), "cuda")
    anchors = torch.tensor([5, 10, 20, 40, 60, 75, 90, 100], device="cuda")
    full = drafter_loss(model, **shard, num_anchors=8, gamma=4.0, attention="flex", anchors=anchors)
    with torch.autocast("cuda", torch.bfloat16):
        half = drafter_loss(model, **shard, num_anchors=8, gamma=4.0, attention="flex", anchors=anchors)
    assert rel_err(half.loss.float(), full.loss) < 2e-2


def test_compiled_training_never_recompiles(tmp_path):
    """The tiny preset on the GPU, compiled (reduce-overhead): 12 steps, 0 recompiles after step 1."""
    cache = tmp_path / "cache"
    preset = str(REPO / "configs" / "tiny.toml")
    assert run_in_process(["extract", "--config", preset, "--out", str(cache), "--limit", "200"]).exit_code == 0
    run = tmp_path / "run"
    from dflash.config import TrainConfig, build_config
    from dflash.train import train

    cfg = build_config(TrainConfig, preset, "train", {"cache": str(cache), "out": str(run), "max_steps": 12,
                                                      "log_every": 4, "compile": "yes", "holdout_shards": 2})
    stats = train(cfg)
    assert stats["steps"] == 12 and stats["recompiles"] == 0 and stats["cudagraph_skips"] == 0
    assert train(cfg)["steps"] == 12  # loads the checkpoint (tensor lr) and finds nothing to do
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(line.get("recompiles", 0) == 0 for line in lines)
    assert all(line["loss"] == line["loss"] for line in lines if "loss" in line)  # no NaN


def test_cross_entropy_as_one_compile_region_trains_as_unrolled(tmp_path):
    """--compile-regions: the same 8 steps as the unrolled step (losses within bf16 noise), 0 recompiles,
    0 CUDA-graph skips."""
    cache = tmp_path / "cache"
    preset = str(REPO / "configs" / "tiny.toml")
    assert run_in_process(["extract", "--config", preset, "--out", str(cache), "--limit", "120"]).exit_code == 0
    from dflash.config import TrainConfig, build_config
    from dflash.train import train

    losses = {}
    for regions in (False, True):
        run = tmp_path / f"run-{regions}"
        cfg = build_config(TrainConfig, preset, "train", {"cache": str(cache), "out": str(run), "max_steps": 8,
                                                          "log_every": 2, "compile": "yes", "holdout_shards": 1,
                                                          "compile_regions": regions, "ce_chunk": 256})
        stats = train(cfg)
        assert stats["recompiles"] == 0 and stats["cudagraph_skips"] == 0, stats
        losses[regions] = torch.tensor([json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()
                                        if '"loss"' in x])
        torch._dynamo.reset()
    assert rel_err(losses[True], losses[False]) < 1e-2, losses


def test_fp8_quantisation_on_the_gpu_gives_the_cpu_bytes_and_compiled_dequantisation_the_eager_values():
    """Extraction quantises on the GPU, `cache convert` (by default) on the CPU: the same bytes. The step
    dequantises inside the compiled graph: the same values as eagerly."""
    from dflash import fp8

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(512, 4096, generator=g) * torch.exp(torch.randn(512, 1, generator=g))).to(torch.bfloat16)
    x[:4, 11] = 3e4
    x[100:] = 0
    for block in (128, 4096):
        q, s = fp8.quantize(x, block)
        qg, sg = fp8.quantize(x.cuda(), block)
        assert torch.equal(qg.cpu(), q) and torch.equal(sg.cpu(), s)
        eager = fp8.dequantize(qg.view(torch.float8_e4m3fn), sg, block, torch.bfloat16)
        compiled = torch.compile(fp8.dequantize, dynamic=False)(qg.view(torch.float8_e4m3fn), sg, block, torch.bfloat16)
        assert torch.equal(compiled, eager) and not eager[100:].any()


def test_compiled_training_on_an_fp8_cache_never_recompiles(tmp_path):
    """The tiny preset converted to fp8: the dequantisation runs inside the compiled step, 0 recompiles,
    0 CUDA-graph skips, and the loss follows the bf16 run's."""
    from dflash.config import TrainConfig, build_config
    from dflash.convert import convert
    from dflash.train import train

    preset = str(REPO / "configs" / "tiny.toml")
    cache, cache8 = tmp_path / "cache", tmp_path / "cache8"
    assert run_in_process(["extract", "--config", preset, "--out", str(cache), "--limit", "200"]).exit_code == 0
    convert(cache, cache8, device="cuda")
    losses = {}
    for name, c in (("bf16", cache), ("fp8", cache8)):
        run = tmp_path / f"run-{name}"
        cfg = build_config(TrainConfig, preset, "train", {"cache": str(c), "out": str(run), "max_steps": 12,
                                                          "log_every": 4, "compile": "yes", "holdout_shards": 2})
        stats = train(cfg)
        assert stats["steps"] == 12 and stats["recompiles"] == 0 and stats["cudagraph_skips"] == 0, name
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [x["loss"] for x in lines if "loss" in x]
        assert [x["tau"] for x in lines if "tau" in x], "training-time eval ran"
    for a, b in zip(losses["fp8"], losses["bf16"]):
        assert abs(a - b) / b < 2e-2
