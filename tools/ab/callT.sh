# Build, then the CUDA tests of the paths this session changed, within T seconds.
T=${T:-300}
BUDGET=$T SLOW=0 TEST_TIMEOUT=$((T - 115)) TEST_PATHS="tests/test_cuda.py tests/test_vjp_regimes.py tests/test_topk_long_rows.py tests/test_hard_topk_cuda.py tests/test_plan.py tests/test_backward.py" \
  PYTEST_EXTRA="-k cuda -n 16 -p no:cacheprovider --durations=10" STEPS="build test" bash benchmarks/gpu_check.sh
