// Decode attention over the paged KV cache on CPU, fp32: one new query token per sequence.
//
// The PyTorch reference gathers every sequence's blocks into a padded copy (written, then read again by
// SDPA); here each (sequence, KV head) pair walks its block table and reads each cached key and value once,
// serving all the query heads of its group. Built by `cpu_paged.py` with torch's extension loader;
// parallel over (sequence, KV head) with ATen's thread pool. Registered as torch.ops.multiserve_cpu.*.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, table_stride, q_row_stride, q_head_stride;
};

// One (sequence, KV head): scores of its `group` query heads against every cached key, softmax, weighted
// sum of the values. `q` points at the group's first query head (heads `q_head_stride` apart), `out` at its
// first output head (contiguous); `scores` holds group x len floats, `acc` group x head_dim.
void attend(const float* q, const float* k_cache, const float* v_cache, const int32_t* table, int64_t len,
            int64_t group, const Shape& s, float scale, float* scores, float* acc, float* out) {
  const int64_t D = s.head_dim, row = s.num_kv_heads * D;  // floats between consecutive cached tokens
  auto slot = [&](int64_t t) { return (static_cast<int64_t>(table[t / s.block_size]) * s.block_size +
                                       t % s.block_size) * row; };
  for (int64_t t = 0; t < len; ++t) {
    const float* k = k_cache + slot(t);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * s.q_head_stride;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
      scores[g * len + t] = dot * scale;
    }
  }
  std::vector<float> inv_sum(group);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    const float mx = *std::max_element(sg, sg + len);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = exp_nonpositive(sg[t] - mx);
      sum += sg[t];
    }
    inv_sum[g] = 1.f / sum;
  }
  std::fill(acc, acc + group * D, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const float* v = v_cache + slot(t);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + t];
      float* a = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv_sum[g];
}

// query [T, H, D] (contiguous in D), out [T, H, D] contiguous; k_cache, v_cache [num_blocks, block_size, KVH, D]; rows [B] int64 (the query row of
// each sequence); block_tables [B, max_blocks] int32; seq_lens [B] int32. Writes out[rows[i]] only.
void paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, at::Tensor& out) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_decode_attention: fp32 only");
  TORCH_CHECK(query.stride(2) == 1 && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: out and caches must be contiguous, query contiguous in head_dim");
  TORCH_CHECK(rows.scalar_type() == at::kLong && block_tables.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "paged_decode_attention: rows int64, block_tables and seq_lens int32");
  const Shape s{query.size(1), k_cache.size(2), query.size(2), k_cache.size(1), block_tables.stride(0),
                query.stride(0), query.stride(1)};
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0 && k_cache.size(3) == s.head_dim,
              "paged_decode_attention: heads ", s.num_heads, " over kv heads ", s.num_kv_heads);
  const int64_t num_seqs = rows.size(0), group = s.num_heads / s.num_kv_heads;
  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, num_seqs * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * s.head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / s.num_kv_heads, kh = item % s.num_kv_heads;
      const int64_t len = lens[i];
      const int64_t head = kh * group;
      scores.resize(group * len);
      attend(q + row_ids[i] * s.q_row_stride + head * s.q_head_stride, kc + kh * s.head_dim, vc + kh * s.head_dim,
             tables + i * s.table_stride, len, group, s, fscale, scores.data(), acc.data(),
             o + (row_ids[i] * s.num_heads + head) * s.head_dim);
    }
  });
}

}  // namespace

TORCH_LIBRARY(multiserve_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor rows, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
}
