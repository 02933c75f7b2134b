"""fp8 hidden-state cache on one GPU, in one device call (results go to bench/RESULTS.md):

1. tau: the tiny target's quality recipe (bench/quality.sh's main run: 2 layers, B = 16, A = 128, lr 3e-3,
   `--tau-steps` steps on the preset's target-written data, target layers 1, 3, 5) trained from a bf16 cache
   and from its fp8 conversions (128-channel blocks, one scale per row), same seed and data, plus a bf16 run
   of another seed for the noise floor; the runs share the GPU. Offline tau of each on one bf16 cache of the
   target's answers to the 100 held-out prompts (prompt/completion rows); the 128-block fp8 drafter
   also on the fp8 conversion of it. Reconstruction error of the tiny target's states, both layouts.
2. train: bench/train.py's run a (Qwen3-8B drafter shape, T = 12288 of 4 x 3072-token documents, 2048 anchors,
   compiled) from a bf16 cache and from its `dflash cache convert` to fp8: step time, input wait, MFU,
   recompiles, peak memory; convert's throughput.
3. extract: bench/extract.py's Qwen3-8B-shaped target cut to 6 layers (random bf16 weights), capturing layers
   1, 3, 5, T = 8192, chat-like lengths: tokens/s with --storage bf16 and fp8 into /dev/shm, into the disk
   folder (page cache), and to the disk (the same plus the `sync` that flushes it); bytes per token;
   reconstruction error of these states, both layouts.

Every part stops at its share of `--budget` and records what it has; `--parts` runs a subset.

    source bench/setup_device.sh || exit; python3 bench/fp8.py --out $OUT
    python bench/fp8.py --smoke --out /tmp/fp8-smoke        # toy sizes on the CPU, to check the script
    python bench/fp8.py --parts error --device cpu --out DIR --error-caches CACHE... --random-tokens 8000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

T0 = time.monotonic()
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash import fp8  # noqa: E402
from dflash.cache import Cache, info  # noqa: E402
from dflash.config import ExtractConfig  # noqa: E402
from dflash.convert import convert  # noqa: E402

DFLASH = [sys.executable, "-m", "dflash"]
PRESET = "configs/tiny.toml"
TAU_RUNS = {  # name: (cache, seed)
    "bf16": ("bf16", 0), "bf16_seed1": ("bf16", 1), "fp8_block128": ("fp8_block128", 0), "fp8_row": ("fp8_row", 0)}


def log(*a):
    print(*a, flush=True)


def elapsed() -> float:
    return time.monotonic() - T0


# -- reconstruction error -------------------------------------------------------------------------------


@torch.no_grad()
def reconstruction_error(path: Path, device, max_shards: int | None = None) -> dict:
    """The fp8 round trip of a bf16 cache's states, per captured layer, over the real tokens: for each scale
    layout the relative RMS error and the largest per-channel relative RMS error; and each layer's largest
    ratio of a row's peak to its RMS (how far massive activations stretch a row)."""
    cache = Cache(path)
    m = cache.manifest
    L, H = len(m["layer_ids"]), m["hidden_size"]
    layouts = {"block128": 128, "row": H}
    err = {k: torch.zeros(L, H, dtype=torch.float64, device=device) for k in layouts}
    signal = torch.zeros(L, H, dtype=torch.float64, device=device)
    peak = torch.zeros(L, device=device)
    tokens = 0
    for s in cache.committed()[:max_shards]:
        shard = cache.read_shard(s)
        n = int(shard.doc_lens.sum())
        x = cache.states(shard, device, torch.float32)[:n].transpose(0, 1)  # [L, n, H]
        signal += x.double().pow(2).sum(1)
        rms = x.pow(2).mean(-1).sqrt().clamp(min=1e-30)
        peak = torch.maximum(peak, (x.abs().amax(-1) / rms).amax(-1))
        for name, block in layouts.items():
            q, scale = fp8.quantize(x, block)
            err[name] += (fp8.dequantize(q, scale, block, torch.float32) - x).double().pow(2).sum(1)
        tokens += n
    out = {"cache": str(path), "layers": m["layer_ids"], "hidden_size": H, "tokens": tokens,
           "peak_to_rms": [round(float(p), 1) for p in peak]}
    for name in layouts:
        out[name] = {"rel_rms": [float(v) for v in (err[name].sum(1) / signal.sum(1)).sqrt()],
                     "max_channel_rel_rms": [float(v) for v in (err[name] / signal.clamp(min=1e-300)).sqrt().amax(1)]}
    return out


