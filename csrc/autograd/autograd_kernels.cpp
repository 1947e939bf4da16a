// Autograd kernels of the differentiable ops (lapsum_threshold, soft_topk_forward, topk),
// registered for the Autograd key. First-order reverse mode is a C++ autograd::Function whose
// backward calls the fused VJP op: an eager forward + backward runs no Python autograd code.
// What the C++ Function cannot serve goes to the Python autograd.Functions of
// fastlapsum/_autograd.py, through ops whose kernels are Python:
// - inputs with a forward-mode tangent: _<op>_python (the Functions have a jvp);
// - a backward that must itself be differentiable (create_graph): _soft_topk_vjp_graph /
//   _lapsum_threshold_vjp_graph, the VJP written with PyTorch ops;
// - torch.func transforms: refused here (a C++ Function cannot run under them); the public
//   functions route them to the Python Functions before calling the op.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/AutogradState.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <utility>

#include "../ops.h"

namespace fastlapsum {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Triple = std::tuple<Tensor, Tensor, Tensor>;
using Lengths = std::optional<Tensor>;

using ThresholdSig = Triple(const Tensor&, const Tensor&, const Tensor&, bool, int64_t);
using SoftSig = Triple(const Tensor&, const Tensor&, const Tensor&, bool, int64_t, int64_t, int64_t);
using TopkSig = std::tuple<Tensor, Tensor>(const Tensor&, int64_t, bool, bool, const Lengths&);
// (grad, x, b, t, largest[, log_mode]): the fused VJPs
using SoftVjpSig = Triple(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, bool);
using ThresholdVjpSig = Triple(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool);
// (grad, x, k, t, b, largest[, log_mode]): the differentiable VJPs (Python kernels)
using SoftVjpGraphSig = Triple(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, bool);
using ThresholdVjpGraphSig = Triple(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool);

// Each op's handle, looked up once (on first use: every schema is registered by then).
#define FASTLAPSUM_OP(fn, name, Sig)                                                                  \
  const c10::TypedOperatorHandle<Sig>& fn() {                                                         \
    static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>(); \
    return handle;                                                                                    \
  }
FASTLAPSUM_OP(threshold_op, "fastlapsum::lapsum_threshold", ThresholdSig)
FASTLAPSUM_OP(soft_op, "fastlapsum::soft_topk_forward", SoftSig)
FASTLAPSUM_OP(topk_op, "fastlapsum::topk", TopkSig)
FASTLAPSUM_OP(soft_vjp_op, "fastlapsum::soft_topk_backward", SoftVjpSig)
FASTLAPSUM_OP(threshold_vjp_op, "fastlapsum::lapsum_threshold_backward", ThresholdVjpSig)
FASTLAPSUM_OP(soft_vjp_graph_op, "fastlapsum::_soft_topk_vjp_graph", SoftVjpGraphSig)
FASTLAPSUM_OP(threshold_vjp_graph_op, "fastlapsum::_lapsum_threshold_vjp_graph", ThresholdVjpGraphSig)
FASTLAPSUM_OP(threshold_python_op, "fastlapsum::_lapsum_threshold_python", ThresholdSig)
FASTLAPSUM_OP(soft_python_op, "fastlapsum::_soft_topk_forward_python", SoftSig)
FASTLAPSUM_OP(topk_python_op, "fastlapsum::_topk_python", TopkSig)
FASTLAPSUM_OP(topk_backward_op, "fastlapsum::_topk_backward", Tensor(const Tensor&, const Tensor&, int64_t))
#undef FASTLAPSUM_OP

template <class Sig, class... Args>
auto below_autograd(const c10::TypedOperatorHandle<Sig>& handle, const Args&... args) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return handle.call(args...);
}

// torch._C._are_functorch_transforms_active()
bool functorch_active() {
  const c10::DispatchKeySet included = c10::impl::tls_local_dispatch_key_set().included_;
  return included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
         included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode);
}

enum class Route { kKernel, kFunction, kPython };

