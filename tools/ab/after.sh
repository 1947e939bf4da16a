# after the A/B (tools/ab/ab.sh): sanitizers on the head tree, then the tests of the changed kernels
cd "$HEAD"
PY=.venv/bin/python
( timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $PY tools/sanitize_smoke.py --quick > $L/memcheck.log 2>&1; echo "memcheck rc $?" | tee -a $L/memcheck.log; tail -2 $L/memcheck.log )
( timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 $PY tools/sanitize_smoke.py --quick > $L/racecheck.log 2>&1; echo "racecheck rc $?" | tee -a $L/racecheck.log; tail -2 $L/racecheck.log )
echo "sanitize done $SECONDS"
left=$((570 - SECONDS)); [ $left -gt 30 ] && timeout $left $PY -m pytest tests/test_tiny_rows_cuda.py tests/test_short_rows_cuda.py tests/test_outer_gap.py tests/test_nonfinite.py tests/test_hard_topk_cuda.py -q -m "not slow" -n 16 -k "cuda" -x -p no:cacheprovider > $L/tests1.log 2>&1
tail -4 $L/tests1.log; grep -E "^(FAILED|ERROR)" $L/tests1.log | head -20
