#!/usr/bin/env bash
# AdamW's moments in bf16 (--optimizer-state bf16) against fp32 on the tiny target's quality recipe: the same
# drafter (2 layers, B = 16, target layers 1,3,5), data, seed and steps, trained each way; the loss curves side by
# side and offline tau on the held-out shards. CPU (2 cores): ~25 min at the default 1200 steps. W: a scratch
# folder; STEPS: steps per run.
set -euo pipefail
W=${W:-/tmp/qopt}
STEPS=${STEPS:-1200}
P=configs/tiny.toml
[ -d $W/cache ] || dflash extract --config $P --out $W/cache --layers 1,3,5
for S in fp32 bf16; do
    [ -f $W/eval-$S.json ] && continue
    rm -rf $W/run-$S
    dflash train --config $P --cache $W/cache --out $W/run-$S --layers 1,3,5 --max-steps $STEPS \
        --log-every 50 --save-every $STEPS --optimizer-state $S
    dflash eval --drafter $W/run-$S --cache $W/cache --json > $W/eval-$S.json
done
python3 - "$W" <<'PY'
import json, sys
from pathlib import Path
w = Path(sys.argv[1])
runs = {s: [json.loads(x) for x in (w / f"run-{s}" / "metrics.jsonl").read_text().splitlines()] for s in ("fp32", "bf16")}
losses = {s: {r["step"]: r["loss"] for r in rs if "loss" in r} for s, rs in runs.items()}
steps = sorted(set(losses["fp32"]) & set(losses["bf16"]))
print("| step | loss fp32 | loss bf16 | bf16 / fp32 |\n|---|---|---|---|")
for s in steps[:: max(1, len(steps) // 8)] + ([steps[-1]] if steps[-1] not in steps[:: max(1, len(steps) // 8)] else []):
    print(f"| {s} | {losses['fp32'][s]:.4f} | {losses['bf16'][s]:.4f} | {losses['bf16'][s] / losses['fp32'][s]:.3f} |")
tail = lambda s: sum(losses[s][k] for k in steps[-5:]) / 5  # noqa: E731
print(f"\nmean loss of the last 5 logged steps: fp32 {tail('fp32'):.4f}, bf16 {tail('bf16'):.4f} "
      f"({100 * (tail('bf16') / tail('fp32') - 1):+.2f} %)")
for s in ("fp32", "bf16"):
    e = json.loads((w / f"eval-{s}.json").read_text())
    print(f"offline tau {s}: {e['tau']:.3f} (per document {e['tau_per_request']:.3f})")
PY
