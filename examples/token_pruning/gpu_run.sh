#!/usr/bin/env bash
# Token pruning + MoE routing on one GPU, sized for a hard 150 s wall limit.
# Fixed step counts, the same for every run of a phase and every seed (no timing-based
# sizing): 9 pruning configurations x 3 seeds x 160 steps, 3 MoE routers x 3 seeds x 120
# steps. Estimated on an H200 from measured ms/step at batch 512 (pruning 15-20, MoE
# 14-15): ~95 s in all with start-up; ~130 s if every run were as slow as the slowest run
# seen. --deadline 120 is a safety net only (no new run after 120 s of train.py; skipped
# runs are listed in results.md).
# Writes OUTDIR/results.md (the README's tables), results.json and log.txt; the log ends
# with both files' content.
#   examples/token_pruning/gpu_run.sh OUTDIR [extra train.py flags, which override these]
# CPU check of the same path at a reduced size:
#   DEVICE=cpu examples/token_pruning/gpu_run.sh /tmp/tp_cpu --dim 32 --heads 2 --batch 32 \
#       --prune-steps 20 --moe-steps 20 --n-test 512 --deadline 600
set -uo pipefail
OUT=${1:?usage: gpu_run.sh OUTDIR [train.py flags]}
shift
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the built fastlapsum of this checkout
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
SECONDS=0
"$PY" -u "$HERE/train.py" --device "$DEVICE" --out "$OUT" --seeds 0,1,2 --keep 2,8 --at 0 \
    --moe-blocks 0,1 --batch 512 --lr 2e-3 --prune-steps 160 --moe-steps 120 --deadline 120 \
    "$@" 2>&1 | tee "$OUT/log.txt"
echo "gpu_run.sh wall ${SECONDS} s" | tee -a "$OUT/log.txt"
