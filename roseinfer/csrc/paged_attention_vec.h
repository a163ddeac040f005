// The loads the CPU attention kernels (paged_attention.cpp) build on: ATen's SIMD type at this CPU's width, a K/V
// row of fp32/bf16/fp16/fp8 as fp32 vectors, N dot products finished at once, and prefetches. Included by
// paged_attention.cpp only, first: it picks at::vec's width itself, in its own namespace (CPU_CAPABILITY below).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512  // at::vec's 512-bit Vectorized (16 floats) on this -march=native build
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif
#define CPU_CAPABILITY roseinfer_attention  // our own namespace for at::vec's inline code: no clash with ATen's
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

#include "static_count.h"

namespace {  // internal linkage: a second build of the kernels (bench_attention's old kernel) cannot clash with them
using Vec = at::vec::Vectorized<float>;
constexpr int64_t N = Vec::size();  // floats per vector register: 16 with AVX-512

using Fp8 = c10::Float8_e4m3fn;

#if defined(CPU_CAPABILITY_AVX512)
// 16 e4m3 bytes -> 16 floats: the 7 bits after the sign, moved up by 20, are a float with e4m3's exponent field
// and mantissa at the top of fp32's mantissa; times 2^(127 - 7) rebias the exponent, which also makes e4m3's
// subnormals (exponent 0) exact. Then the sign. (0x7F, e4m3's NaN, reads as 480: writes saturate, never NaN.)
inline Vec load_fp8(const Fp8* p, int64_t n) {
  const __m128i bytes = n == N ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                               : _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << n) - 1), p);
  const __m512i x = _mm512_cvtepu8_epi32(bytes);  // [16] int32, one byte each
  const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 20);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(0x1p120f));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

// n <= 16 two-byte elements (bf16 or fp16), zeros after them
inline __m256i load_halves(const void* p, int64_t n) {
  return n == N ? _mm256_loadu_si256(static_cast<const __m256i*>(p))
                : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
}

// 16 bf16 -> 16 floats: a bf16 is the top half of an fp32, so widen each to 32 bits and move it up by 16. (With
// ATen's at::vec::load_to_float here instead, bf16 decode of 32 sequences took 2.4-2.6x as long.)
inline Vec load_bf16(const c10::BFloat16* p, int64_t n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_halves(p, n)), 16));
}

// 16 fp16 -> 16 floats: the F16C conversion, one instruction
inline Vec load_fp16(const c10::Half* p, int64_t n) { return _mm512_cvtph_ps(load_halves(p, n)); }
#endif

template <typename T>  // n <= N elements of a K/V/q row as fp32, zeros after them
inline Vec load(const T* p, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, Fp8>) return load_fp8(p, n);
  if constexpr (std::is_same_v<T, c10::BFloat16>) return load_bf16(p, n);
  if constexpr (std::is_same_v<T, c10::Half>) return load_fp16(p, n);
#endif
  if constexpr (std::is_same_v<T, float>) {
    return n == N ? Vec::loadu(p) : Vec::loadu(p, n);
  } else {
    Vec out;
    if constexpr (at::vec::is_reduced_floating_point_v<T>) {
      if (n == N) {
        at::vec::load_to_float<T>(p, out);  // bf16/fp16 -> fp32, in registers
        return out;
      }
    }
    {  // a row's tail (D not a multiple of N), or a double pool
      float tmp[N] = {};
      for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
      out = Vec::loadu(tmp);
    }
    return out;
  }
}

// Lane i of the result = the sum of v[i]'s N lanes: N dot products finished at once. With AVX-512, a tree of
// shuffles and adds (45 instructions for 16 sums) instead of a horizontal sum per vector (~8 each).
inline Vec sum_lanes(const Vec* v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 c[8], e[4], f[2];
  for (int i = 0; i < 8; ++i) {  // 32-bit pairs: each 128-bit lane of c[i] holds 2-element sums of v[2i], v[2i+1]
    __m512 a = v[2 * i], b = v[2 * i + 1];
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // 64-bit pairs: lane k of e[i] = 4-element sums of v[4i .. 4i+3] in lane k
    __m512d a = _mm512_castps_pd(c[2 * i]), b = _mm512_castps_pd(c[2 * i + 1]);
    e[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes added pairwise: 0+1, 2+3
    f[i] = _mm512_add_ps(_mm512_shuffle_f32x4(e[2 * i], e[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(e[2 * i], e[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], 0x88), _mm512_shuffle_f32x4(f[0], f[1], 0xDD));
#else
  float s[N];
  for (int64_t i = 0; i < N; ++i) s[i] = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, v[i]);
  return Vec::loadu(s);
#endif
}

// ask for a row's cache lines ahead of use: blocks are scattered, the prefetcher can't guess. Into L2 (locality
// 2, prefetcht1), not L1: a token's K and V rows are 24 cache lines at SmolLM2's shapes in fp32, and asking for
// them in L1 measured slower (decode of 32 sequences from memory, bench_attention.py: L2 is 1.2x at 1 thread,
// 1.1x at 2)
template <typename T>
inline void prefetch(const T* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < D * int64_t(sizeof(T)); i += 64) __builtin_prefetch(c + i, 0, 2);
}
}  // namespace
