"""The step's memory: the plan made before compiling (its parts, how it moves with the shape and the options,
the one-line refusal, the big drafters of 2026's targets), an out-of-memory said in one line, the leaner optimizer state
(bf16 moments: the update, its rounding, checkpoints and resumption, its compiled kernel) and the compiled step
with the memory options (0 recompiles, the eager step's losses)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, rel_err, run_in_process
from dflash import checkpoint, memory
from dflash.config import DrafterConfig, TrainConfig, build_config
from dflash.drafter import Drafter, drafter_class
from dflash.errors import DflashError
from dflash.memory import (
    HEADROOM,
    BF16AdamW,
    StepShape,
    adamw_bf16_step,
    is_out_of_memory,
    options_that_fit,
    plan,
    refusal,
    round_stochastic,
    tight,
    trainable_parameters,
)
from dflash.objective import ce_rows

PRESET = str(REPO / "configs" / "tiny.toml")
GB = 1e9


def drafter(H=4096, heads=32, kv=8, head_dim=128, mlp=12288, vocab=151936, layers=5, captured=5) -> DrafterConfig:
    return DrafterConfig(num_layers=layers, hidden_size=H, num_attention_heads=heads, num_key_value_heads=kv,
                         head_dim=head_dim, intermediate_size=mlp, vocab_size=vocab, block_size=16, mask_token_id=1,
                         rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960,
                         target_layer_ids=list(range(1, captured + 1)))


QWEN3_8B = drafter()
GLM5 = drafter(H=6144, heads=48, kv=8, head_dim=128, mlp=18432, vocab=154880)
QWEN35_27B = drafter(H=5120, heads=24, kv=4, head_dim=256, mlp=17408, vocab=248320)


def shape(d=QWEN3_8B, T=12288, A=2048, **kw) -> StepShape:
    return StepShape(drafter=d, T=T, A=A, D=8, ce_chunk=kw.pop("ce_chunk", ce_rows(d.vocab_size)), **kw)


# -- the plan ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [drafter(H=64, heads=4, kv=2, head_dim=16, mlp=96, vocab=300, layers=2, captured=2),
                               drafter(H=96, heads=6, kv=6, head_dim=8, mlp=200, vocab=50, layers=3, captured=4)])
def test_the_plan_counts_the_drafters_trained_parameters(d):
    model = Drafter(d, torch.zeros(d.vocab_size, d.hidden_size), torch.zeros(d.vocab_size, d.hidden_size))
    P, largest = trainable_parameters(d)
    assert P == sum(p.numel() for p in model.parameters())
    assert largest == max(p.numel() for p in model.parameters())


def test_the_plans_parts_sum_to_its_peak_and_move_with_the_shape_and_the_options():
    base = plan(shape())
    assert base.peak == sum(base.parts.values()) and base.at == "the end of the forward"
    P, _ = trainable_parameters(QWEN3_8B)
    assert base.parts["weights and optimizer state"] == 12 * P  # fp32 weights and two fp32 moments
    assert plan(shape(optimizer_state="bf16")).parts["weights and optimizer state"] == 8 * P
    assert plan(shape(world=2)).parts["weights and optimizer state"] == 16 * P  # + DDP's gradient buckets
    for bigger in (shape(A=4096), shape(T=24576), shape(ce_chunk=4096), shape(regions=False)):
        assert plan(bigger).peak > base.peak
    budgets = [plan(shape(budget=b)).peak for b in (1.0, 0.8, 0.5, 0.2)]
    assert budgets == sorted(budgets, reverse=True) and len(set(budgets)) == 4
    assert plan(shape(budget=0.5, compiled=False)).peak == base.peak  # an uncompiled step has no budget
    kept = [plan(shape(recompute=r)).parts["activations"] for r in ("none", "attention", "mlp", "layers")]
    assert kept == sorted(kept, reverse=True) and len(set(kept)) == 4
    layers = plan(shape(recompute="layers"))
    assert layers.at == "the backward" and layers.parts["recomputed in the backward"] > 0
    fp8 = plan(shape(scale_block=128))
    assert fp8.parts["input buffers"] < 0.6 * base.parts["input buffers"]
    tiny_step = plan(shape(T=256, A=4))  # almost no activations: the optimizer step, with the gradients, is the peak
    assert tiny_step.at == "the optimizer step" and tiny_step.parts["gradients"] == 4 * P
    lean = plan(shape(T=256, A=4, optimizer_state="bf16"))
    assert lean.parts["optimizer scratch"] == 16 * trainable_parameters(QWEN3_8B)[1]


# peaks `torch.cuda.max_memory_allocated` measured on an H200 by bench/train.py (bench/RESULTS.md; the GLM-5- and
# Qwen3.5-27B-sized drafters' measured again, the same to 0.1 GB, on 2026-12-07):
# drafter, T, anchors, cross-entropy rows (None: the default), region, GB
MEASURED = [(QWEN3_8B, 12288, 2048, None, True, 44.3), (QWEN3_8B, 3072, 512, None, True, 25.2),
            (QWEN3_8B, 12288, 2048, 1024, True, 43.4), (QWEN3_8B, 12288, 2048, 4096, True, 46.1),
            (QWEN3_8B, 12288, 2048, 1024, False, 48.0), (QWEN3_8B, 3072, 512, 1024, True, 24.3),
            (QWEN3_8B, 3072, 512, 1024, False, 27.1), (GLM5, 8192, 1024, None, True, 57.1),
            (GLM5, 49152, 4096, None, True, 118.7), (QWEN35_27B, 12288, 2048, None, True, 66.5)]


@pytest.mark.parametrize("d,T,A,chunk,regions,peak", MEASURED)
def test_the_plan_is_within_5_percent_of_the_peaks_measured_on_an_h200(d, T, A, chunk, regions, peak):
    estimate = plan(shape(d, T, A, ce_chunk=chunk or ce_rows(d.vocab_size), regions=regions)).peak / GB
    assert abs(estimate - peak) / peak < 0.05, (estimate, peak)


# peaks measured by bench/train.py with the memory options (bench/RESULTS.md, 2026-12-06 and -07), on an H100 but
# the last (GLM-5-sized at 8192 anchors, on an H200): drafter, T, anchors, --recompute, --optimizer-state, GB
MEASURED_OPTIONS = [(QWEN3_8B, 12288, 2048, "mlp", "fp32", 32.3), (QWEN3_8B, 12288, 2048, "none", "bf16", 40.1),
                    (QWEN3_8B, 12288, 2048, "mlp", "bf16", 28.1), (QWEN3_8B, 12288, 2048, "layers", "fp32", 28.6),
                    (QWEN3_8B, 12288, 2048, "attention", "fp32", 37.3), (GLM5, 49152, 5376, "layers", "bf16", 72.4),
                    (GLM5, 49152, 8192, "mlp", "fp32", 129.9)]


@pytest.mark.parametrize("d,T,A,recompute,state,peak", MEASURED_OPTIONS)
def test_the_plan_is_within_5_percent_of_the_peaks_measured_with_the_memory_options(d, T, A, recompute, state, peak):
    estimate = plan(shape(d, T, A, recompute=recompute, optimizer_state=state)).peak / GB
    assert abs(estimate - peak) / peak < 0.05, (estimate, peak)


def test_the_plan_counts_what_the_h100s_out_of_memory_needed():
    """The GLM-5-sized step at 8192 anchors with whole layers recomputed and bf16 moments ran out of memory on an
    H100 after a peak of 74.8 GB, asking for 4.50 GiB more: the plan says it needs at least that, so it refuses
    the run on that card's 84.2 GB free instead of letting it fail after a compile."""
    s = shape(GLM5, 49152, 8192, recompute="layers", optimizer_state="bf16")
    assert plan(s).peak > 74.8 * GB + 4.5 * 2**30
    assert refusal(s, plan(s), int(84.2 * GB), "cuda:0") is not None


