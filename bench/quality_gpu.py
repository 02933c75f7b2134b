#!/usr/bin/env python
"""The drafter quality figures on one GPU in one device call: the tiny target writes ~49 K function bodies (`dflash
regenerate`), they are cached (`dflash extract`), and a B = 16 drafter trains on them for as many steps
as the call's time budget allows (a short probe run measures the step time first, so the cosine
schedule ends inside the budget). Then export, offline τ on the held-out shards and, if given, on a
cache of `dflash spec`'s answers to the held-out prompts. The GPU tests run beside it.

Prompts: `python scripts/make_code_data.py --all .qdata/code_all.jsonl` (here: the header set depends on
the Python build the target's corpus came from). Online τ (`dflash spec`) is measured afterwards from the
returned export; see bench/RESULTS.md (2026-12-03: regenerate 171 s, extract ~80 s, cold compile ~270 s,
4.5 ms per step; two calls: the first regenerates and probes, the second reuses its generations).

    source bench/setup_device.sh || exit; python3 bench/quality_gpu.py --out $OUT --budget 540
    python bench/quality_gpu.py --smoke --out /tmp/qg      # toy sizes on the CPU, to check the script
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

T0 = time.monotonic()
REPO = Path(__file__).resolve().parent.parent
DFLASH = [sys.executable, "-m", "dflash"]  # the GPU machine has the repo on PYTHONPATH, no console script


def elapsed() -> float:
    return time.monotonic() - T0


def run(cmd: list[str], log: Path, timeout: float | None = None) -> float:
    """Run one dflash command, its output appended to `log`; returns its wall time. A command past its
    timeout is killed (the caller uses whatever it committed)."""
    t = time.monotonic()
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            f.write(f"\n[killed after {timeout:.0f} s]\n")
            return time.monotonic() - t
    if rc:
        sys.exit(f"failed ({rc}): {' '.join(cmd)}; see {log}")
    return time.monotonic() - t


def step_metrics(run_dir: Path) -> list[dict]:
    """The run's logged steps (metrics.jsonl without its evaluation lines)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if "loss" in r]


