// Writing a step's new K and V into their paged slots: vLLM's `reshape_and_cache`, on a CPU. The Python version
// (roseinfer/attention/sdpa.py's write_kv_flat) is two `index_copy_` calls into the flat views of the pools;
// this is one pass that copies each token's K row and V row straight from the fused qkv output:
//
//     key, value [N, Hkv, D]          any row and head strides, stride 1 on D (views into the qkv output)
//     k_cache, v_cache                [num_blocks, block_size, Hkv, D], contiguous, the same dtype as key
//     slot_mapping [N]                token n goes to flat row slot_mapping[n] = block * block_size + offset
//
//     k_cache.view(-1, Hkv, D)[slot_mapping[n]] = key[n]          (and the same for V), for every n
//
// `index_copy_` first makes each strided view contiguous (a copy of its own), then scatters with torch's general
// indexing loop: at a decode step of 32 tokens the two cost ~30 µs a layer with the pool in cache, for 100 KB of
// rows. Here a token's rows are copied head by head with memcpy, as rotary.cpp's write does; the bytes are the
// same in any float dtype, so there is no dispatch on it. Slots are checked before anything is written.
#include "vec_utils.h"

#include <torch/library.h>

#include <cstring>

namespace {

void check_rows(const at::Tensor& t, const char* name, const at::Tensor& cache) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == cache.size(2) && t.size(2) == cache.size(3), name,
              " must be [N, Hkv, D] with the pool's Hkv and D, got ", t.sizes(), " for a pool of ", cache.sizes());
  TORCH_CHECK(t.stride(2) == 1 || t.size(2) <= 1, name, " needs stride 1 on D");
  TORCH_CHECK(t.scalar_type() == cache.scalar_type(), name, " must be in the pool's dtype ", cache.scalar_type(),
              ", got ", t.scalar_type());
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, D] of one shape and dtype, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  check_rows(key, "key", k_cache);
  check_rows(value, "value", k_cache);
  const int64_t N = key.size(0), Hkv = key.size(1), D = key.size(2);
  TORCH_CHECK(value.size(0) == N, "key and value must have the same tokens, got ", N, " and ", value.size(0));
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == N && slot_mapping.is_contiguous() &&
                  slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be [N] int64, contiguous, got ", slot_mapping.sizes(), " ",
              slot_mapping.scalar_type());
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(slots[n] >= 0 && slots[n] < num_slots, "slot ", slots[n], " is outside the pool's ", num_slots);

  const int64_t esize = key.element_size(), head = D * esize, row = Hkv * head;  // bytes
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t k0 = key.stride(0) * esize, k1 = key.stride(1) * esize;
  const int64_t v0 = value.stride(0) * esize, v1 = value.stride(1) * esize;
  at::parallel_for(0, N, roseinfer::grain_rows(2 * Hkv * D), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      char* kdst = kc + slots[n] * row;  // a slot holds [Hkv, D]
      char* vdst = vc + slots[n] * row;
      for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(kdst + h * head, kp + n * k0 + h * k1, head);
        std::memcpy(vdst + h * head, vp + n * v0 + h * v1, head);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(roseinfer, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(roseinfer, CPU, m) { m.impl("reshape_and_cache", &reshape_and_cache); }
