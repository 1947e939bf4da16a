// fastlapsum.topk on the CPU: exact top-k per row over the valid prefix, -1 padding.
// Floating, integer and bool rows; padding values are -inf / +inf, or the dtype's
// lowest / highest value for integers (false / true for bool).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "../common/cpu_rows.h"
#include "../common/plan.h"
#include "../cuda/topk/plan_topk.h"
#include "../ops.h"
#include "select_cpu.h"

namespace fastlapsum {
namespace {

// Padding past a row's valid length: the worst possible score in the requested order.
template <typename scalar_t>
scalar_t worst_score(bool largest) {
  using lim = std::numeric_limits<scalar_t>;
  if constexpr (std::is_integral_v<scalar_t>)
    return largest ? lim::lowest() : lim::max();
  else
    return static_cast<scalar_t>(largest ? -std::numeric_limits<double>::infinity()
                                         : std::numeric_limits<double>::infinity());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> topk_cpu(const at::Tensor& x_in, int64_t k, bool largest,
                                            bool sorted, const std::optional<at::Tensor>& lengths) {
  TORCH_CHECK(x_in.dim() == 2, "fastlapsum.topk: expected x of shape [rows, n]");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(k >= 0 && k <= n, "fastlapsum.topk: k must be in [0, n]");
  at::Tensor len;
  if (lengths.has_value()) {
    len = lengths->to(at::kLong).contiguous();
    TORCH_CHECK(len.numel() == rows, "fastlapsum.topk: lengths needs one value per row");
    TORCH_CHECK(rows == 0 || (len.min().item<int64_t>() >= 0 && len.max().item<int64_t>() <= n),
                "fastlapsum.topk: lengths must lie in [0, n]");
  }
  at::Tensor values = at::empty({rows, k}, x.options());
  at::Tensor indices = at::empty({rows, k}, x.options().dtype(at::kLong));
  const int64_t* lp = len.defined() ? len.const_data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, x.scalar_type(), "topk", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* vp = values.mutable_data_ptr<scalar_t>();
    int64_t* ip = indices.mutable_data_ptr<int64_t>();
    const scalar_t pad = worst_score<scalar_t>(largest);
    at::parallel_for(0, rows, rows_grain(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t valid = lp ? lp[r] : n;
        const int64_t take = std::min(k, valid);
        const scalar_t* row = xp + r * n;
        int64_t* out_i = ip + r * k;
        select_top_indices(row, valid, take, largest, sorted, out_i);
        std::fill(out_i + take, out_i + k, int64_t{-1});
        for (int64_t j = 0; j < k; ++j) vp[r * k + j] = j < take ? row[out_i[j]] : pad;
      }
    });
  });
  return {values, indices};
}

namespace {

// The topk_regime op on the CPU: every call selects per row with std::nth_element.
int64_t topk_regime_cpu(const at::Tensor& x, int64_t k, bool hard_mask) {
  TORCH_CHECK(x.dim() == 2, "fastlapsum.topk_regime: expected x of shape [rows, n]");
  TORCH_CHECK(hard_mask || (k >= 0 && k <= x.size(1)), "fastlapsum.topk: k must be in [0, n]");
  return kTopkCpu;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastlapsum, CPU, m) { m.impl("topk_regime", &topk_regime_cpu); }

// The CUDA plan (plan_topk.h) of a call, for a device of sm_count SMs holding grid_ctas_per_sm
// of the grid path's collect CTAs each, as [regime, launch, sort_in_kernel, sort_after,
// instance, threads, blocks, cap, smem, workspace bytes]: host arithmetic, so that tests
// check the plan on any build (topk_cuda.cu's launchers follow it field by field).
std::vector<int64_t> topk_cuda_plan_op(int64_t rows, int64_t n, int64_t k, at::ScalarType dtype, bool hard_mask,
                                       bool sorted, int64_t sm_count, int64_t grid_ctas_per_sm) {
  TORCH_CHECK(rows >= 0 && n >= 0, "fastlapsum._topk_cuda_plan: rows and n must be >= 0");
  TORCH_CHECK(hard_mask || (k >= 0 && k <= n), "fastlapsum.topk: k must be in [0, n]");
  TORCH_CHECK(sm_count >= 1 && grid_ctas_per_sm >= 1,
              "fastlapsum._topk_cuda_plan: sm_count and grid_ctas_per_sm must be >= 1");
  const TopkPlan p = plan_topk(rows, n, k, dtype, hard_mask, sorted, sm_count, [&] { return sm_count * grid_ctas_per_sm; });
  return {p.regime, p.launch, p.sort_in_kernel, p.sort_after, p.instance, p.threads,
          p.blocks, p.cap,    p.smem,   p.ws_bytes};
}

}  // namespace fastlapsum
