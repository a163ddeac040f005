// What the two GEMMs over a weight packed in panels of 64 outputs share (int8_gemm.cpp, dense_gemm.cpp): the tile
// size and the split of the (panel, row tile) work over threads. A tile's row count reaches its kernel as a
// compile-time constant through with_count<kMR> (static_count.h).
#pragma once
#include "static_count.h"
#include "vec_utils.h"

namespace roseinfer {

constexpr int64_t kPanel = 64;  // output columns per panel: 4 vectors of 16 32-bit lanes
constexpr int64_t kMR = 6;      // rows per tile: 6 x 4 accumulators + 4 weight vectors + a broadcast < 32 registers

// f(p, r0, mr) for every panel p < P and every tile of mr <= kMR rows from row r0 of N, in parallel. Threads
// split the panels; the rows are cut in two groups when the panels do not split evenly over the threads (9 panels
// on 2 threads: 5 and 4, where 18 items give 9 and 9), each group then reading the panel again
template <typename F>
inline void for_each_panel_tile(int64_t P, int64_t N, const F& f) {
  const int64_t threads = at::get_num_threads(), tiles = (N + kMR - 1) / kMR;
  const int64_t G = threads > 1 && P % threads != 0 && tiles >= 2 ? 2 : 1, group = (tiles + G - 1) / G * kMR;
  at::parallel_for(0, P * G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r_end = std::min(N, (item % G + 1) * group);
      for (int64_t r0 = item % G * group; r0 < r_end; r0 += kMR) f(item / G, r0, std::min(kMR, r_end - r0));
    }
  });
}

}  // namespace roseinfer
