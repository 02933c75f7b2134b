"""Stage-one benchmark on one GPU (run on the H200; see bench/RESULTS.md).

1. A Qwen3-8B-shaped target cut to a few layers (random weights, hidden 4096, 32/8 heads, MLP 12288,
   vocab 151936), T = 8192, chat-like document lengths: extraction tokens/s against the same target's
   forward-only tokens/s over the same batches, fill ratio, bytes per token, and where the time goes.
   The extraction runs twice: into the disk folder given, and into /dev/shm (no disk in the way).
2. A GatedDeltaNet target (Qwen3.5-shaped, cut to 3 linear-attention + 1 full-attention layers):
   fla's forward-only rate at one fixed shape and over the extraction's batches, extraction through
   fla's kernels (this process: its first extraction, with every compile and autotune, and a timed one)
   and through transformers' torch fallback (a subprocess that cannot import fla); how far their
   states differ.
3. MoE targets (Qwen3-30B-A3B- and gpt-oss-20b-shaped, a few layers): forward-only tokens/s of each
   experts implementation at one shape, extraction vs forward-only over the same batches at two
   forward sizes (each extraction run twice: the second counts, the first is reported beside it), MFU on
   active parameters, the share of expert work spent on padding.

    python bench/extract.py --out $OUT/extract --work /tmp/bench [--parts qwen3,gdn,moe]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash.cache import Cache, info  # noqa: E402
from dflash.config import ExtractConfig  # noqa: E402
from dflash.data import Tokenizer, read_rows  # noqa: E402
from dflash.extract import extract, make_batches  # noqa: E402
from dflash.metrics import peak_tflops  # noqa: E402
from dflash.target import Target, load_target  # noqa: E402

TINY_TOKENIZER = REPO / "data" / "tiny-target"
DEVICE = "cuda"
PEAK_FLOPS = 989.4e12  # bf16 peak for MFU: the GPU's datasheet figure (dflash.metrics), set in main()
MOE_SHAPES = {
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "config": dict(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144)},
    "gpt-oss-20b": {"model_type": "gpt_oss", "config": dict(
        vocab_size=201088, hidden_size=2880, num_hidden_layers=4, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, num_local_experts=32, num_experts_per_tok=4, intermediate_size=2880, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2)},
}


def log(*a):
    print(*a, flush=True)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def make_data(path: Path, n_tokens: int, seed: int = 0) -> int:
    """Rows of lognormal length (median 700, sigma 0.8, clipped to [64, 3072]) cut from the sample
    text's token stream, so they re-tokenize to about that length."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    text = [json.loads(x)["text"] for x in (REPO / "data/sample/text.jsonl").read_text().splitlines()]
    stream = np.concatenate([np.asarray(tok(t)["input_ids"]) for t in text])
    rng = np.random.default_rng(seed)
    rows, total = [], 0
    while total < n_tokens:
        n = int(np.clip(rng.lognormal(np.log(700), 0.8), 64, 3072))
        start = int(rng.integers(0, len(stream) - n))
        rows.append(json.dumps({"text": tok.decode(stream[start:start + n])}))
        total += n
    path.write_text("\n".join(rows) + "\n")
    return len(rows)


