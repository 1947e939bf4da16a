#!/usr/bin/env bash
# Token pruning + MoE routing on one GPU, sized for a hard 150 s wall limit:
# 85 s of training in all (steps per run set by a timed calibration, the same for every
# run of a phase), no new run after 115 s, evaluation and start-up on top.
# Writes OUTDIR/results.md (the README's tables), results.json and log.txt.
#   examples/token_pruning/gpu_run.sh OUTDIR [extra train.py flags]
set -uo pipefail
OUT=${1:?usage: gpu_run.sh OUTDIR [train.py flags]}
shift
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
"$PY" -u "$HERE/train.py" --device "$DEVICE" --out "$OUT" --budget 85 --deadline 115 \
    --batch 512 --lr 2e-3 "$@" 2>&1 | tee "$OUT/log.txt"
