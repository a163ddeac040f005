// W8A8's integer GEMM on AVX512-VNNI, with the epilogue fused, for any number of rows. int8_linear.py packs
// the weight at load time (pack_int8_weight) and calls it; int8.py's int8_mm_reference and scaled_mm_epilogue are
// the reference, and the result is equal to theirs bit for bit (integer sums are exact; the epilogue is shared).
//
//   torch.ops.roseinfer.int8_gemm(out [N, out], x_q [N, K] int8, packed [P, K4, 64, 4] int8, comp [P * 64] int32,
//                                 x_scale [N, 1] or [1, 1] fp32, weight_scale [out] fp32, bias [out] or None)
//
// vpdpbusd (VNNI) multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products to an int32 lane: 16 lanes
// are 16 output columns, each over 4 consecutive k. x is signed, so each byte is made unsigned by adding 128
// (x ^ 0x80). The sums are then sum_k (x + 128) w = x . w + 128 sum_k w; comp[n] = 128 sum_k w[n, k], made at
// load time, is taken off again. The packed weight puts the 4 k's of 64 columns in one 256-byte row:
//
//   packed[p, k4, c, j] = w[64 p + c, 4 k4 + j]          (zeros past out and past K)
//
// A tile is kMR rows x 64 columns: 24 int32 vectors held in registers while the k's stream past; per 4 k's, 4
// weight loads, one 4-byte broadcast per row and 24 vpdpbusd. Threads split the panels (p); a panel's weights
// (64 x K bytes: 36 KiB at K = 576) stay in cache while the row tiles pass over them. torch._int_mm (oneDNN) packs
// the weight on every call; this loop over a weight packed once measured faster at a decode step's rows, 0-20%
// apart from 128 rows on with one layer's weight in cache, and faster in the engine, where each weight comes from
// memory, at a mixed step's 50-250 rows too (chapter 22, section 9.7).
#include "int8_epilogue.h"  // includes vec_utils.h
#include "panel_gemm.h"

#include <torch/library.h>

#include <cstring>
#include <vector>

namespace {
using roseinfer::kMR;
using roseinfer::kPanel;  // 4 vectors of 16 int32

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
constexpr bool kHasVnni = true;

// 4 bytes of x (a row's 4 k's) in every lane
inline __m512i broadcast4(const uint8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm512_set1_epi32(four);
}

// c += the 4-byte dot products of u (unsigned) and s (signed), per int32 lane: vpdpbusd written as asm, because
// GCC's own _mm512_dpbusd_epi32 copies each accumulator to a new register and back around every instruction
inline void dpbusd(__m512i& c, const __m512i& u, const __m512i& s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(c) : "v"(u), "v"(s));
}

