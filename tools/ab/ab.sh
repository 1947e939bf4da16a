#!/bin/bash
# Same-call A/B of the tiny-row kernels on the GPU machine. Before the call, here:
#   mkdir -p ab_tmp && git archive --format=tar --prefix=base/ <base-commit> > ab_tmp/base.tar
#   (optional) git diff <base-commit> <variant> > ab_tmp/variant.patch   # a third tree
# then run `bash tools/ab/ab.sh` with carry ["ab_tmp"]. Builds base, the variant and this tree in
# parallel, times them in alternating rounds (tools/ab/ab_shapes.py: graph device time), prints the
# min-of-rounds table, then sanitizers and the tests of the short-row kernels (tools/ab/after.sh).
# Everything lands in $OUT/all.tgz.
set -u
L=$OUT/logs; mkdir -p $L
export TORCH_CUDA_ARCH_LIST=9.0 FASTLAPSUM_CUDA=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv > $L/env.txt
HEAD=$PWD
TREES="base head"
[ -f ab_tmp/variant.patch ] && TREES="base variant head"
if [ "${SKIP_BUILD:-0}" = 0 ]; then
  rm -rf /tmp/ab; mkdir -p /tmp/ab; tar xf ab_tmp/base.tar -C /tmp/ab
  if [ -f ab_tmp/variant.patch ]; then
    cp -r /tmp/ab/base /tmp/ab/variant && (cd /tmp/ab/variant && patch -p1 -s < $HEAD/ab_tmp/variant.patch)
  fi
  for t in $TREES; do
    [ $t = head ] && continue
    ( cd /tmp/ab/$t && MAX_JOBS=5 make build > $L/build_$t.log 2>&1 ) &
  done
  MAX_JOBS=6 make build > $L/build_head.log 2>&1
  wait
  echo "build done $SECONDS"; tail -n 2 $L/build_*.log
fi
PY=$HEAD/.venv/bin/python
for round in 1 2; do
  for side in $TREES; do
    if [ $side = head ]; then T=$HEAD; else T=/tmp/ab/$side; fi
    PYTHONPATH=$T timeout 200 $PY tools/ab/ab_shapes.py $side $L/${side}_$round.json >> $L/ab.log 2>&1
  done
  echo "round $round $SECONDS"
done
$PY tools/ab/cmp.py $L $TREES > $L/cmp.txt 2>&1; cat $L/cmp.txt
echo "ab done $SECONDS"
[ "${SKIP_AFTER:-0}" = 0 ] && source tools/ab/after.sh
tar czf $OUT/all.tgz -C $OUT logs
