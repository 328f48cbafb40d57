// The small per-layer operations of a decode step, fused for fp32 on CPU: each is one pass over its data instead of
// the several PyTorch operators (and temporaries) the reference path in model.py takes, which at batch 1 cost more
// in dispatch than in arithmetic.
//
//   add_rms_norm(x, residual, weight, eps): residual += x (in place), returns rms_norm(residual) * weight
//   rms_norm(x, weight, eps):               x * rsqrt(mean(x^2) + eps) * weight
//   rotary_(qk, cos, sin):                  rotate-halves RoPE in place over qk [T, heads, D] (a view)
//   silu_mul(gate_up):                      silu(gate) * up, gate_up = [gate | up] per row
//   write_kv_(k_cache, v_cache, k, v, slots): each new token's keys and values into its cache slot (fp32 or fp16)
//   decode_layers(...):                     every decoder layer of a decode step (one new token per sequence)
//
// Each is written as the reference computes it, in the same order, and built with -ffp-contract=off, so its results
// equal the reference path's to float rounding: with AVX-512 the norm's sum of squares (in double) is taken sixteen
// at a time and silu's exp is a polynomial within 2 ulp of expf (`exp16`; `exp8` with AVX2).
//
// decode_layers runs the whole layer stack in one call: the ops above, the projections (dense fp32, oneDNN's packed
// copy, or our block-format kernel `multiserve_quant::quant_linear`) and the paged decode attention kernel
// (`multiserve_cpu::paged_decode_attention`), the last two called through torch's dispatcher, so each kernel stays
// in its own library. It does what model.py's layers do, in their order, without ~10 Python-level calls per layer.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.is_cpu() && t.is_contiguous(), name,
              " must be a contiguous 2-D fp32 CPU tensor");
}

void norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  double sum = 0.0;  // torch's CPU mean reduces in higher precision than the float values; so does this
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  for (; i + 16 <= n; i += 16) {
    const __m512d a = _mm512_cvtps_pd(_mm256_loadu_ps(x + i)), b = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8));
    acc0 = _mm512_add_pd(acc0, _mm512_mul_pd(a, a));
    acc1 = _mm512_add_pd(acc1, _mm512_mul_pd(b, b));
  }
  sum = _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
#endif
  for (; i < n; ++i) sum += double(x[i]) * double(x[i]);
  const float scale = 1.f / std::sqrt(float(sum / double(n)) + eps);
  for (i = 0; i < n; ++i) y[i] = w[i] * (x[i] * scale);
}

#if defined(__AVX512F__)
// exp(x), sixteen at a time: x = k ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' degree-7 polynomial (within 2 ulp of
// expf), times 2^k. x is clamped to +-88.38, beyond which float's exp over- or underflows anyway.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts, for an exact reduction
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, k);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The same eight at a time with AVX2: 2^k is put together in the exponent bits, so x is clamped to [-87.3, 88.3],
// where k stays in float's normal range (-126..127) and exp(x) is within 2 ulp as above.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * n, wp, float(eps), n, yp + r * n);
  });
  return y;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have the same shape");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = rp + r * n;
      for (int64_t i = 0; i < n; ++i) row[i] = xp[r * n + i] + row[i];
      norm_row(row, wp, float(eps), n, yp + r * n);
    }
  });
  return y;
}

void rotary_(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  // qk: [T, heads, D] with unit stride in D and a row stride of its own (a view into the fused qkv output);
  // cos, sin: [T, D/2] for this step's positions
  TORCH_CHECK(qk.dim() == 3 && qk.scalar_type() == at::kFloat && qk.stride(2) == 1, "qk must be [T, heads, D] fp32");
  const int64_t tokens = qk.size(0), heads = qk.size(1), dim = qk.size(2), half = dim / 2;
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == half && cos.is_contiguous() &&
              sin.is_contiguous(), "cos and sin must be contiguous [T, D/2]");
  float* base = qk.data_ptr<float>();
  const int64_t token_stride = qk.stride(0), head_stride = qk.stride(1);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = base + t * token_stride + h * head_stride;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = v[i], x2 = v[i + half];
          v[i] = x1 * c[i] - x2 * s[i];
          v[i + half] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * 2 * n;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= n; i += 16) {
        const __m512 gate = _mm512_loadu_ps(g + i);
        const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
        _mm512_storeu_ps(op + r * n + i, _mm512_mul_ps(silu, _mm512_loadu_ps(g + n + i)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= n; i += 8) {
        const __m256 gate = _mm256_loadu_ps(g + i);
        const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate))));
        _mm256_storeu_ps(op + r * n + i, _mm256_mul_ps(silu, _mm256_loadu_ps(g + n + i)));
      }