def error_table(results: dict) -> list[str]:
    rows = []
    for what, r in results.items():
        for i, layer in enumerate(r["layers"]):
            rows.append(f"| {what} | {layer} | {r['block128']['rel_rms'][i]:.4f} | "
                        f"{r['block128']['max_channel_rel_rms'][i]:.4f} | {r['row']['rel_rms'][i]:.4f} | "
                        f"{r['row']['max_channel_rel_rms'][i]:.4f} | {r['peak_to_rms'][i]:.0f} |")
    return ["| states | layer | 128-block rel RMS | its worst channel | per-row rel RMS | its worst channel | "
            "peak/RMS |", "|---|---|---|---|---|---|---|", *rows]


def random_target_error(args, work: Path, out: Path, device: str) -> dict:
    """Reconstruction error of a Qwen3-8B-width random target's states (hidden 4096, GQA 32/8, MLP 12288; cut
    to `--random-layers` layers, a vocabulary of `--random-vocab`), captured at layers 1..L-1 of
    `--random-tokens` tokens of the sample text."""
    import transformers
    from transformers import AutoTokenizer

    from bench.train import QWEN3_8B

    path, cache = work / "qwen3-8b-width", work / "qwen3-8b-width-cache"
    shape = {k: QWEN3_8B[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                      "intermediate_size", "rms_norm_eps", "max_position_embeddings")}
    config = transformers.Qwen3Config(**shape, num_hidden_layers=args.random_layers, vocab_size=args.random_vocab,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    AutoTokenizer.from_pretrained(REPO / "data" / "tiny-target").save_pretrained(path)  # ids < 4096 fit any vocab
    layers = ",".join(map(str, range(1, args.random_layers)))
    run([*DFLASH, "extract", "--target", str(path), "--data", "data/sample/text.jsonl", "--out", str(cache),
         "--layers", layers, "--token-budget", "1024", "--max-docs", "16", "--batch-tokens", "4096",
         "--limit", str(max(1, args.random_tokens // 250)), "--device", device], out / "error.log")
    return reconstruction_error(cache, device)


# -- helpers ----------------------------------------------------------------------------------------------


def run(cmd: list[str], log_path: Path, timeout: float | None = None) -> float:
    """A dflash command, output appended to log_path; its wall time. Fails the part on a non-zero exit."""
    t = time.monotonic()
    with log_path.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, check=True, timeout=timeout)
    return time.monotonic() - t


def state_bytes(path: Path) -> float:
    return info(path)["state_bytes_per_token"]


# -- 1. tau ------------------------------------------------------------------------------------------------


def target_answers(work: Path, log_path: Path, device: str, limit: int | None) -> Path:
    """The tiny target's greedy answers (128 new tokens) to the 100 held-out code headers, as prompt/completion
    rows (loss on the answer only), as `dflash spec --save-outputs` writes them, but batched."""
    prompts, gen, answers = REPO / "data/sample/code_prompts.jsonl", work / "answers.gen.jsonl", work / "answers.jsonl"
    run([*DFLASH, "regenerate", "--target", "data/tiny-target", "--data", str(prompts), "--out", str(gen),
         "--prompt-tokens", "100000", "--max-new-tokens", "128", "--batch-size", "100", "--device", device,
         *(["--limit", str(limit)] if limit else [])], log_path)
    with gen.open() as g, prompts.open() as src, answers.open("w") as out:
        for line, original in zip(g, src):
            prompt, text = json.loads(original)["text"], json.loads(line)["text"]
            row = {"prompt": prompt, "completion": text[len(prompt):]} if text.startswith(prompt) else {"text": text}
            out.write(json.dumps(row) + "\n")
    return answers



def part_tau(args, work: Path, out: Path, device: str, deadline: float) -> dict:
    res: dict = {"steps": args.tau_steps, "seconds": {}}
    lp = out / "tau.log"
    small = ["--limit", "40"] if args.smoke else []
    answers = target_answers(work, lp, device, 4 if args.smoke else None)
    caches = {"bf16": work / "tau-bf16", "answers": work / "tau-answers"}
    gpu_batches = [] if args.smoke else ["--batch-size", "512", "--batch-tokens", "131072"]
    res["seconds"]["extract"] = run([*DFLASH, "extract", "--config", PRESET, "--out", str(caches["bf16"]),
                                     "--layers", "1,3,5", "--device", device, *gpu_batches, *small], lp)
    run([*DFLASH, "extract", "--config", PRESET, "--out", str(caches["answers"]), "--layers", "1,3,5",
         "--data", str(answers), "--device", device], lp)
    for name, block in (("fp8_block128", 128), ("fp8_row", 0)):
        caches[name] = work / f"tau-{name}"
        convert(caches["bf16"], caches[name], scale_block=block, device=device)
    caches["answers_fp8"] = work / "tau-answers-fp8"
    convert(caches["answers"], caches["answers_fp8"], device=device)
    res["error"] = reconstruction_error(caches["bf16"], device)
    res["bytes_per_token"] = {k: info(caches[k])["bytes_per_token"] for k in ("bf16", "fp8_block128", "fp8_row")}
    res["state_bytes_per_token"] = {k: state_bytes(caches[k]) for k in ("bf16", "fp8_block128", "fp8_row")}

    # the trainings share the GPU (the tiny drafter leaves most of it idle), so they run side by side
    procs = {}
    for name in args.tau_runs.split(","):
        cache, seed = TAU_RUNS[name]
        cmd = [*DFLASH, "train", "--config", PRESET, "--cache", str(caches[cache]), "--out", str(work / f"run-{name}"),
               "--layers", "1,3,5", "--max-steps", str(args.tau_steps), "--seed", str(seed), "--log-every", "250",
               "--save-every", str(args.tau_steps), "--eval-every", "0", "--device", device]
        f = (out / f"tau-train-{name}.log").open("w")
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        procs[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    t = time.monotonic()
    for name, p in procs.items():
        try:
            p.wait(timeout=max(1.0, deadline - elapsed() - (20 if args.smoke else 40)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    res["seconds"]["train"] = time.monotonic() - t
    res["runs"], evals = {}, {}
    for name in procs:
        run_dir = work / f"run-{name}"
        r: dict = {"exit": procs[name].returncode}
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] \
            if (run_dir / "metrics.jsonl").exists() else []
        steps = [x for x in metrics if "loss" in x]
        r["steps_done"] = steps[-1]["step"] if steps else 0
        r["final_loss"] = steps[-1]["loss"] if steps else None
        res["runs"][name] = r
        if procs[name].returncode == 0:  # every drafter on the bf16 answers; the fp8 one on their fp8 copy too
            for key in ("answers", "answers_fp8") if name == "fp8_block128" else ("answers",):
                evals[name, key] = subprocess.Popen(
                    [*DFLASH, "eval", "--drafter", str(run_dir), "--cache", str(caches[key]), "--json", "--device",
                     device], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    for (name, key), p in evals.items():
        stdout, stderr = p.communicate()
        res["runs"][name][key] = json.loads(stdout) if p.returncode == 0 else {"error": stderr[-500:]}
    base = res["runs"].get("bf16", {}).get("answers", {}).get("tau")
    for r in res["runs"].values():
        tau = r.get("answers", {}).get("tau")
        if base and tau:
            r["tau_vs_bf16"] = tau / base - 1
    return res


# -- 2. train -----------------------------------------------------------------------------------------------


def part_train(args, work: Path, out: Path, device: str, deadline: float) -> dict:
    from bench.train import QWEN3_8B, run as train_run, synthetic_cache

    dims, T, doc, anchors, steps, compile_ = dict(QWEN3_8B), 12288, 3072, 2048, args.train_steps, "yes"
    if args.smoke:
        dims.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                    vocab_size=512, dflash_mask_token_id=511)
        T, doc, anchors, steps, compile_ = 1024, 256, 64, 6, "no"
    res: dict = {"T": T, "anchors": anchors, "steps": steps}
    bf16, f8 = work / "train-bf16", work / "train-fp8"
    synthetic_cache(bf16, np.full(24, doc), [np.ones(doc, np.uint8)] * 24, T, 8, dims, device)  # 6 shards
    t = time.perf_counter()
    convert(bf16, f8, device=device)
    seconds = time.perf_counter() - t
    tokens = info(bf16)["tokens"]["committed"]
    res["convert"] = {"seconds": seconds, "tokens_per_s": tokens / seconds,
                      "source_gb_per_s": info(bf16)["bytes_on_disk"] / seconds / 1e9}
    res["state_bytes_per_token"] = {"bf16": state_bytes(bf16), "fp8": state_bytes(f8)}
    for name, cache in (("bf16", bf16), ("fp8", f8)):
        if elapsed() > deadline:
            res[name] = {"error": "skipped: out of budget"}
            continue
        try:
            res[name] = train_run(f"train-{name}", cache, work, anchors, steps, compile_, 5 if not args.smoke else 2,
                                  device=device)
        except Exception as e:  # keep going: one device call should tell as much as it can
            traceback.print_exc()
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:1000]}"}
        if device == "cuda":
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    if "step_ms" in res.get("fp8", {}) and "step_ms" in res.get("bf16", {}):
        res["fp8_step_vs_bf16"] = res["fp8"]["step_ms"] / res["bf16"]["step_ms"] - 1
    shutil.rmtree(bf16, ignore_errors=True)
    shutil.rmtree(f8, ignore_errors=True)
    return res


# -- 3. extract -----------------------------------------------------------------------------------------------


def prefault(folder: Path, nbytes: int) -> float:
    """Write and delete `nbytes` once: a fresh VM maps its memory in on first touch, which would slow
    whichever measured run first fills the page cache."""
    t = time.perf_counter()
    block = np.zeros(1 << 26, np.uint8)
    path = folder / "prefault.bin"
    with path.open("wb") as f:
        for _ in range(max(1, nbytes // block.nbytes)):
            f.write(block)
    path.unlink()
    return time.perf_counter() - t


def part_extract(args, work: Path, out: Path, device: str, deadline: float) -> dict:
    import bench.extract as bx

    bx.DEVICE = device
    res: dict = {}
    target, data = work / "qwen3-8b-6l", work / "data.jsonl"
    bx.make_target(target, "qwen3", args.smoke)
    res["rows"] = bx.make_data(data, args.extract_tokens)
    cfg = ExtractConfig(target=str(target), data=[str(data)], out=str(work / "x"), layers=[1, 3, 5],
                        token_budget=1024 if args.smoke else 8192, max_docs=64, batch_size=16, batch_tokens=32768,
                        device=device)
    res["warmup_s"] = bx.warm_up(cfg)
    shm = Path("/dev/shm")
    need = int(1.2 * 3 * (64 if args.smoke else 4096) * 2 * args.extract_tokens)  # the bf16 cache, with padding
    use_shm = shm.is_dir() and shutil.disk_usage(shm).free > 1.3 * need
    res["prefault_s"] = prefault(work, need)
    for where, folder in (("shm", shm / "dflash-fp8-bench"), ("disk", work / "x")):
        if where == "shm" and not use_shm:
            continue
        for storage in ("bf16", "fp8"):
            if elapsed() > deadline:
                res[f"{where}_{storage}"] = {"error": "skipped: out of budget"}
                continue
            os.sync()
            c = ExtractConfig(**{**cfg.__dict__, "out": str(folder), "storage": storage})
            r = bx.timed_extract(c)
            if where == "disk":
                t = time.perf_counter()
                os.sync()  # the page cache to the disk: what a cache larger than memory runs at
                r["sync_s"] = time.perf_counter() - t
                r["tokens_per_s_synced"] = r["tokens"] / (r["seconds"] + r["sync_s"])
            r["state_bytes_per_token"] = state_bytes(folder)
            if where == "disk" and storage == "bf16":
                res["error"] = reconstruction_error(folder, device)
            res[f"{where}_{storage}"] = r
            log(f"extract {where} {storage}:", json.dumps(r))
            shutil.rmtree(folder)
    shutil.rmtree(target)
    return res


# -- main ---------------------------------------------------------------------------------------------------


def main():
    from dflash import logs

    logs.setup()  # the library's log lines on stderr, as the dflash command shows them
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results.json, logs")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-fp8"), help="scratch folder on the disk measured")
    p.add_argument("--parts", default="tau,train,extract", help="any of tau, train, extract, error")
    p.add_argument("--budget", type=float, default=560, help="seconds for everything, from this script's start")
    p.add_argument("--tau-steps", type=int, default=6000)
    p.add_argument("--tau-runs", default=",".join(TAU_RUNS), help=f"any of {', '.join(TAU_RUNS)}")
    p.add_argument("--train-steps", type=int, default=25)
    p.add_argument("--extract-tokens", type=int, default=300_000)
    p.add_argument("--error-caches", nargs="*", default=[], help="error: bf16 caches to measure")
    p.add_argument("--random-tokens", type=int, default=0,
                   help="error: also a Qwen3-8B-width random target's states, on about this many tokens")
    p.add_argument("--random-layers", type=int, default=4, help="error: its depth")
    p.add_argument("--random-vocab", type=int, default=4096, help="error: its vocabulary")
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: checks this script, measures nothing")
    args = p.parse_args()
    if args.smoke:
        args.device, args.tau_steps, args.extract_tokens = "cpu", 20, 6000
        args.budget = max(args.budget, 1200)
    out, work = args.out, args.work
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    res = {"date": time.strftime("%Y-%m-%d"),
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}}
    parts = args.parts.split(",")
    # shares of the budget (tau's trainings compile from cold; train compiles twice; extract is quick)
    ends = {"tau": 0.45, "train": 0.80, "extract": 1.0, "error": 1.0}
    for part in parts:
        deadline = args.budget * ends[part] if part != parts[-1] else args.budget
        t = time.monotonic()
        try:
            if part == "error":
                res["error"] = {str(c): reconstruction_error(Path(c), args.device) for c in args.error_caches}
                if args.random_tokens:
                    res["error"]["Qwen3-8B-width random"] = random_target_error(args, work, out, args.device)
            else:
                fn = {"tau": part_tau, "train": part_train, "extract": part_extract}[part]
                res[part] = fn(args, work, out, args.device, deadline)
        except Exception as e:
            traceback.print_exc()
            res[part] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        res.setdefault("part_seconds", {})[part] = time.monotonic() - t
        (out / "results.json").write_text(json.dumps(res, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    summary(res)


def summary(res: dict) -> None:
    """The short tables, last."""
    tau, tr, ex = res.get("tau", {}), res.get("train", {}), res.get("extract", {})
    lines = []
    if tau.get("runs"):
        lines += ["", f"| tau run ({tau['steps']} steps) | steps done | final loss | tau on answers | vs bf16 seed 0 |",
                  "|---|---|---|---|---|"]
        for name, r in tau["runs"].items():
            a = r.get("answers", {})
            lines.append(f"| {name} | {r['steps_done']} | {r['final_loss'] or 0:.3f} | {a.get('tau', 0):.3f} | "
                         f"{r.get('tau_vs_bf16', 0):+.2%} |")
        f8 = tau["runs"].get("fp8_block128", {}).get("answers_fp8", {})
        if "tau" in f8:
            lines.append(f"| fp8_block128 on the fp8 answers cache | | | {f8['tau']:.3f} | |")
    measures = []
    if "step_ms" in tr.get("bf16", {}) and "step_ms" in tr.get("fp8", {}):
        b, f = tr["bf16"], tr["fp8"]
        measures += [f"| train step ms, T = {tr['T']} | {b['step_ms']:.1f} | {f['step_ms']:.1f} | "
                     f"{tr['fp8_step_vs_bf16']:+.2%} |",
                  f"| input wait | {b['input_wait']:.3%} | {f['input_wait']:.3%} | |",
                  f"| MFU / recompiles / peak GB | {b['mfu']:.1%} / {b['recompiles']} / {b['peak_mem_gb']:.1f} | "
                  f"{f['mfu']:.1%} / {f['recompiles']} / {f['peak_mem_gb']:.1f} | |",
                  f"| convert bf16 -> fp8 | | {tr['convert']['tokens_per_s']:,.0f} tok/s | "
                  f"{tr['convert']['source_gb_per_s']:.2f} GB/s of source |"]
    for where, key, field in (("/dev/shm", "shm", "tokens_per_s"), ("disk folder (page cache)", "disk", "tokens_per_s"),
                              ("disk incl. sync", "disk", "tokens_per_s_synced")):
        b, f = ex.get(f"{key}_bf16", {}), ex.get(f"{key}_fp8", {})
        if field in b and field in f:
            measures.append(f"| extract -> {where}, tok/s | {b[field]:,.0f} | {f[field]:,.0f} | "
                            f"{f[field] / b[field] - 1:+.1%} |")
    for what, r in (("extract", ex.get("disk_fp8") and {"bf16": ex["disk_bf16"].get("state_bytes_per_token"),
                                                        "fp8": ex["disk_fp8"].get("state_bytes_per_token")}),
                    ("train", tr.get("state_bytes_per_token")), ("tau (tiny)", tau.get("state_bytes_per_token"))):
        if r and r.get("bf16") and (r.get("fp8") or r.get("fp8_block128")):
            f = r.get("fp8") or r.get("fp8_block128")
            measures.append(f"| state bytes per token, {what} cache | {r['bf16']:,.0f} | {f:,.0f} | "
                            f"{f / r['bf16']:.3f}x |")
    if measures:
        lines += ["", "| measure | bf16 | fp8 | fp8 vs bf16 |", "|---|---|---|---|", *measures]
    errors = {k: v for k, v in (("tiny target", tau.get("error")), ("Qwen3-8B-shaped random", ex.get("error")))
              if isinstance(v, dict) and "layers" in v}
    errors.update({Path(k).name: v for k, v in res.get("error", {}).items() if isinstance(v, dict) and "layers" in v})
    if errors:
        lines += ["", *error_table(errors)]
    for part in ("tau", "train", "extract", "error"):
        if isinstance(res.get(part), dict) and isinstance(res[part].get("error"), str):
            lines.append(f"{part}: {res[part]['error'][:300]}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