def make_target(path: Path, kind: str, smoke: bool = False) -> None:
    """A random bf16 target saved as a HF folder with the tiny tokenizer (ids < 4096 fit any vocab).
    `smoke`: the same architectures at toy widths, to check this script on a CPU."""
    import transformers
    from transformers import AutoTokenizer

    small = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16) if smoke else {}

    if kind == "qwen3":
        config = transformers.Qwen3Config(
            vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=6,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
        config.update(small)
        cls = transformers.Qwen3ForCausalLM
    elif kind in MOE_SHAPES:
        config = transformers.AutoConfig.for_model(MOE_SHAPES[kind]["model_type"], **MOE_SHAPES[kind]["config"],
                                                   tie_word_embeddings=False)
        config.update(dict(small, num_local_experts=8, num_experts=8, moe_intermediate_size=32) if smoke else {})
        cls = transformers.AutoModelForCausalLM.from_config
    elif hasattr(transformers, "Qwen3_5ForCausalLM"):
        config = transformers.Qwen3_5TextConfig(
            vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
            linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False)
        config.update(dict(small, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                           linear_value_head_dim=16) if smoke else {})
        cls = transformers.Qwen3_5ForCausalLM
    else:  # older transformers: Qwen3-Next with a few experts
        config = transformers.Qwen3NextConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=4, num_attention_heads=16,
            num_key_value_heads=2, head_dim=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, layer_types=["linear_attention"] * 3 + ["full_attention"])
        config.update(dict(small, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                           linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32)
                      if smoke else {})
        cls = transformers.Qwen3NextForCausalLM
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = cls(config).to(torch.bfloat16)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(TINY_TOKENIZER).save_pretrained(path)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def forward_only(cfg: ExtractConfig, cache_dir: Path) -> dict:
    """The target over the same documents and batches as the extraction, computing what a cache needs
    (every layer, then the greedy token of every real position) but capturing, copying and writing
    nothing."""
    from transformers import AutoTokenizer

    cache = Cache(cache_dir)
    model, _ = load_target(Path(cfg.target), torch.device(DEVICE), torch.bfloat16)
    target = Target(model, [0])  # one hook on layer 0: its output is kept anyway by the next layer
    tok = Tokenizer(AutoTokenizer.from_pretrained(cfg.target), cfg.resolved_max_len())
    docs = {d.row_id: d for d in tok(list(read_rows(cfg.data))) if hasattr(d, "input_ids")}
    row_ids, doc_lens = cache.plan()
    windows = [range(k, min(k + cfg.window, len(row_ids))) for k in range(0, len(row_ids), cfg.window)]

    def run(windows_):
        n = 0
        for w in windows_:
            lengths = [int(x) for s in w for x in doc_lens[s] if x > 0]
            rows = [int(r) for s in w for r in row_ids[s] if r >= 0]
            for batch in make_batches(lengths, cfg.batch_size, cfg.batch_tokens):
                width = lengths[batch[0]]
                ids = np.zeros((len(batch), width), np.int64)
                for b, i in enumerate(batch):
                    ids[b, : lengths[i]] = docs[rows[i]].input_ids
                src = torch.from_numpy(np.concatenate([np.arange(b * width, b * width + lengths[i])
                                                       for b, i in enumerate(batch)])).to(DEVICE)
                _, last = target.forward(torch.from_numpy(ids).to(DEVICE))
                target.greedy(last.reshape(-1, last.shape[-1]).index_select(0, src))
                n += sum(lengths[i] for i in batch)
        return n

    run(windows[:1])  # warm-up
    sync()
    t0 = time.perf_counter()
    n = run(windows)
    sync()
    dt = time.perf_counter() - t0
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt}


def warm_up(cfg: ExtractConfig, rows: int = 40) -> float:
    """A short extraction first, so one-time costs (CUDA module loading, kernel selection, Triton
    autotuning of fla kernels) stay out of the measured runs. Returns its wall time."""
    warm = ExtractConfig(**{**cfg.__dict__, "out": cfg.out + "-warmup", "limit": rows})
    seconds = timed_extract(warm)["wall_s"]
    shutil.rmtree(warm.out)
    return seconds


def timed_extract(cfg: ExtractConfig) -> dict:
    shutil.rmtree(cfg.out, ignore_errors=True)
    t0 = time.perf_counter()
    stats = extract(cfg)
    stats["wall_s"] = time.perf_counter() - t0
    i = info(cfg.out)
    stats.update(fill_ratio=i["fill_ratio"], bytes_per_token=i["bytes_per_token"], bytes_on_disk=i["bytes_on_disk"])
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return stats