#endif
      for (; i < n; ++i) op[r * n + i] = g[i] / (1.f + std::exp(-g[i])) * g[n + i];
    }
  });
  return out;
}

template <typename T>
void write_rows(T* kc, T* vc, const at::Tensor& key, const at::Tensor& value, const int64_t* sp, int64_t num_slots) {
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2), row = heads * dim;
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = sp[t];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " is outside the cache (", num_slots, " slots)");
    for (int64_t h = 0; h < heads; ++h) {
      const float* ks = kp + t * key.stride(0) + h * key.stride(1);
      const float* vs = vp + t * value.stride(0) + h * value.stride(1);
      T* kd = kc + slot * row + h * dim;
      T* vd = vc + slot * row + h * dim;
      for (int64_t d = 0; d < dim; ++d) kd[d] = static_cast<T>(ks[d]), vd[d] = static_cast<T>(vs[d]);
    }
  }
}

void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& key, const at::Tensor& value,
               const at::Tensor& slots) {
  // caches: [num_blocks, block_size, KVH, D] contiguous, fp32 or fp16 (values rounded to nearest, as torch's
  // conversion does); key, value: fp32 [T, KVH, D], unit stride in D (views into the fused q|k|v output);
  // slots: [T] int64, a token's slot = block * block_size + offset
  const auto type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == type &&
              (type == at::kFloat || type == at::kHalf), "caches must be contiguous fp32 or fp16");
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat && key.stride(2) == 1 &&
              value.stride(2) == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "key and value must be fp32 [T, KVH, D] with unit stride in D; slots int64");
  const int64_t num_slots = k_cache.numel() / (key.size(1) * key.size(2));
  const int64_t* sp = slots.data_ptr<int64_t>();
  if (type == at::kHalf) {
    write_rows(reinterpret_cast<_Float16*>(k_cache.data_ptr<at::Half>()),
               reinterpret_cast<_Float16*>(v_cache.data_ptr<at::Half>()), key, value, sp, num_slots);
  } else {
    write_rows(k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), key, value, sp, num_slots);
  }
}

