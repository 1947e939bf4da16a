#!/usr/bin/env bash
# Same-run A/B of the soft forward's graph time (benchmarks/soft_forward_sizes.py; or topk's,
# SCRIPT=benchmarks/topk_shapes.py) on the GPU
# machine: the working tree against variant directories made by ab_prepare.sh, all built in
# parallel, then ROUNDS rounds run interleaved (one fresh process per variant per round: the
# spread between processes, ~2 us at 1e6, is larger than that within one). Prints each round
# and a table of per-case medians; logs and ab_sizes.json go to $OUT/logs.
#   device run:  VARIANTS="ab_base ab_x" bash benchmarks/ab_sizes.sh
# Knobs: VARIANTS (directories), ROUNDS (2), TEST_PATHS (run those tests on the working tree
# first, e.g. "tests"; empty: none), SCRIPT (the timing script), MAX_JOBS (per build; 16 cores shared), BUILD=0 (a warm
# machine that built them in an earlier call: time only).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/fastlapsum_gpu_out}
L=$OUT/logs
mkdir -p "$L"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} FASTLAPSUM_CUDA=1 PYTHONUNBUFFERED=1
VARIANTS=${VARIANTS:-}
n=$(( $(echo "$VARIANTS" | wc -w) + 1 ))
jobs=${MAX_JOBS:-$(( 16 / n > 2 ? 16 / n : 2 ))}
if [ "${BUILD:-1}" != 0 ]; then
  MAX_JOBS=$jobs make build > "$L/build_tree.log" 2>&1 &
  tree_build=$!
  while [ ! -f .venv/.ready ]; do  # the variants build with the tree's venv
    kill -0 "$tree_build" 2> /dev/null || { echo "!!! make build ended without a venv"; tail -20 "$L/build_tree.log"; exit 1; }
    sleep 2
  done
  for d in $VARIANTS; do
    (cd "$d" && MAX_JOBS=$jobs ../.venv/bin/python setup.py build_ext --inplace > "$L/build_$d.log" 2>&1) &
  done
  wait
fi
ls fastlapsum/_C*.so > /dev/null 2>&1 || { echo "!!! the tree did not build"; tail -20 "$L/build_tree.log"; exit 1; }
built=""
for d in $VARIANTS; do  # a variant that did not build is left out, with its first errors
  if ls "$d"/fastlapsum/_C*.so > /dev/null 2>&1; then built="$built $d"; else echo "!!! $d did not build"; grep -m5 -B2 "error" "$L/build_$d.log"; fi
done
VARIANTS=$built
if [ -n "${TEST_PATHS:-}" ]; then
  .venv/bin/python -m pytest $TEST_PATHS -m "not slow" -q -rs > "$L/tests.log" 2>&1
  tail -3 "$L/tests.log"
fi
for round in $(seq "${ROUNDS:-2}"); do
  for d in . $VARIANTS; do
    line=$(cd "$d" && PYTHONPATH=. ROUNDS=1 "$ROOT/.venv/bin/python" "${SCRIPT:-benchmarks/soft_forward_sizes.py}" 2>&1 | tail -1)
    echo "$d r$round ${line#r0: }" | tee -a "$L/ab_rounds.txt"
  done
done
.venv/bin/python - "$L/ab_rounds.txt" "$L/ab_sizes.json" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, _, data = line.split(" ", 2)
    try:
        cases = json.loads(data)
    except ValueError:
        print("unparsed:", line.strip()[:200]); continue
    rows.setdefault(name, []).append(cases)
if not rows:
    sys.exit("no round gave a result (see the lines above)")
head = [f"{c[0]}" + ("" if c[1] in (0.0625, None) else f"/k={c[1]}") for c in next(iter(rows.values()))[0]]
print("median graph us   " + " ".join(f"{h:>9}" for h in head))
table = {}
for name, runs in rows.items():
    med = [statistics.median(r[i][2] for r in runs) for i in range(len(head))]
    table["tree" if name == "." else name] = dict(zip(head, med))
    print(f"{'tree' if name == '.' else name:16s}  " + " ".join(f"{m:9.1f}" for m in med))
json.dump({"cases": head, "median_us": table, "rounds": rows}, open(sys.argv[2], "w"), indent=1)
PY
