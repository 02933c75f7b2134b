"""Stage-two benchmark on one GPU (results go to bench/RESULTS.md).

The Qwen3-8B drafter shape (5 layers, hidden 4096, GQA 32/8, head 128, MLP 12288, vocab 151936, B 16)
trained through the real loader and `dflash.train.train` on synthetic caches written with the real
cache code:
  a. shards of T = 12288 (4 x 3072-token documents), 2048 anchors;
  b. shards of T = 3072 (one document), 512 anchors;
  c. chat-like rows (lognormal length, median 700, sigma 0.8, clipped to [64, 3072], the first 15-35 %
     an unsupervised prompt) packed into T = 12288 shards, 2048 anchors: useful draft tokens/s;
  a-dpace: a with the D-PACE loss; a-w2048: a with a 2048-token sliding window;
  a-dflash2: a-w2048 as DFlash2; a-w2048-profile, a-dflash2-profile: their CUDA kernel tables (profile_*.txt);
  long, long-w2048, long-w2048-causal: one 12288-token document per shard, 2048 anchors, full attention
     vs a 2048-token window (whole / causal block).
  Memory (`--runs memory`): a with --activation-memory-budget 0.5 / 0.3, --recompute mlp / attention / layers,
     --optimizer-state bf16 alone, with the 0.5 budget and with --recompute mlp.
The big drafters (`--runs big`; 5 layers, 8 steps each):
  glm-8192: GLM-5-sized (hidden 6144, 48/8 heads, head 128, MLP 18432, vocab 154880), T = 8192 (one document),
     1024 anchors; glm-49152: T = 49,152 (6 x 8192-token documents), 4096 anchors; glm-49152-a8192: 8192
     anchors as they are (the plan refuses it in seconds), -budget (--activation-memory-budget 0.6, tried
     though the plan says it cannot fit), -mlp (--recompute mlp), -mlp-bf16 (and --optimizer-state bf16),
     -layers-bf16 (--recompute layers, bf16 moments); glm-49152-a5376-layers-bf16: the anchors that the
     80 GB card's out-of-memory advised; q27: Qwen3.5-27B-sized
     (hidden 5120, 24/4 heads, head 256, MLP 17408, vocab 248320), T = 12288 (4 x 3072), 2048 anchors.
Each compiled (reduce-overhead) for `--steps` steps (the big ones 8), plus a few eager steps of a and b for the
ratio. Step time, context tokens/s, MFU (FLOPs counted by `flops_per_step`, with the real visible-key count),
first-step time, recompiles, peak memory (`torch.cuda.max_memory_allocated`; reserved: the allocator's
`max_memory_reserved`, its cached blocks included) and the memory plan's estimate made before the compile, input
wait. Checkpoints are not written (their write is not the step).

    python bench/train.py --out $OUT --work /tmp/bench-train [--runs a,b,...|big|memory]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash import cache as cachelib, checkpoint, fp8  # noqa: E402
from dflash.config import TrainConfig, build_config  # noqa: E402
from dflash.packing import plan_shards  # noqa: E402
from dflash.train import train  # noqa: E402

QWEN3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 12288, "vocab_size": 151936, "num_hidden_layers": 36, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 40960, "model_type": "qwen3",
            "dflash_mask_token_id": 151669}
# the big drafters of 2026's targets: GLM-5-sized (a GLM-5-variant target) and Qwen3.5-27B-sized
GLM5 = {**QWEN3_8B, "hidden_size": 6144, "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 18432, "vocab_size": 154880, "num_hidden_layers": 78, "model_type": "glm_moe_dsa",
        "dflash_mask_token_id": 154856}
QWEN35_27B = {**QWEN3_8B, "hidden_size": 5120, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
              "intermediate_size": 17408, "vocab_size": 248320, "num_hidden_layers": 64, "model_type": "qwen3_5_text",
              "dflash_mask_token_id": 248077}
LAYERS = [1, 9, 17, 25, 33]
# run: (result key, cache, anchors, steps (None: --steps / --eager-steps), compile, log every, TrainConfig fields)
WINDOW = {"sliding_window": 2048}
BIG_STEPS = 8  # the big drafters: 8 steps, a line every 2 (steps 3-8 measured)
PLANS = {"a": ("a_T12288", "c12288", 2048, None, "yes", 5, {}),
         "b": ("b_T3072", "c3072", 512, None, "yes", 5, {}),
         "c": ("c_chat", "cchat", 2048, None, "yes", 5, {}),
         "a-eager": ("a_eager", "c12288", 2048, None, "no", 2, {}),
         "b-eager": ("b_eager", "c3072", 512, None, "no", 2, {}),
         "a-profile": ("a_profile", "c12288", 2048, 10, "yes", 5, {}),
         "a-dpace": ("a_T12288_dpace", "c12288", 2048, None, "yes", 5, {"loss": "dpace"}),
         "a-w2048": ("a_T12288_w2048", "c12288", 2048, None, "yes", 5, WINDOW),
         "long": ("long_T12288", "clong", 2048, None, "yes", 5, {}),
         "long-w2048": ("long_T12288_w2048", "clong", 2048, None, "yes", 5, WINDOW),
         "long-w2048-causal": ("long_T12288_w2048_causal", "clong", 2048, None, "yes", 5,
                               {**WINDOW, "causal_block": True}),
         "a-dflash2": ("a_T12288_dflash2", "c12288", 2048, None, "yes", 5, {"arch": "dflash2", **WINDOW}),
         # where DFlash2's extra step time goes: kernel tables of both, side by side
         "a-w2048-profile": ("a_w2048_profile", "c12288", 2048, 10, "yes", 5, WINDOW),
         "a-dflash2-profile": ("a_dflash2_profile", "c12288", 2048, 10, "yes", 5, {"arch": "dflash2", **WINDOW}),
         # memory: the Qwen3-8B shape of run a with the memory options
         "a-budget0.5": ("a_budget0.5", "c12288", 2048, None, "yes", 5, {"activation_memory_budget": 0.5}),
         "a-budget0.3": ("a_budget0.3", "c12288", 2048, None, "yes", 5, {"activation_memory_budget": 0.3}),
         "a-mlp": ("a_recompute_mlp", "c12288", 2048, None, "yes", 5, {"recompute": "mlp"}),
         "a-attention": ("a_recompute_attention", "c12288", 2048, None, "yes", 5, {"recompute": "attention"}),
         "a-layers": ("a_recompute_layers", "c12288", 2048, None, "yes", 5, {"recompute": "layers"}),
         "a-bf16": ("a_bf16_moments", "c12288", 2048, None, "yes", 5, {"optimizer_state": "bf16"}),
         "a-bf16-budget0.5": ("a_bf16_budget0.5", "c12288", 2048, None, "yes", 5,
                              {"optimizer_state": "bf16", "activation_memory_budget": 0.5}),
         "a-mlp-bf16": ("a_mlp_bf16", "c12288", 2048, None, "yes", 5, {"recompute": "mlp", "optimizer_state": "bf16"}),
         # the big drafters
         "glm-8192": ("glm_T8192_A1024", "glm8192", 1024, BIG_STEPS, "yes", 2, {}),
         "glm-49152": ("glm_T49152_A4096", "glm49152", 4096, BIG_STEPS, "yes", 2, {}),
         "glm-49152-a8192": ("glm_T49152_A8192", "glm49152", 8192, BIG_STEPS, "yes", 2, {}),
         "glm-49152-a8192-budget": ("glm_T49152_A8192_budget0.6", "glm49152", 8192, BIG_STEPS, "yes", 2,
                                    {"activation_memory_budget": 0.6, "memory_check": False}),
         "glm-49152-a8192-mlp": ("glm_T49152_A8192_mlp", "glm49152", 8192, BIG_STEPS, "yes", 2, {"recompute": "mlp"}),
         "glm-49152-a8192-mlp-bf16": ("glm_T49152_A8192_mlp_bf16", "glm49152", 8192, BIG_STEPS, "yes", 2,
                                      {"recompute": "mlp", "optimizer_state": "bf16"}),
         "glm-49152-a8192-layers-bf16": ("glm_T49152_A8192_layers_bf16", "glm49152", 8192, BIG_STEPS, "yes", 2,
                                         {"recompute": "layers", "optimizer_state": "bf16"}),
         "glm-49152-a5376-layers-bf16": ("glm_T49152_A5376_layers_bf16", "glm49152", 5376, BIG_STEPS, "yes", 2,
                                         {"recompute": "layers", "optimizer_state": "bf16"}),
         "q27": ("q27_T12288_A2048", "q27", 2048, BIG_STEPS, "yes", 2, {})}
GROUPS = {"memory": ["a", "a-budget0.5", "a-budget0.3", "a-mlp", "a-attention", "a-layers", "a-bf16",
                     "a-bf16-budget0.5", "a-mlp-bf16"],
          "big": ["glm-8192", "glm-49152", "glm-49152-a8192", "glm-49152-a8192-budget", "glm-49152-a8192-mlp",
                  "glm-49152-a8192-mlp-bf16", "glm-49152-a8192-layers-bf16", "q27"]}


def log(*a):
    print(*a, flush=True)


def synthetic_cache(path: Path, doc_lens: np.ndarray, loss_masks: list[np.ndarray], T: int, D: int, dims: dict,
                    device: str, layers: list[int] = LAYERS) -> None:
    """A cache with random states (unit-variance bf16) and random tokens, written by the real cache code."""
    H, V, L = dims["hidden_size"], dims["vocab_size"], len(layers)
    plan = plan_shards(np.arange(len(doc_lens)), doc_lens, T, D)
    manifest = {"format_version": cachelib.FORMAT_VERSION, "target_config_hash": json.dumps(dims, sort_keys=True),
                "target_weights": "synthetic", "tokenizer_hash": "synthetic", "chat_template_hash": "synthetic",
                "data_sha256": [], "limit": None, "layer_ids": layers, "token_budget": T, "max_docs": D,
                "max_len": T, "compute_dtype": "bfloat16", "storage_dtype": "bfloat16", "packer": {"name": "bench"},
                "dflash_version": "bench", "hidden_size": H, "vocab_size": V, "pad_id": 0, "drop_reasons": [],
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "num_shards": plan.num_shards, "data_files": [],
                "target": {"name": f"synthetic {dims['model_type']}", "path": "", "model_type": dims["model_type"],
                           "num_layers": dims["num_hidden_layers"]},
                "stats": {"rows": len(doc_lens), "docs": len(doc_lens), "tokens": int(doc_lens.sum()),
                          "loss_tokens": int(sum(m.sum() for m in loss_masks)), "truncated": 0, "dropped": {}}}
    manifest["cache_key"] = cachelib.cache_key(manifest)
    g = torch.Generator(device=device).manual_seed(0)
    weights = {"embed_tokens.weight": (torch.randn(V, H, generator=g, device=device) * 0.02).bfloat16().cpu(),
               "lm_head.weight": (torch.randn(V, H, generator=g, device=device) * 0.02).bfloat16().cpu()}
    e = np.zeros(0, np.int64)
    cachelib.create_cache(path, manifest, plan, e, np.zeros(0, np.uint8), e, weights, dims)
    cache = cachelib.Cache(path, mode="r+")
    rng = np.random.default_rng(0)
    for s in range(plan.num_shards):
        hidden = fp8.to_bits(torch.randn(L, T, H, generator=g, device=device).bfloat16().cpu())
        ids = rng.integers(1, V, T, dtype=np.int32)
        mask = np.zeros(T, np.uint8)
        o = 0
        for r, n in zip(plan.row_ids[s], plan.doc_lens[s]):
            if r >= 0:
                mask[o:o + n] = loss_masks[r]
                o += n
        ids[o:] = 0
        hidden[:, o:] = 0
        cache.write_shard(s, hidden, ids, mask, rng.integers(1, V, T, dtype=np.int32))


def profiled(out: Path, wait: int = 6, active: int = 3):
    """Profile `active` steps of the next run (after `wait` steps): the kernel table goes to `out`."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from dflash import loader as loaderlib

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=wait, warmup=1, active=active, repeat=1),
                   on_trace_ready=lambda p: out.write_text(p.key_averages().table(sort_by="cuda_time_total",
                                                                                   row_limit=40)))
    plain_iter = loaderlib.ShardLoader.__iter__

    def iter_and_step(self):
        for item in plain_iter(self):
            yield item
            prof.step()

    class Ctx:
        def __enter__(self):
            prof.start()
            loaderlib.ShardLoader.__iter__ = iter_and_step

        def __exit__(self, *exc):
            loaderlib.ShardLoader.__iter__ = plain_iter
            prof.stop()
    return Ctx()


