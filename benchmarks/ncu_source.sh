#!/usr/bin/env bash
# Where one kernel launch spends its time, per SASS instruction: ncu's stall samples of one
# launch (NCU_SRC_KERNEL, after NCU_SRC_SKIP launches) of a Python snippet (NCU_SRC_CMD),
# printed as the details page and the source page (CSV) into $1 (a directory).
#   NCU_SRC_KERNEL=regex:scan_kernel NCU_SRC_SKIP=1 bash benchmarks/ncu_source.sh /tmp/out
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp}
PY=${PY:-.venv/bin/python}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
CMD=${NCU_SRC_CMD:-"import torch, fastlapsum; x = torch.randn(8192, 131072, device='cuda'); fastlapsum.topk(x, 2048); torch.cuda.synchronize()"}
"$NCU" -k "${NCU_SRC_KERNEL:-regex:row_select_kernel}" --launch-skip "${NCU_SRC_SKIP:-0}" --launch-count 1 \
  --section SourceCounters --section InstructionStats --section ComputeWorkloadAnalysis --section WarpStateStats \
  --import-source yes -f -o /tmp/ncu_src "$PY" -c "$CMD"
"$NCU" -i /tmp/ncu_src.ncu-rep --page details > "$out/ncu_source_details.txt"
"$NCU" -i /tmp/ncu_src.ncu-rep --page source --csv --print-source sass > "$out/ncu_source.csv" ||
  "$NCU" -i /tmp/ncu_src.ncu-rep --page source --csv > "$out/ncu_source.csv"
