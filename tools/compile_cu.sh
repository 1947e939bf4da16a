#!/usr/bin/env bash
# Compile-check CUDA sources one by one for sm_90 without building the extension
# (no GPU needed): tools/compile_cu.sh csrc/cuda/soft/threshold_cuda.cu [more.cu ...]
# Uses the torch of .venv (or $PY); objects go to $OBJDIR (default /tmp) and are thrown away. NVCC_EXTRA adds
# flags (e.g. NVCC_EXTRA="-Xptxas -v" for registers and spills). The object's SASS (e.g. to count
# local loads inside a loop) needs cuobjdump and nvdisasm, which this machine's CUDA lacks; PyPI
# has both: pip download --no-deps nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, unzip the wheels,
# put nvidia/cu13/bin on PATH, then cuobjdump -sass /tmp/X.cu.o
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# torch's headers and version found without importing torch (a CUDA build of torch may not
# import on a machine without the CUDA libraries, e.g. libcudnn).
TORCH_DIR=$($PY -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('torch').origin))")
TI="-I$TORCH_DIR/include -I$TORCH_DIR/include/torch/csrc/api/include -I$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")"
STD=$(sed -n "s/^__version__ = '\([0-9]*\)\.\([0-9]*\).*/\1 \2/p" "$TORCH_DIR/version.py" | awk '{print ($1 > 2 || $2 >= 10) ? "c++20" : "c++17"}')
for f in "$@"; do
  echo "== $f"
  nvcc -c "$f" -o "${OBJDIR:-/tmp}/$(basename "$f").o" $TI -std=$STD -O3 --expt-relaxed-constexpr -lineinfo \
    -DFASTLAPSUM_WITH_CUDA -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C \
    -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
    -D__CUDA_NO_HALF2_OPERATORS__ -gencode arch=compute_90,code=sm_90 -Xcompiler -fPIC ${NVCC_EXTRA:-}
done
