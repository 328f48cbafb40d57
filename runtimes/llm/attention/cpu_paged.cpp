// Paged attention over the KV cache on CPU: fp32 queries over an fp32 or fp16 cache (an fp16 cache halves the bytes
// read; its values are widened to fp32 as they are read, which is exact), any number of new query rows per sequence
// (decode, prefill, chunked prefill, mixed steps), GQA. Each sequence walks its block table; each cached key and value
// row is read into L1 once per block of query rows and serves every query head of its KV head in that block.
//
// Batch invariance. The query row at position p attends to its sequence's cached tokens 0..p, and its output for one
// head is a fixed sequence of float operations on that row's query, its length L = p + 1 and the cached keys and
// values alone: it does not depend on how many rows its sequence brings in the step, where in the chunk the row
// sits, what else is in the batch, the thread count or how the work is split. So a token's attention is the same bit
// for bit whether it was decoded or prefilled (whole, or in chunks cut anywhere), alone or in any batch, and a
// request's greedy tokens do not depend on its company or on how its tokens reached the cache. The sequence:
//   score[t] = dot(q * scale, k[t]), t < L: in 8 lanes, lane c summing d = c, c + 8, ... in order (a multiply, then
//              one fma per 8 values), the lanes then added by the tree ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7));
//   e[t]     = exp(score[t] - max_t score) (`exp8`), sum = the e[t] in 8 lanes (lane c: t = c, c + 8, ...), same tree;
//   out[d]   = (e[0] v[0][d] + e[1] v[1][d] + ..., one fma per token from 0.0, in token order) * (1 / sum).
// Every row, decode or prefill, runs through the same three routines (`scores8`, `softmax_row`, `accumulate`); a
// block of rows shares each loaded K and V row, while each row keeps its own accumulators and its own sequence. The
// vector type is AVX2/FMA intrinsics, or eight scalars where the CPU has neither (the same operations, lane by lane);
// the build adds -ffp-contract=off, so the compiler cannot fuse a multiply and an add differently in different
// inlined copies: every fma is written out. (The results depend on the build: an AVX2 and a scalar build may
// differ in the last bits, as any two kernels would; within one build they are reproducible.)
//
// Built by `cpu_paged.py` with torch's extension loader; parallel over (sequence, KV head, block of rows) with ATen's
// thread pool. Registered as torch.ops.multiserve_cpu.{paged_attention, paged_decode_attention}.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// ---- eight floats and the operations the attention takes on them ----

#if defined(__AVX2__) && defined(__FMA__)
struct F8 {
  __m256 v;
};
inline F8 load8(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store8(float* p, F8 a) { _mm256_storeu_ps(p, a.v); }
inline F8 splat(float x) { return {_mm256_set1_ps(x)}; }
inline F8 operator+(F8 a, F8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline F8 operator-(F8 a, F8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline F8 operator*(F8 a, F8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline F8 fma8(F8 a, F8 b, F8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c, rounded once
inline F8 max8(F8 a, F8 b) { return {_mm256_max_ps(a.v, b.v)}; }
inline F8 round8(F8 a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// 2^n for integral n in [-126, 127], through the exponent bits
inline F8 pow2_8(F8 n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
}
// lanes [0, n) of a, the rest `fill`
inline F8 first8(F8 a, int64_t n, float fill) {
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return {_mm256_blendv_ps(_mm256_set1_ps(fill), a.v, _mm256_castsi256_ps(keep))};
}
// lane j = the tree sum of a[j]'s lanes, ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)), for eight vectors at once
inline F8 sums8(const F8* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0].v, a[1].v), _mm256_hadd_ps(a[2].v, a[3].v));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4].v, a[5].v), _mm256_hadd_ps(a[6].v, a[7].v));
  // u0 = [a0 (l0..l3), a1, a2, a3 | a0 (l4..l7), a1, a2, a3], u1 the same for a4..a7
  return {_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31))};
}
// the same tree over one vector's lanes
inline float lane_sum(F8 a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a.v, a.v), _mm256_hadd_ps(a.v, a.v));
  return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
