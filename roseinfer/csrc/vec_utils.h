// What the element-wise kernels (layernorm.cpp, activation.cpp, rotary.cpp) share: ATen's portable SIMD type
// at this CPU's width, loads of fp32/bf16/fp16 as fp32 vectors and stores back, and the rows-per-thread rule.
//
// at::vec::Vectorized<float> is 16 floats (one zmm register) only when CPU_CAPABILITY_AVX512 is defined: torch
// defines it for its own kernels, built once per instruction set, but not for an extension. We build with
// -march=native, so the compiler's own macros say what this CPU has; we pick the matching Vectorized. Include
// this header before any other ATen header.
#pragma once

#if !defined(CPU_CAPABILITY)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
#endif

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>

// fp32, bf16 and fp16 (the model dtypes; fp64 stays on the PyTorch reference): scalar_t is the element type
#define ROSEINFER_DISPATCH_FLOATS(TYPE, NAME, ...)                 \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace roseinfer {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kW = fVec::size();  // floats per vector: 16 with AVX-512, 8 with AVX2

// Work (elements) below which an op stays on the calling thread. Waking the second OpenMP thread and joining it
// costs several microseconds; measured on the 2-core EPYC with every op forced parallel, 2 threads only won from
// ~40-70K elements (rms_norm at C = 576: even at 64 rows, 1.5x at 128; silu_and_mul's exp-bound rows already at
// 16-32 rows of 4608). So a decode step's norms and rotations (N <= ~80 rows) run on one thread, a prefill's on all.
constexpr int64_t kParallelElems = 49152;

inline int64_t grain_rows(int64_t elems_per_row) {
  return std::max<int64_t>(1, kParallelElems / std::max<int64_t>(1, elems_per_row));
}

// n (<= kW) elements of T, as floats (the lanes past n are 0)
template <typename T>
inline fVec load_f(const T* p, int64_t n = kW) {
  if constexpr (std::is_same_v<T, float>) {
    return n == kW ? fVec::loadu(p) : fVec::loadu(p, n);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    if (n == kW) {
      fVec out;
      at::vec::load_to_float<T>(p, out);
      return out;
    }
#endif
    __at_align__ float tmp[kW] = {};
    for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
    return fVec::loadu(tmp);
  }
}

// the first n (<= kW) lanes of v, rounded to T (round to nearest even, as tensor.to(dtype) does)
template <typename T>
inline void store_f(T* p, const fVec& v, int64_t n = kW) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p, n);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    if (n == kW) {
      __m256i r = std::is_same_v<T, at::BFloat16> ? at::vec::cvtfp32_bf16(v) : at::vec::cvtfp32_fp16(v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), r);
      return;
    }
#endif
    __at_align__ float tmp[kW];
    v.store(tmp);
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(tmp[i]);
  }
}

// v rounded to T and back: the value a tensor of dtype T would hold (a no-op for fp32)
template <typename T>
inline fVec round_to(const fVec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    __at_align__ T tmp[kW];
    store_f<T>(tmp, v);
    return load_f<T>(tmp);
  }
}

}  // namespace roseinfer
