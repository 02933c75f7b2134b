#!/usr/bin/env bash
# tau and speedup of speculative decoding on the tiny GatedDeltaNet hybrid target (data/tiny-hybrid-target),
# by the recipe bench/quality.sh ran on the dense tiny target: the same drafter (2 layers, B = 16, target
# layers 1,3,5, 6000 steps at the preset's settings) trained on what this target writes
# (data/sample/generated-hybrid), online tau on the 100 held-out code headers, offline tau on a cache of
# the same answers. CPU (2 cores): ~80 min. W: a scratch folder.
set -euo pipefail
W=${W:-/tmp/qh}
P=configs/tiny.toml
T=data/tiny-hybrid-target
G=data/sample/generated-hybrid
dflash extract --config $P --target $T --data $G/text.jsonl --data $G/code.jsonl --out $W/cache --layers 1,3,5
dflash train --config $P --cache $W/cache --out $W/run --layers 1,3,5 --max-steps 6000 \
    --log-every 100 --eval-every 1000 --save-every 500
dflash export $W/run --out $W/export
dflash spec --target $T --drafter $W/export --prompts data/sample/code_prompts.jsonl \
    --max-new-tokens 128 --json --save-outputs $W/answers.jsonl > $W/spec.json
dflash extract --config $P --target $T --out $W/cache-answers --layers 1,3,5 --data $W/answers.jsonl
dflash eval --drafter $W/export --cache $W/cache-answers --json > $W/eval-answers.json
