// The W8A8 epilogue's row, shared by int8_quant.cpp (the epilogue as an op of its own, after torch._int_mm) and
// int8_gemm.cpp (fused into the VNNI GEMM): acc int32 -> (float(acc) * s_x) * s_w (+ bias) in the output's dtype,
// the arithmetic of int8.py's scaled_mm_epilogue in its order, so equal to it bit for bit.
#pragma once
#include "vec_utils.h"

namespace roseinfer {

// v as it is, hidden from the optimizer: GCC contracts a vector multiply and a following add into one FMA (its
// default), which would skip the product's rounding the reference does before adding the bias
inline fVec opaque(fVec v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = v;
  asm("" : "+v"(r));
  return r;
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 r = v;
  asm("" : "+x"(r));
  return r;
#else
  return v;
#endif
}

// one row of the epilogue: acc [n_out] int32, its token's scale sx, s_w [n_out] fp32, bias [n_out] or null
template <typename T>
inline void epilogue_row(const int32_t* acc, float sx, const float* sw, const T* bias, T* out, int64_t n_out) {
  using iVec = at::vec::Vectorized<int32_t>;
  const fVec vsx(sx);
  for (int64_t i = 0; i < n_out; i += kW) {
    const int64_t n = std::min(kW, n_out - i);
    const iVec a = n == kW ? iVec::loadu(acc + i) : iVec::loadu(acc + i, n);
    fVec y = at::vec::convert_to_fp_of_same_size<float>(a) * vsx;  // int32 -> fp32 rounds as acc.float() does
    y = y * (n == kW ? fVec::loadu(sw + i) : fVec::loadu(sw + i, n));
    if (bias != nullptr) y = opaque(y) + load_f(bias + i, n);
    store_f(out + i, y, n);
  }
}

// the epilogue's operands for N rows of `out` outputs: fp32 scales, one per row or one for all, and one per output;
// a bias, if any, in the output's dtype
inline void check_epilogue_args(const char* op, const at::Tensor& out, int64_t N, int64_t outputs,
                                const at::Tensor& x_scale, const at::Tensor& weight_scale,
                                const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_scale.scalar_type() == at::kFloat && x_scale.is_contiguous() &&
                  (x_scale.numel() == N || x_scale.numel() == 1),
              op, ": x_scale fp32, [N, 1] or [1, 1]");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() && weight_scale.numel() == outputs,
              op, ": weight_scale fp32 [out]");
  TORCH_CHECK(!bias || (bias->scalar_type() == out.scalar_type() && bias->is_contiguous() && bias->numel() == outputs),
              op, ": bias [out] in out's dtype");
}

}  // namespace roseinfer