def test_the_plan_under_an_activation_budget_is_what_an_h100_measured():
    """The budget's one GPU measure (bench/RESULTS.md, 2026-12-06), the point `memory.BUDGET_FLOOR` is fitted to:
    at 0.5 the Qwen3-8B step peaked at 39.2 GB, where a plan taking the budget as the kept share said 30.8."""
    estimate = plan(shape(budget=0.5)).peak / GB
    assert abs(estimate - 39.2) / 39.2 < 0.05, estimate


@pytest.mark.parametrize("d,T,A", [(GLM5, 8192, 1024), (GLM5, 49152, 4096), (GLM5, 49152, 8192),
                                   (QWEN35_27B, 12288, 2048), (QWEN3_8B, 12288, 2048)])
def test_the_big_drafters_are_planned_and_what_fits_an_h200_is_named(d, T, A):
    """Arithmetic only, nothing allocated: the GLM-5-sized drafter at 8192 anchors of 49,152 tokens does not fit
    an H200's ~139.5 GB as it is, and every option the plan names for it does, with HEADROOM to spare."""
    s = shape(d, T, A)
    p = plan(s)
    h200 = int(139.5 * GB)
    assert (p.peak > h200) == (A == 8192)
    line = refusal(s, p, h200, "cuda:0")
    if A != 8192:
        assert line is None
        return
    assert line.startswith(f"the training step needs ~{p.peak / GB:.1f} GB at the end of the forward (weights and "
                           f"optimizer state 27.9 GB, frozen target weights 3.9 GB, input buffers 6.0 GB, ")
    # no activation budget fits it: the partitioner keeps more than the budget's share (the H100's measure)
    assert "but cuda:0 has 139.5 GB free: it fits with --recompute mlp (~" in line
    assert line.endswith("(--no-memory-check tries anyway)") and "\n" not in line
    options = line.split(": it fits with ")[1].split(", or ")
    assert len(options) == 2 and options[0].startswith("--recompute mlp") and "--num-anchors" in options[1]
    for changed in ({"recompute": "mlp"}, {"A": int(options[1].split()[1])}):
        assert plan(dataclasses.replace(s, **changed)).peak <= (1 - HEADROOM) * h200


