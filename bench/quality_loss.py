#!/usr/bin/env python
"""Loss and attention variants side by side, in one GPU call: drafters of the tiny target trained with equal
tokens and steps on one cache of long documents, to compare D-PACE with the fixed decay (two seeds each),
a sliding window with full attention (documents longer than the window), and DFlash2 with DFlash.

1. The tiny target writes a body under every function header of its training files (`dflash regenerate`;
   or `--gen`: an earlier call's generations). The distinct texts are packed, in their files' order, into
   documents of up to `--doc-tokens` tokens (functions of one module after another, as a source file
   reads), so a 2048-token window cuts real context.
2. One cache (`dflash extract`, target layers 1, 3, 4: servable, the last layer is not; T = 4096).
3. The runs of `RUNS` at once on the one GPU, each `--steps` steps (the same schedule, seeds 0/1),
   checkpoints every `--save-every`: if the call's budget cuts them, they are compared at the last step all of
   them saved, if every run still holds it (a run keeps its newest two checkpoints: size `--steps` so that
   all finish; eight runs side by side on an H200 did ~20 steps/s each, after a ~50 s cold compile).
4. Each run's checkpoint at that step: offline tau (pooled, per document, anchor mean) on the held-out shards, an
   export, and online tau (`dflash spec`, lossless) on the 100 held-out code prompts; then, for the runs
   of `LONG`, on long prompts (about 3,000 tokens: other held-out functions with the target's own bodies,
   then a header), where a 2048-token window cuts the context.
5. What comes back: summary.json, log.txt, the generations (a later call's --gen), logs.tar.gz (training
   logs, spec outputs) and drafter-RUN.tar.gz (the exports of `--return`, one a file).

    source bench/setup_device.sh || exit; python3 bench/quality_loss.py --out $OUT --budget 580
    python bench/quality_loss.py --smoke --out /tmp/ql      # toy sizes on the CPU, to check the script
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
sys.path.insert(0, str(REPO))
DFLASH = [sys.executable, "-m", "dflash"]
# name -> `dflash train` options beyond the common ones
RUNS = {
    "decay-s0": ["--loss", "decay", "--seed", "0"],
    "decay-s1": ["--loss", "decay", "--seed", "1"],
    "dpace-s0": ["--loss", "dpace", "--seed", "0"],
    "dpace-s1": ["--loss", "dpace", "--seed", "1"],
    "w2048-s0": ["--loss", "decay", "--seed", "0", "--sliding-window", "2048"],
    "w2048-s1": ["--loss", "decay", "--seed", "1", "--sliding-window", "2048"],
    "w2048-causal-s0": ["--loss", "decay", "--seed", "0", "--sliding-window", "2048", "--causal-block"],
    "w256-s0": ["--loss", "decay", "--seed", "0", "--sliding-window", "256"],
    # DFlash2 beside dpace-s0/s1 (the same loss, full attention); selector defaults (top-16, rank 256)
    "dflash2-s0": ["--loss", "dpace", "--seed", "0", "--arch", "dflash2"],
    "dflash2-s1": ["--loss", "dpace", "--seed", "1", "--arch", "dflash2"],
}
LONG = ("decay-s0", "decay-s1", "w2048-s0", "w2048-s1", "w2048-causal-s0", "w256-s0")  # online on long prompts


def elapsed() -> float:
    return time.monotonic() - T0


def run(cmd: list[str], log: Path) -> float:
    t = time.monotonic()
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode:
            sys.exit(f"failed: {' '.join(cmd)}; see {log}")
    return time.monotonic() - t


def long_documents(gen: Path, out: Path, doc_tokens: int, target: Path) -> dict:
    """The distinct generated texts packed in order into `{"text"}` rows of up to `doc_tokens` tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    seen, docs, cur, cur_len = set(), [], [], 0
    for line in gen.open(encoding="utf-8"):
        text = json.loads(line)["text"]
        if text in seen:
            continue
        seen.add(text)
        n = len(tok(text)["input_ids"]) + 2
        if cur and cur_len + n > doc_tokens:
            docs.append("\n\n".join(cur))
            cur, cur_len = [], 0
        cur.append(text)
        cur_len += n
    if cur:
        docs.append("\n\n".join(cur))
    out.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    lengths = sorted(len(tok(d)["input_ids"]) for d in docs)
    return {"functions": len(seen), "documents": len(docs), "median_tokens": lengths[len(lengths) // 2],
            "over_2048": sum(n > 2048 for n in lengths)}


def make_long_prompts(answers: Path, out: Path, n: int, target: Path, tokens: int) -> dict:
    """Long prompts from held-out material only: prompt j is other held-out headers with the target's own
    greedy bodies (`dflash spec --save-outputs`), as many as fit in `tokens`, then header j."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    rows = [json.loads(x) for x in answers.read_text().splitlines()]
    texts = [r["prompt"] + r["completion"] for r in rows]
    sizes = [len(tok(t)["input_ids"]) for t in texts]
    prompts, lengths = [], []
    for j in range(min(n, len(rows))):
        parts, used, k = [], len(tok(rows[j]["prompt"])["input_ids"]), j + 1
        while k < j + len(rows) and used + sizes[k % len(rows)] + 2 <= tokens:
            parts.append(texts[k % len(rows)])
            used += sizes[k % len(rows)] + 2
            k += 1
        prompts.append("\n\n".join([*parts, rows[j]["prompt"]]))
        lengths.append(used)
    out.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))
    return {"prompts": len(prompts), "min_tokens": min(lengths), "median_tokens": sorted(lengths)[len(lengths) // 2]}


def checkpoints(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*")
                  if (p / "state.json").exists())


def keep_only(run_dir: Path, step: int) -> None:
    """Make the checkpoint of `step` the run's latest (later ones removed), so eval and export read it."""
    for p in (run_dir / "checkpoints").glob("step-*"):
        if int(p.name.split("-")[1]) > step:
            shutil.rmtree(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ql-work"))
    ap.add_argument("--budget", type=float, default=560, help="seconds for everything, from this script's start")
    ap.add_argument("--prompts", default=".qdata/code_all.jsonl", help="headers for the target to continue")
    ap.add_argument("--gen", help="already generated rows (skips regenerate; .jsonl or .jsonl.gz)")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--doc-tokens", type=int, default=3800)
    ap.add_argument("--limit", type=int, default=24000, help="headers regenerated (of ~48 K)")
    ap.add_argument("--reserve", type=float, default=200, help="seconds kept after training: eval, export, spec")
    ap.add_argument("--spec-prompts", type=int, default=100)
    ap.add_argument("--long-prompts", type=int, default=40)
    ap.add_argument("--return", dest="ret", default="decay-s0,dpace-s0",
                    help="runs whose exports come back (`all`: every run), two per archive (16 MiB a file)")
    ap.add_argument("--no-spec", action="store_true", help="no online tau here (run dflash spec on the exports)")
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    out, work = args.out, args.work
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = out / "log.txt"
    logs = work / "logs"
    logs.mkdir()
    dev = "cpu" if args.smoke else "cuda"
    summary: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "seconds": {}}

    def save() -> None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))

    tests = None
    if not args.no_tests and not args.smoke:
        tests = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests"],
                                 stdout=(logs / "gpu-tests.log").open("w"), stderr=subprocess.STDOUT, cwd=REPO)

    gen = work / "gen.jsonl"
    if args.gen:
        opener = gzip.open if args.gen.endswith(".gz") else open
        with opener(args.gen, "rb") as src, gen.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    else:
        limit = ["--limit", "60" if args.smoke else str(args.limit)]
        summary["seconds"]["regenerate"] = run(
            [*DFLASH, "regenerate", "--target", "data/tiny-target", "--data", args.prompts, "--out", str(gen),
             "--prompt-tokens", "100000", "--max-new-tokens", "192", "--batch-size", "8" if args.smoke else "1024",
             "--device", dev, *limit], log)
        with gen.open("rb") as src, gzip.open(out / "code_all.gen.jsonl.gz", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
    docs = work / "long.jsonl"
    summary["data"] = long_documents(gen, docs, 300 if args.smoke else args.doc_tokens, REPO / "data" / "tiny-target")
    save()

    cache = work / "cache"
    T = 512 if args.smoke else 4096
    summary["seconds"]["extract"] = run(
        [*DFLASH, "extract", "--config", "configs/tiny.toml", "--out", str(cache), "--layers", "1,3,4", "--data",
         str(docs), "--token-budget", str(T), "--max-docs", "8", "--device", dev,
         *([] if args.smoke else ["--batch-size", "64", "--batch-tokens", "131072"])], log)
    save()

    steps = 12 if args.smoke else args.steps
    names = args.runs.split(",")
    common = ["train", "--config", "configs/tiny.toml", "--cache", str(cache), "--layers", "1,3,4", "--num-layers",
              "2" if args.smoke else "4", "--num-anchors", "32" if args.smoke else "512", "--lr", "3e-3",
              "--holdout-shards", "2" if args.smoke else "16", "--eval-every", "0", "--max-steps", str(steps),
              "--log-every", "4" if args.smoke else "200", "--save-every", str(4 if args.smoke else args.save_every),
              "--device", dev]
    t = time.monotonic()
    procs = {}
    for name in names:
        procs[name] = subprocess.Popen([*DFLASH, *common, "--out", str(work / name), *RUNS[name]],
                                       stdout=(logs / f"train-{name}.log").open("w"), stderr=subprocess.STDOUT,
                                       cwd=REPO)
    reserve = 30 if args.smoke else args.reserve  # eval, export and spec of every run
    for name, p in procs.items():
        try:
            p.wait(timeout=max(1.0, args.budget - reserve - elapsed()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    summary["seconds"]["train"] = time.monotonic() - t
    saved = {name: checkpoints(work / name) for name in names}
    common_step = min((s[-1] if s else 0) for s in saved.values())
    summary["compared_at_step"] = common_step
    save()
    if not common_step:
        sys.exit("no step that every run saved; see the train logs")

    bundle = work / "drafters"
    summary["runs"] = {}
    for name in names:
        keep_only(work / name, common_step)
        fmt = "zlab" if "--sliding-window" not in RUNS[name] or "--causal-block" in RUNS[name] else "speculators"
        subprocess.run([*DFLASH, "export", str(work / name), "--out", str(bundle / name), "--format", fmt],
                       capture_output=True, cwd=REPO)
    evals = {name: subprocess.Popen([*DFLASH, "eval", "--drafter", str(work / name), "--cache", str(cache), "--json",
                                     "--device", dev], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    cwd=REPO) for name in names}
    for name in names:
        stdout, stderr = evals[name].communicate()
        lines = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
        steps_logged = [x for x in lines if "loss" in x and x["step"] <= common_step]
        summary["runs"][name] = {"options": RUNS[name], "eval": json.loads(stdout) if evals[name].returncode == 0
                                 else stderr[-400:], "last_log": steps_logged[-1] if steps_logged else None,
                                 "first_step_s": next((x.get("first_step_s") for x in lines if "first_step_s" in x),
                                                      None)}
    save()

    def spec_all(runs, prompts: Path, key: str, max_new: int, limit: int, save_outputs: str | None = None):
        """`dflash spec` of every run at once on the GPU, each result under summary["runs"][run][key]."""
        procs = {}
        for name in runs:
            extra = ["--save-outputs", str(work / f"{name}-{key}.answers.jsonl")] if name == save_outputs else []
            procs[name] = subprocess.Popen(
                [*DFLASH, "spec", "--target", "data/tiny-target", "--drafter", str(bundle / name), "--prompts",
                 str(prompts), "--max-new-tokens", str(max_new), "--limit", str(limit), "--device", dev, "--json",
                 *extra], stdout=subprocess.PIPE, stderr=(logs / f"spec-{key}-{name}.log").open("w"), text=True,
                cwd=REPO)
        for name, p in procs.items():
            try:
                stdout, _ = p.communicate(timeout=max(1.0, args.budget - 5 - elapsed()))
                result = json.loads(stdout.strip().splitlines()[-1]) if p.returncode == 0 else f"rc {p.returncode}"
            except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
                p.kill()
                result = f"no result: {type(e).__name__}"
            summary["runs"][name][key] = result
        save()

    n_short = 4 if args.smoke else args.spec_prompts
    if not args.no_spec:
        spec_all(names, REPO / "data" / "sample" / "code_prompts.jsonl", "spec", 16 if args.smoke else 128,
                 n_short, save_outputs=names[0])
    answers = work / f"{names[0]}-spec.answers.jsonl"
    if answers.exists() and not args.no_spec:
        long_prompts = work / "long_prompts.jsonl"
        summary["long_prompts"] = make_long_prompts(answers, long_prompts, 4 if args.smoke else args.long_prompts,
                                                    REPO / "data" / "tiny-target", 3300)
        spec_all([n for n in names if n in LONG], long_prompts, "spec_long", 16 if args.smoke else 128,
                 4 if args.smoke else args.long_prompts)
    returned = [n for n in (names if args.ret == "all" else args.ret.split(",")) if (bundle / n).exists()]
    for name in returned:  # one a file: a file comes back only under 16 MiB (a DFlash2 export is ~9 MB compressed)
        with tarfile.open(out / f"drafter-{name}.tar.gz", "w:gz") as tar:
            tar.add(bundle / name, arcname=f"drafters/{name}")
    if tests is not None:
        try:
            summary["gpu_tests_rc"] = tests.wait(timeout=max(1.0, args.budget - elapsed()))
        except subprocess.TimeoutExpired:
            tests.kill()
            summary["gpu_tests_rc"] = "killed at the budget"
    summary["seconds"]["total"] = elapsed()
    save()
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname="logs")
        for f in work.glob("*.answers.jsonl"):
            tar.add(f, arcname=f"logs/{f.name}")

    print(f"\ncompared at step {common_step}; data {summary['data']}; seconds {summary['seconds']}")
    print("| run | loss | offline tau pooled / per doc / anchors | train walk | online tau pooled / per request "
          "(lossless) | long prompts |")
    print("|---|---|---|---|---|---|")

    def online(r):
        return f"{r['tau']:.3f} / {r['tau_per_request']:.3f} ({r['lossless']})" if isinstance(r, dict) else str(r)

    for name, r in summary["runs"].items():
        e, last = r["eval"], r["last_log"] or {}
        offline = (f"{e['tau']:.3f} / {e['tau_per_request']:.3f} / {e['tau_anchors']:.3f}" if isinstance(e, dict)
                   else f"failed: {str(e)[-80:]}")
        print(f"| {name} | {last.get('loss', float('nan')):.3f} | {offline} | {last.get('tau_walk', float('nan')):.3f} "
              f"| {online(r.get('spec'))} | {online(r.get('spec_long', '-'))} |")
    print(f"gpu tests rc {summary.get('gpu_tests_rc')}")


if __name__ == "__main__":
    main()