inline float lane_max(F8 a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#else
// Without AVX2 and FMA: the same operations one lane at a time (std::fma rounds once, as vfmadd does).
struct F8 {
  float v[8];
};
inline F8 load8(const float* p) {
  F8 r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void store8(float* p, F8 a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline F8 splat(float x) {
  F8 r;
  for (float& l : r.v) l = x;
  return r;
}
#define MULTISERVE_LANEWISE(expr) \
  F8 r;                           \
  for (int l = 0; l < 8; ++l) r.v[l] = (expr);  \
  return r
inline F8 operator+(F8 a, F8 b) { MULTISERVE_LANEWISE(a.v[l] + b.v[l]); }
inline F8 operator-(F8 a, F8 b) { MULTISERVE_LANEWISE(a.v[l] - b.v[l]); }
inline F8 operator*(F8 a, F8 b) { MULTISERVE_LANEWISE(a.v[l] * b.v[l]); }
inline F8 fma8(F8 a, F8 b, F8 c) { MULTISERVE_LANEWISE(std::fma(a.v[l], b.v[l], c.v[l])); }
inline F8 max8(F8 a, F8 b) { MULTISERVE_LANEWISE(a.v[l] > b.v[l] ? a.v[l] : b.v[l]); }
inline F8 round8(F8 a) { MULTISERVE_LANEWISE(std::nearbyint(a.v[l])); }
inline F8 first8(F8 a, int64_t n, float fill) { MULTISERVE_LANEWISE(l < n ? a.v[l] : fill); }
inline F8 pow2_8(F8 n) {
  F8 r;
  for (int l = 0; l < 8; ++l) {
    const int32_t bits = (static_cast<int32_t>(n.v[l]) + 127) << 23;
    std::memcpy(&r.v[l], &bits, sizeof(bits));
  }
  return r;
}
#undef MULTISERVE_LANEWISE
inline float tree_sum(const float* x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }
inline F8 sums8(const F8* a) {
  F8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = tree_sum(a[j].v);
  return r;
}
inline float lane_sum(F8 a) { return tree_sum(a.v); }
inline float lane_max(F8 a) { return *std::max_element(a.v, a.v + 8); }
#endif

// exp(x) for x <= 0 (scores minus their max): x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 Taylor polynomial
// (relative error ~1e-7), 2^n through the exponent bits. Below -87 the result would be denormal; it is clamped there
// (its weight cannot move an fp32 sum).
inline F8 exp8(F8 x) {
  x = max8(x, splat(-87.0f));
  const F8 n = round8(x * splat(1.44269504088896341f));
  const F8 r = (x - n * splat(0.693145751953125f)) - n * splat(1.428606765330187e-06f);  // ln2 split hi + lo
  F8 p = splat(1.0f / 720.0f);
  p = fma8(p, r, splat(1.0f / 120.0f));
  p = fma8(p, r, splat(1.0f / 24.0f));
  p = fma8(p, r, splat(1.0f / 6.0f));
  p = fma8(p, r, splat(0.5f));
  p = fma8(p, r, splat(1.0f));
  p = fma8(p, r, splat(1.0f));
  return p * pow2_8(n);
}

// ---- the per-row arithmetic: every query row of every step runs through these three ----

// One query row's (pre-scaled, zero-padded to `dp` floats) scores against eight key rows: lane i = dot(q, k[i]).
// D: dp at compile time (64, 128), or 0 for `dp` at run time.
template <int D>
inline F8 scores8(const float* q, const float* const* k, int64_t dp) {
  const int64_t n = D > 0 ? D : dp;
  F8 a[8];
  F8 qv = load8(q);
  for (int i = 0; i < 8; ++i) a[i] = qv * load8(k[i]);
  for (int64_t c = 8; c < n; c += 8) {
    qv = load8(q + c);
    for (int i = 0; i < 8; ++i) a[i] = fma8(qv, load8(k[i] + c), a[i]);
  }
  return sums8(a);
}

// Scores s[0, len) become their softmax numerators exp(s - max) (s[len, round_up(len, 8)) zeros); returns 1 / sum.
inline float softmax_row(float* s, int64_t len) {
  const int64_t full = len / 8 * 8, rest = len - full;
  F8 mx = splat(-INFINITY);
  for (int64_t t = 0; t < full; t += 8) mx = max8(mx, load8(s + t));
  if (rest > 0) mx = max8(mx, first8(load8(s + full), rest, -INFINITY));
  const F8 m = splat(lane_max(mx));
  F8 sum = splat(0.f);
  for (int64_t t = 0; t < full; t += 8) {
    const F8 e = exp8(load8(s + t) - m);
    store8(s + t, e);
    sum = sum + e;
  }
  if (rest > 0) {
    const F8 e = first8(exp8(load8(s + full) - m), rest, 0.f);
    store8(s + full, e);
    sum = sum + e;
  }
  return 1.f / lane_sum(sum);
}

// acc[0, 8 NC) += e[i] * v[i][off, off + 8 NC) for i = 0..n-1, one fma per value, in i order.
template <int NC>
inline void accumulate(float* acc, const float* e, const float* const* v, int64_t n, int64_t off) {
  F8 a[NC];
  for (int j = 0; j < NC; ++j) a[j] = load8(acc + 8 * j);
  for (int64_t i = 0; i < n; ++i) {
    const F8 p = splat(e[i]);
    for (int j = 0; j < NC; ++j) a[j] = fma8(p, load8(v[i] + off + 8 * j), a[j]);
  }
  for (int j = 0; j < NC; ++j) store8(acc + 8 * j, a[j]);
}

// `accumulate` over a whole row of dp floats, eight vectors of accumulators at a time (what stays in registers).
template <int D>
inline void accumulate_row(float* acc, const float* e, const float* const* v, int64_t n, int64_t dp) {
  if constexpr (D > 0) {
    static_assert(D % 64 == 0);
    for (int64_t off = 0; off < D; off += 64) accumulate<8>(acc + off, e, v, n, off);
  } else {
    for (int64_t off = 0; off < dp; off += 64) {
      switch ((std::min<int64_t>(dp - off, 64)) / 8) {
        case 1: accumulate<1>(acc + off, e, v, n, off); break;
        case 2: accumulate<2>(acc + off, e, v, n, off); break;
        case 3: accumulate<3>(acc + off, e, v, n, off); break;
        case 4: accumulate<4>(acc + off, e, v, n, off); break;
        case 5: accumulate<5>(acc + off, e, v, n, off); break;
        case 6: accumulate<6>(acc + off, e, v, n, off); break;
        case 7: accumulate<7>(acc + off, e, v, n, off); break;
        default: accumulate<8>(acc + off, e, v, n, off); break;
      }
    }
  }
}

// ---- walking the cache ----

struct Geometry {
  int64_t num_heads, group, head_dim, dp;  // dp: head_dim rounded up to a multiple of 8 (the rows the routines read)
  int64_t block_size, row;                 // row: values between consecutive cached tokens (num_kv_heads x head_dim)
  int64_t q_row_stride, q_head_stride;
  float scale;
  int64_t window;  // a query at position p reads tokens (p - window, p]; 0: the whole context
  float softcap;   // each score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2); 0: none
};

// One KV head's cached rows of a sequence, token by token, without a division per token.
template <typename T>
struct Walk {
  const T* cache;
  const int32_t* table;
  int64_t block_size, row, off, block = 0, slot = 0;
  const T* next() {
    const T* p = cache + (static_cast<int64_t>(table[block]) * block_size + slot) * row + off;
    if (++slot == block_size) {
      slot = 0;
      ++block;
    }
    return p;
  }
};

// The next n cached rows as pointers to dp floats: into an fp32 cache itself when head_dim is a multiple of 8, else
// widened (fp16, exactly) or zero-padded copies in `buf`; rows [n, count) point at `zero`.
template <typename T, int D>
inline void next_rows(Walk<T>& walk, int64_t n, int64_t count, const Geometry& g, float* buf, const float* zero,
                      const float** rows) {
  const int64_t dp = D > 0 ? D : g.dp, d = D > 0 ? D : g.head_dim;
  for (int64_t i = 0; i < n; ++i) {
    const T* src = walk.next();
    if constexpr (std::is_same_v<T, float>) {
      if (d == dp) {
        rows[i] = src;
        continue;
      }
    }
    float* dst = buf + i * dp;
    int64_t c = 0;
#if defined(__F16C__)
    if constexpr (!std::is_same_v<T, float>) {
      for (; c + 8 <= d; c += 8)
        _mm256_storeu_ps(dst + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c))));
    }
#endif
    for (; c < d; ++c) dst[c] = static_cast<float>(src[c]);
    for (; c < dp; ++c) dst[c] = 0.f;
    rows[i] = dst;
  }
  for (int64_t i = n; i < count; ++i) rows[i] = zero;
}