def gdn_torch_path(cfg: ExtractConfig, fla_dir: str) -> dict:
    """The same extraction in a process that cannot import fla (transformers' torch fallback)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != fla_dir)
    probe = subprocess.run([sys.executable, "-c", "import fla"], env=env, capture_output=True)
    if probe.returncode == 0:
        return {"error": "fla still importable without its folder; torch path not measured"}
    code = ("import json,sys; sys.path.insert(0, %r); from bench.extract import timed_extract; "
            "from dflash.config import ExtractConfig; cfg = ExtractConfig(**json.loads(sys.argv[1])); "
            "from bench.extract import warm_up; w = warm_up(cfg); s = timed_extract(cfg); s['warmup_s'] = w; "
            "print('RESULT ' + json.dumps(s))" % str(REPO))
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cfg.__dict__)], env=env, capture_output=True,
                         text=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": out.stderr[-2000:]}


def part_qwen3(args, res, work):
    """1. Qwen3-8B-shaped, 6 layers, capture [1, 3, 5]."""
    t = time.perf_counter()
    n_rows = make_data(work / "data.jsonl", args.tokens)
    make_target(work / "qwen3-8b-6l", "qwen3", args.smoke)
    log(f"setup: {n_rows} rows, target saved in {time.perf_counter() - t:.0f}s")
    cfg = ExtractConfig(target=str(work / "qwen3-8b-6l"), data=[str(work / "data.jsonl")], out=str(work / "cache"),
                        layers=[1, 3, 5], token_budget=8192, max_docs=64, device=DEVICE)
    res["warmup_s"] = warm_up(cfg)
    res["disk"] = timed_extract(cfg)
    log("disk:", json.dumps(res["disk"]))
    res["disk_8_threads"] = timed_extract(ExtractConfig(**{**cfg.__dict__, "write_threads": 8}))
    log("disk, 8 write threads:", json.dumps(res["disk_8_threads"]))
    res["forward_only"] = forward_only(cfg, work / "cache")
    log("forward only:", json.dumps(res["forward_only"]))
    shutil.rmtree(work / "cache")
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.3 * res["disk"]["bytes_on_disk"]:
        cfg.out = str(shm / "dflash-cache")
        res["shm"] = timed_extract(cfg)
        log("shm:", json.dumps(res["shm"]))
        shutil.rmtree(cfg.out)
    shutil.rmtree(work / "qwen3-8b-6l")
    d, f = res["disk"], res["forward_only"]
    rows = [("forward only (same batches)", f"{f['tokens_per_s']:,.0f}", "")]
    for name in ("disk", "disk_8_threads", "shm"):
        if name in res:
            r = res[name]
            rows.append((f"extract -> {name}", f"{r['tokens_per_s']:,.0f}",
                         f"{r['tokens_per_s'] / f['tokens_per_s']:.0%} of forward; "
                         f"GPU in forwards {r['gpu_forward_s']:.1f}s; waited {r['wait_for_writer_s']:.1f}s for writer; "
                         f"writer busy {r['write_s']:.1f}s of {r['seconds']:.1f}s"))
    rows.append(("fill ratio / bytes per token", f"{d['fill_ratio']:.1%}", f"{d['bytes_per_token']:,.0f} B"))
    return rows


def fixed_shape_rate(cfg: ExtractConfig, rows: int, width: int, repeats: int = 10) -> dict:
    """Forward-only tokens/s of the target at one batch shape [rows, width], after one warm-up forward
    (the kernels see this shape only: what fla's kernels do at their best)."""
    model, _ = load_target(Path(cfg.target), torch.device(DEVICE), torch.bfloat16,
                           experts_implementation=cfg.experts_implementation)
    target = Target(model, [0])
    ids = torch.randint(0, 4000, (rows, width), device=DEVICE)
    target.forward(ids)
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        _, last = target.forward(ids)
        target.greedy(last.reshape(-1, last.shape[-1]))
    sync()
    dt = (time.perf_counter() - t0) / repeats
    del model, target
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"rows": rows, "width": width, "tokens_per_s": rows * width / dt, "ms": dt * 1e3}


