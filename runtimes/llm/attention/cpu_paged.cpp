// Decode attention over the paged KV cache on CPU: fp32 queries, an fp32 or fp16 cache, one new query token per
// sequence (an fp16 cache halves the bytes read; its values are widened to fp32 as they are read).
//
// The PyTorch reference gathers every sequence's blocks into a padded copy (written, then read again by
// SDPA); here each sequence walks its block table and reads each cached key and value once, serving all
// the query heads that share it (GQA). Built by `cpu_paged.py` with torch's extension loader;
// parallel over sequences with ATen's thread pool. Registered as torch.ops.multiserve_cpu.*.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// exp(x) for x <= 0 (scores minus their max), in a form the compiler vectorizes: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by a degree-6 Taylor polynomial (relative error ~1e-7), 2^n through the exponent bits.
// Below -87 the result would be denormal; it is clamped there (its weight cannot move an fp32 sum).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;  // ln2 split hi + lo
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

// Calls f(t, offset) for t = 0..len-1, offset = where token t's row starts in a cache laid out as
// [num_blocks, block_size, row] (floats), plus `off`. Walks the block table block by block: a division per
// token to find its block cost ~4 ms of a 86 ms batch-32 SmolLM2 step.
template <class F>
inline void for_each_slot(const int32_t* table, int64_t len, int64_t block_size, int64_t row, int64_t off, F&& f) {
  for (int64_t b = 0, t = 0; t < len; ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * block_size * row + off;
    const int64_t end = std::min(len, t + block_size);
    for (int64_t j = 0; t < end; ++t, ++j) f(t, base + j * row);
  }
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, table_stride, q_row_stride, q_head_stride;
};

// One sequence, query heads [h0, h0 + num_q) (whole groups): scores against every cached key, softmax,
// weighted sum of the values. Walking tokens in cache order, each token's K (then V) row of all KV heads
// is read once, front to back, which the hardware prefetcher follows within a block. `q` points at head
// h0's query, `out` at its output row; `scores` holds num_q x len floats, `acc` num_q x head_dim.
template <typename T>
void attend(const float* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t len,
            int64_t h0, int64_t num_q, const Shape& s, float scale, float* scores, float* acc, float* out) {
  const int64_t D = s.head_dim, row = s.num_kv_heads * D;  // floats between consecutive cached tokens
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t kv0 = (h0 / group) * D;  // offset of the first KV head this call reads within a token row
  for_each_slot(table, len, s.block_size, row, kv0, [&](int64_t t, int64_t offset) {
    const T* k = k_cache + offset;
    for (int64_t h = 0; h < num_q; ++h) {
      const float* qh = q + h * s.q_head_stride;
      const T* kh = k + (h / group) * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * static_cast<float>(kh[d]);
      scores[h * len + t] = dot * scale;
    }
  });
  std::vector<float> inv_sum(num_q);
  for (int64_t h = 0; h < num_q; ++h) {
    float* sh = scores + h * len;
    const float mx = *std::max_element(sh, sh + len);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      sh[t] = exp_nonpositive(sh[t] - mx);
      sum += sh[t];
    }
    inv_sum[h] = 1.f / sum;
  }
  std::fill(acc, acc + num_q * D, 0.f);
  for_each_slot(table, len, s.block_size, row, kv0, [&](int64_t t, int64_t offset) {
    const T* v = v_cache + offset;
    for (int64_t h = 0; h < num_q; ++h) {
      const float p = scores[h * len + t];
      const T* vh = v + (h / group) * D;
      float* a = acc + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(vh[d]);
    }
  });
  for (int64_t h = 0; h < num_q; ++h)
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = acc[h * D + d] * inv_sum[h];
}

// A cached row of D values as floats: the row itself in an fp32 cache; from an fp16 one, widened into `buf` with
// vcvtph2ps (a scalar conversion per value would cost more than the bytes it saves).
template <int D>
inline const float* as_floats(const float* row, float*) {
  return row;
}

template <int D>
inline const float* as_floats(const _Float16* row, float* buf) {
#if defined(__AVX512F__)
  static_assert(D % 16 == 0);
  for (int d = 0; d < D; d += 16) {
    _mm512_storeu_ps(buf + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d))));
  }
#elif defined(__F16C__)
  static_assert(D % 8 == 0);
  for (int d = 0; d < D; d += 8) {
    _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
  }
#else
  for (int d = 0; d < D; ++d) buf[d] = static_cast<float>(row[d]);
#endif
  return buf;
}

// The same for one KV head and its G query heads, with D and G known at compile time (the common shapes:
// head_dim 64 or 128, groups of 1-8). The queries (pre-scaled) and the G output accumulators then live in
// registers through the token loops instead of being reloaded and stored for every token.
template <typename T, int D, int G>
void attend_kv_head(const float* q, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                    const int32_t* table, int64_t len, int64_t kv_off, int64_t row, int64_t block_size, float scale,
                    float* scores, float* out) {
  float qs[G][D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) qs[g][d] = q[g * q_head_stride + d] * scale;
  float mx[G];
  for (int g = 0; g < G; ++g) mx[g] = -INFINITY;
  alignas(64) float wide[D];
  for_each_slot(table, len, block_size, row, kv_off, [&](int64_t t, int64_t offset) {
    const float* k = as_floats<D>(k_cache + offset, wide);
    for (int g = 0; g < G; ++g) {
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < D; ++d) dot += qs[g][d] * k[d];
      scores[g * len + t] = dot;
      mx[g] = std::max(mx[g], dot);
    }
  });
  float inv_sum[G];
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * len;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = exp_nonpositive(sg[t] - mx[g]);
      sum += sg[t];
    }
    inv_sum[g] = 1.f / sum;
  }
  float acc[G][D] = {};
  for_each_slot(table, len, block_size, row, kv_off, [&](int64_t t, int64_t offset) {
    const float* v = as_floats<D>(v_cache + offset, wide);
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * len + t];
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[g][d] += p * v[d];
    }
  });
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) out[g * D + d] = acc[g][d] * inv_sum[g];
}

