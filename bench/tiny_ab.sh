#!/usr/bin/env bash
# Two training recipes side by side on the tiny target's preset, on a CPU: the same drafter (2 layers, B = 16,
# target layers 1,3,5), cache, seeds and steps, trained with options A and with options B; the loss curves
# side by side, offline tau on the held-out shards and (SPEC=1) online tau, lossless, from `dflash spec` on the
# held-out code prompts. CPU (2 cores): ~12 min a run at 1200 steps, ~2 min a spec. The losses compare only where
# both recipes train the same objective (DFlash2's adds its selector's cross-entropy).
#
#   W=/tmp/qopt STEPS=1200 SEEDS=0 SPEC=0 bash bench/tiny_ab.sh fp32 "--optimizer-state fp32" bf16 "--optimizer-state bf16"
#   W=/tmp/qarch SEEDS="0 1" bash bench/tiny_ab.sh dflash "--arch dflash" dflash2 "--arch dflash2"
#
# W: a scratch folder (finished runs are kept: a rerun picks up where it stopped); STEPS: steps per run; SEEDS;
# SPEC (default 1) and LIMIT (prompts, default 100): the online tau.
set -euo pipefail
[ $# -eq 4 ] || { echo "usage: bash bench/tiny_ab.sh NAME_A 'OPTIONS_A' NAME_B 'OPTIONS_B'" >&2; exit 2; }
W=${W:-/tmp/tiny-ab}
STEPS=${STEPS:-1200}
SEEDS=${SEEDS:-0}
SPEC=${SPEC:-1}
LIMIT=${LIMIT:-100}
P=configs/tiny.toml
declare -A OPTS=([$1]="$2" [$3]="$4")
[ -d $W/cache ] || dflash extract --config $P --out $W/cache --layers 1,3,5
for S in $SEEDS; do
    for R in $1 $3; do
        N=$R-s$S
        if [ ! -f $W/eval-$N.json ]; then
            rm -rf $W/run-$N
            # shellcheck disable=SC2086  # the options are words
            dflash train --config $P --cache $W/cache --out $W/run-$N --layers 1,3,5 --max-steps $STEPS \
                --log-every 50 --save-every $STEPS --seed $S ${OPTS[$R]}
            dflash eval --drafter $W/run-$N --cache $W/cache --json > $W/eval-$N.json
        fi
        if [ "$SPEC" = 1 ] && [ ! -f $W/spec-$N.json ]; then
            dflash spec --target data/tiny-target --drafter $W/run-$N --prompts data/sample/code_prompts.jsonl \
                --limit $LIMIT --device cpu --json > $W/spec-$N.json
        fi
    done
done
python3 - "$W" "$1" "$3" "$SEEDS" <<'PY'
import json, sys
from pathlib import Path
w, a, b, seeds = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4].split()
def losses(n):
    return {r["step"]: r["loss"] for r in map(json.loads, (w / f"run-{n}" / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}
def mean(xs):
    return sum(xs) / len(xs)
for s in seeds:
    la, lb = losses(f"{a}-s{s}"), losses(f"{b}-s{s}")
    steps = sorted(set(la) & set(lb))
    shown = steps[:: max(1, len(steps) // 8)]
    shown += [steps[-1]] if steps[-1] not in shown else []
    print(f"\nseed {s}\n| step | loss {a} | loss {b} | {b} / {a} |\n|---|---|---|---|")
    for k in shown:
        print(f"| {k} | {la[k]:.4f} | {lb[k]:.4f} | {lb[k] / la[k]:.3f} |")
    ta, tb = mean([la[k] for k in steps[-5:]]), mean([lb[k] for k in steps[-5:]])
    print(f"mean loss of the last 5 logged steps: {a} {ta:.4f}, {b} {tb:.4f} ({100 * (tb / ta - 1):+.2f} %)")
print(f"\n| run | offline tau | per document | online tau | per request | lossless |\n|---|---|---|---|---|---|")
kind = "online" if all((w / f"spec-{r}-s{s}.json").exists() for r in (a, b) for s in seeds) else "offline"
tau = {a: [], b: []}
for r in (a, b):
    for s in seeds:
        e = json.loads((w / f"eval-{r}-s{s}.json").read_text())
        sp = w / f"spec-{r}-s{s}.json"
        o = json.loads(sp.read_text()) if sp.exists() else None
        tau[r].append(o["tau"] if kind == "online" else e["tau"])
        online = f"{o['tau']:.3f} | {o['tau_per_request']:.3f} | {o['lossless']}" if o else "- | - | -"
        print(f"| {r}-s{s} | {e['tau']:.3f} | {e['tau_per_request']:.3f} | {online} |")
print(f"\nmean {kind} tau over seeds {' '.join(seeds)}: {a} {mean(tau[a]):.3f}, {b} {mean(tau[b]):.3f} "
      f"({100 * (mean(tau[b]) / mean(tau[a]) - 1):+.1f} %)")
PY
