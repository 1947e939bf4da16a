// Op schemas (one TORCH_LIBRARY block) and the CPU kernels. CUDA kernels register
// themselves in their .cu files, the autograd kernels in autograd/autograd_kernels.cpp;
// see fastlapsum/_ops.py for fake kernels and fastlapsum/_autograd.py for the Python side
// of autograd.
#include <Python.h>
#include <torch/library.h>

#include <iterator>
#include <utility>

#include "common/plan.h"
#include "ops.h"

// An importable module, so that `import fastlapsum._C` loads the op library; it also carries
// the constants Python needs (the plan's crossover, the diagnostics' path codes, the path and
// regime names indexed by code), so that they are never copied by hand.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  const std::pair<const char*, int64_t> constants[] = {
      {"AUTO_SORT_MAX_N_CPU", fastlapsum::kAutoSortMaxNCpu}, {"AUTO_SORT_MAX_N_CUDA", fastlapsum::kAutoSortMaxNCuda},
      {"PATH_DIRECT", fastlapsum::kPathDirect},       {"PATH_SORT", fastlapsum::kPathSort},
      {"PATH_BRACKET", fastlapsum::kPathBracket},
      {"PATH_BRACKET_RETRY", fastlapsum::kPathBracketRetry}, {"PATH_RADIX", fastlapsum::kPathRadix},
      {"PATH_OUTER_GAP", fastlapsum::kPathOuterGap},
      {"METHOD_AUTO", fastlapsum::kMethodAuto},       {"METHOD_SORT", fastlapsum::kMethodSort},
      {"METHOD_BRACKET", fastlapsum::kMethodBracket}, {"MODE_SOFT", fastlapsum::kModeSoft},
      {"MODE_LOG", fastlapsum::kModeLog},             {"MODE_HARD", fastlapsum::kModeHard},
      {"SOFT_CPU_SORT", fastlapsum::kSoftCpuSort},    {"SOFT_CPU_BRACKET", fastlapsum::kSoftCpuBracket},
      {"SOFT_WARP_ROWS", fastlapsum::kSoftWarpRows},  {"SOFT_CTA_ROWS", fastlapsum::kSoftCtaRows},
      {"SOFT_LONG_ROWS", fastlapsum::kSoftLongRows},  {"SOFT_RADIX_ROWS", fastlapsum::kSoftRadixRows},
      {"TOPK_THREAD_ROWS", fastlapsum::kTopkThreadRows}, {"TOPK_WARP_ROWS", fastlapsum::kTopkWarpRows},
      {"TOPK_ROW_CTA", fastlapsum::kTopkRowCta},      {"TOPK_GRID", fastlapsum::kTopkGrid},
      {"TOPK_SORT", fastlapsum::kTopkSort},           {"TOPK_CPU", fastlapsum::kTopkCpu}};
  for (const auto& [name, value] : constants)
    if (PyModule_AddIntConstant(m, name, static_cast<long>(value)) != 0) {
      Py_DECREF(m);
      return nullptr;
    }
  const auto add_names = [m](const char* name, const char* const* names, Py_ssize_t count) {
    PyObject* tuple = PyTuple_New(count);
    if (tuple == nullptr) return false;
    for (Py_ssize_t i = 0; i < count; ++i) {
      PyObject* s = PyUnicode_FromString(names[i]);
      if (s == nullptr) {
        Py_DECREF(tuple);
        return false;
      }
      PyTuple_SET_ITEM(tuple, i, s);
    }
    if (PyModule_AddObject(m, name, tuple) != 0) {
      Py_DECREF(tuple);
      return false;
    }
    return true;
  };
  if (!add_names("PATH_NAMES", fastlapsum::kPathNames, std::size(fastlapsum::kPathNames)) ||
      !add_names("SOFT_REGIME_NAMES", fastlapsum::kSoftRegimeNames, std::size(fastlapsum::kSoftRegimeNames)) ||
      !add_names("TOPK_REGIME_NAMES", fastlapsum::kTopkRegimeNames, std::size(fastlapsum::kTopkRegimeNames))) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}

