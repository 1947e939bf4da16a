#!/usr/bin/env bash
# The GPU run of this example (H200: gsplat's rasterizer, the preset "gpu" of train.py).
# Usage: examples/gaussian_splatting/gpu_run.sh OUTDIR [extra train.py arguments]
# Writes OUTDIR/{results.json,results.md,psnr_vs_retention.png,renders.png,log.txt}; results
# are rewritten after every method, so a cut-short run still leaves what it finished.
# The script budgets 200 s of training and evaluation (--budget-s); `timeout` sends SIGINT
# at 228 s, which train.py turns into a final write of what it has.
set -u
OUT=${1:?usage: gpu_run.sh OUTDIR [train.py arguments]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$HERE"
nvidia-smi -L 2>&1 | tee "$OUT/log.txt"
timeout -s INT -k 8 228 python3 -u train.py --preset gpu --out "$OUT" "$@" 2>&1 | tee -a "$OUT/log.txt"
rc=${PIPESTATUS[0]}
echo "train.py exit status $rc" | tee -a "$OUT/log.txt"
ls -l "$OUT" | tee -a "$OUT/log.txt"
exit "$rc"
