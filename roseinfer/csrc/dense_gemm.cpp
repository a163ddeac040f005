// A float linear layer's GEMM, out = x Wᵀ (+ bias), over a weight packed once at load time, for fp32 and bf16
// (AVX512-BF16). dense_linear.py packs the weight (pack_dense_weight) and calls it; F.linear is the reference.
//
//   torch.ops.roseinfer.dense_gemm(out [N, out], x [N, K], packed [P, Kp, 64, E], bias [out] or None)
//
// The packed weight holds 64 output columns in one row of 64 * E elements for each step of E k's:
//
//   packed[p, kp, c, e] = w[64 p + c, E kp + e]          (zeros past out and past K; E = 1 fp32, 2 bf16)
//
// so one step reads 4 vectors (16 columns each) and adds x[r, k] * w[c, k] into 16 fp32 lanes per vector: an FMA
// with x[r, k] broadcast (fp32), or vdpbf16ps, which multiplies the 2 bf16 of each 32-bit lane by 2 bf16 of x
// broadcast and adds both products to the fp32 lane (bf16). A tile is kMR rows x 64 columns: 24 fp32 accumulators
// in registers while the k's stream past. Threads split the panels; a panel's weights (64 x K elements: 72 KiB at
// K = 576 in bf16) stay in cache while the row tiles pass over it. The same loop as int8_gemm.cpp's, on floats.
//
// Why not oneDNN's packed linear (onednn_linear.py)? In the engine each layer's weights come from memory, not from
// cache: a step walks 30 layers of them. At SmolLM2's shapes, every layer's weight read once, this loop measured
// faster than oneDNN's at 1 to 200 rows (chapter 20, section 9.9); with one layer's weight kept in cache the gap is
// smaller. The sums are fp32 in both, in another order: results agree to fp32 (or bf16) rounding, not bit for bit.
#include "panel_gemm.h"  // includes vec_utils.h

#include <torch/library.h>

#include <cstring>
#include <vector>

