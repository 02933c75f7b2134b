"""DFlash2's top-K over the vocabulary, one cross-entropy chunk: torch.topk against a two-stage top-K (the top-K of
each group of vocabulary columns, then the top-K of the group winners; exact, as every global winner is among its
group's). Checks that both pick the same values, then times each, eager and compiled, on the GPU (CPU: --smoke).

    python bench/topk.py [--rows 1536 --vocab 151936 --k 16 --groups 128,256,1024] [--out DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def naive_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x.topk(k)


def two_stage_topk(x: torch.Tensor, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [c, k] of x [c, V], as torch.topk: each group of `group` columns' top-k [c, G, k] (the last
    group padded with -inf), then the top-k of those G * k candidates."""
    c, V = x.shape
    G = math.ceil(V / group)
    padded = torch.nn.functional.pad(x, (0, G * group - V), value=float("-inf")) if G * group != V else x
    v1, i1 = padded.view(c, G, group).topk(k)  # [c, G, k]
    v2, j = v1.view(c, G * k).topk(k)  # [c, k]
    columns = i1.view(c, G * k).gather(1, j) + (j // k) * group
    return v2, columns


def timed(fn, x, k, reps: int) -> float:
    """Milliseconds per call (CUDA events; CPU: wall clock)."""
    for _ in range(3):
        fn(x, k)
    if x.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn(x, k)
        end.record()
        torch.cuda.synchronize()  # host sync: the events' time
        return start.elapsed_time(end) / reps
    t = time.perf_counter()
    for _ in range(reps):
        fn(x, k)
    return (time.perf_counter() - t) * 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1536, help="rows of one cross-entropy chunk")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--groups", default="128,256,512,1024")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU")
    args = ap.parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    rows, vocab, reps = (64, 5000, 3) if args.smoke else (args.rows, args.vocab, args.reps)
    x = torch.randn(rows, vocab, device=device).to(torch.bfloat16)  # the head's raw logits, many ties in bf16
    want = naive_topk(x, args.k)
    results = []
    variants = [("torch.topk", naive_topk)] + [
        (f"two-stage, group {g}", lambda x, k, g=g: two_stage_topk(x, k, g)) for g in map(int, args.groups.split(","))]
    for name, fn in variants:
        for mode in ("eager", "compiled"):
            f = torch.compile(fn, dynamic=False) if mode == "compiled" else fn
            values, ids = f(x, args.k)
            same = bool(torch.equal(values, want.values) and torch.equal(x.gather(1, ids), values))
            results.append({"variant": name, "mode": mode, "ms": round(timed(f, x, args.k, reps), 4), "exact": same})
    print(f"top-{args.k} of [{rows}, {vocab}] bf16 on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    print(f"{'variant':24} {'mode':9} {'ms':>8}  exact")
    for r in results:
        print(f"{r['variant']:24} {r['mode']:9} {r['ms']:8.3f}  {r['exact']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "topk.json").write_text(json.dumps({"rows": rows, "vocab": vocab, "k": args.k, "device": device,
                                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
