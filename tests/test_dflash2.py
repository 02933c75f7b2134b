"""DFlash2 (`--arch dflash2`): its convolutions, selector and objective against the naive reference (loss and
gradients, eager and compiled), the convolution's block boundary and identity start, the label put among the
candidates, the greedy walk, the export read back and served as trained, and `dflash train --arch dflash2` through
export, eval and a lossless `dflash spec`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, SAMPLE_CHAT, TINY_TARGET, rel_err, run_in_process, write_jsonl
from dflash.config import DrafterConfig, TrainConfig, build_config
from dflash.dflash2 import BlockConv, DFlash2, training_candidates
from dflash.drafter import build_drafter
from dflash.drafter_io import check_servable, from_hf, read_drafter, to_zlab
from dflash.errors import DflashError
from dflash.naive import naive_loss, plain_conv, selector_terms
from dflash.objective import drafter_loss
from test_drafter_io import QWEN3_8B, vllm_reads, zlab_reads
from test_objective import H, V, grads, random_shard, tiny_config

PRESET = str(REPO / "configs" / "tiny.toml")


def dflash2_config(**fields) -> DrafterConfig:
    """tiny_config's drafter (hidden 64, vocabulary 300) as DFlash2: 8 groups of 8 channels, rank 12, top 6."""
    return tiny_config(**{"arch": "dflash2", "conv_group_size": 8, "selector_rank": 12, "selector_top_k": 6,
                          **fields})