def test_dflash2s_own_activations_are_what_its_compiled_step_keeps_beyond_dflashs():
    """The plan's count of what DFlash2 adds (its convolutions' and selector's activations) is what the partitioner
    keeps for the backward of the compiled bf16 step beyond DFlash's at the same shape: within 10 %, so neither the
    head rows gathered for the candidates [R, K, H] nor shifted copies of the convolutions' inputs are kept."""
    from dflash.drafter import build_drafter

    T, A = 768, 32
    kept, cfgs = {}, {}
    for arch in ("dflash", "dflash2"):
        d = dataclasses.replace(drafter(H=128, heads=4, kv=1, head_dim=32, mlp=384, vocab=2048, layers=2, captured=3),
                                arch=arch, selector_top_k=16, selector_rank=32, conv_group_size=16)
        # the weights' bf16 copies are the plan's 2 P, not the architecture's own part
        weights = {tuple(p.shape) for p in build_drafter(d, *(torch.zeros(2048, 128) for _ in range(2))).parameters()}
        kept[arch] = sum(k.nbytes for k in memory.kept_by_training_step(d, T, A)
                         if not k.is_input and k.shape not in weights)
        cfgs[arch] = d
    own = drafter_class(cfgs["dflash2"]).own_activations(cfgs["dflash2"], A, "none")
    assert rel_err(torch.tensor(float(kept["dflash2"] - kept["dflash"])), torch.tensor(float(own))) < 0.1, (kept, own)


def test_options_that_fit_combine_with_the_leaner_optimizer_state_when_none_fits_alone():
    s = shape(GLM5, 49152, 8192)
    fewest = plan(dataclasses.replace(s, A=16)).peak  # the least any single option reaches
    limit = (fewest + plan(dataclasses.replace(s, A=16, optimizer_state="bf16")).peak) // 2
    options = options_that_fit(s, limit)
    assert len(options) == 1 and options[0].startswith("--optimizer-state bf16 --num-anchors "), options
    assert options_that_fit(s, 10**9) == []  # 1 GB: nothing fits
    uncompiled = options_that_fit(dataclasses.replace(s, compiled=False), int(139.5 * GB))
    assert not any("budget" in o for o in uncompiled)