template <typename T>
using KvHeadFn = void (*)(const float*, int64_t, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t,
                          int64_t, float, float*, float*);

template <typename T, int D>
KvHeadFn<T> kv_head_fn_for_group(int64_t group) {
  switch (group) {
    case 1: return attend_kv_head<T, D, 1>;
    case 2: return attend_kv_head<T, D, 2>;
    case 3: return attend_kv_head<T, D, 3>;
    case 4: return attend_kv_head<T, D, 4>;
    case 6: return attend_kv_head<T, D, 6>;
    case 8: return attend_kv_head<T, D, 8>;
    default: return nullptr;
  }
}

// The specialized kernel for (head_dim, group), or nullptr: then `attend` (any shape) serves it.
template <typename T>
KvHeadFn<T> kv_head_fn(int64_t head_dim, int64_t group) {
  switch (head_dim) {
    case 64: return kv_head_fn_for_group<T, 64>(group);
    case 128: return kv_head_fn_for_group<T, 128>(group);
    default: return nullptr;
  }
}

// paged_decode_attention over a cache of T (kc, vc: the caches' data).
template <typename T>
void decode(const at::Tensor& query, const T* kc, const T* vc, const at::Tensor& k_cache, const at::Tensor& rows,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  TORCH_CHECK(query.stride(2) == 1 && out.is_contiguous() && k_cache.is_contiguous(),
              "paged_decode_attention: out and caches must be contiguous, query contiguous in head_dim");
  TORCH_CHECK(rows.scalar_type() == at::kLong && block_tables.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "paged_decode_attention: rows int64, block_tables and seq_lens int32");
  const Shape s{query.size(1), k_cache.size(2), query.size(2), k_cache.size(1), block_tables.stride(0),
                query.stride(0), query.stride(1)};
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0 && k_cache.size(3) == s.head_dim,
              "paged_decode_attention: heads ", s.num_heads, " over kv heads ", s.num_kv_heads);
  const int64_t num_seqs = rows.size(0);
  // A work item is a whole sequence (all heads: its cache rows are read front to back) when there are
  // enough sequences to keep every thread busy, else one KV head's group of one sequence.
  const int64_t splits = num_seqs >= at::get_num_threads() ? 1 : s.num_kv_heads;
  const int64_t heads_per_item = s.num_heads / splits, num_items = num_seqs * splits;
  const float* q = query.data_ptr<float>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // Sequences differ in length, so items are handed out one at a time rather than in equal ranges.
  const int64_t group = s.num_heads / s.num_kv_heads, row = s.num_kv_heads * s.head_dim;
  const KvHeadFn<T> fast = kv_head_fn<T>(s.head_dim, group);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores, acc(heads_per_item * s.head_dim);
    for (int64_t item = next++; item < num_items; item = next++) {
      const int64_t i = item / splits, h0 = (item % splits) * heads_per_item;
      const int64_t len = lens[i];
      scores.resize(heads_per_item * len);
      float* out_row = o + (row_ids[i] * s.num_heads + h0) * s.head_dim;
      const float* q_row = q + row_ids[i] * s.q_row_stride + h0 * s.q_head_stride;
      const int32_t* table = tables + i * s.table_stride;
      if (fast == nullptr) {
        attend(q_row, kc, vc, table, len, h0, heads_per_item, s, fscale, scores.data(), acc.data(), out_row);
        continue;
      }
      for (int64_t g0 = 0; g0 < heads_per_item; g0 += group) {  // one KV head and its query heads at a time
        fast(q_row + g0 * s.q_head_stride, s.q_head_stride, kc, vc, table, len, ((h0 + g0) / group) * s.head_dim,
             row, s.block_size, fscale, scores.data(), out_row + g0 * s.head_dim);
      }
    }
  });
}

// query [T, H, D] (contiguous in D), out [T, H, D] contiguous; k_cache, v_cache [num_blocks, block_size, KVH, D], fp32
// or fp16 (as _Float16, GCC and Clang's half type; rows widened by `as_floats`); rows [B] int64 (the query row of each
// sequence); block_tables [B, max_blocks] int32; seq_lens [B] int32. Writes out[rows[i]] only.
void paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, at::Tensor& out) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf),
              "paged_decode_attention: fp32 queries over an fp32 or fp16 cache");
  TORCH_CHECK(v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: the V cache must be contiguous and shaped as the K cache");
  if (k_cache.scalar_type() == at::kHalf) {
    decode(query, reinterpret_cast<const _Float16*>(k_cache.data_ptr<at::Half>()),
           reinterpret_cast<const _Float16*>(v_cache.data_ptr<at::Half>()), k_cache, rows, block_tables, seq_lens,
           scale, out);
  } else {
    decode(query, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache, rows, block_tables, seq_lens, scale,
           out);
  }
}

}  // namespace

TORCH_LIBRARY(multiserve_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor rows, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
}
