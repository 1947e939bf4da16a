"""Build of fastlapsum._C against the torch already installed in this environment.

    pip install --no-build-isolation .      (plain `pip install .` stops with a message: see
                                              require_torch below)
    python setup.py build_ext --inplace      (the Makefile's route: the .so lands in fastlapsum/)

Every build switch is documented here and in README.md:

    FASTLAPSUM_CUDA=auto|0|1   auto (default): build the CUDA sources when nvcc is found and
                               torch is a CUDA build (no GPU needed); 1: require it; 0: CPU only
    TORCH_CUDA_ARCH_LIST       GPU architectures; defaults to 9.0 (H100/H200) with no GPU visible
    MAX_JOBS                   parallel compile jobs (ninja)
    FASTLAPSUM_DEBUG=1         -O0 -g (otherwise -O3 and no debug info; C++ always with
                               -fno-trapping-math, which lets the CPU loops vectorize:
                               csrc/common/cpu_vec.h)
    FASTLAPSUM_OPENMP=0        no -fopenmp (default: on Linux when torch runs OpenMP and the
                               compiler links it; the CPU kernels' parallel_for needs it)
    FASTLAPSUM_BUILD_DIR       where objects, build/ and egg-info go (never the source tree);
                               default: a folder per checkout under ~/.cache/fastlapsum (kept,
                               so rebuilds are incremental), or a temporary one for a source
                               tree that itself lies in the temporary folder (an unpacked sdist)
"""
import atexit
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import setup

HERE = os.path.dirname(os.path.realpath(__file__))


def major_minor(version: str):
    return tuple(int(v) for v in version.split(".")[:2])


def temporary_dir() -> str:
    path = tempfile.mkdtemp(prefix="fastlapsum-build-")
    atexit.register(shutil.rmtree, path, True)
    return path


def require_torch():
    """The extension links against torch's C++ library, whose ABI changes with every release:
    it must be compiled with the headers of the torch it will run with. pip's default build
    isolation would build against a second, freshly downloaded torch (gigabytes, maybe another
    version), so torch is not in [build-system].requires and a build without it stops here."""
    try:
        import torch
    except ImportError:
        isolated = any("pip-build-env" in p for p in sys.path)
        sys.exit(
            "\nfastlapsum: torch is not importable in this build environment"
            + (" (pip's build isolation hides the installed torch)" if isolated else "") + ".\n"
            "fastlapsum compiles against the torch it will run with. Install torch first, then:\n"
            "    pip install --no-build-isolation .\n"
        )
    if major_minor(torch.__version__) < (2, 4):
        sys.exit(f"\nfastlapsum needs torch >= 2.4 (torch.library's custom-op API); found {torch.__version__}.\n")


require_torch()

if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"  # before torch reads it

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def build_dir() -> str:
    """build_base and egg_base: outside the source tree (see FASTLAPSUM_BUILD_DIR above)."""
    path = os.environ.get("FASTLAPSUM_BUILD_DIR")
    if not path:
        tmp = os.path.realpath(tempfile.gettempdir())
        if HERE.startswith(tmp + os.sep):
            path = temporary_dir()
        else:
            cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            tag = hashlib.sha1(HERE.encode()).hexdigest()[:8]  # the Makefile's BUILD_DIR names it alike
            path = os.path.join(cache, "fastlapsum", f"{os.path.basename(HERE)}-{tag}", "setup")
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:  # e.g. no writable home: a temporary folder rather than the source tree
        path = temporary_dir()
    return path


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


def openmp_flags() -> list:
    """-fopenmp where torch itself runs OpenMP (Linux wheels) and the C++ compiler links it:
    ATen's parallel_for is a header template that runs its loop serially unless the extension
    is compiled with OpenMP. FASTLAPSUM_OPENMP=0 leaves it out."""
    if os.environ.get("FASTLAPSUM_OPENMP", "1") == "0" or not sys.platform.startswith("linux"):
        return []
    if not torch.backends.openmp.is_available():
        return []
    probe = subprocess.run([os.environ.get("CXX", "c++"), "-fopenmp", "-x", "c++", "-", "-o", os.devnull],
                           input=b"#include <omp.h>\nint main() { return omp_get_max_threads() < 1; }\n",
                           capture_output=True)
    return ["-fopenmp"] if probe.returncode == 0 else []


def extension():
    debug = os.environ.get("FASTLAPSUM_DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    # -g0 overrides the -g of Python's CFLAGS: debug info of torch's headers doubles the compile time
    omp = openmp_flags()  # compile and link flags (the probe compiles once)
    # -fno-trapping-math: selects in the per-score loops may evaluate both sides, so they vectorize
    # (no fast math: results stay IEEE); -Wno-psabi: GCC notes that vectors passed without AVX
    # change the ABI, but those helpers are always inlined (cpu_vec.h); cpp_extension picks the
    # C++ standard torch needs
    cxx = opt + ([] if debug else ["-g0"]) + ["-fno-trapping-math", "-Wno-psabi"] + omp
    sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    if not sources:
        raise RuntimeError(f"no C++ sources under {os.path.abspath('csrc')}: run from the source tree")
    if not want_cuda():
        return CppExtension("fastlapsum._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=omp,
                            py_limited_api=False)
    if not torch.cuda.is_available():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    sources += sorted(glob.glob("csrc/**/*.cu", recursive=True))
    nvcc = opt + ["--expt-relaxed-constexpr", "-lineinfo", "-DFASTLAPSUM_WITH_CUDA"]
    return CUDAExtension(
        "fastlapsum._C",
        sources,
        extra_compile_args={"cxx": cxx + ["-DFASTLAPSUM_WITH_CUDA"], "nvcc": nvcc},
        extra_link_args=omp,
    )


def torch_requirement() -> str:
    """The binary runs only with the torch release it was compiled against (major.minor)."""
    major, minor = major_minor(torch.__version__)
    return f"torch>={major}.{minor}.0a0,<{major}.{minor + 1}"


BUILD = build_dir()
print(f"fastlapsum: building against torch {torch.__version__} in {BUILD}", file=sys.stderr)
setup(
    ext_modules=[extension()],
    install_requires=[torch_requirement()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"build": {"build_base": os.path.join(BUILD, "build")}, "egg_info": {"egg_base": BUILD}},
)
