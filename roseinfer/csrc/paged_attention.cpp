// Attention that reads the paged KV cache in place, on a CPU (roseinfer/attention/cpu_paged.py teaches it).
//   torch.ops.roseinfer.paged_decode(q [B, H, D], k_cache, v_cache, block_tables [B, W], seq_lens [B], scale)
//   torch.ops.roseinfer.paged_prefill(q [T, H, D], k_cache, v_cache, block_table [W], seq_len, scale)
// Pools are [num_blocks, block_size, Hkv, D]; query head h = j * G + g reads K/V head j (G = H / Hkv).
//
// Both ops cut their work into items, run in parallel by at::parallel_for, and run each item through `attend`:
// R query rows of ONE sequence (a decode of many sequences: all H heads, so a token's Hkv rows of D, side by side
// in the pool, are one read; else the G heads of one K/V head j, in a prefill chunk for some of its tokens),
// over a range of that sequence's tokens, in chunks of kChunk tokens (per K/V head, for the rows that read it):
//
//   S[R, n]   = Q[R, D] . K[n, D]^T        a K row loaded once per RB rows, whose q stay in registers
//   m'        = max(m, rowmax S)           online softmax: acc and l rescaled by exp(m - m')
//   P[R, n]   = exp(S - m')                Vectorized<float>::exp_u20, 16 tokens at a time
//   acc[R, D] += P[R, n] . V[n, D]         a V row loaded once per RB rows, whose acc stay in registers
//   l[R]     += rowsum P
//
// and the output row is acc / l. A decode item's arithmetic also carries the reads of the thread's next item
// (`Ahead`): its K/V rows are asked for a few cache lines per inner step, so that they arrive from memory while
// this item computes instead of in a stall at its start. A decode with few (sequence, K/V head) pairs for the
// threads splits each sequence into chunks of kSplit tokens, items of their own, and merges their (acc, m, l) by
// log-sum-exp.
// fp16/bf16 pools are converted to fp32 as they are loaded; so are fp8 (e4m3) pools, whatever q's dtype
// (kv_cache_dtype="fp8", roseinfer/attention/fp8_kv.py); every sum is fp32.
#include "paged_attention_vec.h"  // first: it sets at::vec's width

#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace {  // internal linkage: a second build of this file (bench_attention's old kernel) cannot clash with it
constexpr int64_t kChunk = 256;     // tokens whose scores one item keeps at a time (S is [R, kChunk])
constexpr int64_t kSplit = 256;     // a decode's context chunk when sequences are split over threads
constexpr int64_t kMaxD = 512;      // head sizes up to this: a K or V row is kMaxD / N registers
constexpr int64_t kRows = 32;       // query rows per prefill item (tokens x G heads)
constexpr int64_t kItemTokens = 16;  // a decode item's setup, counted as this many tokens' reads
constexpr float kInf = std::numeric_limits<float>::infinity();

template <typename T, typename I>
struct KV {  // one sequence's K/V heads j .. j + heads - 1, read through its block table
  const T* k;  // k_cache + j * D: token t's rows are at slot(t) * stride, head j + i's i * D after it
  const T* v;
  const I* table;
  int64_t block_size, stride, heads;  // stride = Hkv * D elements from one slot to the next
  // off[i] = where token t0 + i's row starts (slot * stride), i < n: one division per call, not one per token
  void rows_at(int64_t t0, int64_t n, int64_t* off) const {
    int64_t b = t0 / block_size, o = t0 % block_size;
    for (int64_t i = 0; i < n; ++i) {
      off[i] = (static_cast<int64_t>(table[b]) * block_size + o) * stride;
      if (++o == block_size) o = 0, ++b;
    }
  }
};

// A thread's next item's first rows (K of its first n tokens, then their V), fetched while this item computes:
// `per` cache lines at each step() of the item's inner loops, so that the reads from memory spread over all of
// its arithmetic instead of queueing in bursts. n = 0: nothing to fetch
template <typename T>
struct Ahead {
  const T *k = nullptr, *v = nullptr;
  const int64_t* off = nullptr;  // [n]: the rows' offsets (KV::rows_at)
  int64_t n = 0, lines = 0;      // rows of K (and of V), cache lines per row
  int64_t per = 0, u = 0, line = 0;  // lines per step; the cursor: row u of 2n (K rows, then V rows), its line
  void step() {
    for (int64_t i = 0; i < per && u < 2 * n; ++i) {
      const T* row = u < n ? k + off[u] : v + off[u - n];
      __builtin_prefetch(reinterpret_cast<const char*>(row) + line * 64, 0, 2);
      if (++line == lines) line = 0, ++u;
    }
  }
};