// Values per call of `accumulate`: a tile of V rows (8 KiB in fp32 at head_dim 64) stays in L1 while every query row
// of the block adds it in.
constexpr int64_t kValueTile = 32;

struct Workspace {
  std::vector<float> q, scores, acc, inv, k_buf, v_buf, zero;
};

// Query rows [r0, r1) of one sequence (its row r at position start + r, query row q_row0 + r; it attends to tokens
// lo..start + r, lo = 0 or, with a window, start + r + 1 - window) for the query heads of KV head `kvh`. The rows'
// query heads are "query vectors" m = r * group + g; each K tile of 8 rows and V tile of kValueTile rows is read once
// for all of them.
//
// Tiles sit at absolute positions (multiples of 8 from token 0), and a vector's softmax runs over its tiles from the
// one holding its first token, the tokens before it in that tile masked to exp(-inf) = 0; its values are added
// token by token in position order. So what a vector computes depends on its position and its sequence's cached
// tokens only, never on the rows it was grouped with: the same bits decoded or prefilled, whole or in chunks, with a
// window or without one that reaches back as far. Tokens before the first row's window are not read at all.
template <typename T, int D>
void attend_rows(const float* query, float* out, const T* k_cache, const T* v_cache, const int32_t* table,
                 int64_t q_row0, int64_t start, int64_t r0, int64_t r1, int64_t kvh, const Geometry& g,
                 Workspace& w) {
  const int64_t dp = D > 0 ? D : g.dp, group = g.group, num_q = (r1 - r0) * group;
  // length of query vector m, and its first token; rows are in position order, so the vectors still reading tile t0
  // are those from first_reading(t0) to last_reading(t0)
  const auto len_of = [&](int64_t m) { return start + r0 + m / group + 1; };
  const auto lo_of = [&](int64_t m) { return g.window > 0 ? std::max<int64_t>(0, len_of(m) - g.window) : 0; };
  const auto first_reading = [&](int64_t t0) { return std::max<int64_t>(0, t0 - start - r0) * group; };
  const auto last_reading = [&](int64_t t_end) {  // vectors whose first token is before t_end
    if (g.window <= 0) return num_q;
    return std::clamp<int64_t>((t_end + g.window - 1 - start - r0) * group, 0, num_q);
  };
  const int64_t begin = lo_of(0) / 8 * 8, len_max = start + r1, stride = (len_max - begin + 7) / 8 * 8;
  w.q.resize(num_q * dp);
  w.scores.resize(num_q * stride);
  w.acc.assign(num_q * dp, 0.f);
  w.inv.resize(num_q);
  w.k_buf.resize(8 * dp);
  w.v_buf.resize(kValueTile * dp);
  w.zero.assign(dp, 0.f);
  for (int64_t m = 0; m < num_q; ++m) {
    const float* src = query + (q_row0 + r0 + m / group) * g.q_row_stride + (kvh * group + m % group) * g.q_head_stride;
    float* dst = w.q.data() + m * dp;
    for (int64_t d = 0; d < g.head_dim; ++d) dst[d] = src[d] * g.scale;
    std::fill(dst + g.head_dim, dst + dp, 0.f);
  }
  const float* rows[kValueTile];
  Walk<T> keys{k_cache, table, g.block_size, g.row, kvh * g.head_dim, begin / g.block_size, begin % g.block_size};
  for (int64_t t0 = begin; t0 < len_max; t0 += 8) {
    next_rows<T, D>(keys, std::min<int64_t>(8, len_max - t0), 8, g, w.k_buf.data(), w.zero.data(), rows);
    for (int64_t m = first_reading(t0), end = last_reading(t0 + 8); m < end; ++m)
      store8(w.scores.data() + m * stride + t0 - begin, scores8<D>(w.q.data() + m * dp, rows, dp));
  }
  for (int64_t m = 0; m < num_q; ++m) {
    const int64_t lo = lo_of(m), lo8 = lo / 8 * 8;
    float* s = w.scores.data() + m * stride + lo8 - begin;
    if (g.softcap > 0.f) {
      const float cap = g.softcap, inv = 1.f / g.softcap;
      for (int64_t t = lo - lo8, n = len_of(m) - lo8; t < n; ++t) s[t] = cap * std::tanh(s[t] * inv);
    }
    std::fill(s, s + (lo - lo8), -INFINITY);
    w.inv[m] = softmax_row(s, len_of(m) - lo8);
  }
  Walk<T> values{v_cache, table, g.block_size, g.row, kvh * g.head_dim, begin / g.block_size, begin % g.block_size};
  for (int64_t t0 = begin; t0 < len_max; t0 += kValueTile) {
    const int64_t n = std::min(kValueTile, len_max - t0);
    next_rows<T, D>(values, n, n, g, w.v_buf.data(), w.zero.data(), rows);
    for (int64_t m = first_reading(t0), end = last_reading(t0 + n); m < end; ++m) {
      const int64_t from = std::max(t0, lo_of(m)), to = std::min(t0 + n, len_of(m));
      accumulate_row<D>(w.acc.data() + m * dp, w.scores.data() + m * stride + from - begin, rows + (from - t0),
                        to - from, dp);
    }
  }
  for (int64_t m = 0; m < num_q; ++m) {
    const float* acc = w.acc.data() + m * dp;
    float* dst = out + ((q_row0 + r0 + m / group) * g.num_heads + kvh * group + m % group) * g.head_dim;
    for (int64_t d = 0; d < g.head_dim; ++d) dst[d] = acc[d] * w.inv[m];
  }
}

