"""Stage-one benchmark on one GPU (run on the H200; see bench/RESULTS.md).

1. A Qwen3-8B-shaped target cut to a few layers (random weights, hidden 4096, 32/8 heads, MLP 12288,
   vocab 151936), T = 8192, chat-like document lengths: extraction tokens/s against the same target's
   forward-only tokens/s over the same batches, fill ratio, bytes per token, and where the time goes.
   The extraction runs twice: into the disk folder given, and into /dev/shm (no disk in the way).
2. A GatedDeltaNet target (Qwen3.5-shaped, cut to 3 linear-attention + 1 full-attention layers):
   extraction through fla's kernels (this process) and through transformers' torch fallback (a
   subprocess that cannot import fla); tokens/s of both and how far their states differ.

    python bench/extract.py --out $OUT/extract --work /tmp/bench
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
from dflash.target import Target, load_target  # noqa: E402

TINY_TOKENIZER = REPO / "data" / "tiny-target"
DEVICE = "cuda"


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
    stats = extract(cfg, log=log)
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="folder for results.json")
    p.add_argument("--work", default="/tmp/bench", help="scratch folder on the disk being measured")
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--gdn-tokens", type=int, default=60_000)
    p.add_argument("--fla-dir", default="/tmp/fla", help="the folder fla was installed into (hidden from the torch run)")
    p.add_argument("--smoke", action="store_true", help="toy widths on the CPU: checks this script, measures nothing")
    args = p.parse_args()
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    import transformers

    res = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
           "torch": torch.__version__,
           "transformers": transformers.__version__}
    log(json.dumps(res))

    # 1. Qwen3-8B-shaped, 6 layers, capture [1, 3, 5]
    t = time.perf_counter()
    n_rows = make_data(work / "data.jsonl", args.tokens)
    make_target(work / "qwen3-8b-6l", "qwen3", args.smoke)
    log(f"setup: {n_rows} rows, target saved in {time.perf_counter() - t:.0f}s")
    cfg = ExtractConfig(target=str(work / "qwen3-8b-6l"), data=[str(work / "data.jsonl")], out=str(work / "cache"),
                        layers=[1, 3, 5], token_budget=8192, max_docs=64, batch_size=16, batch_tokens=32768,
                        device=DEVICE)
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

    # 2. GatedDeltaNet target: fla path here, torch path in a process without fla
    from dflash.target import linear_attention_backend

    make_target(work / "gdn", "gdn", args.smoke)
    make_data(work / "gdn.jsonl", args.gdn_tokens, seed=1)
    gcfg = ExtractConfig(target=str(work / "gdn"), data=[str(work / "gdn.jsonl")], out=str(work / "gdn-fla"),
                         layers=[0, 1, 3], token_budget=8192, max_docs=64, batch_size=16, batch_tokens=32768,
                         device=DEVICE)
    res["gdn_backend_here"] = linear_attention_backend()
    res["gdn_fla_warmup_s"] = warm_up(gcfg)
    res["gdn_fla"] = timed_extract(gcfg)
    log("gdn fla:", json.dumps(res["gdn_fla"]))
    tcfg = ExtractConfig(**{**gcfg.__dict__, "out": str(work / "gdn-torch")})
    res["gdn_torch"] = gdn_torch_path(tcfg, args.fla_dir)
    log("gdn torch:", json.dumps(res["gdn_torch"]))
    if "error" not in res["gdn_torch"]:
        a, b = Cache(work / "gdn-fla"), Cache(work / "gdn-torch")
        errs = []
        for s in range(min(3, a.num_shards)):
            x = torch.from_numpy(a.read_shard(s).hidden.view(np.int16)).view(torch.bfloat16).float()
            y = torch.from_numpy(b.read_shard(s).hidden.view(np.int16)).view(torch.bfloat16).float()
            errs.append(((x - y).norm() / y.norm()).item())
        res["gdn_rel_err_fla_vs_torch"] = max(errs)
    (out / "results.json").write_text(json.dumps(res, indent=2))

    d, f = res["disk"], res["forward_only"]
    rows = [("forward only (same batches)", f"{f['tokens_per_s']:,.0f}", "")]
    for name in ("disk", "disk_8_threads", "shm"):
        if name in res:
            r = res[name]
            rows.append((f"extract -> {name}", f"{r['tokens_per_s']:,.0f}",
                         f"{r['tokens_per_s'] / f['tokens_per_s']:.0%} of forward; GPU in forwards {r['gpu_forward_s']:.1f}s; "
                         f"waited {r['wait_for_writer_s']:.1f}s for writer; writer busy {r['write_s']:.1f}s of {r['seconds']:.1f}s"))
    rows.append(("fill ratio / bytes per token", f"{d['fill_ratio']:.1%}", f"{d['bytes_per_token']:,.0f} B"))
    rows.append((f"GDN extract, fla ({res['gdn_backend_here']})", f"{res['gdn_fla']['tokens_per_s']:,.0f}",
                 f"after a {res['gdn_fla_warmup_s']:.0f}s warm-up (Triton autotuning)"))
    if "error" not in res["gdn_torch"]:
        rows.append(("GDN extract, torch fallback", f"{res['gdn_torch']['tokens_per_s']:,.0f}",
                     f"after a {res['gdn_torch']['warmup_s']:.0f}s warm-up; max rel err vs fla "
                     f"{res['gdn_rel_err_fla_vs_torch']:.2e}"))
    print("\n| measure | tok/s | notes |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


if __name__ == "__main__":
    main()