struct Rows {  // one item's query rows and running softmax state, in the thread's scratch
  int64_t R, D, Dv;  // rows, head size, head size rounded up to whole vectors
  float *q, *acc, *m, *l, *s;  // q, acc [R, Dv]; m, l [R]; s [R, kChunk]
  Vec* part;                   // [R, N]: per row, N tokens' unfinished dot products
  int64_t* limit;              // [R]: row r sees tokens t < limit[r] (the caller fills it)
  int64_t* off;                // [kChunk + N]: the chunk's K/V row offsets (KV::rows_at), N more to prefetch
};

inline Rows scratch(int64_t R, int64_t D) {  // the thread's buffers, grown when a call needs more, never freed
  thread_local std::vector<float> buf;
  thread_local std::vector<Vec> part;
  thread_local std::vector<int64_t> limit;
  thread_local std::vector<int64_t> off(kChunk + N);
  const int64_t Dv = (D + N - 1) / N * N;
  if (buf.size() < size_t(R * (2 * Dv + 2 + kChunk))) buf.resize(R * (2 * Dv + 2 + kChunk));
  if (part.size() < size_t(R * N)) part.resize(R * N);
  if (limit.size() < size_t(R)) limit.resize(R);
  float* p = buf.data();
  Rows rows{R, D, Dv, p, p + R * Dv, p + 2 * R * Dv, p + 2 * R * Dv + R, p + 2 * R * Dv + 2 * R, part.data(),
            limit.data(), off.data()};
  std::fill(rows.acc, rows.acc + R * Dv, 0.f);
  std::fill(rows.m, rows.m + R, -kInf);
  std::fill(rows.l, rows.l + R, 0.f);
  return rows;
}

template <typename T, typename F>  // rows.q[r] = q_row(r)[0 .. D-1] * scale, zero-padded to Dv
inline void load_q(Rows& rows, float scale, const F& q_row) {
  for (int64_t r = 0; r < rows.R; ++r) {
    const T* src = q_row(r);
    float* dst = rows.q + r * rows.Dv;
    for (int64_t d = 0; d < rows.Dv; ++d) dst[d] = d < rows.D ? static_cast<float>(src[d]) * scale : 0.f;
  }
}

