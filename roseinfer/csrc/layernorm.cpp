// RMSNorm, and the residual add before it, in one pass per row (roseinfer/model_executor/layernorm.py teaches
// the math). Registered as torch.ops.roseinfer.rms_norm and torch.ops.roseinfer.fused_add_rms_norm.
//
// Each row of C features is read once to sum its squares and once more to normalise it (the second read hits
// the L1 cache: a row of 576 floats is 2.3 KB). The PyTorch reference makes ~9 passes over the whole [N, C]
// tensor, each through memory. The rounding follows the reference step by step:
//
//     residual = x + residual                    rounded to the dtype (the reference adds in the dtype)
//     h        = float(residual) · 1/√(mean(h²) + ε)     fp32
//     out      = dtype(h) · weight               the normalised row rounded to the dtype, then the product
//
// A row is x[a, b, :] of an x viewed as [A, B, C] with any strides on A and B and stride 1 on C, so a plain
// [N, C] (B = 1) and Qwen3's q/k norm over heads of the fused qkv output, [N, H, D] with row stride
// (H + 2·Hkv)·D, both run without a copy.
#include "vec_utils.h"

#include <torch/library.h>

#include <cmath>

using roseinfer::fVec;
using roseinfer::kW;

namespace {

// where row r of an [A, B, C] tensor starts: rows run over (a, b), b fastest
struct Rows {
  int64_t A, B, s0, s1;
  explicit Rows(const at::Tensor& t)
      : A(t.size(0)), B(t.dim() == 3 ? t.size(1) : 1), s0(t.stride(0)), s1(t.dim() == 3 ? t.stride(1) : 0) {}
  int64_t count() const { return A * B; }
  int64_t offset(int64_t r) const { return B == 1 ? r * s0 : (r / B) * s0 + (r % B) * s1; }
};

void check_rows(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, name, " must be [N, C] or [A, B, C], got ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, name, " needs stride 1 on its last dim");
  TORCH_CHECK(t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type(), name, " must match x: ",
              t.sizes(), " ", t.scalar_type(), " vs ", like.sizes(), " ", like.scalar_type());
}

// dst[:] = dtype(src · 1/√(mean(src²) + ε)) · w, one row of C (dst may be src)
template <typename T>
inline void normalise_row(const T* src, T* dst, const T* w, int64_t C, float eps) {
  fVec acc(0.f);
  for (int64_t i = 0; i < C; i += kW) {
    fVec v = roseinfer::load_f(src + i, std::min(kW, C - i));  // lanes past C load as 0
    acc = acc + v * v;
  }
  const float ss = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, acc);
  const fVec r(1.f / std::sqrt(ss / static_cast<float>(C) + eps));
  for (int64_t i = 0; i < C; i += kW) {
    const int64_t n = std::min(kW, C - i);
    fVec h = roseinfer::round_to<T>(roseinfer::load_f(src + i, n) * r);
    roseinfer::store_f(dst + i, h * roseinfer::load_f(w + i, n), n);
  }
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x", x);
  check_rows(out, "out", x);
  const int64_t C = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == C && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(), "weight must be [C], contiguous, in x's dtype");
  const Rows xr(x), orows(out);
  ROSEINFER_DISPATCH_FLOATS(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, xr.count(), roseinfer::grain_rows(C), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        normalise_row(xp + xr.offset(r), op + orows.offset(r), wp, C, static_cast<float>(eps));
    });
  });
}

void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x", x);
  check_rows(residual, "residual", x);
  const int64_t C = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == C && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(), "weight must be [C], contiguous, in x's dtype");
  const Rows xr(x), rr(residual);
  ROSEINFER_DISPATCH_FLOATS(x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, xr.count(), roseinfer::grain_rows(2 * C), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xrow = xp + xr.offset(r);
        scalar_t* rrow = rp + rr.offset(r);
        for (int64_t i = 0; i < C; i += kW) {  // residual = x + residual, in the dtype
          const int64_t n = std::min(kW, C - i);
          roseinfer::store_f(rrow + i, roseinfer::load_f(xrow + i, n) + roseinfer::load_f(rrow + i, n), n);
        }
        normalise_row(static_cast<const scalar_t*>(rrow), xrow, wp, C, static_cast<float>(eps));
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(roseinfer, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(roseinfer, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
}
