# Call A: build this tree and 03a9712 side by side, the whole CUDA suite (not slow), then one
# A/B round against 03a9712 with what is left. T: seconds for the whole call.
T=${T:-560}
export TORCH_CUDA_ARCH_LIST=9.0 FASTLAPSUM_CUDA=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/abw; rm -rf /tmp/base && tar xf ab_tmp/base.tar -C /tmp
( cd /tmp/base && MAX_JOBS=6 make build > /tmp/abw/build_base.log 2>&1 ) &
BUDGET=$((T - 110)) SLOW=0 TEST_TIMEOUT=$((T - 230)) MAX_JOBS=10 PYTEST_EXTRA="-k cuda -n 16 -p no:cacheprovider --durations=15" STEPS="build test" bash benchmarks/gpu_check.sh
wait; echo "suite done at $SECONDS s"
SKIP_BUILD=1 ROUNDS=1 timeout $((T - SECONDS - 5)) bash tools/ab/ab_run.sh
