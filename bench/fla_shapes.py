"""Where a GatedDeltaNet target's time goes with flash-linear-attention: the forward of a Qwen3.5-shaped
target (random bf16, hidden 4096, 3 GatedDeltaNet + 1 attention layer) at a sequence of batch shapes,
each timed, with the Triton compiles (count, seconds, kernels) and autotuning runs it triggers.

    python bench/fla_shapes.py --out $OUT/fla-shapes          # on the GPU, fla importable
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES = [(8, 2048), (8, 2048), (16, 1024), (8, 1536), (8, 1792), (8, 1000), (8, 1536), (4, 2048), (8, 2048)]


class TritonEvents:
    """Counts Triton JIT compiles and autotuning runs (and their seconds) per kernel."""

    def __init__(self):
        import triton
        from triton.runtime import autotuner, jit

        self.compiles, self.tunes = collections.Counter(), collections.Counter()
        self.compile_s = self.tune_s = 0.0
        original_compile, original_run = jit.JITFunction._do_compile, autotuner.Autotuner.run
        events = self

        def do_compile(fn, *a, **k):
            t0 = time.perf_counter()
            out = original_compile(fn, *a, **k)
            events.compile_s += time.perf_counter() - t0
            events.compiles[fn.__name__] += 1
            return out

        def run(tuner, *a, **k):
            before = len(tuner.cache)
            t0 = time.perf_counter()
            out = original_run(tuner, *a, **k)
            if len(tuner.cache) > before:
                events.tune_s += time.perf_counter() - t0
                events.tunes[tuner.base_fn.__name__] += 1
            return out

        jit.JITFunction._do_compile = do_compile
        autotuner.Autotuner.run = run
        self.version = triton.__version__

    def take(self) -> dict:
        out = {"compiles": sum(self.compiles.values()), "compile_s": round(self.compile_s, 2),
               "tunes": sum(self.tunes.values()), "tune_s": round(self.tune_s, 2),
               "compiled": dict(self.compiles), "tuned": dict(self.tunes)}
        self.compiles, self.tunes = collections.Counter(), collections.Counter()
        self.compile_s = self.tune_s = 0.0
        return out


def main():
    from dflash import logs

    logs.setup()  # the library's log lines on stderr, as the dflash command shows them
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=None, help="rows x width list, e.g. 8x2048,8x1536")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    from bench.extract import make_target
    from dflash.target import Target, linear_attention_backend, load_target

    events = TritonEvents()
    make_target(Path("/tmp/fla-shapes-target"), "gdn")
    model, _ = load_target(Path("/tmp/fla-shapes-target"), torch.device("cuda"), torch.bfloat16)
    target = Target(model, [0, 1, 3])
    rows = []
    print(f"backend {linear_attention_backend()}, triton {events.version}, torch {torch.__version__}", flush=True)
    for b, w in shapes:
        ids = torch.randint(0, 4000, (b, w), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        target.forward(ids)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(3):
            target.forward(ids)
        torch.cuda.synchronize()
        steady = (time.perf_counter() - t0) / 3
        row = {"rows": b, "width": w, "first_s": round(first, 3), "steady_ms": round(steady * 1e3, 2),
               "tok_per_s": round(b * w / steady), **events.take()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "fla_shapes.json").write_text(json.dumps(rows, indent=2))
    print("\n| shape | first call s | steady ms | tok/s | compiles (s) | autotunes (s) |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']}x{r['width']} | {r['first_s']} | {r['steady_ms']} | {r['tok_per_s']:,} | "
              f"{r['compiles']} ({r['compile_s']}) | {r['tunes']} ({r['tune_s']}) |")


if __name__ == "__main__":
    main()
