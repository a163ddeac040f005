// A grammar's bitmask on a step's logits (structured outputs, roseinfer/sample/grammar_bitmask.py): every token
// the bitmask does not allow gets -inf. Registered as torch.ops.roseinfer.apply_token_bitmask.
//
//   logits [S, V] float32 (in place), bitmask [R, W] int32 (W = ceil(V / 32)), rows [R] int64: bitmask row i
//   masks logits row rows[i]; token t is allowed iff bit (t % 32) of word t / 32 is set.
//
// A word of all ones (32 allowed tokens, the usual case inside a JSON string) is skipped with one compare; the
// others write -inf to their forbidden tokens. Rows are split over threads.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>

namespace {

void apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask: logits must be [S, V] float32 with rows of stride 1, got ", logits.sizes());
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask must be a contiguous [R, W] int32 tensor, got ", bitmask.sizes());
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "apply_token_bitmask: rows must be [R] int64, one per bitmask row");
  const int64_t V = logits.size(1), W = bitmask.size(1), R = bitmask.size(0), S = logits.size(0);
  TORCH_CHECK(W * 32 >= V, "apply_token_bitmask: ", W, " words cannot cover ", V, " tokens");
  float* lp = logits.data_ptr<float>();
  const int32_t* bp = bitmask.data_ptr<int32_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t ls = logits.stride(0);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(0 <= rp[i] && rp[i] < S, "apply_token_bitmask: row ", rp[i], " out of range");
  at::parallel_for(0, R, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = lp + rp[i] * ls;
      const int32_t* words = bp + i * W;
      for (int64_t w = 0; w < W; ++w) {
        const uint32_t word = static_cast<uint32_t>(words[w]);
        if (word == 0xFFFFFFFFu) continue;  // all 32 allowed
        const int64_t base = w * 32, n = std::min<int64_t>(32, V - base);
        for (int64_t b = 0; b < n; ++b) {
          if (!((word >> b) & 1u)) row[base + b] = kNegInf;
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(roseinfer, m) { m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()"); }

TORCH_LIBRARY_IMPL(roseinfer, CPU, m) { m.impl("apply_token_bitmask", &apply_token_bitmask); }