def test_an_out_of_memory_is_recognised_inside_other_errors():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    try:
        try:
            raise RuntimeError("CUDA error: out of memory")
        except RuntimeError as e:
            raise ValueError("compiling the step failed") from e
    except ValueError as e:
        assert is_out_of_memory(e)
    assert not is_out_of_memory(RuntimeError("out of resource: shared memory"))
    try:  # torch's figures are read from inside the wrapping error too
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total "
                                         "capacity of 79.19 GiB of which 301.06 MiB is free.")
        except torch.OutOfMemoryError as e:
            raise RuntimeError("compiling the step failed") from e
    except RuntimeError as e:
        assert memory.allocator_said(e) == " (torch tried to allocate 512.00 MiB with 301.06 MiB free)"
    assert memory.allocator_said(RuntimeError("CUDA error: out of memory")) == ""


def test_the_budgets_runtime_estimate_counts_flops_and_keeps_what_it_cannot_count():
    """The knapsack's runtime estimate is torch's flop count; a node with an argument that carries no fake value
    (torch's own estimator raises KeyError 'val' on it) costs as much as the graph's counted nodes together."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w1, w2):
        return torch.relu(x @ w1) @ w2  # [64, 32] @ [32, 48], then [64, 48] @ [48, 16]

    gm = make_fx(f, tracing_mode="fake")(torch.randn(64, 32), torch.randn(32, 48), torch.randn(48, 16))
    mms = [n for n in gm.graph.nodes if n.op == "call_function" and "mm" in str(n.target)]
    estimate = memory.FlopRuntime()
    assert [estimate(n) for n in mms] == [2 * 64 * 32 * 48, 2 * 64 * 48 * 16]
    # a node whose argument has no fake value, as a subgraph's get_attr in a higher-order op
    with gm.graph.inserting_after(mms[-1]):
        opaque = gm.graph.get_attr("w_opaque")
        node = gm.graph.call_function(torch.ops.aten.relu.default, (opaque,))
    with torch._functorch.config.patch(activation_memory_budget_runtime_estimator="flops"), pytest.raises(KeyError):
        torch._functorch.partitioners.estimate_runtime(node)
    assert estimate(node) == 2 * 64 * 32 * 48 + 2 * 64 * 48 * 16


# -- dflash train: the plan's line, the refusal, an out-of-memory --------------------------------------------------


def train_args(cache: Path, run: Path, *extra) -> list[str]:
    return ["train", "--config", PRESET, "--cache", str(cache), "--out", str(run), "--device", "cpu",
            "--holdout-shards", "0", *extra]


def errors(output: str) -> list[str]:
    return [x for x in output.splitlines() if x.startswith("error:")]


def test_the_free_memory_counts_the_blocks_this_process_holds_unused(monkeypatch):
    """The driver counts the allocator's cached blocks as taken; a step in the same process reuses them first."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * GB, 140 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 25 * GB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 5 * GB)
    assert memory.device_memory(torch.device("cuda", 0)) == (50 * GB, 140 * GB)
    assert memory.device_memory(torch.device("cpu")) is None


def test_a_step_that_cannot_fit_stops_in_one_line_before_anything_is_written(tmp_path, small_cache, monkeypatch):
    """The device's free memory faked to 60 MB (the check runs on CUDA devices; here it is handed a number): one
    line names the estimate, the free memory and options that fit; with --no-memory-check it is a warning."""
    monkeypatch.setattr(memory, "device_memory", lambda device: (60_000_000, 80 * 10**9))
    run = tmp_path / "run"
    out = run_in_process(train_args(small_cache, run, "--max-steps", "2"))
    assert out.exit_code == 1 and len(errors(out.output)) == 1 and "Traceback" not in out.output
    line = errors(out.output)[0]
    assert line.startswith("error: the training step needs ~") and "but cpu has 60 MB free: it fits with " in line
    assert "--num-anchors" in line and not (run / "config.json").exists() and not (run / "checkpoints").exists()
    out = run_in_process(train_args(small_cache, run, "--max-steps", "2", "--no-memory-check"))
    assert out.exit_code == 0 and "warning: the training step needs ~" in out.output
    assert "memory plan: the step needs ~" in out.output and "60 MB free on cpu" in out.output