def part_gdn(args, res, work):
    """2. GatedDeltaNet target: fla here (cold extraction first, then timed), torch in a process without fla."""
    from bench.fla_shapes import TritonEvents
    from dflash.target import linear_attention_backend

    events = TritonEvents() if DEVICE == "cuda" else None
    make_target(work / "gdn", "gdn", args.smoke)
    make_data(work / "gdn.jsonl", args.gdn_tokens, seed=1)
    gcfg = ExtractConfig(target=str(work / "gdn"), data=[str(work / "gdn.jsonl")], out=str(work / "gdn-fla"),
                         layers=[0, 1, 3], token_budget=8192, max_docs=64, device=DEVICE,
                         storage=args.storage)
    res["gdn_backend_here"] = linear_attention_backend()
    res["gdn_fla_cold"] = timed_extract(gcfg)  # the process's first: every compile and autotune counted
    res["gdn_fla_cold"]["triton"] = events.take() if events else {}
    log("gdn fla, cold:", json.dumps(res["gdn_fla_cold"]))
    res["gdn_fla"] = timed_extract(gcfg)
    res["gdn_fla"]["triton"] = events.take() if events else {}
    log("gdn fla:", json.dumps(res["gdn_fla"]))
    res["gdn_forward_only"] = forward_only(gcfg, work / "gdn-fla")
    res["gdn_fixed_shape"] = fixed_shape_rate(gcfg, 8, 2048)
    log("gdn forward only:", json.dumps(res["gdn_forward_only"]), json.dumps(res["gdn_fixed_shape"]))
    fla_cache = Cache(work / "gdn-fla")
    checked = range(min(3, fla_cache.num_shards))
    fla_states = [bf16_states(fla_cache, s) for s in checked]
    shutil.rmtree(work / "gdn-fla")  # one cache on the disk at a time (two of 2 M tokens fill 64 GB)
    tcfg = ExtractConfig(**{**gcfg.__dict__, "out": str(work / "gdn-torch")})
    res["gdn_torch"] = gdn_torch_path(tcfg, args.fla_dir)
    log("gdn torch:", json.dumps(res["gdn_torch"]))
    if "error" not in res["gdn_torch"]:
        torch_cache = Cache(work / "gdn-torch")
        res["gdn_rel_err_fla_vs_torch"] = max(((x - y).norm() / y.norm()).item() for x, y in
                                              zip(fla_states, (bf16_states(torch_cache, s) for s in checked)))
    fixed, fo = res["gdn_fixed_shape"]["tokens_per_s"], res["gdn_forward_only"]["tokens_per_s"]
    rows = [("GDN forward only, fla, fixed shape 8x2048", f"{fixed:,.0f}", "the kernels at their best"),
            ("GDN forward only, fla, extraction's batches", f"{fo:,.0f}", f"{fo / fixed:.0%} of fixed shape")]
    for name, what in (("gdn_fla_cold", "first in the process (every compile)"), ("gdn_fla", "second")):
        r = res[name]
        tri = r.get("triton") or {}
        rows.append((f"GDN extract, fla ({res['gdn_backend_here']}), {what}", f"{r['tokens_per_s']:,.0f}",
                     f"{r['tokens_per_s'] / fixed:.0%} of fixed shape; {r['wall_s']:.1f}s wall; "
                     f"{tri.get('compiles', '-')} compiles ({tri.get('compile_s', '-')}s), "
                     f"{tri.get('tunes', '-')} autotunes ({tri.get('tune_s', '-')}s)"))
    if "error" not in res["gdn_torch"]:
        t = res["gdn_torch"]
        rows.append(("GDN extract, torch fallback", f"{t['tokens_per_s']:,.0f}",
                     f"fla second run is {res['gdn_fla']['tokens_per_s'] / t['tokens_per_s']:.2f}x; "
                     f"max rel err vs fla {res['gdn_rel_err_fla_vs_torch']:.2e}"))
    shutil.rmtree(work / "gdn-torch", ignore_errors=True)
    return rows


def bf16_states(cache: Cache, shard: int) -> torch.Tensor:
    """A shard's states as fp32, whatever the storage."""
    return cache.states(cache.read_shard(shard), "cpu", torch.float32)


def active_flops_per_token(config, width: int) -> float:
    """Forward FLOPs per token of an MoE target counted on active parameters: 2 per active weight
    (attention, routed experts actually used, shared experts, routers; the LM head for the greedy
    token), plus attention scores over an average context of width / 2 (window-capped)."""
    c = config
    H, L = c.hidden_size, c.num_hidden_layers
    heads, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    attn = H * hd * (2 * heads + 2 * kv)
    experts = getattr(c, "num_experts", None) or c.num_local_experts
    inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    mlp = 3 * H * inter * c.num_experts_per_tok + H * experts
    window = getattr(c, "sliding_window", None) or width
    kinds = getattr(c, "layer_types", None) or ["full_attention"] * L
    ctx = sum(min(width, window) if k == "sliding_attention" else width for k in kinds) / 2
    return 2 * (L * (attn + mlp) + H * c.vocab_size) + 4 * ctx * heads * hd