def chat_documents(rng, n: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """n chat-like rows: lognormal lengths (median 700, sigma 0.8, clipped to [64, 3072]) and loss masks
    whose first 15-35 % is an unsupervised prompt."""
    lens = np.clip(rng.lognormal(np.log(700), 0.8, n), 64, 3072).astype(np.int64)
    masks = []
    for k in lens:
        m = np.ones(k, np.uint8)
        m[: int(k * rng.uniform(0.15, 0.35))] = 0
        masks.append(m)
    return lens, masks


def run(name: str, cache: Path, work: Path, anchors: int, steps: int, compile_: str, log_every: int,
        device: str = "cuda", num_layers: int = 5, **overrides) -> dict:
    """A `dflash train` run on `cache`: step time, MFU, first step, recompiles, peak memory, the compile
    record; `overrides`: other TrainConfig fields."""
    out = work / f"run-{name}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = build_config(TrainConfig, None, "train", dict(
        cache=str(cache), out=str(out), num_layers=num_layers, num_anchors=anchors, block_size=16, max_steps=steps,
        log_every=log_every, save_every=10**9, compile=compile_, holdout_shards=0, epochs=1000, device=device,
        **overrides))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with mock.patch.object(checkpoint, "save", lambda *a, **k: None):  # a checkpoint's write is not the step
        stats = train(cfg)
    wall = time.perf_counter() - t0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    lines = [x for x in records if "loss" in x]
    steady = lines[1:] or lines  # the first interval holds the compile
    tok_s = float(np.mean([x["tokens_per_s"] for x in steady]))
    T = cachelib.read_manifest(cache)["token_budget"]
    res = {"name": name, "steps": stats["steps"], "first_step_s": stats["first_step_s"],
           "recompiles": stats["recompiles"], "step_ms": 1e3 * T / tok_s, "context_tokens_per_s": tok_s,
           "mfu": float(np.mean([x.get("mfu", 0) for x in steady])),
           "input_wait": float(np.mean([x["input_wait"] for x in steady])),
           "useful_draft_tokens_per_s": float(np.mean([x["trained_slots_per_step"] for x in steady])) * tok_s / T,
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0, "wall_s": wall,
           # what the allocator held at most (allocated plus its cached blocks): what an out-of-memory is about
           "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if device == "cuda" else 0.0,
           "final_loss": lines[-1]["loss"], "cudagraph_skips": stats["cudagraph_skips"],
           "memory_plan_gb": stats["memory_plan_gb"], "compile": next((x for x in records if "compile" in x), None)}
    shutil.rmtree(out, ignore_errors=True)
    log(json.dumps(res))
    return res


