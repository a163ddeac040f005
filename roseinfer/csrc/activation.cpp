// The MLP's activations in one pass each (roseinfer/model_executor/activations.py):
//
//   torch.ops.roseinfer.silu_and_mul   SwiGLU's gate: x [N, 2I] = [gate | up] -> out [N, I] = silu(gate) · up
//                                      (SiluAndMul). PyTorch's version chunks x, writes silu(gate) to a new
//                                      [N, I] tensor and reads it back for the product; here each gate and up
//                                      value is read once and each product written once. silu(g) =
//                                      g / (1 + exp(-g)), computed as PyTorch's CPU kernel computes it (the same
//                                      vectorised exp), in fp32 for every dtype.
//   torch.ops.roseinfer.gelu_new       GPT-2's GELU, tanh form: x [N, C] -> out [N, C] (NewGELU). PyTorch's
//                                      0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), calls an accurate
//                                      vectorised tanh: ~1.9 ns an element on this CPU, which made it 6.7% of a
//                                      W8A8 GPT-2 run. Here the same function as x / (1 + exp(-2u)) (0.5 (1 +
//                                      tanh u) is the logistic function of 2u), on the exp silu uses: no tanh,
//                                      no cancellation near u = 0; equal to PyTorch's to a few fp32 ulps.
#include "vec_utils.h"

#include <torch/library.h>

using roseinfer::fVec;
using roseinfer::kW;

namespace {

template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* out, int64_t I) {
  const fVec one(1.f);
  for (int64_t i = 0; i < I; i += kW) {
    const int64_t n = std::min(kW, I - i);
    fVec g = roseinfer::load_f(gate + i, n);
    fVec s = g / (one + g.neg().exp_u20());
    roseinfer::store_f(out + i, s * roseinfer::load_f(up + i, n), n);
  }
}

void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "silu_and_mul: x [N, 2I] and out [N, I], got ", x.sizes(), " and ",
              out.sizes());
  const int64_t N = x.size(0), I = x.size(1) / 2;
  TORCH_CHECK(x.size(1) == 2 * I && out.size(0) == N && out.size(1) == I, "silu_and_mul: x [N, 2I] -> out [N, I], got ",
              x.sizes(), " and ", out.sizes());
  TORCH_CHECK((x.stride(1) == 1 || I == 0) && (out.stride(1) == 1 || I == 0), "silu_and_mul: rows need stride 1");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "silu_and_mul: out must be in x's dtype");
  const int64_t xs = x.stride(0), os = out.stride(0);
  ROSEINFER_DISPATCH_FLOATS(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, roseinfer::grain_rows(3 * I), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row(xp + r * xs, xp + r * xs + I, op + r * os, I);
    });
  });
}

template <typename T>
inline void gelu_new_row(const T* x, T* out, int64_t C) {
  const fVec one(1.f), a(-2.f * 0.7978845608028654f), b(0.044715f);  // -2 sqrt(2/pi)
  for (int64_t i = 0; i < C; i += kW) {
    const int64_t n = std::min(kW, C - i);
    const fVec v = roseinfer::load_f(x + i, n);
    const fVec e = (a * (v + b * v * v * v)).exp_u20();  // exp(-2u)
    roseinfer::store_f(out + i, v / (one + e), n);
  }
}

void gelu_new(const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes(), "gelu_new: x and out [N, C], got ", x.sizes(), " and ",
              out.sizes());
  const int64_t N = x.size(0), C = x.size(1);
  TORCH_CHECK((x.stride(1) == 1 || C == 0) && (out.stride(1) == 1 || C == 0), "gelu_new: rows need stride 1");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "gelu_new: out must be in x's dtype");
  const int64_t xs = x.stride(0), os = out.stride(0);
  ROSEINFER_DISPATCH_FLOATS(x.scalar_type(), "gelu_new", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, roseinfer::grain_rows(2 * C), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) gelu_new_row(xp + r * xs, op + r * os, C);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(roseinfer, m) {
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_new(Tensor(a!) out, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(roseinfer, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_new", &gelu_new);
}
