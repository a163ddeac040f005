// W8A8's two element-wise passes in C++, around the integer GEMM (roseinfer/model_executor/quantization/int8.py
// holds the references; int8_linear.py calls these ops). Registered under vLLM's name for the first:
//
//   torch.ops.roseinfer.dynamic_scaled_int8_quant   x [N, K] float -> scale [N, 1] fp32 = max|x_row| / 127
//                                                     (1 for an all-zero row), out [N, K] int8 =
//                                                     clamp(round_half_even(x / scale), -127, 127)
//   torch.ops.roseinfer.int8_scaled_mm_epilogue     acc [N, out] int32 -> out [N, out] =
//                                                     (float(acc) * s_x[row]) * s_w[col] (+ bias[col]), rounded
//                                                     once to out's dtype
//
// PyTorch's quantization makes five passes over x (abs, amax, divide, round, clamp) and four [N, K] temporaries;
// here a row is read twice (its max, then the quantization) while it is still in L1. PyTorch's epilogue makes
// four passes over [N, out] (int32 -> fp32, two multiplies, fp32 -> the model's dtype); here one. Each does the
// reference's arithmetic in the reference's order (a division, not a multiply by 1/scale; the same rounding), so
// both are equal to it bit for bit.
#include "int8_epilogue.h"  // includes vec_utils.h

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
  for (int64_t i = 0; i < K; i += kW) {
    const int64_t n = std::min(kW, K - i);
    fVec q = at::vec::clamp((roseinfer::load_f(x + i, n) / vs).round(), lo, hi);  // whole numbers in [-127, 127]
#if defined(CPU_CAPABILITY_AVX512)
    // 16 lanes -> int32 -> their low bytes (vpmovdb), stored at once: the values are whole, so nothing rounds
    const __mmask16 m = n == kW ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
    _mm_mask_storeu_epi8(out + i, m, _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q)));
#else
    float buf[kW];
    q.store(buf, n);
    for (int64_t j = 0; j < n; ++j) out[i + j] = static_cast<int8_t>(buf[j]);
#endif
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

void int8_scaled_mm_epilogue(const at::Tensor& out, const at::Tensor& acc, const at::Tensor& x_scale,
                             const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous(),
              "int8_scaled_mm_epilogue: acc [N, out] int32, contiguous, got ", acc.sizes(), " ", acc.scalar_type());
  const int64_t N = acc.size(0), M = acc.size(1);
  TORCH_CHECK(out.sizes() == acc.sizes() && out.is_contiguous(), "int8_scaled_mm_epilogue: out [N, out] like acc");
  roseinfer::check_epilogue_args("int8_scaled_mm_epilogue", out, N, M, x_scale, weight_scale, bias);
  const int64_t sx_step = x_scale.numel() == N ? 1 : 0;  // per token, or one static scale for every row
  ROSEINFER_DISPATCH_FLOATS(out.scalar_type(), "int8_scaled_mm_epilogue", [&] {
    const int32_t* ap = acc.data_ptr<int32_t>();
    const float* sxp = x_scale.data_ptr<float>();
    const float* swp = weight_scale.data_ptr<float>();
    const scalar_t* bp = bias ? bias->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, roseinfer::grain_rows(2 * M), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        roseinfer::epilogue_row(ap + r * M, sxp[r * sx_step], swp, bp, op + r * M, M);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(roseinfer, m) {
  m.def("dynamic_scaled_int8_quant(Tensor(a!) out, Tensor x, Tensor(b!) scale) -> ()");
  m.def("int8_scaled_mm_epilogue(Tensor(a!) out, Tensor acc, Tensor x_scale, Tensor weight_scale, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(roseinfer, CPU, m) {
  m.impl("dynamic_scaled_int8_quant", &dynamic_scaled_int8_quant);
  m.impl("int8_scaled_mm_epilogue", &int8_scaled_mm_epilogue);
}
