// RoPE on q and k in place, in one pass over a step's tokens (roseinfer/model_executor/rotary_embedding.py
// teaches the math), and the same pass that also writes each token's rotated K and its V into their paged KV
// slot. Registered as torch.ops.roseinfer.rotary_embedding and torch.ops.roseinfer.rotary_embedding_write_kv.
//
//     q [N, H, D], k [N, Hkv, D]      views into the fused qkv output (row stride (H + 2·Hkv)·D, head stride D)
//     cos, sin [N, 1, D] or [N, D]    RotaryEmbedding.forward's; only the first D/2 of each row are read
//
// Per token, the D/2 cos and sin values are loaded once (as fp32) and turn all H + Hkv heads:
//
//     neox (rotate-half)   pair i = features (i, i + D/2)      x_i' = x_i·cos_i − x_{i+D/2}·sin_i
//                                                              x_{i+D/2}' = x_{i+D/2}·cos_i + x_i·sin_i
//     GPT-J (interleaved)  pair i = features (2i, 2i + 1)      the same rotation, pairs side by side
//
// The math is fp32 (one rounding at the end, where the reference rounds each product in the dtype).
#include "vec_utils.h"

#include <torch/library.h>

#include <cstring>

using roseinfer::fVec;
using roseinfer::kW;

namespace {

constexpr int64_t kMaxHalf = 512;  // head_dim up to 1024

template <typename T>
inline void rotate_head(T* x, const float* c, const float* s, int64_t half, bool neox) {
  if (neox) {
    for (int64_t i = 0; i < half; i += kW) {
      const int64_t n = std::min(kW, half - i);
      fVec x1 = roseinfer::load_f(x + i, n), x2 = roseinfer::load_f(x + half + i, n);
      fVec cv = fVec::loadu(c + i, n), sv = fVec::loadu(s + i, n);
      roseinfer::store_f(x + i, x1 * cv - x2 * sv, n);
      roseinfer::store_f(x + half + i, x2 * cv + x1 * sv, n);
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(x[2 * i]), b = static_cast<float>(x[2 * i + 1]);
      x[2 * i] = static_cast<T>(a * c[i] - b * s[i]);
      x[2 * i + 1] = static_cast<T>(b * c[i] + a * s[i]);
    }
  }
}

struct Heads {  // a [N, heads, D] view: its pointer and strides
  int64_t heads, s0, s1;
  explicit Heads(const at::Tensor& t) : heads(t.size(1)), s0(t.stride(0)), s1(t.stride(1)) {}
};

void check_qkv(const at::Tensor& t, const char* name, int64_t N, int64_t D, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == N && t.size(2) == D, name, " must be [N, heads, D] with N = ", N,
              ", D = ", D, ", got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 || D <= 1, name, " needs stride 1 on its last dim");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be in q's dtype");
}

void check_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3, "q must be [N, H, D], got ", q.sizes());
  const int64_t N = q.size(0), D = q.size(2);
  TORCH_CHECK(D % 2 == 0 && D / 2 <= kMaxHalf, "head_dim must be even and <= ", 2 * kMaxHalf, ", got ", D);
  check_qkv(q, "q", N, D, q.scalar_type());
  check_qkv(k, "k", N, D, q.scalar_type());
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK((t->dim() == 2 || (t->dim() == 3 && t->size(1) == 1)) && t->size(0) == N && t->size(-1) == D &&
                    (t->stride(-1) == 1 || D <= 1) && t->scalar_type() == q.scalar_type(),
                "cos and sin must be [N, 1, D] or [N, D] in q's dtype, got ", t->sizes(), " ", t->scalar_type());
  }
}

// Rotate token n's q and k heads; with `write`, also copy its K and V rows into slot slots[n] of the pools.
template <typename T, typename index_t>
void rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, bool neox,
          const at::Tensor* v, const at::Tensor* k_cache, const at::Tensor* v_cache, const index_t* slots) {
  const int64_t N = q.size(0), D = q.size(2), half = D / 2;
  const Heads qh(q), kh(k);
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t cs = cos.stride(0), ss = sin.stride(0);
  const int64_t work = (qh.heads + kh.heads) * D;  // elements turned per token
  at::parallel_for(0, N, roseinfer::grain_rows(work), [&](int64_t begin, int64_t end) {
    float c[kMaxHalf], s[kMaxHalf];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t i = 0; i < half; ++i) {
        c[i] = static_cast<float>(cp[n * cs + i]);
        s[i] = static_cast<float>(sp[n * ss + i]);
      }
      for (int64_t h = 0; h < qh.heads; ++h) rotate_head(qp + n * qh.s0 + h * qh.s1, c, s, half, neox);
      for (int64_t h = 0; h < kh.heads; ++h) rotate_head(kp + n * kh.s0 + h * kh.s1, c, s, half, neox);
      if (v == nullptr) continue;
      const int64_t slot = static_cast<int64_t>(slots[n]), row = kh.heads * D;  // a slot holds [Hkv, D]
      T* kdst = k_cache->data_ptr<T>() + slot * row;
      T* vdst = v_cache->data_ptr<T>() + slot * row;
      const T* vp = v->data_ptr<T>() + n * v->stride(0);
      for (int64_t h = 0; h < kh.heads; ++h) {
        std::memcpy(kdst + h * D, kp + n * kh.s0 + h * kh.s1, D * sizeof(T));
        std::memcpy(vdst + h * D, vp + h * v->stride(1), D * sizeof(T));
      }
    }
  });
}

void rotary_embedding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                      bool is_neox) {
  check_rope(q, k, cos, sin);
  ROSEINFER_DISPATCH_FLOATS(q.scalar_type(), "rotary_embedding", [&] {
    rope<scalar_t, int64_t>(q, k, cos, sin, is_neox, nullptr, nullptr, nullptr, nullptr);
  });
}

void rotary_embedding_write_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                               const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& slot_mapping, bool is_neox) {
  check_rope(q, k, cos, sin);
  const int64_t N = q.size(0), Hkv = k.size(1), D = q.size(2);
  check_qkv(v, "v", N, D, q.scalar_type());
  TORCH_CHECK(v.size(1) == Hkv, "v must have k's heads");
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->dim() == 4 && t->size(2) == Hkv && t->size(3) == D && t->is_contiguous() &&
                    t->scalar_type() == q.scalar_type(),
                "k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, D] in q's dtype, got ",
                t->sizes());
  }
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "k_cache and v_cache must have one shape");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == N && slot_mapping.is_contiguous(),
              "slot_mapping must be [N], contiguous");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  AT_DISPATCH_INDEX_TYPES(slot_mapping.scalar_type(), "rotary_embedding_write_kv", [&] {
    const index_t* slots = slot_mapping.data_ptr<index_t>();
    for (int64_t n = 0; n < N; ++n)  // checked before any thread writes
      TORCH_CHECK(slots[n] >= 0 && slots[n] < num_slots, "slot ", slots[n], " is outside the pool's ", num_slots);
    ROSEINFER_DISPATCH_FLOATS(q.scalar_type(), "rotary_embedding_write_kv", [&] {
      rope<scalar_t, index_t>(q, k, cos, sin, is_neox, &v, &k_cache, &v_cache, slots);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(roseinfer, m) {
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, bool is_neox) -> ()");
  m.def("rotary_embedding_write_kv(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, "
        "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, bool is_neox) -> ()");
}

TORCH_LIBRARY_IMPL(roseinfer, CPU, m) {
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("rotary_embedding_write_kv", &rotary_embedding_write_kv);
}