def cache_specs(smoke: bool) -> dict:
    """Cache name -> (document lengths, loss masks, T, D, target dims): the runs' synthetic caches (`--smoke`: the
    ones its runs use, at toy widths)."""
    lens, masks = chat_documents(np.random.default_rng(0), 140)

    def docs(n: int, length: int) -> tuple:
        return np.full(n, length), [np.ones(length, np.uint8)] * n

    if smoke:
        toy = {**QWEN3_8B, **SMOKE_WIDTHS}
        glm = {**GLM5, **SMOKE_WIDTHS, "hidden_size": 96, "num_attention_heads": 6, "intermediate_size": 192}
        return {"cchat": (lens, masks, 12288, 64, toy), "clong": (*docs(6, 12288), 12288, 1, toy),
                "c12288": (*docs(8, 3072), 12288, 4, toy), "glm8192": (*docs(4, 8192), 8192, 1, glm)}
    return {"c12288": (*docs(24, 3072), 12288, 8, QWEN3_8B),  # 6 shards of 4 x 3072
            "c3072": (*docs(8, 3072), 3072, 1, QWEN3_8B),
            "cchat": (lens, masks, 12288, 64, QWEN3_8B),
            "clong": (*docs(6, 12288), 12288, 1, QWEN3_8B),
            "glm8192": (*docs(4, 8192), 8192, 1, GLM5),  # 4 shards of one 8192-token document
            "glm49152": (*docs(18, 8192), 49152, 6, GLM5),  # 3 shards of 6 x 8192 (3 GB of states each)
            "q27": (*docs(16, 3072), 12288, 4, QWEN35_27B)}  # 4 shards of 4 x 3072