def test_a_step_that_fits_with_little_to_spare_is_warned_of_and_runs(tmp_path, small_cache, monkeypatch):
    """Free memory faked to 1/0.95 of the plan: one warning line, and the run trains; with 20 % to spare, none."""
    real, planned = memory.plan, []
    monkeypatch.setattr(memory, "plan", lambda s: planned.append(real(s)) or planned[-1])
    for spare, warned in ((0.95, True), (0.8, False)):
        monkeypatch.setattr(memory, "device_memory", lambda device: (int(planned[-1].peak / spare), 80 * 10**9))
        out = run_in_process(train_args(small_cache, tmp_path / f"run{spare}", "--max-steps", "1"))
        assert out.exit_code == 0, out.output
        warnings = [x for x in out.output.splitlines() if x.startswith("warning: the training step needs ~")]
        assert len(warnings) == warned and all("less than 10% to spare" in x for x in warnings), out.output
    p = planned[-1]
    assert tight(p, int(p.peak / 0.95), "cuda:0").startswith(f"the training step needs ~{memory.size(p.peak)} of")
    assert tight(p, int(p.peak / 0.8), "cuda:0") is None and tight(p, p.peak - 1, "cuda:0") is None


def test_an_out_of_memory_in_a_step_is_one_line_and_the_last_checkpoint_stays(tmp_path, small_cache, monkeypatch):
    import dflash.train as trainlib

    real, calls = trainlib.drafter_loss, []

    def out_of_memory_at_step_7(*args, **kwargs):
        calls.append(1)
        if len(calls) == 7:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                         "of 139.81 GiB of which 1.2 GiB is free.")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainlib, "drafter_loss", out_of_memory_at_step_7)
    run = tmp_path / "run"
    out = run_in_process(train_args(small_cache, run, "--max-steps", "10", "--save-every", "4"))
    assert out.exit_code == 1 and "Traceback" not in out.output
    (line,) = errors(out.output)
    assert line.startswith("error: step 7: out of GPU memory (torch tried to allocate 2.00 GiB with 1.2 GiB free); "
                           "the plan estimated ~")
    assert "; its last good checkpoint, step-00000004, is intact; lower it with --" in line
    assert line.endswith(", and run the same command: it resumes from there")
    assert checkpoint.latest(run).name == "step-00000004" and not list((run / "checkpoints").glob("*08"))
    monkeypatch.setattr(trainlib, "drafter_loss", real)
    again = run_in_process(train_args(small_cache, run, "--max-steps", "10", "--save-every", "4", "--recompute",
                                      "layers"))  # the advice taken: a memory option may change on resume
    assert again.exit_code == 0 and "resuming" in again.output and checkpoint.latest(run).name == "step-00000010"


def test_a_budget_needs_a_compiled_step_and_a_budget_outside_0_1_is_refused(tmp_path, small_cache):
    out = run_in_process(train_args(small_cache, tmp_path / "a", "--activation-memory-budget", "0.5"))
    assert out.exit_code == 1 and errors(out.output) == [
        "error: --activation-memory-budget 0.5 applies to a compiled step (--compile yes, the default on a GPU); an "
        "uncompiled one can use --recompute"]
    with pytest.raises(DflashError, match=r"--activation-memory-budget must be in \(0, 1\], got 0.0"):
        build_config(TrainConfig, None, "train", {"cache": "c", "out": "o", "activation_memory_budget": 0.0})


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_compiled_step_with_the_memory_options_has_the_eager_losses_and_never_recompiles(tmp_path, small_cache):
    """Inductor on the CPU: the step compiled under a 0.5 activation budget with recomputed MLPs logs the losses of
    the eager step, and compiles once. The anchors' random numbers are drawn outside the compiled graph: under a
    budget, the partitioner would recompute a random op inside it with fresh numbers for the backward."""
    args = ["--max-steps", "3", "--log-every", "1", "--recompute", "mlp"]
    eager = run_in_process(train_args(small_cache, tmp_path / "eager", *args))
    compiled = run_in_process(train_args(small_cache, tmp_path / "compiled", *args, "--compile", "yes",
                                         "--activation-memory-budget", "0.5"))
    assert eager.exit_code == 0 and compiled.exit_code == 0, compiled.output
    assert "recompiles after step 1: 0" in compiled.output
    want = [m["loss"] for m in metrics(tmp_path / "eager") if "loss" in m]
    got = [m["loss"] for m in metrics(tmp_path / "compiled") if "loss" in m]
    assert len(got) == 3 and all(abs(a - b) / abs(b) < 1e-4 for a, b in zip(got, want)), (got, want)


