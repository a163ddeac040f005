// Decode attention that reads the paged KV cache in place (roseinfer/attention/cpu_paged.py explains it).
// Registered as torch.ops.roseinfer.paged_decode; roseinfer/custom_ops.py builds this folder into one library.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

template <typename scalar_t, typename index_t>
static void decode(const scalar_t* q, const scalar_t* k, const scalar_t* v, const index_t* tables,
                   const index_t* lens, scalar_t* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                   int64_t block_size, int64_t max_blocks, float scale, int64_t max_len) {
  const int64_t G = H / Hkv;  // query heads per K/V head: query head h = j * G + g reads K/V head j
  // one sequence at a time per thread, all its heads together: each token's K (and V) row, [Hkv, D], is one
  // contiguous read of Hkv * D elements, each K/V head's D of them used by the G query heads of its group
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(H * std::max<int64_t>(max_len, 1)), acc(H * D), qf(H * D), m(H), sum(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = lens[b];
      const index_t* table = tables + b * max_blocks;
      for (int64_t j = 0; j < H * D; ++j) qf[j] = static_cast<float>(q[b * H * D + j]) * scale;
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < n; ++t) {  // s[h, t] = q[h] · k[t, h / G]
        const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
        const scalar_t* kp = k + slot * Hkv * D;
        for (int64_t j = 0; j < Hkv; ++j) {
          const scalar_t* kj = kp + j * D;  // K/V head j of token t: from memory for its first query head,
          for (int64_t h = j * G; h < (j + 1) * G; ++h) {  // from the L1 cache for the G - 1 others
            const float* qh = qf.data() + h * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * static_cast<float>(kj[d]);
            s[h * max_len + t] = dot;
            m[h] = std::max(m[h], dot);
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {  // p[h, t] = exp(s - max) (normalised at the end)
        float total = 0.f;
        float* sh = s.data() + h * max_len;
        for (int64_t t = 0; t < n; ++t) {
          sh[t] = std::exp(sh[t] - m[h]);
          total += sh[t];
        }
        sum[h] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {  // acc[h] += p[h, t] · v[t, h / G]
        const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
        const scalar_t* vp = v + slot * Hkv * D;
        for (int64_t j = 0; j < Hkv; ++j) {
          const scalar_t* vj = vp + j * D;
          for (int64_t h = j * G; h < (j + 1) * G; ++h) {
            const float p = s[h * max_len + t];
            float* ah = acc.data() + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ah[d] += p * static_cast<float>(vj[d]);
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        const float inv = 1.f / sum[h];
        for (int64_t d = 0; d < D; ++d) out[(b * H + h) * D + d] = static_cast<scalar_t>(acc[h * D + d] * inv);
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == seq_lens.scalar_type());
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
              v_cache.sizes() == k_cache.sizes(), "q, k_cache and v_cache must share one dtype, the pools one shape");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hkv >= 1 && H % Hkv == 0,
              "q [B, H, D] needs pools [num_blocks, block_size, Hkv, D] with H % Hkv == 0");
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, q.scalar_type(), "decode", [&] {
    AT_DISPATCH_INDEX_TYPES(block_tables.scalar_type(), "decode_index", [&] {
      const index_t* lens = seq_lens.data_ptr<index_t>();
      int64_t max_len = 0;  // each thread's scratch holds H x max_len scores
      for (int64_t b = 0; b < B; ++b) {
        TORCH_CHECK(lens[b] >= 1, "every sequence attends to at least one token");
        max_len = std::max<int64_t>(max_len, lens[b]);
      }
      decode<scalar_t, index_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                block_tables.data_ptr<index_t>(), lens,
                                out.data_ptr<scalar_t>(), B, H, Hkv, D, k_cache.size(1), block_tables.size(1),
                                static_cast<float>(scale), max_len);
    });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(roseinfer, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(roseinfer, CPU, m) { m.impl("paged_decode", &paged_decode); }