// Which implementation serves a call with these differentiable inputs: the kernel when no
// derivative can be taken, the C++ Function for reverse mode, the Python Function when an
// input carries a forward-mode tangent (forward AD has one level, 0).
template <class... Ts>
Route route(const char* name, const Ts&... inputs) {
  const bool grad = at::GradMode::is_enabled() && (inputs.requires_grad() || ...);
  const bool forward_ad = c10::AutogradState::get_tls_state().get_fw_grad_mode();
  const bool tangent = forward_ad && (inputs._fw_grad(0).defined() || ...);
  const bool functorch = (grad || forward_ad) && functorch_active();
  if (!grad && !tangent && !functorch) return Route::kKernel;
  TORCH_CHECK(!functorch, "fastlapsum: torch.func transforms of torch.ops.fastlapsum.", name,
              " called directly are not supported; call the public functions (fastlapsum.soft_topk, ...)");
  return tangent ? Route::kPython : Route::kFunction;
}

// The backward must itself be differentiable: create_graph with a differentiable input.
bool graph_wanted(const Tensor& grad, const variable_list& saved) {
  if (!at::GradMode::is_enabled()) return false;
  if (grad.requires_grad() || functorch_active()) return true;
  for (size_t i = 0; i < 3; ++i)  // x, k, t
    if (saved[i].requires_grad()) return true;
  return false;
}

// x, k, t and the solved threshold b, which the VJPs read instead of re-solving.
void save_rows(AutogradContext* ctx, const Tensor& x, const Tensor& k, const Tensor& t, const Tensor& b,
               bool largest) {
  ctx->set_materialize_grads(false);  // no zeros built for an output without a gradient
  ctx->save_for_backward({x, k, t, b});
  ctx->saved_data["largest"] = largest;
}

// The VJP's (grad_x, grad_k, grad_t) as the gradients of (x, k, t, and n_args - 3 other
// arguments); grad_k and grad_t only where k and t require grad.
variable_list input_grads(AutogradContext* ctx, Triple vjp, size_t n_args) {
  variable_list out(n_args);
  out[0] = std::move(std::get<0>(vjp));
  if (ctx->needs_input_grad(1)) out[1] = std::move(std::get<1>(vjp));
  if (ctx->needs_input_grad(2)) out[2] = std::move(std::get<2>(vjp));
  return out;
}

}  // namespace

// Each Function returns the op's one differentiable output; the others (the threshold and
// diagnostics beside the mask, edge and diagnostics beside the threshold, the indices) leave
// through `rest` as plain tensors, never marked non-differentiable, which compiled autograd
// cannot trace. The Functions are outside the anonymous namespace: their names show in the
// graph (grad_fn.name() "torch::autograd::CppNode<fastlapsum::SoftTopKFunction>") and in errors.
struct Rest {
  Tensor first, second;
};

struct ThresholdFunction : torch::autograd::Function<ThresholdFunction> {
  static constexpr bool is_traceable = true;  // compiled autograd: all state is in ctx

  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& k, const Tensor& t,
                               bool largest, int64_t method, Rest* rest) {
    auto [b, edge, diag] = below_autograd(threshold_op(), x, k, t, largest, method);
    save_rows(ctx, x, k, t, b, largest);
    *rest = {std::move(edge), std::move(diag)};
    return {b};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& gb = grads[0];
    if (!gb.defined()) return variable_list(6);
    const variable_list s = ctx->get_saved_variables();  // x, k, t, b
    const bool largest = ctx->saved_data["largest"].toBool();
    return input_grads(ctx,
                       graph_wanted(gb, s) ? threshold_vjp_graph_op().call(gb, s[0], s[1], s[2], s[3], largest)
                                           : below_autograd(threshold_vjp_op(), gb, s[0], s[3], s[2], largest),
                       6);
  }
};

