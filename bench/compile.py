"""Cold and warm start of the compiled training step on one GPU (results go to bench/RESULTS.md).

For each shape, `dflash.train.train` runs in its own process on a synthetic cache (bench/train.py's
writer), in up to three conditions:
  cold     empty Inductor, Triton and dflash compile caches: a fresh machine;
  warm     the same command again in a new process: the same machine, every cache kept;
  carried  a new process with empty Inductor and Triton caches but the dflash compile cache of the cold
           run: a fresh machine that has the user's ~/.cache/dflash.
Per run: the first step (compile + first run), the second (CUDA-graph recording) and the third
(replay), each timed with a sync; where the first step's time goes (torch._dynamo.utils.compile_times:
dynamo tracing, AOT autograd, Inductor lowering and code generation, Triton compilation and autotuning,
forward and backward); then the steady step time, MFU, recompiles, CUDA-graph skips and peak memory.

Shapes (the Qwen3-8B drafter: 5 layers, hidden 4096, vocab 151936; the tiny target's drafter: hidden 256,
vocab 4096):
  8b-12288  T = 12288 (4 x 3072-token documents), 2048 anchors
  8b-3072   T = 3072 (one document), 512 anchors
  tiny-4096 4 layers, T = 4096 (chat-like rows), 512 anchors, target layers 1, 3, 5
  tiny-1024 the embedded preset's 2 layers, T = 1024, 128 anchors

    source bench/setup_device.sh || exit; python3 bench/compile.py --out $OUT --shapes 8b-3072,tiny-4096
    python3 bench/compile.py --out $OUT --shapes tiny-4096 --set triton.autotune_pointwise=True   # a compile option
    python3 bench/compile.py --out $OUT --shapes 8b-12288 --train compile_regions=true   # a TrainConfig field
    python3 bench/compile.py --out $OUT --shapes tiny-4096 --flex bwd_num_stages=2   # a flex kernel option
    python3 bench/compile.py --out $OUT --shapes tiny-4096 --conditions cold --kernel-times   # per-kernel compile s
    python3 bench/compile.py --out $OUT --shapes 8b-12288 --conditions cold --profile   # where the CPU time goes
    python bench/compile.py --smoke --out /tmp/compile-smoke      # toy widths on the CPU (compile="yes")
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.train import QWEN3_8B, chat_documents, run, synthetic_cache  # noqa: E402

_tiny = json.loads((REPO / "data" / "tiny-target" / "config.json").read_text())
TINY = {**{k: _tiny[k] for k in QWEN3_8B if k in _tiny}, "rope_theta": _tiny["rope_parameters"]["rope_theta"]}
SMOKE = {**TINY, "hidden_size": 64, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
         "dflash_mask_token_id": 5}
# name: (dims, target layers, drafter layers, T, max docs, anchors, documents: "long" (T-filling) or "chat")
SHAPES = {"8b-12288": (QWEN3_8B, [1, 9, 17, 25, 33], 5, 12288, 8, 2048, "long"),
          "8b-3072": (QWEN3_8B, [1, 9, 17, 25, 33], 5, 3072, 1, 512, "long"),
          "tiny-4096": (TINY, [1, 3, 5], 4, 4096, 64, 512, "chat"),
          "tiny-1024": (TINY, [1, 2, 3], 2, 1024, 64, 128, "chat"),
          "smoke": (SMOKE, [1, 3], 1, 256, 8, 16, "chat")}
CONDITIONS = ("cold", "warm", "carried")


def log(*a):
    print(*a, flush=True)


def documents(kind: str, T: int, n_shards: int, rng) -> tuple[np.ndarray, list[np.ndarray]]:
    """T-filling documents (3072 tokens, or T if shorter), or chat-like rows (bench/train.py's) cut to T."""
    if kind == "long":
        n = min(T, 3072)
        return np.full(n_shards * (T // n), n), [np.ones(n, np.uint8)] * (n_shards * (T // n))
    lens, masks = chat_documents(rng, n_shards * max(T // 700, 1) + 8)
    return np.minimum(lens, T), [m[:T] for m in masks]


def make_cache(shape: str, work: Path, device: str, n_shards: int = 6) -> Path:
    dims, layers, _, T, D, _, kind = SHAPES[shape]
    path = work / f"cache-{shape}"
    if not path.exists():
        lens, masks = documents(kind, T, n_shards, np.random.default_rng(0))
        synthetic_cache(path, lens, masks, T, D, dims, device, layers=layers)
    return path


# -- the child: one training run, timed ---------------------------------------------------------------


def child(args) -> None:
    """One `dflash train` run in this process (bench/train.py's), its first 3 steps timed apart; the
    measurements as JSON on the last line of stdout."""
    import logging

    from torch._dynamo.utils import compile_times, counters

    import dflash.objective as objective
    import dflash.train as trainlib

    bypass: list[str] = []  # why AOT autograd's cache was bypassed (a warm start then retraces the joint graph)

    class Bypass(logging.Handler):
        def emit(self, record):
            if "Bypassing" in record.getMessage():
                bypass.append(record.getMessage()[:300])

    aot_log = logging.getLogger("torch._functorch._aot_autograd.autograd_cache")
    aot_log.addHandler(Bypass())
    aot_log.setLevel(logging.INFO)

    for kv in args.set:  # Inductor knobs to try, e.g. triton.autotune_pointwise=True: the step's compile options
        key, value = kv.split("=", 1)
        trainlib.COMPILE_OPTIONS["options"][key] = json.loads(value.lower() if value in ("True", "False") else value)
    for kv in args.flex:  # flex_attention kernel options, e.g. bwd_num_stages=2
        key, value = kv.split("=", 1)
        objective.FLEX_KERNEL_OPTIONS[key] = json.loads(value)
    kernels = kernel_compiles(args.kernel_times)
    _, _, num_layers, _, _, anchors, _ = SHAPES[args.child]
    device = "cpu" if args.smoke else "cuda"
    step_s: list[float] = []
    plain_step = trainlib.train_step

    def timed_step(s, inputs, lr):  # the first 3 steps, each with a sync on both sides
        if len(step_s) >= 3:
            return plain_step(s, inputs, lr)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = plain_step(s, inputs, lr)
        if device == "cuda":
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
        return out

    trainlib.train_step = timed_step
    overrides = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.train)}
    profile = cProfile.Profile() if args.profile else None
    if profile:
        profile.enable()
    res = run(args.child, Path(args.cache), Path(args.work), anchors, args.steps, "yes", 5, device=device,
              num_layers=num_layers, **overrides)
    if profile:
        profile.disable()
        save_profile(profile, Path(args.out) / f"{args.child}-profile.txt")
    if kernels.per_kernel:
        kernels.save_slowest(Path(args.out) / f"{args.child}-slowest-kernels")
    keys, values = compile_times(repr="csv", aggregate=True)
    caches = {f"{group}.{k}": v for group in ("aot_autograd", "inductor") for k, v in counters[group].items()
              if "cache" in k}
    res.update(step_s_first3=step_s, compile_times={k: float(v) for k, v in zip(keys, values)}, set=args.set,
               train=args.train, caches=caches, aot_cache_bypass=bypass, flex=args.flex, kernels=kernels.summary())
    print("RESULT " + json.dumps(res), flush=True)


def save_profile(profile: cProfile.Profile, path: Path, n: int = 60) -> None:
    """The run's Python profile: the top functions by own time, then by cumulative time."""
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(n)
    path.write_text(text.getvalue())


class KernelCompiles:
    """Triton kernels Inductor asked for: how many were compiled in this process because the worker pool
    was not ready yet (each blocks codegen), and with `per_kernel` (compile_threads = 1: every kernel
    compiled here, one after another) each kernel's compile seconds."""

    def __init__(self):
        self.in_process, self.in_process_s, self.submitted, self.per_kernel, self.sources = 0, 0.0, 0, {}, {}

    def slowest(self, n: int) -> list[tuple[str, float]]:
        return sorted(self.per_kernel.items(), key=lambda kv: -kv[1])[:n]

    def save_slowest(self, folder: Path, n: int = 8) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for name, _ in self.slowest(n):
            (folder / f"{name[:120]}.py").write_text(self.sources.get(name, ""))

    def summary(self) -> dict:
        top = self.slowest(15)
        return {"in_process": self.in_process, "in_process_s": round(self.in_process_s, 2),
                "submitted": self.submitted, "per_kernel_total_s": round(sum(self.per_kernel.values()), 2),
                "per_kernel_top": [[k, round(v, 2)] for k, v in top]}


def kernel_compiles(per_kernel: bool) -> KernelCompiles:
    from torch._inductor import async_compile
    from torch._inductor.runtime import triton_heuristics

    rec = KernelCompiles()
    if per_kernel:
        torch._inductor.config.compile_threads = 1
        precompile = triton_heuristics.CachingAutotuner.precompile

        def timed_precompile(self, *a, **k):
            t0 = time.perf_counter()
            out = precompile(self, *a, **k)
            name = self.inductor_meta.get("kernel_name") or getattr(self.fn, "__name__", "?")
            rec.per_kernel[name] = rec.per_kernel.get(name, 0.0) + time.perf_counter() - t0
            rec.sources[name] = getattr(self.fn, "src", "")
            return out

        triton_heuristics.CachingAutotuner.precompile = timed_precompile
    triton = async_compile.AsyncCompile.triton

    def counted_triton(self, kernel_name, source_code, *a, **k):
        parallel = async_compile.AsyncCompile.use_process_pool()
        t0 = time.perf_counter()
        out = triton(self, kernel_name, source_code, *a, **k)
        if parallel:
            rec.submitted += 1
        else:
            rec.in_process += 1
            rec.in_process_s += time.perf_counter() - t0
        return out

    async_compile.AsyncCompile.triton = counted_triton
    return rec


# -- the parent: conditions, breakdown, table ---------------------------------------------------------


def breakdown(ct: dict) -> dict:
    """The first step's compile, by phase (seconds, summed over every graph compiled in the process)."""
    g = lambda k: ct.get(k, 0.0)  # noqa: E731
    fw, bw = g("compile_fx.<locals>.fw_compiler_base"), g("compile_fx.<locals>.bw_compiler")
    return {"total": g("_compile.compile_inner") + bw,
            "dynamo": g("_compile.compile_inner") - g("OutputGraph.call_user_compiler"),
            "aot_autograd": g("create_aot_dispatcher_function") - fw,
            "inductor_fw": fw, "inductor_bw": bw,
            "lowering": g("GraphLowering.run"), "scheduler": g("Scheduler.__init__") + g("Scheduler.codegen"),
            "triton_compile_wait": g("async_compile.wait"),
            "autotune": sum(v for k, v in ct.items() if "benchmark_all_configs" in k or "autotune" in k.lower()),
            "load_modules": g("PyCodeCache.load_by_key_path")}


def run_child(shape: str, cache: Path, condition: str, args, dirs: dict) -> dict:
    env = dict(os.environ)
    torch_dir = dirs["torch"] if condition != "carried" else dirs["torch_carried"]
    env.update(TORCHINDUCTOR_CACHE_DIR=str(torch_dir / "inductor"), TRITON_CACHE_DIR=str(torch_dir / "triton"),
               DFLASH_CACHE_DIR=str(dirs["dflash"]))
    knobs = ([x for s in args.set for x in ("--set", s)] + [x for s in args.train for x in ("--train", s)]
             + [x for s in args.flex for x in ("--flex", s)] + ["--kernel-times"] * args.kernel_times
             + ["--profile"] * args.profile)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", shape, "--cache", str(cache), "--work",
           str(args.work), "--steps", str(args.steps), "--out", str(args.out), *knobs,
           *(["--smoke"] if args.smoke else [])]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    (Path(args.out) / f"{shape}-{condition}.log").write_text(p.stdout[-200_000:] + p.stderr[-200_000:])
    line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("RESULT ")), None)
    if line is None:
        return {"error": f"exit {p.returncode}: {(p.stderr or p.stdout).strip().splitlines()[-1:]}",
                "process_s": time.perf_counter() - t0}
    res = json.loads(line[len("RESULT "):])
    res["process_s"] = time.perf_counter() - t0
    res["breakdown"] = breakdown(res.pop("compile_times"))
    res["artifact_bytes"] = sum(f.stat().st_size for f in (dirs["dflash"] / "compile").glob("*.bin"))
    return res