// A projection of decode_layers: its kernel by `kind` (0: dense fp32 weight; else the GGML type of the block format
// whose panels `weight` holds).
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& packed,
                   int64_t kind, int64_t in_features, int64_t out_features, int64_t packed_min_rows) {
  if (kind != 0) {
    static const auto quant = c10::Dispatcher::singleton()
        .findSchemaOrThrow("multiserve_quant::quant_linear", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>();
    return quant.call(x, weight, kind, in_features, out_features);
  }
  if (packed.has_value() && x.size(0) >= packed_min_rows) {
    static const auto pointwise = c10::Dispatcher::singleton()
        .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, c10::string_view,
                          c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
    return pointwise.call(x, *packed, c10::nullopt, "none", c10::List<c10::optional<at::Scalar>>(), "");
  }
  return at::linear(x, weight);
}

// x [B, H]: the step's embeddings, one token per sequence. Per layer l: norms[2l], norms[2l+1] (input and
// post-attention RMSNorm weights); weights, packed, kinds [4l .. 4l+3]: q|k|v, o, gate|up, down; k_caches[l], v_caches[l].
// shape = (num_heads, num_kv_heads, head_dim, intermediate_size); windows: each layer's attention window (0: all; empty:
// none anywhere). Returns the last layer's (MLP output, residual),
// the pair model.py's layers pass on, for the final norm.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::TensorList norms, at::TensorList weights,
    const c10::List<c10::optional<at::Tensor>>& packed, at::IntArrayRef kinds, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& rows, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, at::IntArrayRef shape, double eps, double scale, int64_t packed_min_rows,
    at::IntArrayRef windows) {
  check_rows(x, "x");
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(shape.size() == 4, "shape must be (num_heads, num_kv_heads, head_dim, intermediate_size)");
  const int64_t heads = shape[0], kv_heads = shape[1], dim = shape[2], intermediate = shape[3];
  const int64_t tokens = x.size(0), hidden = x.size(1), q_size = heads * dim, kv_size = kv_heads * dim;
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == num_layers &&
              static_cast<int64_t>(norms.size()) == 2 * num_layers &&
              static_cast<int64_t>(weights.size()) == 4 * num_layers &&
              static_cast<int64_t>(packed.size()) == 4 * num_layers &&
              static_cast<int64_t>(kinds.size()) == 4 * num_layers,
              "decode_layers: per layer 2 norms, 4 weights (and packed, kinds) and a K and V cache");
  TORCH_CHECK(rows.size(0) == tokens && slots.size(0) == tokens, "decode_layers: one new token per sequence");
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == num_layers,
              "decode_layers: windows lists each layer's attention window, or none");
  const int64_t in_features[4] = {hidden, q_size, hidden, intermediate};
  const int64_t out_features[4] = {q_size + 2 * kv_size, hidden, 2 * intermediate, hidden};
  static const auto attention = c10::Dispatcher::singleton()
      .findSchemaOrThrow("multiserve_cpu::paged_decode_attention", "")
      .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                  const at::Tensor&, double, int64_t, at::Tensor&)>();
  at::Tensor residual = x.clone();
  at::Tensor h = rms_norm(x, norms[0], eps);
  at::Tensor out;
  for (int64_t l = 0; l < num_layers; ++l) {
    const auto proj = [&](int64_t i, const at::Tensor& in) {
      const int64_t w = 4 * l + i;
      return project(in, weights[w], packed.get(w), kinds[w], in_features[i], out_features[i], packed_min_rows);
    };
    if (l > 0) h = add_rms_norm(out, residual, norms[2 * l], eps);
    at::Tensor qkv = proj(0, h);  // [B, q + 2 kv]
    // a partial RoPE (cos and sin narrower than dim / 2) rotates each head's first 2 * cos.size(1) dims only
    at::Tensor qk =
        qkv.narrow(1, 0, q_size + kv_size).view({tokens, heads + kv_heads, dim}).narrow(2, 0, 2 * cos.size(1));
    rotary_(qk, cos, sin);
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, dim});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, dim});
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    write_kv_(k_cache, v_cache, k, v, slots);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads, dim});
    at::Tensor attended = at::empty({tokens, heads, dim}, x.options());
    attention.call(q, k_cache, v_cache, rows, block_tables, seq_lens, scale, windows.empty() ? 0 : windows[l],
                   attended);
    h = add_rms_norm(proj(1, attended.view({tokens, q_size})), residual, norms[2 * l + 1], eps);
    out = proj(3, silu_mul(proj(2, h)));
  }
  return {out, residual};
}

}  // namespace

TORCH_LIBRARY(multiserve_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor key, Tensor value, Tensor slots) -> ()");
  m.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] weights, Tensor?[] packed, "
        "int[] kinds, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor rows, Tensor block_tables, "
        "Tensor seq_lens, int[] shape, float eps, float scale, int packed_min_rows, int[] windows) -> (Tensor, Tensor)");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("rotary_", c10::DispatchKey::CPU, TORCH_FN(rotary_));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.impl("write_kv_", c10::DispatchKey::CPU, TORCH_FN(write_kv_));
  m.impl("decode_layers", c10::DispatchKey::CPU, TORCH_FN(decode_layers));
  // oneDNN's packed weights among the arguments make torch pick this key; the op is the same
  m.impl("decode_layers", c10::DispatchKey::MkldnnCPU, TORCH_FN(decode_layers));
}