# -- the leaner optimizer state ------------------------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    x = torch.full((200_000,), 1 + 2**-10)  # a quarter of the way from bf16's 1.0 to 1.0078125
    noise = memory.hash32(torch.arange(x.numel()))
    r = round_stochastic(x, noise).float()
    assert set(r.unique().tolist()) == {1.0, 1.0078125}
    assert abs(r.mean().item() - x[0].item()) < 2e-5
    y = -x * 3.7
    assert abs(round_stochastic(y, noise).float().mean().item() - y[0].item()) < 1e-4  # negative values too


def quadratic(optimizer_cls, steps=300, seed=0, **kw):
    """A noisy, badly scaled quadratic, `steps` steps: (final weights, optimizer)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(64, 48, generator=g))
    target, scale = torch.randn(64, 48, generator=g), torch.logspace(-2, 1, 48)
    opt = optimizer_cls([w], lr=1e-2, **kw)
    for _ in range(steps):
        loss = ((w - target) ** 2 * scale).sum() + (w * torch.randn(64, 48, generator=g)).sum() * 0.1
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w.detach(), opt


def test_bf16_moments_follow_torchs_adamw():
    want, ref = quadratic(torch.optim.AdamW, weight_decay=0.01)
    got, opt = quadratic(BF16AdamW, weight_decay=0.01)
    assert rel_err(got, want) < 5e-3
    state, ref_state = opt.state[opt.param_groups[0]["params"][0]], ref.state[ref.param_groups[0]["params"][0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16 and state["step"].item() == 300
    assert rel_err(state["exp_avg_sq"].float(), ref_state["exp_avg_sq"]) < 2e-2


def test_the_bf16_second_moment_keeps_following_the_gradients():
    """With zero gradients the second moment decays by beta2 each step: rounded to nearest, bf16 would keep it
    where it is (0.1 % a step is below half its spacing); rounded stochastically it decays as in fp32."""
    w = torch.nn.Parameter(torch.zeros(100_000))
    opt = BF16AdamW([w], lr=1e-3)
    w.grad = torch.ones_like(w)
    opt.step()
    v0 = opt.state[w]["exp_avg_sq"].float().mean().item()
    w.grad = torch.zeros_like(w)
    for _ in range(500):
        opt.step()
    v = opt.state[w]["exp_avg_sq"].float().mean().item()
    assert abs(v / v0 - 0.999**500) < 0.01, v / v0


def test_bf16_moments_round_trip_through_a_checkpoint_and_resume_exactly(tmp_path):
    """Saved as bf16 (safetensors), loaded back exactly; the run continued from the checkpoint takes the same
    steps as the run that never stopped (the rounding noise follows the step, not the process)."""
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        return model, BF16AdamW(model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1, seed=3)

    def train(model, opt, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            model(torch.randn(8, 16, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()

    ref_model, ref_opt = make()
    train(ref_model, ref_opt, 5, 0)
    train(ref_model, ref_opt, 5, 1)
    model, opt = make()
    train(model, opt, 5, 0)
    checkpoint.save(tmp_path, 5, model, opt, {})
    model, opt = make()
    checkpoint.load(checkpoint.latest(tmp_path), model, opt)
    saved = opt.state_dict()["state"]
    assert all(s["exp_avg"].dtype == torch.bfloat16 and s["step"].item() == 5 for s in saved.values())
    assert torch.is_tensor(opt.param_groups[0]["lr"]) and opt.param_groups[0]["weight_decay"] == 0.1
    train(model, opt, 5, 1)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_a_run_resumes_with_the_other_optimizer_state(tmp_path):
    """fp32 AdamW -> bf16 moments (rounded) -> fp32 again (AdamW keeps its decoupled weight decay and flags)."""
    model = torch.nn.Linear(8, 8)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model(torch.randn(4, 8)).sum().backward()
    adamw.step()
    checkpoint.save(tmp_path / "a", 1, model, adamw, {})
    lean = BF16AdamW(model.parameters(), lr=1e-3)
    checkpoint.load(checkpoint.latest(tmp_path / "a"), model, lean)
    for p in model.parameters():
        assert lean.state[p]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(lean.state[p]["exp_avg_sq"], adamw.state[p]["exp_avg_sq"].bfloat16())
    assert lean.param_groups[0]["weight_decay"] == 0.1
    lean.step()
    checkpoint.save(tmp_path / "b", 2, model, lean, {})
    back = torch.optim.AdamW(model.parameters(), lr=1e-3)
    checkpoint.load(checkpoint.latest(tmp_path / "b"), model, back)
    group = back.param_groups[0]
    assert group["decoupled_weight_decay"] is True and group["weight_decay"] == 0.1
    for p in model.parameters():
        assert back.state[p]["exp_avg"].dtype == torch.float32 and back.state[p]["step"].item() == 2
        assert torch.equal(back.state[p]["exp_avg"], lean.state[p]["exp_avg"].float())
    back.step()


def test_the_bf16_update_compiles_into_one_graph_with_the_eager_result():
    """What a GPU runs: the update compiled once for every parameter size (dynamic), with the eager moments bit for
    bit and the weights to rounding; here with Inductor on the CPU."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled = torch.compile(adamw_bf16_step, dynamic=True)
    graphs = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(0)
    for n in (1000, 3001):
        p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
        m, v = torch.randn(n, generator=g).bfloat16(), torch.rand(n, generator=g).bfloat16()
        eager, fused = [[x.clone() for x in (p, grad, m, v, torch.zeros(()))] for _ in range(2)]
        for _ in range(2):
            adamw_bf16_step(*eager, torch.tensor(7), torch.tensor(1e-3), 0.9, 0.999, 1e-8, 0.01)
            compiled(*fused, torch.tensor(7), torch.tensor(1e-3), 0.9, 0.999, 1e-8, 0.01)
        assert all(torch.equal(a, b) for a, b in zip(eager[1:], fused[1:]))
        assert rel_err(fused[0], eager[0]) < 1e-6
    assert counters["stats"]["unique_graphs"] - graphs == 1