def host_cpu() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?") if Path("/proc/cpuinfo").exists() else "?"
    return {"model": model, "cores": len(os.sched_getaffinity(0))}


def main():
    from dflash import logs

    logs.setup()  # the library's log lines on stderr, as the dflash command shows them
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/bench-compile")
    p.add_argument("--shapes", default="8b-12288,8b-3072,tiny-4096")
    p.add_argument("--conditions", default=",".join(CONDITIONS), help=f"any of {', '.join(CONDITIONS)}")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--set", action="append", default=[], help="a compile option of the step for every run: KEY=VALUE")
    p.add_argument("--train", action="append", default=[], help="a TrainConfig field for every run: KEY=JSON")
    p.add_argument("--flex", action="append", default=[], help="a flex_attention kernel option: KEY=JSON")
    p.add_argument("--kernel-times", action="store_true",
                   help="diagnosis: compile every Triton kernel in the process, one at a time, and time each")
    p.add_argument("--profile", action="store_true",
                   help="diagnosis: profile the run's Python (cProfile: slows the compile; one condition) into "
                        "<shape>-profile.txt")
    p.add_argument("--child-timeout", type=float, default=560)
    p.add_argument("--smoke", action="store_true", help="toy widths on the CPU: checks this script")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    shapes = ["smoke"] if args.smoke else args.shapes.split(",")
    device = "cpu" if args.smoke else "cuda"
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "host_cpu": host_cpu(),  # the compile is CPU-bound: machines of one GPU kind differ by up to 1.5x
           "torch": torch.__version__, "set": args.set, "train": args.train, "flex": args.flex,
           "kernel_times": args.kernel_times}
    rows = []
    for shape in shapes:
        cache = make_cache(shape, work, device)
        dirs = {k: work / f"{shape}-{k}" for k in ("torch", "torch_carried", "dflash")}
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
        for condition in args.conditions.split(","):
            r = res.setdefault(shape, {})[condition] = run_child(shape, cache, condition, args, dirs)
            log(shape, condition, json.dumps(r))
            (out / "results.json").write_text(json.dumps(res, indent=2))  # a cut run keeps what it measured
            if "error" in r:
                rows.append(f"| {shape} | {condition} | error: {r['error']} |")
                continue
            b, s3 = r["breakdown"], r["step_s_first3"]
            rows.append(f"| {shape} | {condition} | {s3[0]:.1f} | {b['dynamo']:.1f} | {b['aot_autograd']:.1f} | "
                        f"{b['inductor_fw']:.1f} / {b['inductor_bw']:.1f} | {b['triton_compile_wait']:.1f} | "
                        f"{b['autotune']:.1f} | {s3[1]:.2f} | {r['step_ms']:.1f} | {r['mfu']:.1%} | "
                        f"{r['recompiles']} / {r['cudagraph_skips']} | {r['peak_mem_gb']:.1f} |")
    print("\n| shape | start | step 1 s | dynamo | AOT | Inductor fw / bw | Triton wait | autotune | step 2 s "
          "(graph record) | step ms | MFU | recompiles / skips | peak GB |\n|" + "---|" * 13)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