namespace {
using roseinfer::kMR;
using roseinfer::kPanel;  // 4 vectors of 16 fp32

#if defined(CPU_CAPABILITY_AVX512)
template <typename T>
constexpr int64_t kPack = std::is_same_v<T, float> ? 1 : 2;  // k's per packed step (E)

// c += x . w per lane: an FMA (fp32), or the 2-product dot of vdpbf16ps (bf16 pairs), written as asm because GCC
// copies the accumulator around its own intrinsic (as int8_gemm.cpp's vpdpbusd)
template <typename T>
inline void madd(__m512& c, const __m512& x, const __m512& w) {
  if constexpr (std::is_same_v<T, float>) {
    c = _mm512_fmadd_ps(x, w, c);
  } else {
    asm("vdpbf16ps %2, %1, %0" : "+v"(c) : "v"(x), "v"(w));
  }
}

// x's E elements at k, in every 32-bit lane: one float, or two bf16
template <typename T>
inline __m512 broadcast(const T* p) {
  int32_t bits;
  std::memcpy(&bits, p, 4);
  return _mm512_castsi512_ps(_mm512_set1_epi32(bits));
}

// acc[r, 64] = x[r] . panel for MR <= 6 rows; x rows xs elements apart. Named accumulators, not an array (GCC
// spills an array of them, as in int8_gemm.cpp)
#define ROSEINFER_ROW(r)                                    \
  if constexpr (MR > r) {                                   \
    const __m512 xv = broadcast(x + r * xs + kPack<T> * k); \
    madd<T>(c##r##0, xv, w0);                               \
    madd<T>(c##r##1, xv, w1);                               \
    madd<T>(c##r##2, xv, w2);                               \
    madd<T>(c##r##3, xv, w3);                               \
  }
#define ROSEINFER_STORE(r)                              \
  if constexpr (MR > r) {                               \
    _mm512_store_ps(acc + r * kPanel, c##r##0);         \
    _mm512_store_ps(acc + r * kPanel + 16, c##r##1);    \
    _mm512_store_ps(acc + r * kPanel + 32, c##r##2);    \
    _mm512_store_ps(acc + r * kPanel + 48, c##r##3);    \
  }

template <int MR, typename T>
inline void tile(const T* x, int64_t xs, const T* panel, int64_t Kp, float* acc) {
  constexpr int64_t step = kPanel * kPack<T>;  // elements per packed step: 64 columns x E k's = 4 vectors
  const __m512 z = _mm512_setzero_ps();
  __m512 c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z;
  __m512 c20 = z, c21 = z, c22 = z, c23 = z, c30 = z, c31 = z, c32 = z, c33 = z;
  __m512 c40 = z, c41 = z, c42 = z, c43 = z, c50 = z, c51 = z, c52 = z, c53 = z;
  for (int64_t k = 0; k < Kp; ++k) {
    const float* wk = reinterpret_cast<const float*>(panel + k * step);  // 4 vectors of 64 bytes
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    const __m512 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
    ROSEINFER_ROW(0) ROSEINFER_ROW(1) ROSEINFER_ROW(2) ROSEINFER_ROW(3) ROSEINFER_ROW(4) ROSEINFER_ROW(5)
  }
  ROSEINFER_STORE(0) ROSEINFER_STORE(1) ROSEINFER_STORE(2) ROSEINFER_STORE(3) ROSEINFER_STORE(4)
  ROSEINFER_STORE(5)
}
#undef ROSEINFER_ROW
#undef ROSEINFER_STORE

template <typename T>
inline void run_tile(int64_t mr, const T* x, int64_t xs, const T* panel, int64_t Kp, float* acc) {
  roseinfer::with_count<kMR>(mr, [&](auto MR) { tile<MR, T>(x, xs, panel, Kp, acc); });  // mr <= kMR
}

// one row of out: acc (+ bias, added in fp32) rounded to T once
template <typename T>
inline void store_row(const float* acc, const T* bias, T* out, int64_t n_out) {
  for (int64_t i = 0; i < n_out; i += roseinfer::kW) {
    const int64_t n = std::min(roseinfer::kW, n_out - i);
    roseinfer::fVec y = roseinfer::fVec::loadu(acc + i);
    if (bias != nullptr) y = y + roseinfer::load_f(bias + i, n);
    roseinfer::store_f(out + i, y, n);
  }
}

template <typename T>
void gemm(const T* xp, int64_t N, int64_t K, const T* wp, int64_t P, int64_t Kp, const T* bias, T* op, int64_t O) {
  // x's rows as the packed steps read them: E * Kp elements each. Only an odd K in bf16 needs a padded copy
  const int64_t xs = kPack<T> * Kp;
  std::vector<T> padded(xs == K ? 0 : N * xs, T(0));
  for (int64_t r = 0; xs != K && r < N; ++r) std::copy(xp + r * K, xp + (r + 1) * K, padded.data() + r * xs);
  const T* x = xs == K ? xp : padded.data();
  roseinfer::for_each_panel_tile(P, N, [&](int64_t p, int64_t r0, int64_t mr) {
    alignas(64) float acc[kMR * kPanel];
    const int64_t c0 = p * kPanel, nc = std::min(kPanel, O - c0);
    run_tile<T>(mr, x + r0 * xs, xs, wp + p * Kp * kPanel * kPack<T>, Kp, acc);
    for (int64_t r = 0; r < mr; ++r)
      store_row<T>(acc + r * kPanel, bias ? bias + c0 : nullptr, op + (r0 + r) * O + c0, nc);
  });
}
#endif

bool dense_gemm_available(at::ScalarType dtype) {
#if defined(CPU_CAPABILITY_AVX512)
  if (dtype == at::kFloat) return true;
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#endif
  return false;
}

void dense_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                const std::optional<at::Tensor>& bias) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dense_gemm_available(dt), "dense_gemm: this build has no kernel for ", dt,
              " (dense_gemm_available is false)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "dense_gemm: x [N, K], contiguous");
  const int64_t N = x.size(0), K = x.size(1), E = dt == at::kFloat ? 1 : 2;
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == dt && packed.is_contiguous() && packed.size(2) == kPanel &&
                  packed.size(3) == E,
              "dense_gemm: packed [P, Kp, 64, ", E, "] in x's dtype (pack_dense_weight), got ", packed.sizes(), " ",
              packed.scalar_type());
  const int64_t P = packed.size(0), Kp = packed.size(1);
  TORCH_CHECK(Kp == (K + E - 1) / E, "dense_gemm: packed for ", E * Kp, " inputs, x has ", K);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.is_contiguous() && out.scalar_type() == dt,
              "dense_gemm: out [N, out], contiguous, in x's dtype");
  const int64_t O = out.size(1);
  TORCH_CHECK(P == (O + kPanel - 1) / kPanel, "dense_gemm: packed for ", P * kPanel, " outputs, out has ", O);
  TORCH_CHECK(!bias || (bias->scalar_type() == dt && bias->is_contiguous() && bias->numel() == O),
              "dense_gemm: bias [out] in x's dtype");
#if defined(CPU_CAPABILITY_AVX512)
  if (dt == at::kFloat) {
    gemm<float>(x.data_ptr<float>(), N, K, packed.data_ptr<float>(), P, Kp, bias ? bias->data_ptr<float>() : nullptr,
                out.data_ptr<float>(), O);
  } else {
    using B = c10::BFloat16;
    gemm<B>(x.data_ptr<B>(), N, K, packed.data_ptr<B>(), P, Kp, bias ? bias->data_ptr<B>() : nullptr,
            out.data_ptr<B>(), O);
  }
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(roseinfer, m) {
  m.def("dense_gemm_available(ScalarType dtype) -> bool", &dense_gemm_available);
  m.def("dense_gemm(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(roseinfer, CPU, m) { m.impl("dense_gemm", &dense_gemm); }