def part_moe(args, res, work):
    """3. MoE targets: experts implementations, extraction vs forward-only, MFU, padding share."""
    from transformers import AutoConfig

    make_data(work / "moe.jsonl", args.moe_tokens, seed=2)
    rows = []
    for kind in MOE_SHAPES:
        make_target(work / kind, kind, args.smoke)
        r = res.setdefault("moe", {}).setdefault(kind, {})
        config = AutoConfig.from_pretrained(work / kind)
        for impl in args.moe_impls.split(","):
            cfg = ExtractConfig(target=str(work / kind), data=[str(work / "moe.jsonl")], out=str(work / "moe-cache"),
                                layers=[1, 3], token_budget=8192, max_docs=64, device=DEVICE,
                                experts_implementation=impl)
            try:
                r[impl] = fixed_shape_rate(cfg, 8, 2048, repeats=3 if impl != "grouped_mm" else 10)
            except torch.OutOfMemoryError as e:
                r[impl] = {"error": str(e).splitlines()[0][:200]}
                torch.cuda.empty_cache()
            log(kind, impl, json.dumps(r[impl]))
            rate = r[impl].get("tokens_per_s")
            mfu = rate * active_flops_per_token(config, 2048) / PEAK_FLOPS if rate else None
            rows.append((f"{kind} forward only, {impl}, 8x2048", f"{rate:,.0f}" if rate else "-",
                         f"MFU on active parameters {mfu:.1%}" if mfu else r[impl].get("error", "")))
        for batch_tokens in map(int, args.moe_batch_tokens.split(",")):
            cfg = ExtractConfig(target=str(work / kind), data=[str(work / "moe.jsonl")], out=str(work / "moe-cache"),
                                layers=[1, 3], token_budget=8192, max_docs=64, batch_tokens=batch_tokens, device=DEVICE)
            warm_up(cfg)
            first = timed_extract(cfg)  # a process's first full extraction ran its forwards up to 2x slower
            ex = timed_extract(cfg)
            ex["first_pass"] = {k: first[k] for k in ("tokens_per_s", "gpu_forward_s", "wait_for_writer_s")}
            fo = forward_only(cfg, work / "moe-cache")
            pad = 1 - ex["tokens"] / ex["padded_tokens"]
            r[f"extract_{batch_tokens}"], r[f"forward_only_{batch_tokens}"] = ex, fo
            rows.append((f"{kind} extract, {batch_tokens} tokens/forward", f"{ex['tokens_per_s']:,.0f}",
                         f"{ex['tokens_per_s'] / fo['tokens_per_s']:.0%} of forward-only ({fo['tokens_per_s']:,.0f}); "
                         f"first pass {first['tokens_per_s']:,.0f}; "
                         f"MFU {ex['tokens_per_s'] * active_flops_per_token(config, 700) / PEAK_FLOPS:.1%}; "
                         f"padding {pad:.1%} of expert tokens"))
            log(kind, batch_tokens, json.dumps(ex), json.dumps(fo))
            shutil.rmtree(work / "moe-cache")
        shutil.rmtree(work / kind)
    return rows


def main():
    from dflash import logs

    logs.setup()  # the library's log lines on stderr, as the dflash command shows them
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="folder for results.json")
    p.add_argument("--work", default="/tmp/bench", help="scratch folder on the disk being measured")
    p.add_argument("--parts", default="qwen3,gdn,moe", help="which measurements: qwen3, gdn, moe")
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--gdn-tokens", type=int, default=2_000_000)
    p.add_argument("--moe-tokens", type=int, default=1_000_000)
    p.add_argument("--moe-impls", default="grouped_mm,eager,batched_mm", help="moe part: experts implementations timed")
    p.add_argument("--moe-batch-tokens", default="32768,65536", help="moe part: tokens per forward of the extractions")
    p.add_argument("--storage", default="bf16", help="gdn part: the cache storage (fp8 halves the writer's bytes)")
    p.add_argument("--fla-dir", default="/tmp/fla",
                   help="the folder fla was installed into (hidden from the torch run)")
    p.add_argument("--smoke", action="store_true", help="toy widths on the CPU: checks this script, measures nothing")
    args = p.parse_args()
    global DEVICE, PEAK_FLOPS
    if args.smoke:
        DEVICE = "cpu"
    else:
        PEAK_FLOPS = (peak_tflops(torch.cuda.get_device_name()) or float("nan")) * 1e12
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    import transformers

    res = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__}
    log(json.dumps(res))
    rows = []
    for part in args.parts.split(","):
        rows += {"qwen3": part_qwen3, "gdn": part_gdn, "moe": part_moe}[part](args, res, work)
        # after each part: a cut run keeps what it measured
        (out / "results.json").write_text(json.dumps(res, indent=2))
    print("\n| measure | tok/s | notes |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


if __name__ == "__main__":
    main()