// acc[r, 64] = x_u8[r] . panel - comp for MR <= 6 rows: x rows of K4 * 4 unsigned bytes, xs apart. The 24
// accumulators are named variables, not an array: GCC spills an array of them to the stack on every k
#define ROSEINFER_ROW(r)                                 \
  if constexpr (MR > r) {                                \
    const __m512i xv = broadcast4(x + r * xs + 4 * k);   \
    dpbusd(c##r##0, xv, w0);                \
    dpbusd(c##r##1, xv, w1);                \
    dpbusd(c##r##2, xv, w2);                \
    dpbusd(c##r##3, xv, w3);                \
  }
#define ROSEINFER_STORE(r)                                                                         \
  if constexpr (MR > r) {                                                                          \
    _mm512_storeu_si512(acc + r * kPanel, _mm512_sub_epi32(c##r##0, _mm512_loadu_si512(comp)));           \
    _mm512_storeu_si512(acc + r * kPanel + 16, _mm512_sub_epi32(c##r##1, _mm512_loadu_si512(comp + 16))); \
    _mm512_storeu_si512(acc + r * kPanel + 32, _mm512_sub_epi32(c##r##2, _mm512_loadu_si512(comp + 32))); \
    _mm512_storeu_si512(acc + r * kPanel + 48, _mm512_sub_epi32(c##r##3, _mm512_loadu_si512(comp + 48))); \
  }

template <int MR>
inline void tile(const uint8_t* x, int64_t xs, const int8_t* panel, int64_t K4, const int32_t* comp, int32_t* acc) {
  const __m512i z = _mm512_setzero_si512();
  __m512i c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z;
  __m512i c20 = z, c21 = z, c22 = z, c23 = z, c30 = z, c31 = z, c32 = z, c33 = z;
  __m512i c40 = z, c41 = z, c42 = z, c43 = z, c50 = z, c51 = z, c52 = z, c53 = z;
  for (int64_t k = 0; k < K4; ++k) {
    const int8_t* wk = panel + k * kPanel * 4;  // 4 k's of 64 columns: 4 vectors of 16 columns
    const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 64);
    const __m512i w2 = _mm512_loadu_si512(wk + 128), w3 = _mm512_loadu_si512(wk + 192);
    ROSEINFER_ROW(0) ROSEINFER_ROW(1) ROSEINFER_ROW(2) ROSEINFER_ROW(3) ROSEINFER_ROW(4) ROSEINFER_ROW(5)
  }
  ROSEINFER_STORE(0) ROSEINFER_STORE(1) ROSEINFER_STORE(2) ROSEINFER_STORE(3) ROSEINFER_STORE(4)
  ROSEINFER_STORE(5)
}
#undef ROSEINFER_ROW
#undef ROSEINFER_STORE

inline void run_tile(int64_t mr, const uint8_t* x, int64_t xs, const int8_t* panel, int64_t K4, const int32_t* comp,
                     int32_t* acc) {
  roseinfer::with_count<kMR>(mr, [&](auto MR) { tile<MR>(x, xs, panel, K4, comp, acc); });  // mr <= kMR
}
#else
constexpr bool kHasVnni = false;
#endif

bool int8_gemm_available() { return kHasVnni; }

void int8_gemm(const at::Tensor& out, const at::Tensor& x_q, const at::Tensor& packed, const at::Tensor& comp,
               const at::Tensor& x_scale, const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kHasVnni, "int8_gemm: this build has no AVX512-VNNI (int8_gemm_available() is false)");
  TORCH_CHECK(x_q.dim() == 2 && x_q.scalar_type() == at::kChar && x_q.is_contiguous(), "int8_gemm: x_q [N, K] int8");
  const int64_t N = x_q.size(0), K = x_q.size(1);
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kPanel && packed.size(3) == 4,
              "int8_gemm: packed [P, K4, 64, 4] int8 (pack_int8_weight), got ", packed.sizes());
  const int64_t P = packed.size(0), K4 = packed.size(1);
  TORCH_CHECK(K4 == (K + 3) / 4, "int8_gemm: packed for ", 4 * K4, " inputs, x_q has ", K);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.is_contiguous(), "int8_gemm: out [N, out], contiguous");
  const int64_t O = out.size(1);
  TORCH_CHECK(P == (O + kPanel - 1) / kPanel, "int8_gemm: packed for ", P * kPanel, " outputs, out has ", O);
  TORCH_CHECK(comp.scalar_type() == at::kInt && comp.is_contiguous() && comp.numel() == P * kPanel,
              "int8_gemm: comp [P * 64] int32");
  roseinfer::check_epilogue_args("int8_gemm", out, N, O, x_scale, weight_scale, bias);
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
  // x as unsigned bytes (x ^ 0x80 = x + 128), each row padded to 4 * K4 (the padding meets zero weights), 64 bytes
  // at a time: with a byte loop here, which GCC left scalar, a 32-row call of SmolLM2's layers took 1.1-1.35x as long
  const int64_t xs = 4 * K4;
  std::vector<uint8_t> xu(N * xs, 0);
  const int8_t* xp = x_q.data_ptr<int8_t>();
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t r = 0; r < N; ++r)
    for (int64_t k = 0; k < K; k += 64) {
      const __mmask64 m = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
      const __m512i v = _mm512_maskz_loadu_epi8(m, xp + r * K + k);
      _mm512_mask_storeu_epi8(xu.data() + r * xs + k, m, _mm512_xor_si512(v, sign));
    }
  const int64_t sx_step = x_scale.numel() == N ? 1 : 0;  // per token, or one static scale for every row
  ROSEINFER_DISPATCH_FLOATS(out.scalar_type(), "int8_gemm", [&] {
    const int8_t* wp = packed.data_ptr<int8_t>();
    const int32_t* cp = comp.data_ptr<int32_t>();
    const float* sxp = x_scale.data_ptr<float>();
    const float* swp = weight_scale.data_ptr<float>();
    const scalar_t* bp = bias ? bias->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    roseinfer::for_each_panel_tile(P, N, [&](int64_t p, int64_t r0, int64_t mr) {
      alignas(64) int32_t acc[kMR * kPanel];
      const int64_t c0 = p * kPanel, nc = std::min(kPanel, O - c0);
      run_tile(mr, xu.data() + r0 * xs, xs, wp + p * K4 * kPanel * 4, K4, cp + c0, acc);
      for (int64_t r = 0; r < mr; ++r)
        roseinfer::epilogue_row(acc + r * kPanel, sxp[(r0 + r) * sx_step], swp + c0, bp ? bp + c0 : nullptr,
                                op + (r0 + r) * O + c0, nc);
    });
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(roseinfer, m) {
  m.def("int8_gemm_available() -> bool", &int8_gemm_available);
  m.def(
      "int8_gemm(Tensor(a!) out, Tensor x_q, Tensor packed, Tensor comp, Tensor x_scale, Tensor weight_scale, "
      "Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(roseinfer, CPU, m) { m.impl("int8_gemm", &int8_gemm); }
