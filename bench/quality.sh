#!/usr/bin/env bash
# Issue 4's quality figures for the tiny target (results: bench/RESULTS.md). Runs on a CPU (~1 h on
# 2 cores) or a GPU (add --device cuda). W: a scratch folder.
set -euo pipefail
W=${W:-/tmp/q}
P=configs/tiny.toml
# 1. a cache of the target-generated sample data (the preset's) and one of the human originals
dflash extract --config $P --out $W/cache
dflash extract --config $P --out $W/cache-human \
    --data data/sample/text.jsonl --data data/sample/chat.jsonl
# 2. drafters (B = 16, 2 layers): the main one, and labels = data vs target on the human text
dflash train --config $P --cache $W/cache --out $W/run-target --max-steps 2000 --log-every 50 --eval-every 500
for L in data target; do
    dflash train --config $P --cache $W/cache-human --out $W/run-human-$L --labels $L --max-steps 600 --log-every 50
done
# 3. online tau: speculative decoding of 100 held-out code headers; the answers become a cache for the offline tau
for R in run-target run-human-data run-human-target; do
    dflash export $W/$R --out $W/export-$R
    dflash spec --target data/tiny-target --drafter $W/export-$R --prompts data/sample/code_prompts.jsonl \
        --max-new-tokens 128 --json --save-outputs $W/answers-$R.jsonl > $W/spec-$R.json
done
dflash extract --config $P --out $W/cache-answers --data $W/answers-run-target.jsonl
# 4. offline tau on that cache (every shard, every anchor) and on the training cache's held-out shards
for R in run-target run-human-data run-human-target; do
    dflash eval --drafter $W/export-$R --cache $W/cache-answers --json > $W/eval-answers-$R.json  # an export: every shard
done
dflash eval --drafter $W/run-target --cache $W/cache --json > $W/eval-holdout-run-target.json
