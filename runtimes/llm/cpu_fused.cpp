// The small per-layer operations of a decode step, fused for fp32 on CPU: each is one pass over its data instead of
// the several PyTorch operators (and temporaries) the reference path in model.py takes, which at batch 1 cost more
// in dispatch than in arithmetic.
//
//   add_rms_norm(x, residual, weight, eps): residual += x (in place), returns rms_norm(residual) * weight
//   rms_norm(x, weight, eps):               x * rsqrt(mean(x^2) + eps) * weight
//   rotary_(qk, positions, cos, sin):       rotate-halves RoPE in place over qk [T, heads, D]
//   silu_mul(gate_up):                      silu(gate) * up, gate_up = [gate | up] per row
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

}  // namespace

TORCH_LIBRARY(multiserve_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("rotary_", c10::DispatchKey::CPU, TORCH_FN(rotary_));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
}