// ---- the ops ----

struct Seq {
  int64_t q_row0, q_len, seq_len;  // its query rows [q_row0, q_row0 + q_len) are its last q_len positions
  const int32_t* table;
};

// A work item: rows [r0, r1) of a sequence, for KV heads [kv0, kv1).
struct Item {
  int64_t seq, kv0, kv1, r0, r1, cost;
};

template <typename T>
using RowsFn = void (*)(const float*, float*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                        int64_t, const Geometry&, Workspace&);

template <typename T>
RowsFn<T> rows_fn(int64_t head_dim) {
  switch (head_dim) {
    case 64: return attend_rows<T, 64>;
    case 128: return attend_rows<T, 128>;
    default: return attend_rows<T, 0>;
  }
}

template <typename T>
void attend_all(const at::Tensor& query, const T* kc, const T* vc, const std::vector<Seq>& seqs, const Geometry& g,
                int64_t num_kv_heads, float* out) {
  // Rows per item: enough query vectors (rows x group) to reuse each K and V row many times from L1, few enough that
  // their queries and accumulators stay there (12 KiB each).
  const int64_t rows_per_item = std::max<int64_t>(1, 3072 / (g.dp * g.group));
  const int64_t threads = at::get_num_threads();
  const bool whole_decodes = static_cast<int64_t>(seqs.size()) >= threads;
  std::vector<Item> items;
  // the tokens a row reads: its position + 1, or the window
  const auto reads = [&](int64_t len) { return g.window > 0 ? std::min(len, g.window) : len; };
  for (int64_t i = 0; i < static_cast<int64_t>(seqs.size()); ++i) {
    const Seq& s = seqs[i];
    const int64_t start = s.seq_len - s.q_len;
    if (s.q_len == 1 && whole_decodes) {  // enough sequences to keep every thread busy: one item each
      items.push_back({i, 0, num_kv_heads, 0, 1, num_kv_heads * reads(s.seq_len)});
      continue;
    }
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh)
      for (int64_t r0 = 0; r0 < s.q_len; r0 += rows_per_item) {
        const int64_t r1 = std::min(s.q_len, r0 + rows_per_item);
        items.push_back({i, kvh, kvh + 1, r0, r1, (r1 - r0) * reads(start + (r0 + r1) / 2 + 1)});
      }
  }
  // Costliest first, handed out one at a time: items differ in length, so equal ranges would leave threads idle.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const RowsFn<T> fn = rows_fn<T>(g.head_dim);
  const float* q = query.data_ptr<float>();
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min(threads, num_items), 1, [&](int64_t, int64_t) {
    Workspace w;
    for (int64_t k = next++; k < num_items; k = next++) {
      const Item& it = items[k];
      const Seq& s = seqs[it.seq];
      for (int64_t kvh = it.kv0; kvh < it.kv1; ++kvh)
        fn(q, out, kc, vc, s.table, s.q_row0, s.seq_len - s.q_len, it.r0, it.r1, kvh, g, w);
    }
  });
}