// every row over tokens t0 .. t1-1 (the header's loop); rows [i * R / heads, (i + 1) * R / heads) read head i
// of kv, so a token's rows of all kv.heads heads, side by side in the pool, are one contiguous read. NV = D / N
// vectors per row when it is a compile-time constant (D = NV * N: loops over D unroll, loads need no tail test),
// else 0. Rows go RB at a time, their q (step 1) or acc (step 3) in registers while the tokens stream past. `next`
// is a copy of the caller's: its cursor stays in registers instead of being stored to memory at every step
template <int64_t NV, typename T, typename I>
void attend(const KV<T, I>& kv, Rows& rows, int64_t t0, int64_t t1, Ahead<T> next, bool fetched) {
  constexpr int64_t RB = NV == 0 ? 1 : NV <= 2 ? 8 : NV <= 4 ? 4 : 2, NA = NV ? NV : kMaxD / N;
  const int64_t R = rows.R, D = NV ? NV * N : rows.D, Dv = rows.Dv, nv = NV ? NV : Dv / N, J = kv.heads, Rj = R / J;
  const int64_t blocks = J * ((Rj + RB - 1) / RB);  // row blocks: each walks the chunk's tokens in steps 1 and 3
  for (int64_t c0 = t0; c0 < t1; c0 += kChunk) {
    const int64_t n = std::min(kChunk, t1 - c0), ahead = std::min(n + N, t1 - c0);
    kv.rows_at(c0, ahead, rows.off);  // rows.off[i]: token c0 + i's row
    // the last chunk brings in the next item's rows, over its 2 * blocks * n inner steps; a first chunk that the
    // item before brought in fetches only what lies past it
    if (c0 + kChunk >= t1) next.per = (2 * next.n * next.lines + 2 * blocks * n - 1) / (2 * blocks * n);
    const bool own = !(fetched && c0 == t0);
    // 1. S[r, t] = q[r] . k[t]: a tile of N tokens at a time, each K row read once per RB rows
    for (int64_t tt = 0; tt < n; tt += N) {
      const int64_t nt = std::min(N, n - tt);
      for (int64_t t = 0; t < nt; ++t) {
        if (tt + t + N < ahead && (own || tt + t + N >= n)) prefetch(kv.k + rows.off[tt + t + N], J * D);  // K
        if (own) prefetch(kv.v + rows.off[tt + t], J * D);  // V of this token, needed in step 3
      }
      for (int64_t i = 0; i < J; ++i)
        for (int64_t r0 = i * Rj; r0 < (i + 1) * Rj; r0 += RB)
          roseinfer::with_count<RB>((i + 1) * Rj - r0, [&](auto RBc) {  // rb rows, a compile-time count: q in registers
            constexpr int64_t rb = decltype(RBc)::value;
            Vec a[rb][NA], x[NA];
            for (int64_t r = 0; r < rb; ++r)
              for (int64_t c = 0; c < nv; ++c) a[r][c] = Vec::loadu(rows.q + (r0 + r) * Dv + c * N);
            for (int64_t t = 0; t < nt; ++t) {
              next.step();
              const T* kp = kv.k + rows.off[tt + t] + i * D;
              for (int64_t c = 0; c < nv; ++c) x[c] = load(kp + c * N, std::min(N, D - c * N));
              for (int64_t r = 0; r < rb; ++r) {
                Vec dot = a[r][0] * x[0];
                for (int64_t c = 1; c < nv; ++c) dot = at::vec::fmadd(a[r][c], x[c], dot);
                rows.part[(r0 + r) * N + t] = dot;  // D/N lanes still to add up
              }
            }
          });
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t t = nt; t < N; ++t) rows.part[r * N + t] = Vec(0.f);
        sum_lanes(rows.part + r * N).store(rows.s + r * kChunk + tt, nt);  // N scores of row r, no hsum each
      }
    }
    // 2. online softmax, a vector of tokens at a time: P = exp(S - m'), acc and l rescaled by exp(m - m')
    for (int64_t r = 0; r < R; ++r) {
      float* s = rows.s + r * kChunk;
      const int64_t visible = std::clamp<int64_t>(rows.limit[r] - c0, 0, n);  // causal: later tokens masked
      std::fill(s + visible, s + n, -kInf);
      Vec mv(rows.m[r]);
      for (int64_t t = 0; t < visible; t += N) mv = at::vec::maximum(mv, Vec::loadu(s + t, std::min(N, visible - t)));
      const float m = std::max(rows.m[r], at::vec::vec_reduce_all<float>([](Vec u, Vec w) { return at::vec::maximum(u, w); }, mv));
      if (m == -kInf) {  // nothing visible yet (a chunk's row before its first token)
        std::fill(s, s + n, 0.f);
        continue;
      }
      const float alpha = std::exp(rows.m[r] - m);
      Vec sum(0.f);
      mv = Vec(m);
      for (int64_t t = 0; t < n; t += N) {
        const int64_t nt = std::min(N, n - t);
        Vec p = (Vec::loadu(s + t, nt) - mv).exp_u20();
        if (nt < N) p = Vec::set(Vec(0.f), p, nt);  // lanes past the chunk count nothing
        p.store(s + t, nt);
        sum = sum + p;
      }
      rows.l[r] = rows.l[r] * alpha + at::vec::vec_reduce_all<float>([](Vec u, Vec w) { return u + w; }, sum);
      rows.m[r] = m;
      float* acc = rows.acc + r * Dv;
      if (alpha != 1.f)
        for (int64_t d = 0; d < Dv; ++d) acc[d] *= alpha;
    }
    // 3. acc[r] += P[r, t] * v[t], RB rows' acc in registers: each V row read once per RB rows
    for (int64_t i = 0; i < J; ++i)
      for (int64_t r0 = i * Rj; r0 < (i + 1) * Rj; r0 += RB)
        roseinfer::with_count<RB>((i + 1) * Rj - r0, [&](auto RBc) {  // rb rows' acc in registers
          constexpr int64_t rb = decltype(RBc)::value;
          int64_t tn = 0;  // tokens any of the rows sees (masked ones have P = 0)
          for (int64_t r = 0; r < rb; ++r) tn = std::max(tn, std::clamp<int64_t>(rows.limit[r0 + r] - c0, 0, n));
          Vec a[rb][NA], x[NA];
          for (int64_t r = 0; r < rb; ++r)
            for (int64_t c = 0; c < nv; ++c) a[r][c] = Vec::loadu(rows.acc + (r0 + r) * Dv + c * N);
          for (int64_t t = 0; t < tn; ++t) {
            next.step();
            const T* vp = kv.v + rows.off[t] + i * D;
            for (int64_t c = 0; c < nv; ++c) x[c] = load(vp + c * N, std::min(N, D - c * N));
            for (int64_t r = 0; r < rb; ++r) {
              const Vec p(rows.s[(r0 + r) * kChunk + t]);
              for (int64_t c = 0; c < nv; ++c) a[r][c] = at::vec::fmadd(p, x[c], a[r][c]);
            }
          }
          for (int64_t r = 0; r < rb; ++r)
            for (int64_t c = 0; c < nv; ++c) a[r][c].store(rows.acc + (r0 + r) * Dv + c * N);
        });
  }
}

