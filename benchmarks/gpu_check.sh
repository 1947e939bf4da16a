#!/usr/bin/env bash
# A GPU machine's whole check in one call: build (sm_90 unless TORCH_CUDA_ARCH_LIST says
# otherwise), run the test suite (slow tests too), the demo, the benchmarks and, on request,
# profiles and the examples on CUDA. Logs, JSON and plots go to $OUT, packed into
# $OUT/gpu_check.tgz next to summary.txt. The files in benchmarks/results/ come from its
# steps test, bench, bench_hard and timeline.
#   device run:  bash benchmarks/gpu_check.sh     (STEPS="build test demo bench bench_hard"; carry
#                [".whl", ".gsplat_ext"] when present: see below)
# Knobs: STEPS (also user_shapes, eager, topk_long_rows, sanitize, profile, timeline, profile_topk, ncu, ncu_hard, ncu_source, token_pruning, gaussian_splatting, l0_attack, extra), TEST_PATHS,
# NCU_KERNELS, NCU_SIZES, NCU_HARD_SHAPE, NCU_HARD_K, NCU_METRICS, NCU_EXTRA (e.g. --section SourceCounters),
# NCU_SRC_KERNEL, NCU_SRC_SKIP, NCU_SRC_CMD (step ncu_source), EXTRA_CMD/EXTRA_TIMEOUT (step extra),
# BUDGET (seconds for the whole script).
# SLOW (0: skip slow tests), PYTEST_EXTRA (unquoted words only), BENCH_ARGS, BENCH_HARD_ARGS, and the examples' own gpu_run.sh (each writes its README's table).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fastlapsum_gpu_out}
mkdir -p "$OUT/logs"
L=$OUT/logs
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} FASTLAPSUM_CUDA=${FASTLAPSUM_CUDA:-1}
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"build test demo bench bench_hard"}
PY=${PY:-.venv/bin/python}
# Carried packages (device README): wheels in .whl/ (FlashInfer, gsplat, the L0 peers) and
# gsplat's compiled extension in .gsplat_ext/ (so it does not rebuild for ~100 s).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -f .gsplat_ext/gsplat_cuda/gsplat_cuda.so ]; then  # see examples/gaussian_splatting/renderer.py
  export GSPLAT_CUDA_SO=$PWD/.gsplat_ext/gsplat_cuda/gsplat_cuda.so
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } > "$L/env.txt" 2>&1
cat "$L/env.txt"
status=0
# stall reasons per issued instruction (the WarpStateStats section prints only their sum)
NCU_METRICS=${NCU_METRICS:-'regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$'}
BUDGET=${BUDGET:-0}  # seconds for the whole script (0: none): later steps get what is left
run() {  # run NAME TIMEOUT CMD...: log to $L/NAME.log, show its tail
  local name=$1 limit=$2; shift 2
  if [ "$BUDGET" -gt 0 ]; then
    local left=$((BUDGET - SECONDS - 10))
    [ "$left" -lt 20 ] && { echo "=== $name skipped (budget)"; return; }
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "=== $name ($(date +%T))"
  # SIGINT first: pytest then prints its summary (the FAILED lines) of what ran, Python
  # scripts their traceback; SIGKILL 20 s later
  timeout -s INT -k 20 "$limit" "$@" > "$L/$name.log" 2>&1 || { echo "!!! $name failed ($?)"; status=1; }
  tail -${TAIL:-30} "$L/$name.log"
  grep -E "^(FAILED|ERROR) " "$L/$name.log" | head -40 || true
}
for step in $STEPS; do
  case $step in
    build) run build 900 make build || true; [ -f fastlapsum/_C*.so ] || { tar czf "$OUT/gpu_check.tgz" -C "$OUT" logs; exit 1; } ;;
    test)  # SLOW=0 deselects the slow tests (a quoted -m expression cannot pass through PYTEST_EXTRA's word splitting)
      if [ "${SLOW:-1}" = 0 ]; then set -- -m "not slow"; else set --; fi
      run tests "${TEST_TIMEOUT:-420}" $PY -m pytest ${TEST_PATHS:-tests} -q -rs "$@" ${PYTEST_EXTRA:-} ;;
    demo) run demo 300 $PY examples/demo.py ;;
    bench) run bench_soft "${BENCH_TIMEOUT:-420}" $PY benchmarks/bench_soft_topk.py ${BENCH_ARGS:-} --out "$L/soft_topk_h200.json" ;;
    user_shapes) run user_shapes 300 $PY benchmarks/bench_user_shapes.py --out "$L/user_shapes_h200.json" ;;
    eager) run eager 200 $PY benchmarks/bench_eager.py --device cuda --host --out "$L/eager_h200.json" ;;
    topk_long_rows) run topk_long_rows 200 $PY benchmarks/bench_topk_long_rows.py --out "$L/topk_long_rows_h200.json" ;;
    sanitize)  # memcheck over every kernel on small awkward shapes (tools/sanitize_smoke.py)
      SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
      [ -n "$SAN" ] && run sanitize "${SANITIZE_TIMEOUT:-300}" "$SAN" --tool memcheck --error-exitcode 9 $PY tools/sanitize_smoke.py --quick \
        || echo "compute-sanitizer: not found or failed" ;;
    bench_hard) run bench_hard "${BENCH_TIMEOUT:-420}" $PY benchmarks/bench_hard_topk.py ${BENCH_HARD_ARGS:-} --out "$L/hard_topk_h200.json" ;;
    profile) FASTLAPSUM_DEPENDENT_LAUNCH=0 run profile 120 $PY benchmarks/profile_kernels.py --sizes ${PROFILE_SIZES:-1e6 1e8} && FASTLAPSUM_DEPENDENT_LAUNCH=0 $PY benchmarks/profile_kernels.py --rows 16 --sizes 4096 >> "$L/profile.log" ;;
    timeline)  # each launch of one soft forward in order, without and with dependent launches
      run timeline 120 bash -c "for pdl in 0 1; do echo \"## FASTLAPSUM_DEPENDENT_LAUNCH=\$pdl\"; FASTLAPSUM_DEPENDENT_LAUNCH=\$pdl $PY benchmarks/profile_kernels.py --forward --timeline --sizes ${PROFILE_SIZES:-1e6 1e8}; done" ;;
    profile_topk) FASTLAPSUM_DEPENDENT_LAUNCH=0 run profile_topk 120 $PY benchmarks/profile_kernels.py --op topk --sizes ${PROFILE_TOPK_SIZES:-1e6 1e8 1e9} && FASTLAPSUM_DEPENDENT_LAUNCH=0 $PY benchmarks/profile_kernels.py --op topk --rows 2048 --sizes 131072 --k 2048 >> "$L/profile_topk.log" ;;
    ncu)  # per-kernel hardware counters of one forward+backward at each size (if ncu exists)
      NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
      [ -n "$NCU" ] && run ncu 300 "$NCU" -k "${NCU_KERNELS:-regex:^(propose|level|scan|sides|solve|lapsum_mask|lapsum_mask_f32|vjp_reduce|vjp_apply|short_rows)_kernel}" --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --metrics "$NCU_METRICS" ${NCU_EXTRA:-} \
        $PY benchmarks/profile_kernels.py --sizes ${NCU_SIZES:-1e6 1e8} --warmup 0 --calls 1 --bare \
        || echo "ncu: not found or failed" ;;
    ncu_hard)  # the same for fastlapsum.topk on one shape of the 20-shape matrix
      NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
      [ -n "$NCU" ] && run ncu_hard 300 "$NCU" -k "regex:row_select_kernel|^g_" --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --metrics "$NCU_METRICS" ${NCU_EXTRA:-} \
        $PY -c "import torch, fastlapsum; x = torch.randn(${NCU_HARD_SHAPE:-2048, 524288}, device='cuda'); fastlapsum.topk(x, ${NCU_HARD_K:-2048}, sorted=False); torch.cuda.synchronize()" \
        || echo "ncu: not found or failed" ;;
    ncu_source) run ncu_source 240 bash benchmarks/ncu_source.sh "$L" ;;  # knobs: see that script
    token_pruning) run token_pruning "${EXAMPLE_TIMEOUT:-420}" bash examples/token_pruning/gpu_run.sh "$L/token_pruning" ;;
    gaussian_splatting) run gaussian_splatting "${EXAMPLE_TIMEOUT:-420}" bash examples/gaussian_splatting/gpu_run.sh "$L/gaussian_splatting" ;;
    l0_attack) run l0_attack "${EXAMPLE_TIMEOUT:-420}" bash examples/l0_attack/gpu_run.sh "$L/l0_attack" ;;
    extra)  # EXTRA_CMD (bash, run in the checkout; $L is the log folder): e.g. a same-call A/B under two env settings
      L=$L PY=$PY run extra "${EXTRA_TIMEOUT:-200}" bash -c "${EXTRA_CMD:?extra needs EXTRA_CMD}" ;;
  esac
done
{ grep -h "passed\|failed\|error" "$L"/tests.log 2>/dev/null | tail -3; grep -h -E "^(FAILED|ERROR) " "$L"/*.log 2>/dev/null | head -60; } > "$OUT/summary.txt"
tar czf "$OUT/gpu_check.tgz" -C "$OUT" logs && rm -rf "$L"
exit $status
