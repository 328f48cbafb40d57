// The small per-layer operations of a decode step, fused for fp32 on CPU: each is one pass over its data instead of
// the several PyTorch operators (and temporaries) the reference path in model.py takes, which at batch 1 cost more
// in dispatch than in arithmetic.
//
//   add_rms_norm(x, residual, weight, eps): residual += x (in place), returns rms_norm(residual) * weight
//   rms_norm(x, weight, eps):               x * rsqrt(mean(x^2) + eps) * weight
//   rotary_(qk, cos, sin):                  rotate-halves RoPE in place over qk [T, heads, D]
//   silu_mul(gate_up):                      silu(gate) * up, gate_up = [gate | up] per row
//   write_kv_(k_cache, v_cache, k, v, slots): each new token's keys and values into its cache slot
//
// Each is written as the reference computes it, element by element in the same order, and built with
// -ffp-contract=off, so its results equal the reference path's.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.is_cpu() && t.is_contiguous(), name,
              " must be a contiguous 2-D fp32 CPU tensor");
}

void norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  double sum = 0.0;  // torch's CPU mean reduces in higher precision than the float values; so does this
  for (int64_t i = 0; i < n; ++i) sum += double(x[i]) * double(x[i]);
  const float scale = 1.f / std::sqrt(float(sum / double(n)) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * scale);
}

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
      for (int64_t i = 0; i < n; ++i) op[r * n + i] = g[i] / (1.f + std::exp(-g[i])) * g[n + i];
    }
  });
  return out;
}

void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& key, const at::Tensor& value,
               const at::Tensor& slots) {
  // caches: [num_blocks, block_size, KVH, D] contiguous; key, value: [T, KVH, D], unit stride in D (views into the
  // fused q|k|v output); slots: [T] int64, a token's slot = block * block_size + offset
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "caches must be contiguous fp32");
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat && key.stride(2) == 1 &&
              value.stride(2) == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "key and value must be fp32 [T, KVH, D] with unit stride in D; slots int64");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2), row = heads * dim;
  const int64_t num_slots = k_cache.numel() / row;
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = sp[t];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " is outside the cache (", num_slots, " slots)");
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kc + slot * row + h * dim, kp + t * key.stride(0) + h * key.stride(1), dim * sizeof(float));
      std::memcpy(vc + slot * row + h * dim, vp + t * value.stride(0) + h * value.stride(1), dim * sizeof(float));
    }
  }
}

}  // namespace

TORCH_LIBRARY(multiserve_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor key, Tensor value, Tensor slots) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("rotary_", c10::DispatchKey::CPU, TORCH_FN(rotary_));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.impl("write_kv_", c10::DispatchKey::CPU, TORCH_FN(write_kv_));
}