template <typename T, typename I>  // attend<NV> for this head size
void run_attend(const KV<T, I>& kv, Rows& rows, int64_t t0, int64_t t1, Ahead<T>& next, bool fetched) {
  switch (rows.D == rows.Dv ? rows.D / N : 0) {
    case 2: return attend<2>(kv, rows, t0, t1, next, fetched);
    case 4: return attend<4>(kv, rows, t0, t1, next, fetched);
    case 8: return attend<8>(kv, rows, t0, t1, next, fetched);
    default: return attend<0>(kv, rows, t0, t1, next, fetched);
  }
}
template <typename T>  // out[d] = acc / l, in the output's dtype
inline void store_row(T* out, const Rows& rows, int64_t r) {
  const float inv = 1.f / rows.l[r];
  for (int64_t d = 0; d < rows.D; ++d) out[d] = static_cast<T>(rows.acc[r * rows.Dv + d] * inv);
}

template <typename T, typename P, typename I>  // T: q and out; P: the pools' elements (T, or Fp8)
void decode(const T* q, const P* k, const P* v, const I* tables, const I* lens, T* out, int64_t B, int64_t H,
            int64_t Hkv, int64_t D, int64_t block_size, int64_t width, float scale) {
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max<int64_t>(max_len, lens[b]);
  // items: (sequence b, group of J K/V heads, context chunk c), each with the R = J * G query heads that read its
  // group (head h = j * G + g reads K/V head j: rows in the order attend wants). J = Hkv, a token's K/V one
  // contiguous read, when there are sequences enough for 2 items per thread; else one K/V head per item, and when
  // B * Hkv items still leave threads idle, each sequence is also cut into chunks of kSplit tokens
  const int64_t threads = at::get_num_threads(), J = B >= 2 * threads ? Hkv : 1, NJ = Hkv / J, R = J * (H / Hkv);
  const bool split = B * NJ < 2 * threads && max_len > kSplit;
  const int64_t C = split ? (max_len + kSplit - 1) / kSplit : 1, items = B * NJ * C;
  std::vector<float> partial(split ? B * NJ * C * R * (D + 2) : 0);  // [B, NJ, C, R, D + 2]: acc, m, l
  struct Item {  // sequence b's K/V heads jg * J .. + J - 1, tokens t0 .. t1 - 1
    int64_t b, jg, t0, t1;
    KV<P, I> kv;
  };
  auto item_at = [&](int64_t item) {
    const int64_t b = item / (NJ * C), jg = item / C % NJ, t0 = item % C * kSplit;
    const int64_t t1 = split ? std::min<int64_t>(lens[b], t0 + kSplit) : lens[b];
    return Item{b, jg, t0, t1, {k + jg * J * D, v + jg * J * D, tables + b * width, block_size, Hkv * D, J}};
  };
  // each thread's share: a contiguous range of items of about equal work (the tokens they read, plus kItemTokens
  // for an item's setup), not of equal count: the engine's sequences differ in length (16 to 256 tokens here)
  std::vector<int64_t> work(items + 1, 0), bound(threads + 1, items);  // work[i]: items 0 .. i-1's, summed
  for (int64_t i = 0; i < items; ++i) {
    const Item it = item_at(i);
    work[i + 1] = work[i] + std::max<int64_t>(0, it.t1 - it.t0) + kItemTokens;
  }
  for (int64_t t = 0; t < threads; ++t)
    bound[t] = std::lower_bound(work.begin(), work.end() - 1, work[items] * t / threads) - work.begin();
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    thread_local std::vector<int64_t> next_off(kChunk);
    for (int64_t share = first; share < last; ++share) {
      const int64_t begin = bound[share], end = bound[share + 1];
      for (int64_t item = begin; item < end; ++item) {
        const Item it = item_at(item);
        const int64_t b = it.b, h0 = it.jg * R, n = lens[b];
        Rows rows = scratch(R, D);
        std::fill(rows.limit, rows.limit + R, n);  // a decode sees every token
        load_q<T>(rows, scale, [&](int64_t r) { return q + (b * H + h0 + r) * D; });  // [R, D]
        // the thread's next item, if any: its first chunk's rows come in while this one computes
        Ahead<P> next;
        if (const Item nx = item + 1 < end ? item_at(item + 1) : Item{}; nx.t0 < nx.t1) {
          const int64_t lines = (J * D * int64_t(sizeof(P)) + 63) / 64;  // cache lines per row
          next = {nx.kv.k, nx.kv.v, next_off.data(), std::min(kChunk, nx.t1 - nx.t0), lines};
          nx.kv.rows_at(nx.t0, next.n, next_off.data());
        }
        if (it.t0 < it.t1) run_attend(it.kv, rows, it.t0, it.t1, next, item > begin);
        for (int64_t r = 0; r < R; ++r) {
          if (!split) {
            store_row(out + (b * H + h0 + r) * D, rows, r);
            continue;
          }
          float* dst = partial.data() + (item * R + r) * (D + 2);
          std::copy(rows.acc + r * rows.Dv, rows.acc + r * rows.Dv + D, dst);
          dst[D] = rows.m[r], dst[D + 1] = rows.l[r];
        }
      }
    }
  });
  if (!split) return;
  // the merge: out = sum_c acc_c * exp(m_c - M) / sum_c l_c * exp(m_c - M), M = max_c m_c (log-sum-exp)
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, jg = bh % H / R, r = bh % R;
      const float* part = partial.data() + ((b * NJ + jg) * C * R + r) * (D + 2);  // chunk c at + c * R * (D + 2)
      float M = -kInf, l = 0.f;
      for (int64_t c = 0; c < C; ++c) M = std::max(M, part[c * R * (D + 2) + D]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0; c < C; ++c) {
        const float* pc = part + c * R * (D + 2);
        if (pc[D + 1] == 0.f) continue;  // a chunk past this sequence's end
        const float w = std::exp(pc[D] - M);
        l += pc[D + 1] * w;
        for (int64_t d = 0; d < D; ++d) acc[d] += pc[d] * w;
      }
      for (int64_t d = 0; d < D; ++d) out[bh * D + d] = static_cast<T>(acc[d] / l);
    }
  });
}