SMOKE_WIDTHS = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 128, "vocab_size": 512, "dflash_mask_token_id": 511}
# --smoke: eager runs on the CPU through the same path (an uncompiled step takes no activation budget)
SMOKE_PLANS = {"smoke": ("smoke_chat", "cchat", 64, 6, "no", 2, {}),
               "smoke-dpace-window": ("smoke_dpace_window", "clong", 64, 4, "no", 2,
                                      {"loss": "dpace", "sliding_window": 256, "causal_block": True}),
               "smoke-dflash2": ("smoke_dflash2", "cchat", 64, 4, "no", 2, {"arch": "dflash2", "selector_top_k": 8}),
               "smoke-memory": ("smoke_bf16_mlp", "c12288", 64, 4, "no", 2,
                                {"optimizer_state": "bf16", "recompute": "mlp"}),
               "smoke-big": ("smoke_glm_layers", "glm8192", 64, 4, "no", 2, {"recompute": "layers"})}


def selected(runs: str, plans: dict) -> list[str]:
    """--runs: names of PLANS and of GROUPS (expanded), in order, each once."""
    names = [n for r in runs.split(",") for n in GROUPS.get(r, [r])]
    unknown = [n for n in names if n not in plans]
    if unknown:
        raise SystemExit(f"--runs: unknown {', '.join(unknown)} (known: {', '.join([*plans, *GROUPS])})")
    return list(dict.fromkeys(names))


