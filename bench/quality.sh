#!/usr/bin/env bash
# Issue 4's quality figures for the tiny target (results: bench/RESULTS.md, "Drafter quality").
# CPU: ~75 min on 2 cores, most of it the main run (6000 steps at ~2 steps/s); on a GPU add --device cuda
# to every command. W: a scratch folder.
set -euo pipefail
W=${W:-/tmp/q}
P=configs/tiny.toml
# 1. caches: the target-generated sample data (the preset's), with target layers 1-5 so that runs can
#    pick their subset; the human originals of the text rows, for labels = data vs target
dflash extract --config $P --out $W/cache5 --layers 1,2,3,4,5
dflash extract --config $P --out $W/cache-human --layers 1,3,5 --data data/sample/text.jsonl --data data/sample/chat.jsonl
# 2. drafters (2 layers, B = 16, target layers 1,3,5): the main one, and labels = data vs target
dflash train --config $P --cache $W/cache5 --out $W/run-long --layers 1,3,5 --max-steps 6000 \
    --log-every 100 --eval-every 1000 --save-every 500
for L in data target; do
    dflash train --config $P --cache $W/cache-human --out $W/run-human-$L --labels $L --max-steps 1000 --log-every 100
done
# 3. online tau: speculative decoding of the 100 held-out code headers (lossless check, n-gram baseline);
#    the main drafter's answers are the target's greedy outputs: they become a cache for the offline tau
for R in run-long run-human-data run-human-target; do
    dflash export $W/$R --out $W/export-$R
    dflash spec --target data/tiny-target --drafter $W/export-$R --prompts data/sample/code_prompts.jsonl \
        --max-new-tokens 128 --json --save-outputs $W/answers-$R.jsonl > $W/spec-$R.json
done
dflash extract --config $P --out $W/cache-answers --layers 1,3,5 --data $W/answers-run-long.jsonl
# 4. offline tau on that cache (an export: every shard, every anchor) and on the main run's held-out shards
for R in run-long run-human-data run-human-target; do
    dflash eval --drafter $W/export-$R --cache $W/cache-answers --json > $W/eval-answers-$R.json
done
dflash eval --drafter $W/run-long --cache $W/cache5 --json > $W/eval-holdout-run-long.json
