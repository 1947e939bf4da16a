#!/usr/bin/env bash
# Compile-check CUDA sources one by one for sm_90 without building the extension
# (no GPU needed): tools/compile_cu.sh csrc/forward/threshold_cuda.cu [more.cu ...]
# Uses the torch of .venv (or $PY); objects go to /tmp and are thrown away. NVCC_EXTRA adds
# flags (e.g. NVCC_EXTRA="-Xptxas -v" for registers and spills).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TI=$($PY -c "import torch.utils.cpp_extension as c; print(' '.join('-I'+p for p in c.include_paths()))")
STD=$($PY -c "import torch; v=tuple(int(p) for p in torch.__version__.split('.')[:2]); print('c++20' if v >= (2, 10) else 'c++17')")
for f in "$@"; do
  echo "== $f"
  nvcc -c "$f" -o "/tmp/$(basename "$f").o" $TI -std=$STD -O3 --expt-relaxed-constexpr -lineinfo \
    -DFASTLAPSUM_WITH_CUDA -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C \
    -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
    -D__CUDA_NO_HALF2_OPERATORS__ -gencode arch=compute_90,code=sm_90 -Xcompiler -fPIC ${NVCC_EXTRA:-}
done