def offline_tau(drafter: Path, cache: Path, device: str):
    """dflash eval's JSON, or the end of its error."""
    ev = subprocess.run([*DFLASH, "eval", "--drafter", str(drafter), "--cache", str(cache), "--json",
                         "--device", device], capture_output=True, text=True, cwd=REPO)
    return json.loads(ev.stdout) if ev.returncode == 0 else ev.stderr[-500:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="results (summary.json, logs, the export)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/qg-work"), help="scratch, emptied at the start")
    ap.add_argument("--budget", type=float, default=540, help="seconds for everything, from this script's start")
    ap.add_argument("--prompts", default=".qdata/code_all.jsonl", help="headers for the target to continue")
    ap.add_argument("--gen", help="already generated rows (skips regenerate; .jsonl or .jsonl.gz)")
    ap.add_argument("--answers", help="dflash spec --save-outputs answers: offline tau on a cache of them")
    ap.add_argument("--layers", action="append",
                    help="target layers a drafter reads; repeat for one main run each (default 1,3,5)")
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--max-steps", type=int, default=100_000, help="upper bound on the main run's steps")
    ap.add_argument("--step-ms", type=float, help="the main run's step time from an earlier probe (skips it)")
    ap.add_argument("--startup-s", type=float, default=280,
                    help="with --step-ms: the main run's start, mostly the cold compile (~270 s on the H200)")
    ap.add_argument("--no-tests", action="store_true", help="skip the GPU tests")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU")
    args = ap.parse_args()
    out, work = args.out, args.work
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)  # a second call on a warm machine would resume the first call's runs
    work.mkdir(parents=True)
    log = out / "log.txt"
    dev = "cpu" if args.smoke else "cuda"
    layer_sets = args.layers or ["1,3,5"]
    extract_layers = ",".join(map(str, sorted({int(i) for ls in layer_sets for i in ls.split(",")})))
    limit = ["--limit", "48"] if args.smoke else []
    summary: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "seconds": {}}

    def save() -> None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))

    tests = None
    if not args.no_tests and not args.smoke:  # beside the rest: they take minutes, mostly compiling
        tests = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "tests/test_gpu_train.py", "tests/test_gpu.py"],
                                 stdout=(out / "gpu-tests.log").open("w"), stderr=subprocess.STDOUT, cwd=REPO)

    # 1. the target writes the training text
    gen = work / "code_all.gen.jsonl"
    if args.gen:
        opener = gzip.open if args.gen.endswith(".gz") else open
        with opener(args.gen, "rb") as src, gen.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    else:
        summary["seconds"]["regenerate"] = run(
            [*DFLASH, "regenerate", "--target", "data/tiny-target", "--data", args.prompts, "--out", str(gen),
             "--prompt-tokens", "100000", "--max-new-tokens", "192", "--batch-size", "8" if args.smoke else "1024",
             "--device", dev, *limit], log)
        with gen.open("rb") as src, gzip.open(out / "code_all.gen.jsonl.gz", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)  # back to the workstation: a later call (--gen) reuses it
    save()

    # 2. the cache of the distinct texts (a quarter of the headers are common signatures such as
    #    `def __init__(self):`, whose greedy bodies are identical), every target layer a run reads
    unique, seen = work / "code_all.unique.jsonl", set()
    with gen.open(encoding="utf-8") as src, unique.open("w", encoding="utf-8") as dst:
        for line in src:
            text = json.loads(line)["text"]
            if text not in seen:
                seen.add(text)
                dst.write(line)
    summary["distinct_rows"] = len(seen)
    cache = work / "cache"
    gpu_extract = [] if args.smoke else ["--batch-size", "512", "--batch-tokens", "131072"]
    summary["seconds"]["extract"] = run(
        [*DFLASH, "extract", "--config", "configs/tiny.toml", "--out", str(cache), "--layers", extract_layers,
         "--data", str(unique), "--data", "data/sample/generated/text.jsonl",
         "--token-budget", str(args.token_budget), "--max-docs", "64", "--device", dev, *gpu_extract, *limit], log)
    save()

    train = [*DFLASH, "train", "--config", "configs/tiny.toml", "--cache", str(cache),
             "--num-layers", str(args.num_layers), "--num-anchors", str(16 if args.smoke else args.num_anchors),
             "--lr", str(args.lr),
             "--device", dev, "--eval-every", "0", *(["--holdout-shards", "1"] if args.smoke else [])]

    # 3. probe: the step time of exactly this configuration (its compile also warms inductor's cache),
    #    unless a previous call measured it (--step-ms, --startup-s)
    if args.step_ms:
        step_s, startup_s = args.step_ms / 1e3, args.startup_s
    else:
        probe = work / "probe"
        probe_steps = 20 if args.smoke else 300
        t = run([*train, "--layers", layer_sets[0], "--out", str(probe), "--max-steps", str(probe_steps),
                 "--log-every", "50", "--save-every", "100000"], log)
        step_s = args.token_budget / step_metrics(probe)[-1]["tokens_per_s"]  # the last window: compiled, warm
        startup_s = t - probe_steps * step_s
    summary["step"] = {"step_ms": 1e3 * step_s, "startup_s": startup_s, "measured": not args.step_ms}
    save()

    # 4. the main runs (one per --layers), each as many steps as fit, keeping ~45 s for export and evaluation
    reserve = 45 if not args.smoke else 5
    left = (args.budget - elapsed() - reserve) / len(layer_sets) - startup_s
    steps = max(100, min(args.max_steps, int(0.92 * left / step_s)))
    summary["runs"] = {}
    for layers in layer_sets:
        name = layers.replace(",", "-")
        run_dir, res = work / f"run-{name}", {"layers": layers, "planned_steps": steps}
        summary["runs"][layers] = res
        share = (args.budget - elapsed() - reserve) / (len(layer_sets) - list(layer_sets).index(layers))
        res["seconds"] = run([*train, "--layers", layers, "--out", str(run_dir), "--max-steps", str(steps),
                              "--log-every", "200", "--save-every", "1000"], log, timeout=max(30.0, share + 10))
        logged = step_metrics(run_dir)
        res.update(steps_done=logged[-1]["step"] if logged else 0, final=logged[-1] if logged else None)
        save()

        # 5. the drafter back to the workstation (online tau there) as one tar (at most 8 files come back):
        #    the run's config, metrics and newest weights, without the optimizer
        newest = sorted((run_dir / "checkpoints").glob("step-*"))
        if newest:
            with tarfile.open(out / f"run-{name}.tar", "w") as tar:
                for f in ["config.json", "metrics.jsonl", "checkpoints/latest.json",
                          *(f"checkpoints/{newest[-1].name}/{n}" for n in ("model.safetensors", "state.json"))]:
                    tar.add(run_dir / f, arcname=f"run-{name}/{f}")
        ex = subprocess.run([*DFLASH, "export", str(run_dir), "--out", str(work / f"drafter-{name}")],
                            capture_output=True, text=True, cwd=REPO)
        res["export"] = "ok" if ex.returncode == 0 else ex.stderr.strip()[-300:]  # checked, not returned
        res["holdout"] = offline_tau(run_dir, cache, dev)
        if args.answers:
            ans = work / "cache-answers"
            if not ans.exists():
                run([*DFLASH, "extract", "--config", "configs/tiny.toml", "--out", str(ans),
                     "--layers", extract_layers, "--data", args.answers, "--device", dev], log)
            res["answers"] = offline_tau(run_dir, ans, dev)
        save()
    if tests is not None:
        try:
            summary["gpu_tests_rc"] = tests.wait(timeout=max(1.0, args.budget - elapsed()))
        except subprocess.TimeoutExpired:
            tests.kill()
            summary["gpu_tests_rc"] = "killed at the budget"
    summary["seconds"]["total"] = elapsed()
    save()

    def tau(r):
        return f"{r['tau']:.3f} (anchors {r['tau_anchors']:.3f})" if isinstance(r, dict) else str(r)[:60]
    print(f"\n{'phase':<24}{'value'}")
    for k, v in summary["seconds"].items():
        print(f"{k + ' s':<24}{v:.1f}")
    print(f"{'step ms':<24}{summary['step']['step_ms']:.2f}")
    for layers, res in summary["runs"].items():
        print(f"layers {layers}: {res['steps_done']} of {res['planned_steps']} steps, "
              f"loss {res['final']['loss'] if res['final'] else float('nan'):.3f}, export {res['export'][:40]}")
        print(f"{'  tau held-out shards':<24}{tau(res.get('holdout'))}")
        print(f"{'  tau spec answers':<24}{tau(res.get('answers'))}")
    print(f"{'gpu tests rc':<24}{summary.get('gpu_tests_rc')}")


if __name__ == "__main__":
    main()