def main():
    from dflash import logs

    logs.setup()  # the library's log lines on stderr, as the dflash command shows them
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/bench-train")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--eager-steps", type=int, default=6)
    p.add_argument("--runs", default="a,b,c,a-eager,b-eager,a-profile",
                   help="runs, or groups of them (" + ", ".join(f"{g}: {','.join(v)}" for g, v in GROUPS.items()) + ")")
    p.add_argument("--smoke", action="store_true", help="toy widths, to check this script on a CPU")
    args = p.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    plans = SMOKE_PLANS if args.smoke else PLANS
    runs = list(plans) if args.smoke else selected(args.runs, plans)
    device = "cpu" if args.smoke else "cuda"
    t0 = time.perf_counter()
    for name, (lens, masks, T, D, dims) in cache_specs(args.smoke).items():
        if any(plans[r][1] == name for r in runs):
            synthetic_cache(work / name, lens, masks, T, D, dims, device)
    log(f"synthetic caches written in {time.perf_counter() - t0:.0f}s")
    res = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__}
    for name in runs:
        key, c, anchors, steps, compile_, every, fields = plans[name]
        if steps is None:
            steps = args.steps if compile_ == "yes" else args.eager_steps
        t1 = time.perf_counter()
        try:
            with profiled(out / f"profile_{key}.txt") if name.endswith("profile") else contextlib.nullcontext():
                res[key] = run(name, work / c, work, anchors, steps, compile_, every, device=device, **fields)
        except Exception as e:  # keep going: one device call should tell as much as it can
            traceback.print_exc()
            res[key] = {"error": f"{type(e).__name__}: {str(e)[:2000]}", "after_s": time.perf_counter() - t1}
            if device == "cuda":  # what the step had allocated at most before it failed (an out-of-memory's floor)
                res[key]["peak_before_error_gb"] = torch.cuda.max_memory_allocated() / 1e9
                res[key]["peak_reserved_before_error_gb"] = torch.cuda.max_memory_reserved() / 1e9
        torch._dynamo.reset()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        (out / "results_train.json").write_text(json.dumps(res, indent=2))
    print_table(res)


def print_table(res: dict) -> None:
    print("\n| run | step ms | ctx tok/s | MFU | first step s | recompiles | cudagraph skips | peak GB | reserved GB "
          "| plan GB | plan / peak | input wait | useful draft tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k, r in res.items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            floor = f" (peak before it {r['peak_before_error_gb']:.1f} GB)" if "peak_before_error_gb" in r else ""
            print(f"| {k} | error after {r['after_s']:.0f} s{floor}: {r['error'][:400]} |")
            continue
        ratio = f"{r['memory_plan_gb'] / r['peak_mem_gb']:.3f}" if r["peak_mem_gb"] else "–"
        print(f"| {k} | {r['step_ms']:.0f} | {r['context_tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
              f"{r['first_step_s']:.1f} | {r['recompiles']} | {r['cudagraph_skips']} | {r['peak_mem_gb']:.1f} | "
              f"{r['peak_reserved_gb']:.1f} | {r['memory_plan_gb']:.1f} | {ratio} | {r['input_wait']:.1%} | "
              f"{r['useful_draft_tokens_per_s']:,.0f} |")


if __name__ == "__main__":
    main()