template <typename T, typename P, typename I>
void prefill(const T* q, const P* k, const P* v, const I* table, T* out, int64_t Tq, int64_t H, int64_t Hkv,
             int64_t D, int64_t block_size, int64_t seq_len, float scale) {
  const int64_t G = H / Hkv, ctx = seq_len - Tq;  // query token i sits at position ctx + i
  const int64_t per = std::max<int64_t>(1, kRows / G), tiles = (Tq + per - 1) / per;  // query tokens per item
  // items: (tile of `per` query tokens, K/V head j), R = per * G rows each, row r = token r / G, head j * G + r % G.
  // Causal: a later tile reads more tokens, so tiles are dealt from both ends (0, last, 1, last - 1, ...) and each
  // thread's contiguous share of items gets as many early as late ones.
  at::parallel_for(0, tiles * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / Hkv, j = item % Hkv, tile = p % 2 ? tiles - 1 - p / 2 : p / 2;
      const int64_t i0 = tile * per, i1 = std::min(Tq, i0 + per);
      Rows rows = scratch((i1 - i0) * G, D);
      for (int64_t r = 0; r < rows.R; ++r) rows.limit[r] = ctx + i0 + r / G + 1;  // keys 0 .. its own position
      auto row = [&](int64_t r) { return ((i0 + r / G) * H + j * G + r % G) * D; };
      load_q<T>(rows, scale, [&](int64_t r) { return q + row(r); });
      KV<P, I> kv{k + j * D, v + j * D, table, block_size, Hkv * D, 1};
      Ahead<P> none;  // a prefill item fetches its own rows only
      run_attend(kv, rows, 0, ctx + i1, none, false);
      for (int64_t r = 0; r < rows.R; ++r) store_row(out + row(r), rows, r);
    }
  });
}

