#!/usr/bin/env bash
# Everything the GPU machine is for, in one call: build for the H200, run the whole
# test suite (slow tests too), the demo and the benchmarks. Logs and JSON go to $OUT.
#   device run:  bash benchmarks/gpu_check.sh            (STEPS="build test demo bench")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fastlapsum_gpu_out}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} FASTLAPSUM_CUDA=${FASTLAPSUM_CUDA:-1}
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"build test demo bench"}
PY=.venv/bin/python
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
status=0
for step in $STEPS; do
  echo "=== $step ($(date +%T))"
  case $step in
    build) make build > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }; tail -3 "$OUT/build.log" ;;
    test)  timeout "${TEST_TIMEOUT:-420}" $PY -m pytest tests -q -rs ${PYTEST_EXTRA:-} > "$OUT/tests.log" 2>&1 || status=1; tail -25 "$OUT/tests.log" ;;
    demo)  timeout 300 $PY examples/demo.py > "$OUT/demo.log" 2>&1 || status=1; cat "$OUT/demo.log" ;;
    bench) timeout "${BENCH_TIMEOUT:-420}" $PY benchmarks/bench_soft_topk.py ${BENCH_ARGS:-} --out "$OUT/soft_topk_h200.json" > "$OUT/bench_soft.log" 2>&1 || status=1; cat "$OUT/bench_soft.log" ;;
  esac
done
exit $status
