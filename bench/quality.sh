#!/usr/bin/env bash
# The drafter quality figures for the tiny target (results: bench/RESULTS.md, "Drafter quality").
# CPU: ~80 min on 2 cores, most of it the main run (6000 steps at ~1.7 steps/s); on a GPU add --device cuda
# to every command. W: a scratch folder.
set -euo pipefail
W=${W:-/tmp/q}
P=configs/tiny.toml
# 1. caches: the target-generated sample data (the preset's), with target layers 1-5 so that runs can
#    pick their subset; the human originals of the text rows, for labels = data vs target
dflash extract --config $P --out $W/cache5 --layers 1,2,3,4,5
dflash extract --config $P --out $W/cache-human --layers 1,3,5 --data data/sample/text.jsonl --data data/sample/chat.jsonl
# 2. the main drafter (2 layers, B = 16, target layers 1,3,5)
dflash train --config $P --cache $W/cache5 --out $W/run-long --layers 1,3,5 --max-steps 6000 \
    --log-every 100 --eval-every 1000 --save-every 500
dflash export $W/run-long --out $W/export-run-long
# 3. online tau: speculative decoding of the 100 held-out code headers (lossless check, n-gram baseline);
#    the answers are the target's greedy outputs: a cache of them gives the offline tau to compare
dflash spec --target data/tiny-target --drafter $W/export-run-long --prompts data/sample/code_prompts.jsonl \
    --max-new-tokens 128 --json --save-outputs $W/answers-run-long.jsonl > $W/spec-run-long.json
dflash extract --config $P --out $W/cache-answers --layers 1,3,5 --data $W/answers-run-long.jsonl
dflash eval --drafter $W/export-run-long --cache $W/cache-answers --json > $W/eval-answers-run-long.json
dflash eval --drafter $W/run-long --cache $W/cache5 --json > $W/eval-holdout-run-long.json
# 4. labels = data vs target: the main drafter fine-tuned on human text, each way, measured on the answers
for L in data target; do
    dflash train --config $P --cache $W/cache-human --out $W/run-ft-$L --labels $L --init-from $W/export-run-long \
        --max-steps 300 --lr 1e-3 --log-every 50
    dflash eval --drafter $W/run-ft-$L --cache $W/cache-answers --json > $W/eval-answers-run-ft-$L.json
done
