// W8A8's per-token activation quantization in one pass per row (roseinfer/model_executor/quantization/int8.py,
// scaled_int8_quant, is the reference). Registered as torch.ops.roseinfer.dynamic_scaled_int8_quant (vLLM's name).
//
//   x [N, K] float -> scale [N, 1] fp32 = max|x_row| / 127 (1 for an all-zero row)
//                     out   [N, K] int8 = clamp(round_half_even(x / scale), -127, 127)
//
// PyTorch's version makes five passes over x (abs, amax, divide, round, clamp) and four [N, K] temporaries; here
// a row is read twice (its max, then the quantization) while it is still in L1. The division (not a multiply by
// 1/scale) and the rounding mode are the reference's, so x_q is equal bit for bit.
#include "vec_utils.h"

#include <torch/library.h>

using roseinfer::fVec;
using roseinfer::kW;

namespace {

template <typename T>
inline void quant_row(const T* x, int8_t* out, float* scale, int64_t K) {
  fVec vmax(0.f);
  for (int64_t i = 0; i < K; i += kW) {
    const int64_t n = std::min(kW, K - i);
    vmax = at::vec::maximum(vmax, roseinfer::load_f(x + i, n).abs());  // load_f fills the tail with zeros
  }
  float amax = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, vmax);
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  *scale = s;
  const fVec vs(s), lo(-127.f), hi(127.f);
  float buf[kW];
  for (int64_t i = 0; i < K; i += kW) {
    const int64_t n = std::min(kW, K - i);
    fVec q = at::vec::clamp((roseinfer::load_f(x + i, n) / vs).round(), lo, hi);
    q.store(buf, n);
    for (int64_t j = 0; j < n; ++j) out[i + j] = static_cast<int8_t>(buf[j]);
  }
}

void dynamic_scaled_int8_quant(const at::Tensor& out, const at::Tensor& x, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes(), "dynamic_scaled_int8_quant: x and out [N, K], got ",
              x.sizes(), " and ", out.sizes());
  TORCH_CHECK(out.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
              "dynamic_scaled_int8_quant: out int8, scale float32");
  const int64_t N = x.size(0), K = x.size(1);
  TORCH_CHECK(scale.numel() == N && scale.is_contiguous(), "dynamic_scaled_int8_quant: scale [N, 1], contiguous");
  TORCH_CHECK(x.stride(1) == 1 && out.is_contiguous(), "dynamic_scaled_int8_quant: rows need stride 1");
  const int64_t xs = x.stride(0);
  ROSEINFER_DISPATCH_FLOATS(x.scalar_type(), "dynamic_scaled_int8_quant", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    int8_t* op = out.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    at::parallel_for(0, N, roseinfer::grain_rows(2 * K), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) quant_row(xp + r * xs, op + r * K, sp + r, K);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(roseinfer, m) {
  m.def("dynamic_scaled_int8_quant(Tensor(a!) out, Tensor x, Tensor(b!) scale) -> ()");
}

TORCH_LIBRARY_IMPL(roseinfer, CPU, m) { m.impl("dynamic_scaled_int8_quant", &dynamic_scaled_int8_quant); }