def dflash2_drafter(seed: int = 0, **fields) -> DFlash2:
    """Random weights everywhere: convolutions far from the identity, a selector that moves the scores."""
    g = torch.Generator().manual_seed(seed)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.2
    model = build_drafter(dflash2_config(**fields), embed, head)
    model.reset_parameters(std=0.1, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_conv." in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
            elif "codebook" in name:
                p.mul_(10)
    return model


# -- the objective against the naive reference ----------------------------------------------------------------

CASES = {  # name -> (drafter fields, objective options)
    "decay, target labels": ({}, dict(loss="decay", labels_from="target")),
    "dpace, data labels": ({}, dict(loss="dpace", labels_from="data")),
    "K=3, B=4, window": ({"conv_kernel_size": 3, "block_size": 4, "sliding_window": 6}, dict(loss="dpace")),
    "K=1, causal block": ({"conv_kernel_size": 1, "causal_block": True}, dict(loss="decay")),
    "top-1, group 64, alpha 0": ({"selector_top_k": 1, "conv_group_size": 64}, dict(loss="dpace", selector_alpha=0.0)),
    "B=16, window = B": ({"block_size": 16, "sliding_window": 16}, dict(loss="dpace", selector_alpha=2.5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fast_loss_and_gradients_match_the_naive_reference(case):
    fields, options = CASES[case]
    seed = len(case)
    model, shard = dflash2_drafter(seed, **fields), random_shard(seed)
    kw = dict(gamma=3.0, dpace_alpha=0.3, **options)
    out = drafter_loss(model, **shard, num_anchors=10, ce_chunk=7, generator=torch.Generator().manual_seed(seed), **kw)
    out.loss.backward()
    fast = grads(model)
    model.zero_grad()
    ref, correct, count = naive_loss(model, **shard, anchors=out.anchors, **kw)
    ref.backward()
    slow = grads(model)
    assert out.anchor_ok.sum() >= 8
    assert rel_err(out.loss.detach(), ref.detach()) < 1e-5
    for name in fast:
        if options.get("selector_alpha") == 0.0 and name.startswith("candidate_selector."):
            assert not slow[name].any() and not fast[name].any(), name  # alpha 0: the selector learns nothing
            continue
        assert rel_err(fast[name], slow[name]) < 1e-4, name
    assert torch.equal(out.slot_correct, correct) and torch.equal(out.slot_count, count)


def test_the_compiled_step_matches_the_naive_reference_and_never_recompiles():
    """Traced whole (top-K, the label put among the candidates, the walk: fixed shapes, no host sync), the step
    gives the naive loss and gradients, and another shard of the same shapes reuses its graphs."""
    from dflash.metrics import compiled_graphs

    model = dflash2_drafter(7)
    model.cache_rope(96 + 8)
    torch._dynamo.reset()
    step = torch.compile(lambda shard, anchors: drafter_loss(model, **shard, num_anchors=8, gamma=3.0, loss="dpace",
                                                             ce_chunk=32, ce_region=True, anchors=anchors),
                         backend="aot_eager")
    graphs = []
    for seed in (7, 8):
        shard, anchors = random_shard(seed), torch.tensor([1, 5, 12, 33, 40, 57, 61, 70]) + seed - 7
        model.zero_grad(set_to_none=True)
        out = step(shard, anchors)
        out.loss.backward()
        got = grads(model)
        graphs.append(compiled_graphs())
        model.zero_grad()
        ref, correct, _ = naive_loss(model, **shard, anchors=anchors, gamma=3.0, loss="dpace")
        ref.backward()
        want = grads(model)
        assert rel_err(out.loss.detach(), ref.detach()) < 1e-5 and torch.equal(out.slot_correct, correct)
        assert all(rel_err(got[n], want[n]) < 1e-4 for n in want)
    assert graphs[0] >= 1 and graphs[1] == graphs[0], graphs
    torch._dynamo.reset()


# -- the parts ------------------------------------------------------------------------------------------------


def test_the_convolution_is_the_plain_formula_and_stops_at_the_block_start():
    """Each output token takes taps o < K of the tokens o slots back in its own block only: a block's output never
    depends on another block, nor slot t on slots after t or more than K - 1 before it."""
    cfg = dflash2_config(block_size=5, conv_kernel_size=3)
    conv = BlockConv(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(3 * 5, H, generator=g, requires_grad=True)  # 3 blocks of 5
    y, late = conv.prepare(x)
    out = conv.finish(y, late)
    projected = x @ conv.kernel_projection.weight.t()
    for b in range(3):
        rows = slice(5 * b, 5 * b + 5)
        side0 = plain_conv(x[rows], conv.base_kernel, projected[rows], 0, 8)
        assert rel_err(y[rows], side0) < 1e-6
        assert rel_err(out[rows], plain_conv(y[rows], conv.base_kernel, projected[rows], 1, 8)) < 1e-6
    # which inputs each output reads (side 0, a fixed projection: the taps alone)
    reads = torch.zeros(15, 15, dtype=torch.bool)
    taps = conv.kernel_projection(x.detach()).unflatten(-1, (2, 3, 8))[:, 0]  # fixed: the inputs' path alone
    for t in range(15):
        (grad,) = torch.autograd.grad(conv.convolve(x, taps, 0)[t].sum(), x)
        reads[t] = grad.abs().sum(1) > 0
    slot = torch.arange(15) % 5
    want = (torch.arange(15)[None, :] <= torch.arange(15)[:, None]) & \
        (torch.arange(15)[:, None] - torch.arange(15)[None, :] <= torch.minimum(slot, torch.tensor(2))[:, None])
    assert torch.equal(reads, want)


def test_dflash2_starts_as_dflash():
    """At initialisation the convolutions are the identity and the backbone is DFlash's of the same seed: the same
    unary logits, and with the selector's loss weighted 0, the same loss and backbone gradients."""
    cfg = dflash2_config()
    g = torch.Generator().manual_seed(3)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.2
    two = build_drafter(cfg, embed, head)
    one = build_drafter(dataclasses.replace(cfg, arch="dflash"), embed, head)
    for model in (one, two):
        model.reset_parameters(std=0.1, seed=3)
    conv = two.layers[0].mlp_conv
    assert torch.equal(conv.base_kernel[:, 0], torch.ones(2, H)) and not conv.base_kernel[:, 1].any()
    assert not conv.kernel_projection.weight.any() and two.candidate_selector.successor_codebook.std() > 0.05
    shard, anchors = random_shard(3), torch.tensor([1, 5, 12, 33, 40, 57, 61, 70])
    outs = [drafter_loss(m, **shard, num_anchors=8, gamma=3.0, anchors=anchors, selector_alpha=0.0) for m in (one, two)]
    for out in outs:
        out.loss.backward()
    assert rel_err(outs[1].loss.detach(), outs[0].loss.detach()) < 1e-6
    a, b = grads(one), grads(two)
    assert all(rel_err(b[n], a[n]) < 1e-5 for n in a)
    with torch.no_grad():
        states = [m(m.context(shard["hidden"]), torch.arange(96), torch.tensor([5] + [V - 1] * 7), torch.arange(40, 48),
                    lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
                  for m in (one, two)]
    assert rel_err(states[1] @ head.t(), states[0] @ head.t()) < 1e-6


def test_the_label_takes_the_last_candidate_when_it_is_missing():
    cand = torch.tensor([[4, 9, 2, 7], [4, 9, 2, 7], [1, 2, 3, 5]])
    labels = torch.tensor([2, 8, 5])
    got, gold = training_candidates(cand, labels)
    assert got.tolist() == [[4, 9, 2, 7], [4, 9, 2, 8], [1, 2, 3, 5]] and gold.tolist() == [2, 3, 3]


def test_the_walk_is_the_plain_greedy_walk_and_the_selector_changes_drafts():
    """propose = each slot's argmax of unary + pair score over its top-K, the predecessor being the anchor, then the
    candidate chosen before (the naive walk); the selector changes some of the unary argmax's drafts."""
    model = dflash2_drafter(11, block_size=8)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(20, 7, H, generator=g)  # 20 blocks, slots 1..7
    anchors = torch.randint(0, V, (20,), generator=g)
    with torch.no_grad():
        drafts = model.propose(h, anchors)
        logits = h @ model.head_weight.t()
        for n in range(20):
            block = torch.cat([torch.zeros(1, V), logits[n]])  # slot 0 (the anchor) drafts nothing
            _, plain = selector_terms(model, block, torch.cat([torch.zeros(1, H), h[n]]), [int(anchors[n])] * 7,
                                      [None] * 7)
            assert drafts[n].tolist() == plain, n
    assert (drafts != logits.argmax(-1)).float().mean() > 0.2


# -- config, export, the servers' reading ----------------------------------------------------------------------

DFLASH2_8B = dataclasses.replace(QWEN3_8B, arch="dflash2", sliding_window=2048)  # the released drafters' window


@pytest.mark.parametrize("fields, message", [
    ({"conv_group_size": 48}, "--conv-group-size 48 does not divide the hidden size 4096"),
    ({"selector_top_k": 200_000}, "--selector-top-k 200000 is more than the vocabulary"),
    ({"conv_kernel_size": 17}, "--conv-kernel-size 17 is longer than the block"),
    ({"selector_rank": 0}, "--selector-rank must be >= 1"),
])
def test_bad_dflash2_fields_are_refused_naming_the_option(fields, message):
    with pytest.raises(DflashError, match=message):
        dataclasses.replace(DFLASH2_8B, **fields)


def test_a_dflash_drafter_is_not_held_to_dflash2_rules():
    cfg = dataclasses.replace(QWEN3_8B, conv_group_size=48, selector_top_k=200_000)  # unused by DFlash
    assert cfg.arch == "dflash" and cfg.conv_group_size == 48


def test_the_options_are_on_the_train_command():
    out = run_in_process(["train", "--help"])
    for option in ("--arch [dflash|dflash2]", "--conv-kernel-size", "--conv-group-size", "--selector-rank",
                   "--selector-top-k", "--selector-loss-alpha"):
        assert option in out.output, option
    with pytest.raises(DflashError, match="--selector-loss-alpha must be >= 0"):
        build_config(TrainConfig, None, "train", {"cache": "c", "out": "o", "selector_loss_alpha": -1.0})


@pytest.mark.parametrize("window, causal", [(None, False), (2048, False), (2048, True), (None, True)])
def test_the_export_says_what_the_servers_need_and_reads_back(window, causal):
    """architectures DFlash2DraftModel, the four keys vLLM indexes in dflash_config, is_causal always (a sliding
    layer would be served causally without it); z-lab's and vLLM's readers attend as trained; from_hf reads it
    back; the speculators layout is refused."""
    cfg = dataclasses.replace(DFLASH2_8B, sliding_window=window, causal_block=causal)
    check_servable(cfg, "zlab", 36)
    hf = json.loads(json.dumps(to_zlab(cfg, 36)))
    assert hf["architectures"] == ["DFlash2DraftModel"] and hf["is_causal"] is causal
    assert hf["dflash_config"] == {"block_size": 16, "mask_token_id": cfg.mask_token_id,
                                   "target_layer_ids": cfg.target_layer_ids, "conv_kernel_size": 2,
                                   "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
    trained = [(window, causal)] * cfg.num_layers
    assert vllm_reads(hf)["layers"] == trained and zlab_reads(hf)["layers"] == trained
    assert from_hf(hf) == cfg
    with pytest.raises(DflashError, match="--format speculators: vLLM serves a DFlash2 drafter from the zlab"):
        check_servable(cfg, "speculators", 36)
    for key in ("selector_top_k", "conv_group_size"):
        with pytest.raises(DflashError, match=f"a DFlash2DraftModel without dflash_config.{key}"):
            from_hf({**hf, "dflash_config": {k: v for k, v in hf["dflash_config"].items() if k != key}})


def test_a_released_config_with_a_logit_scale_is_refused():
    hf = to_zlab(DFLASH2_8B, 36)
    with pytest.raises(DflashError, match=r"x: dflash_config.output_multiplier 0.196: dflash's drafters apply none"):
        from_hf({**hf, "dflash_config": {**hf["dflash_config"], "output_multiplier": 0.196}}, "x")
    assert from_hf({**hf, "dflash_config": {**hf["dflash_config"], "final_logit_softcapping": 0}}) == DFLASH2_8B


def test_the_memory_plan_counts_dflash2s_parameters():
    from dflash.memory import trainable_parameters

    cfg = dflash2_config(conv_kernel_size=3, selector_rank=20)
    model = build_drafter(cfg, torch.zeros(V, H), torch.zeros(V, H))
    P, largest = trainable_parameters(cfg)
    assert P == sum(p.numel() for p in model.parameters()) and largest == max(p.numel() for p in model.parameters())


# -- end to end ------------------------------------------------------------------------------------------------


def train_args(cache: Path, run: Path, *extra) -> list[str]:
    return ["train", "--config", PRESET, "--cache", str(cache), "--out", str(run), "--device", "cpu", "--arch",
            "dflash2", "--selector-rank", "32", "--selector-top-k", "8", "--holdout-shards", "1", "--log-every", "1",
            *extra]


def test_train_export_eval_and_a_lossless_spec(tmp_path, small_cache):
    """`dflash train --arch dflash2` (eager), its export in the layout vLLM loads, read back as the run's drafter,
    evaluated offline and decoded losslessly; `--init-from` the export starts a run from its weights."""
    run, export = tmp_path / "run", tmp_path / "export"
    out = run_in_process(train_args(small_cache, run, "--max-steps", "3"))
    assert out.exit_code == 0, out.output
    assert "note: this drafter exports to zlab only: --format speculators" in out.output
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["loss"] > 0 for x in lines if "loss" in x] == [True] * 3 and any("tau" in x for x in lines)
    assert run_in_process(["export", str(run), "--out", str(export)]).exit_code == 0
    refused = run_in_process(["export", str(run), "--out", str(tmp_path / "s"), "--format", "speculators"])
    assert refused.exit_code == 1 and "--format speculators: vLLM serves a DFlash2 drafter" in refused.output
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    from safetensors.torch import load_file

    names = load_file(export / "model.safetensors")
    assert names["candidate_selector.predecessor_codebook"].shape == (4096, 32)
    assert names["layers.1.attention_conv.kernel_projection.weight"].shape == (2 * 2 * 256 // 16, 256)
    assert names["layers.0.mlp_conv.base_kernel"].shape == (2, 2, 256)
    assert names["candidate_selector.hidden_projection.weight"].shape == (32, 256)
    from_run, from_export = read_drafter(run), read_drafter(export)
    assert from_run[0] == from_export[0] and from_export[0].arch == "dflash2"
    assert set(from_run[1]) == set(from_export[1])
    r = run_in_process(["eval", "--drafter", str(export), "--cache", str(small_cache), "--json", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tau"] >= 1.0
    rows = [json.loads(x) for x in SAMPLE_CHAT.read_text().splitlines()[-2:]]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": r["messages"][:-1]} for r in rows])
    r = run_in_process(["spec", "--target", str(TINY_TARGET), "--drafter", str(export), "--prompts", str(prompts),
                        "--max-new-tokens", "16", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["lossless"] is True and result["prompts"] == 2 and result["tau"] >= 1.0
    tuned = tmp_path / "tuned"
    assert run_in_process(train_args(small_cache, tuned, "--max-steps", "1", "--lr", "1e-12", "--init-from",
                                     str(export))).exit_code == 0
    from dflash import checkpoint

    start, after = checkpoint.load_weights(checkpoint.latest(run)), checkpoint.load_weights(checkpoint.latest(tuned))
    assert all(rel_err(after[n], start[n]) < 1e-2 for n in start)


# -- on the GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_flex_step_on_gpu_matches_the_naive_reference(compiled):
    torch.backends.cuda.matmul.allow_tf32 = False
    model, shard = dflash2_drafter(5, sliding_window=16), random_shard(5, T=128, doc_lens=(50, 40, 30))
    gpu_model = dflash2_drafter(5, sliding_window=16).cuda()
    loss_fn = torch.compile(drafter_loss, dynamic=False) if compiled else drafter_loss
    kw = dict(gamma=4.0, loss="dpace", dpace_alpha=0.5)
    out = loss_fn(gpu_model, **{k: v.cuda() for k, v in shard.items()}, num_anchors=12, attention="flex", ce_chunk=16,
                  **kw)
    out.loss.backward()
    ref, correct, _ = naive_loss(model, **shard, anchors=out.anchors.cpu(), **kw)
    ref.backward()
    assert out.anchor_ok.sum() >= 8
    assert rel_err(out.loss.detach().cpu(), ref.detach()) < 1e-4
    fast = {n: p.grad.float().cpu() for n, p in gpu_model.named_parameters()}
    for name, p in model.named_parameters():
        assert rel_err(fast[name], p.grad) < 1e-3, name


@pytest.mark.gpu
def test_compiled_training_on_gpu_never_recompiles_and_follows_the_eager_losses(tmp_path):
    """The tiny preset as DFlash2, compiled (reduce-overhead: CUDA graphs): 0 recompiles after step 1, no CUDA-graph
    skip, and the losses of the uncompiled step within bf16 noise."""
    cache = tmp_path / "cache"
    assert run_in_process(["extract", "--config", PRESET, "--out", str(cache), "--limit", "120"]).exit_code == 0
    from dflash.train import train

    losses = {}
    for compile in ("no", "yes"):
        run = tmp_path / f"run-{compile}"
        cfg = build_config(TrainConfig, PRESET, "train", {"cache": str(cache), "out": str(run), "max_steps": 8,
                                                          "log_every": 2, "compile": compile, "holdout_shards": 1,
                                                          "arch": "dflash2"})
        stats = train(cfg)
        if compile == "yes":
            assert stats["recompiles"] == 0 and stats["cudagraph_skips"] == 0, stats
        losses[compile] = torch.tensor([json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()
                                        if '"loss"' in x])
    assert rel_err(losses["yes"], losses["no"]) < 2e-2, losses