// Checks what both ops take and runs them: query [T, H, D] fp32 (contiguous in D), out [T, H, D] fp32 contiguous,
// k_cache, v_cache [num_blocks, block_size, KVH, D] contiguous, fp32 or fp16 (read as _Float16, GCC and Clang's half
// type), H a multiple of KVH.
void run(const char* op, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const std::vector<Seq>& seqs, double scale, int64_t window,
         double softcap, at::Tensor& out) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf),
              op, ": fp32 queries over an fp32 or fp16 cache");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && out.is_contiguous() && out.sizes() == query.sizes(), op,
              ": query [T, H, D] contiguous in D, out shaped as query and contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              op, ": caches [num_blocks, block_size, KVH, D], contiguous, the same shape");
  const int64_t heads = query.size(1), kv_heads = k_cache.size(2), head_dim = query.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && k_cache.size(3) == head_dim, op, ": ", heads,
              " query heads over ", kv_heads, " KV heads of ", k_cache.size(3), " (query: ", head_dim, ")");
  const int64_t block_size = k_cache.size(1), capacity = block_tables.size(1) * block_size;
  for (const Seq& s : seqs) {
    TORCH_CHECK(s.q_len >= 0 && s.q_len <= s.seq_len && s.seq_len <= capacity && s.q_row0 >= 0 &&
                    s.q_row0 + s.q_len <= query.size(0),
                op, ": a sequence of ", s.seq_len, " tokens with ", s.q_len, " new at row ", s.q_row0,
                " does not fit its table (", capacity, " slots) or the query (", query.size(0), " rows)");
  }
  const Geometry g{heads, heads / kv_heads, head_dim, (head_dim + 7) / 8 * 8, block_size, kv_heads * head_dim,
                   query.stride(0), query.stride(1), static_cast<float>(scale), window,
                   static_cast<float>(softcap)};
  float* o = out.data_ptr<float>();
  if (k_cache.scalar_type() == at::kHalf) {
    attend_all(query, reinterpret_cast<const _Float16*>(k_cache.data_ptr<at::Half>()),
               reinterpret_cast<const _Float16*>(v_cache.data_ptr<at::Half>()), seqs, g, kv_heads, o);
  } else {
    attend_all(query, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), seqs, g, kv_heads, o);
  }
}