TORCH_LIBRARY(fastlapsum, m) {
  // -> (b, edge, diag); b in x's units, diag int64 [rows, 3] = (path, middle size, attempts)
  m.def("lapsum_threshold(Tensor x, Tensor k, Tensor t, bool largest, int method)"
        " -> (Tensor, Tensor, Tensor)");
  // -> (p, b, diag); mode 0 soft, 1 log, 2 hard (straight-through forward). k_max: a bound
  // on every row's k when the caller knows one (a number k), else -1; hard mode's selector
  // plans its launch with it (CUDA), the answer does not depend on it.
  m.def("soft_topk_forward(Tensor x, Tensor k, Tensor t, bool largest, int method, int mode, int k_max=-1)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("lapsum_mask(Tensor x, Tensor b, Tensor t, Tensor edge, bool largest, bool log_mode)"
        " -> Tensor");
  // -> (grad_x, grad_k, grad_t)
  m.def("soft_topk_backward(Tensor grad, Tensor x, Tensor b, Tensor t, bool largest,"
        " bool log_mode) -> (Tensor, Tensor, Tensor)");
  m.def("lapsum_threshold_backward(Tensor grad_b, Tensor x, Tensor b, Tensor t, bool largest)"
        " -> (Tensor, Tensor, Tensor)");
  // -> (values, indices); indices -1 (values -inf / +inf) past a row's valid length
  m.def("topk(Tensor x, int k, bool largest, bool sorted, Tensor? lengths) -> (Tensor, Tensor)");
  // The regime (plan.h: SoftRegime, TopkRegime) that lapsum_threshold / soft_topk_forward, or
  // topk (hard_mask: the straight-through hard mask, k its k_max), would take for x; reads only
  // x's shape, dtype and device, never its data.
  m.def("soft_regime(Tensor x, int method) -> int");
  m.def("topk_regime(Tensor x, int k, bool hard_mask) -> int");
  // Python kernels (fastlapsum/_autograd.py) that the C++ autograd kernels
  // (autograd/autograd_kernels.cpp) call for what a C++ autograd::Function cannot do:
  // the VJPs written with differentiable PyTorch ops (a backward with create_graph) and the
  // ops through their Python autograd.Function (inputs with a forward-mode tangent).
  m.def("_soft_topk_vjp_graph(Tensor grad, Tensor x, Tensor k, Tensor t, Tensor b, bool largest,"
        " bool log_mode) -> (Tensor, Tensor, Tensor)");
  m.def("_lapsum_threshold_vjp_graph(Tensor grad_b, Tensor x, Tensor k, Tensor t, Tensor b,"
        " bool largest) -> (Tensor, Tensor, Tensor)");
  m.def("_lapsum_threshold_python(Tensor x, Tensor k, Tensor t, bool largest, int method)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("_soft_topk_forward_python(Tensor x, Tensor k, Tensor t, bool largest, int method, int mode,"
        " int k_max=-1)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("_topk_python(Tensor x, int k, bool largest, bool sorted, Tensor? lengths) -> (Tensor, Tensor)");
  // topk's backward (values are a gather of x): the upstream gradient scattered back to the
  // selected indices of rows of n scores, padding (-1) left out. Composite (PyTorch ops), so
  // itself differentiable; the C++ and the Python autograd Functions both call it.
  m.def("_topk_backward(Tensor grad, Tensor indices, int n) -> Tensor");
  // The CUDA top-k plan (cuda/topk/plan_topk.h) for a device of sm_count SMs holding
  // grid_ctas_per_sm grid-path collect CTAs each: host arithmetic, for table-driven tests on
  // any build. No tensor argument, so one kernel for every backend.
  m.def("_topk_cuda_plan(int rows, int n, int k, ScalarType dtype, bool hard_mask, bool sorted, int sm_count,"
        " int grid_ctas_per_sm) -> int[]",
        &fastlapsum::topk_cuda_plan_op);
}

namespace {

int64_t soft_regime_cpu_op(const at::Tensor& x, int64_t method) {
  TORCH_CHECK(x.dim() == 2, "fastlapsum.soft_regime: expected x of shape [rows, n]");
  TORCH_CHECK(method >= fastlapsum::kMethodAuto && method <= fastlapsum::kMethodBracket,
              "fastlapsum: method must be 0 (auto), 1 (sort) or 2 (bracket)");
  return fastlapsum::soft_regime_cpu(x.size(1), method);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastlapsum, CPU, m) {
  m.impl("lapsum_threshold", &fastlapsum::lapsum_threshold_cpu);
  m.impl("soft_topk_forward", &fastlapsum::soft_topk_forward_cpu);
  m.impl("lapsum_mask", &fastlapsum::lapsum_mask_cpu);
  m.impl("soft_topk_backward", &fastlapsum::soft_topk_backward_cpu);
  m.impl("lapsum_threshold_backward", &fastlapsum::lapsum_threshold_backward_cpu);
  m.impl("topk", &fastlapsum::topk_cpu);
  m.impl("soft_regime", &soft_regime_cpu_op);
}
