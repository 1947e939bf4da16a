#!/usr/bin/env bash
# Needs ab_tmp/base.tar (ignored, carried): git archive --format=tar --prefix=base/ 03a9712 > ab_tmp/base.tar; device run carry ["ab_tmp", ".whl"].
# Same-call A/B: base (03a9712, ab_tmp/base.tar) vs this tree, timed alternately in separate
# processes. Work files in /tmp/abw, packed into $OUT/ab.tgz; the comparison in $OUT/ab_cmp.txt.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 FASTLAPSUM_CUDA=1 PYTHONUNBUFFERED=1
R=$PWD W=/tmp/abw
mkdir -p $W
if [ -z "${SKIP_BUILD:-}" ]; then
  rm -rf /tmp/base && tar xf ab_tmp/base.tar -C /tmp
  ( cd /tmp/base && MAX_JOBS=8 make build > $W/build_base.log 2>&1 ) &
  MAX_JOBS=8 make build > $W/build_head.log 2>&1
  wait
fi
ls /tmp/base/fastlapsum/_C*.so fastlapsum/_C*.so || { tail -30 $W/build_*.log; exit 1; }
echo "built $SECONDS s"
PROF=${PROF:-r1e8/hard,r1e7/hard,r1e7/soft,gs5e6/soft,r1e6/fwdbwd,expert/fwdbwd,l0/hard,sparse/hard,w262k_k8192/hard,r1e8/soft}
for round in ${ROUNDS:-1 2}; do
  p=""; [ $round = 1 ] && p=$PROF
  PYTHONPATH=/tmp/base python3 tools/ab/ab_time.py base $W/base$round.json $p > $W/ab_base$round.log 2>&1 || tail -5 $W/ab_base$round.log
  PYTHONPATH=$R python3 tools/ab/ab_time.py head $W/head$round.json $p > $W/ab_head$round.log 2>&1 || tail -5 $W/ab_head$round.log
  echo "round $round $SECONDS s"
done
python3 tools/ab/ab_cmp.py $W/base*.json $W/head*.json > $OUT/ab_cmp.txt
tar czf $OUT/ab.tgz -C $W .
grep -c . $OUT/ab_cmp.txt; grep "slower>3" $OUT/ab_cmp.txt