void check_tables(const char* op, const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_seqs) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) >= num_seqs && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous() && seq_lens.size(0) == num_seqs,
              op, ": block_tables [B, max_blocks] int32 (rows contiguous), seq_lens [B] int32");
}

// Every query row of a step: sequence i's rows are [query_start_loc[i], query_start_loc[i + 1]), its last positions
// of seq_lens[i]. query_start_loc [B + 1] int32; seq_lens [B] int32; block_tables [B, max_blocks] int32. A row at
// position p reads tokens (p - window, p] (window 0: all of 0..p); block-table entries of blocks wholly before the
// first row's window are never read, so they may name blocks handed back to the pool. softcap > 0 caps each score
// at softcap * tanh(score / softcap) before the softmax (Gemma 2), 0 leaves them.
void paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     double scale, int64_t window, double softcap, at::Tensor& out) {
  TORCH_CHECK(window >= 0, "paged_attention: window ", window, " < 0");
  TORCH_CHECK(softcap >= 0, "paged_attention: softcap ", softcap, " < 0");
  const int64_t num_seqs = seq_lens.size(0);
  check_tables("paged_attention", block_tables, seq_lens, num_seqs);
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                  query_start_loc.size(0) == num_seqs + 1,
              "paged_attention: query_start_loc [B + 1] int32");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  std::vector<Seq> seqs(num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i)
    seqs[i] = {starts[i], starts[i + 1] - starts[i], lens[i], tables + i * block_tables.stride(0)};
  run("paged_attention", query, k_cache, v_cache, block_tables, seqs, scale, window, softcap, out);
}

// Decode rows only (one new token per sequence), as runtimes/llm/cpu_fused.cpp calls it: rows [B] int64 (each
// sequence's query row), block_tables [B, max_blocks] int32, seq_lens [B] int32. Writes out[rows[i]] only. The same
// routines as `paged_attention`, so a decode-only step and a mixed one agree bit for bit.
void paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, int64_t window, at::Tensor& out) {
  TORCH_CHECK(window >= 0, "paged_decode_attention: window ", window, " < 0");
  const int64_t num_seqs = rows.size(0);
  check_tables("paged_decode_attention", block_tables, seq_lens, num_seqs);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous(), "paged_decode_attention: rows [B] int64");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  std::vector<Seq> seqs(num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i) seqs[i] = {row_ids[i], 1, lens[i], tables + i * block_tables.stride(0)};
  run("paged_decode_attention", query, k_cache, v_cache, block_tables, seqs, scale, window, 0.0, out);
}

}  // namespace

TORCH_LIBRARY(multiserve_cpu, m) {
  m.def("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_tables, float scale, int window, float softcap, Tensor(a!) out) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor rows, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window, Tensor(a!) out) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
}
