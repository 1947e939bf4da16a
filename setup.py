"""Build of fastlapsum._C. Every build switch is documented here and in README.md.

    FASTLAPSUM_CUDA=auto|0|1   auto (default): build the CUDA sources when nvcc is found and
                               torch is a CUDA build (no GPU needed); 1: require it; 0: CPU only
    TORCH_CUDA_ARCH_LIST       GPU architectures; defaults to 9.0 (H100/H200) with no GPU visible
    MAX_JOBS                   parallel compile jobs (ninja)
    FASTLAPSUM_DEBUG=1         -O0 -g, no fast math
"""
import glob
import os
import shutil

from setuptools import setup

if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"  # before torch reads it

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    mode = os.environ.get("FASTLAPSUM_CUDA", "auto").lower()
    available = torch.version.cuda is not None and (
        shutil.which("nvcc") is not None or os.path.exists(os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"))
    )
    if mode in ("0", "off", "false"):
        return False
    if mode in ("1", "on", "true"):
        if not available:
            raise RuntimeError("FASTLAPSUM_CUDA=1 but nvcc or a CUDA build of torch is missing")
        return True
    return available


def extension():
    debug = os.environ.get("FASTLAPSUM_DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    cxx = list(opt)  # torch.utils.cpp_extension picks the C++ standard torch needs
    sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    if not want_cuda():
        return CppExtension("fastlapsum._C", sources, extra_compile_args={"cxx": cxx}, py_limited_api=False)
    if not torch.cuda.is_available():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    sources += sorted(glob.glob("csrc/**/*.cu", recursive=True))
    nvcc = opt + ["--expt-relaxed-constexpr", "-lineinfo", "-DFASTLAPSUM_WITH_CUDA"]
    return CUDAExtension(
        "fastlapsum._C",
        sources,
        extra_compile_args={"cxx": cxx + ["-DFASTLAPSUM_WITH_CUDA"], "nvcc": nvcc},
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