void check_pools(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& table, const at::Tensor& lens) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && table.is_contiguous() && lens.is_contiguous());
  TORCH_CHECK(table.scalar_type() == lens.scalar_type(), "block tables and seq_lens must share one dtype");
  TORCH_CHECK((q.scalar_type() == k_cache.scalar_type() || k_cache.scalar_type() == at::kFloat8_e4m3fn) &&
              v_cache.scalar_type() == k_cache.scalar_type() && v_cache.sizes() == k_cache.sizes(),
              "the pools must share one dtype (q's, or float8_e4m3fn) and one shape");
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hkv >= 1 && H % Hkv == 0,
              "q [N, H, D] needs pools [num_blocks, block_size, Hkv, D] with H % Hkv == 0");
  TORCH_CHECK(D <= kMaxD, "head size ", D, " is larger than the kernel's ", kMaxD);
}

template <typename T, typename F>  // f(k, v): the pools' data, typed T (q's dtype) or Fp8
inline void with_pools(const at::Tensor& k_cache, const at::Tensor& v_cache, const F& f) {
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn)
    f(static_cast<const Fp8*>(k_cache.data_ptr()), static_cast<const Fp8*>(v_cache.data_ptr()));
  else
    f(static_cast<const T*>(k_cache.data_ptr<T>()), static_cast<const T*>(v_cache.data_ptr<T>()));
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  check_pools(q, k_cache, v_cache, block_tables, seq_lens);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, q.scalar_type(), "decode", [&] {
    AT_DISPATCH_INDEX_TYPES(block_tables.scalar_type(), "decode_index", [&] {
      const index_t* lens = seq_lens.data_ptr<index_t>();
      for (int64_t b = 0; b < B; ++b) TORCH_CHECK(lens[b] >= 1, "every sequence attends to at least one token");
      with_pools<scalar_t>(k_cache, v_cache, [&](auto k, auto v) {
        decode(q.data_ptr<scalar_t>(), k, v, block_tables.data_ptr<index_t>(), lens, out.data_ptr<scalar_t>(), B, H,
               Hkv, D, k_cache.size(1), block_tables.size(1), static_cast<float>(scale));
      });
    });
  });
  return out;
}

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_table, int64_t seq_len, double scale) {
  check_pools(q, k_cache, v_cache, block_table, block_table);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(block_table.dim() == 1 && T >= 1 && T <= seq_len && block_table.size(0) * bs >= seq_len,
              "a chunk of T tokens needs seq_len >= T and a block table [>= ceil(seq_len / block_size)]");
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, q.scalar_type(), "prefill", [&] {
    AT_DISPATCH_INDEX_TYPES(block_table.scalar_type(), "prefill_index", [&] {
      with_pools<scalar_t>(k_cache, v_cache, [&](auto k, auto v) {
        prefill(q.data_ptr<scalar_t>(), k, v, block_table.data_ptr<index_t>(), out.data_ptr<scalar_t>(), T, H, Hkv,
                D, bs, seq_len, static_cast<float>(scale));
      });
    });
  });
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(roseinfer, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int seq_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(roseinfer, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_prefill", &paged_prefill);
}