def test_a_run_with_bf16_moments_resumes_with_fp32_ones(tmp_path, small_cache, monkeypatch):
    """Stopped after its step-2 checkpoint (an out-of-memory at step 3), a --optimizer-state bf16 run goes on
    with --optimizer-state fp32: the same command with the other state resumes it."""
    import dflash.train as trainlib

    real, calls = trainlib.drafter_loss, []

    def out_of_memory_at_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainlib, "drafter_loss", out_of_memory_at_step_3)
    run, args = tmp_path / "run", ["--max-steps", "4", "--save-every", "2", "--log-every", "1"]
    assert run_in_process(train_args(small_cache, run, *args, "--optimizer-state", "bf16")).exit_code == 1
    tensors = load_file(checkpoint.latest(run) / "optimizer.safetensors")
    assert {t.dtype for k, t in tensors.items() if not k.endswith("::step")} == {torch.bfloat16}
    monkeypatch.setattr(trainlib, "drafter_loss", real)
    again = run_in_process(train_args(small_cache, run, *args, "--optimizer-state", "fp32"))
    assert again.exit_code == 0 and f"resuming {run} from step 2" in again.output
    assert [m["step"] for m in metrics(run) if "loss" in m] == [1, 2, 3, 4]
    tensors = load_file(checkpoint.latest(run) / "optimizer.safetensors")
    assert {t.dtype for k, t in tensors.items() if not k.endswith("::step")} == {torch.float32}


@pytest.mark.gpu
def test_the_bf16_update_on_the_gpu_matches_the_cpus():
    opt_cpu, opt_gpu = [], []
    for device, into in (("cpu", opt_cpu), ("cuda", opt_gpu)):
        w = torch.nn.Parameter(torch.randn(4096, 257, generator=torch.Generator().manual_seed(0)).to(device))
        opt = BF16AdamW([w], lr=torch.tensor(1e-3, device=device) if device == "cuda" else 1e-3, weight_decay=0.01)
        for i in range(3):
            w.grad = torch.randn(4096, 257, generator=torch.Generator().manual_seed(i)).to(device)
            opt.step()
        into.extend([w.detach().cpu(), opt.state[w]["exp_avg_sq"].float().cpu()])
    assert rel_err(opt_gpu[0], opt_cpu[0]) < 1e-6 and rel_err(opt_gpu[1], opt_cpu[1]) < 1e-2
