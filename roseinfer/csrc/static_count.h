// A count known only at run time, handed on as a compile-time constant: what the register-tiled kernels use for
// a tile's rows (panel_gemm.h's GEMM tiles, paged_attention.cpp's row blocks), so that the tile's vectors stay in
// registers and its loops over rows unroll with no test of a row against the count. No ATen: any header may
// include it.
#pragma once
#include <cstdint>
#include <type_traits>

namespace roseinfer {

// f(std::integral_constant<int64_t, min(n, Max)>{}) for 1 <= n: one instantiation of f per count up to Max
template <int64_t Max, typename F>
inline void with_count(int64_t n, const F& f) {
  if constexpr (Max > 1)
    if (n < Max) return with_count<Max - 1>(n, f);
  f(std::integral_constant<int64_t, Max>{});
}

}  // namespace roseinfer