// soft_topk_forward: p is differentiable (hard mode: with the soft mask's VJP, straight-
// through); b and diag are not.
struct SoftTopKFunction : torch::autograd::Function<SoftTopKFunction> {
  static constexpr bool is_traceable = true;

  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& k, const Tensor& t,
                               bool largest, int64_t method, int64_t mode, int64_t k_max, Rest* rest) {
    auto [p, b, diag] = below_autograd(soft_op(), x, k, t, largest, method, mode, k_max);
    save_rows(ctx, x, k, t, b, largest);
    ctx->saved_data["log_mode"] = mode == kModeLog;
    *rest = {std::move(b), std::move(diag)};
    return {p};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& gp = grads[0];
    if (!gp.defined()) return variable_list(8);
    const variable_list s = ctx->get_saved_variables();
    const bool largest = ctx->saved_data["largest"].toBool();
    const bool log_mode = ctx->saved_data["log_mode"].toBool();
    return input_grads(ctx,
                       graph_wanted(gp, s) ? soft_vjp_graph_op().call(gp, s[0], s[1], s[2], s[3], largest, log_mode)
                                           : below_autograd(soft_vjp_op(), gp, s[0], s[3], s[2], largest, log_mode),
                       8);
  }
};

// topk: values are a gather of x (differentiable, also its backward: PyTorch ops), indices
// are not.
struct TopKFunction : torch::autograd::Function<TopKFunction> {
  static constexpr bool is_traceable = true;

  static variable_list forward(AutogradContext* ctx, const Tensor& x, int64_t k, bool largest, bool sorted,
                               const Lengths& lengths, Tensor* indices_out) {
    auto [values, indices] = below_autograd(topk_op(), x, k, largest, sorted, lengths);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({indices});
    ctx->saved_data["n"] = x.size(1);
    *indices_out = std::move(indices);
    return {values};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(6);
    const Tensor& g = grads[0];
    if (!g.defined()) return out;
    out[0] = topk_backward_op().call(g, ctx->get_saved_variables()[0], ctx->saved_data["n"].toInt());
    return out;
  }
};

namespace {

Triple threshold_autograd(const Tensor& x, const Tensor& k, const Tensor& t, bool largest, int64_t method) {
  switch (route("lapsum_threshold", x, k, t)) {
    case Route::kFunction: {
      Rest rest;
      Tensor b = ThresholdFunction::apply(x, k, t, largest, method, &rest)[0];
      return {std::move(b), std::move(rest.first), std::move(rest.second)};
    }
    case Route::kPython: return threshold_python_op().call(x, k, t, largest, method);
    default: return below_autograd(threshold_op(), x, k, t, largest, method);
  }
}

Triple soft_autograd(const Tensor& x, const Tensor& k, const Tensor& t, bool largest, int64_t method,
                     int64_t mode, int64_t k_max) {
  switch (route("soft_topk_forward", x, k, t)) {
    case Route::kFunction: {
      Rest rest;
      Tensor p = SoftTopKFunction::apply(x, k, t, largest, method, mode, k_max, &rest)[0];
      return {std::move(p), std::move(rest.first), std::move(rest.second)};
    }
    case Route::kPython: return soft_python_op().call(x, k, t, largest, method, mode, k_max);
    default: return below_autograd(soft_op(), x, k, t, largest, method, mode, k_max);
  }
}

std::tuple<Tensor, Tensor> topk_autograd(const Tensor& x, int64_t k, bool largest, bool sorted,
                                         const Lengths& lengths) {
  switch (route("topk", x)) {
    case Route::kFunction: {
      Tensor indices;
      Tensor values = TopKFunction::apply(x, k, largest, sorted, lengths, &indices)[0];
      return {std::move(values), std::move(indices)};
    }
    case Route::kPython: return topk_python_op().call(x, k, largest, sorted, lengths);
    default: return below_autograd(topk_op(), x, k, largest, sorted, lengths);
  }
}

Tensor topk_backward(const Tensor& grad, const Tensor& indices, int64_t n) {
  return at::zeros({indices.size(0), n}, grad.options())
      .scatter_add(1, indices.clamp_min(0), grad.masked_fill(indices < 0, 0));
}

}  // namespace
}  // namespace fastlapsum

TORCH_LIBRARY_IMPL(fastlapsum, CompositeImplicitAutograd, m) { m.impl("_topk_backward", &fastlapsum::topk_backward); }

TORCH_LIBRARY_IMPL(fastlapsum, Autograd, m) {
  m.impl("lapsum_threshold", &fastlapsum::threshold_autograd);
  m.impl("soft_topk_forward", &fastlapsum::soft_autograd);
  m.impl("topk", &fastlapsum::topk_autograd);
}
