#!/usr/bin/env bash
# The tiny GatedDeltaNet hybrid target (data/tiny-hybrid-target) and the sample data it writes, on the
# GPU in one device call (~6 min): train it on the stdlib corpus (transformers' torch path of
# GatedDeltaNet: fla's backward needs Triton >= 3.7.1), then regenerate data/sample's code bodies and
# text continuations with it (without fla: its kernels would compile per batch shape).
# Usage (device): source bench/setup_device.sh || exit; bash bench/hybrid_target.sh $OUT [MINUTES]
set -euo pipefail
OUT=$1
MINUTES=${2:-3.5}
NOFLA=/tmp/site:$PWD  # PYTHONPATH without fla
PYTHONPATH=$NOFLA python3 scripts/train_tiny_target.py --arch qwen3_5 --out "$OUT/tiny-hybrid-target" \
    --minutes "$MINUTES" --corpus .qdata/corpus.npz 2>&1 | grep -v Warning | tee "$OUT/train.log" | tail -3
mkdir -p "$OUT/generated"
for f in code text; do
    [ $f = code ] && prompt=100000 || prompt=32
    PYTHONPATH=$NOFLA python3 -m dflash regenerate --target "$OUT/tiny-hybrid-target" --data data/sample/$f.jsonl \
        --out "$OUT/generated/$f.jsonl" --prompt-tokens $prompt --max-new-tokens 192 --batch-size 32 2>&1 | tail -1
done
