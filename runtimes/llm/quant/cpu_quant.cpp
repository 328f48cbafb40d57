// Weight-quantized linear layers on CPU: y[M, N] = x[M, K] @ W[N, K]^T, W in llama.cpp's 4- or 8-bit blocks of 32
// values (Q4_0, Q4_1, Q8_0; the op's `kind` is the GGML type id: 2, 3 or 8).
//
// One kernel serves every batch: a decode step's few rows and a prefill's hundreds, with the same arithmetic for
// each output element whatever M is, where the row sits in the batch and which thread computes it. That is what
// makes a greedy request's tokens independent of its batch, and a prefill's KV equal to what decode steps compute.
// Each element is, by definition (the scalar code below is this formula, and every vector path computes it):
//
//   acc = 0
//   for b in blocks, in order:        idot = sum_k w_int[n, b, k] * p[m, b, k]             (exact, int32)
//                                     acc  = fma(d[n, b] * dx[m, b], float(idot), acc)
//                      Q4_1 only:     acc  = fma(c[n, b], dsum[m, b], acc)
//   y[m, n] = acc
//
// where p are the activations quantized per row and block of 32 to int8 (scale dx = max |x| / 127, rounded to
// nearest even, as ggml's q8_1), dsum = dx * sum(p) (one rounding), and w_int the weight's integers: Q4_1 u (0..15,
// w = d u + c with c its min), Q4_0 u - 8, Q8_0 q (signed). Integer sums do not depend on their order, so the
// vector code is free to form idot any way it likes; the float operations are a fixed sequence over the blocks, run
// in vector lanes that each hold one output column (never a reduction across lanes). So the AVX2 code, the VNNI code
// and the scalar code give bit-identical results, which the tests check across builds.
//
// Weights are repacked at load (`pack_panels`) from the row layout (formats.py) into panels of 16 output columns:
// per panel, per block of 32 inputs, a record of
//
//   values: 4-bit: 4 chunks of 64 bytes; chunk j, byte 4c + i (column c, i < 4) holds u[4j + i] in its low nibble
//           and u[16 + 4j + i] in its high one (GGUF's own nibble pairs: the byte is the row's byte 4j + i);
//           8-bit: 8 chunks of 64 bytes; chunk j, byte 4c + i = q[4j + i], signed
//   d:      16 float16 scales          c: 16 float16 offsets (Q4_1 only)
//
// so that 32 bytes hold four consecutive inputs of eight columns: with the four matching activation bytes
// broadcast to every column, `vpmaddubsw` + `vpmaddwd` (or one `vpdpbusd` with VNNI) give eight columns' partial
// sums at once, one per int32 lane. 4-bit values are unsigned and activations signed, as vpmaddubsw wants; eight of
// its 16-bit pair sums (|.| <= 2 * 15 * 127) add up without overflow within a block, so one vpmaddwd per block
// widens them. 8-bit weights are signed: vpmaddubsw takes |q| and the activations with q's signs (vpsignb).
//
// In the 256-bit code a tile is up to 4 rows x 8 columns (one or two rows: 16): the unpacked weight vector serves every row of the
// tile, a broadcast activation the tile's columns; float accumulators stay in registers over all blocks. Threads take ranges of
// panels; within a range the panels go in groups small enough to stay in L2 while every tile of rows passes over
// them, so each weight is read from memory once per call whatever M is, and a many-row call is compute-bound.
//
// With AVX-512 (F, BW and VNNI) a tile of up to 6 rows spans the whole panel: one 512-bit register holds a row's 16 columns, so a
// weight chunk is unpacked once and each broadcast activation feeds 16 columns per instruction where the 256-bit code
// needs two. Same integer sums, same float operations per column: the same bits as the other paths. A many-row call
// (prefill, a speculative step's verification rows) runs 1.3-1.4x faster than with 256-bit registers (2-core AMD
// EPYC, SmolLM2's projections); building with -DMULTISERVE_NO_AVX512 keeps the 256-bit code (the tests do, to check
// it on such a machine).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MULTISERVE_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MULTISERVE_VNNI 1
#define MULTISERVE_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define MULTISERVE_VNNI 1
#define MULTISERVE_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(MULTISERVE_NO_AVX512)
#define MULTISERVE_AVX512 1
#endif
#endif

namespace {

constexpr int64_t QK = 32;     // values per block
constexpr int64_t PANEL = 16;  // output columns per panel
// activation rows per tile at most (a call's rows are split into tiles as even as they go: 5 rows, one tile of 5, not
// 4 and 1); 512-bit code has 32 registers for a tile's accumulators, 256-bit code 16
#if defined(MULTISERVE_AVX512)
constexpr int64_t TILE = 6;
#else
constexpr int64_t TILE = 4;
#endif
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8;

int64_t value_bytes(int64_t kind) { return kind == Q8_0 ? PANEL * QK : PANEL * QK / 2; }
// bytes of one (panel, block) record: values, scales, and for Q4_1 offsets
int64_t record_bytes(int64_t kind) { return value_bytes(kind) + 2 * PANEL * (kind == Q4_1 ? 2 : 1); }

void check_kind(int64_t kind) {
  TORCH_CHECK(kind == Q4_0 || kind == Q4_1 || kind == Q8_0, "kind must be a GGML type id of Q4_0 (2), Q4_1 (3) or "
              "Q8_0 (8), got ", kind);
}

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = mant;
      do { ++e; m <<= 1; } while ((m & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
#endif
}

// ------------------------------------------------------------------------------------------------ activations

// x quantized per row and block: q [M, K] int8, and per block [M, nb] its scale dx, dsum = dx * sum(q), and
// eight times sum(q) (Q4_0's offset, subtracted from the unsigned dot product).
struct Activations {
  int64_t rows, K, nb;
  std::unique_ptr<int8_t[]> q;  // (not zero-filled first: every byte is written)
  std::unique_ptr<float[]> dx, dsum;
  std::unique_ptr<int32_t[]> sum8;
};

// The largest |value| of a block of 32 (exact, in any order).
inline float block_amax(const float* src) {
#if defined(MULTISERVE_AVX2)
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_and_ps(_mm256_loadu_ps(src), abs);
  for (int i = 1; i < 4; ++i) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(src + 8 * i), abs));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
#else
  float amax = 0.f;
  for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(src[i]));
  return amax;
#endif
}

// A block of 32 values as int8 at scale d (rounded to nearest, ties to even, as nearbyint does), into q; returns
// their sum.
inline int32_t quantize_block(const float* src, float d, int8_t* q) {
  const float inv = d > 0.f ? 1.f / d : 0.f;
#if defined(MULTISERVE_AVX2)
  const __m256 scale = _mm256_set1_ps(inv);
  __m256i v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + 8 * i), scale));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  // packs work within 128-bit lanes: the permute puts the 32 bytes back in order
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return _mm_cvtsi128_si32(s);
#else
  int32_t total = 0;
  for (int64_t i = 0; i < QK; ++i) {
    const int v = static_cast<int>(std::nearbyint(src[i] * inv));
    q[i] = static_cast<int8_t>(v);
    total += v;
  }
  return total;
#endif
}

Activations quantize_activations(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  Activations a{M, K, nb, std::unique_ptr<int8_t[]>(new int8_t[M * K]), std::unique_ptr<float[]>(new float[M * nb]),
                std::unique_ptr<float[]>(new float[M * nb]), std::unique_ptr<int32_t[]>(new int32_t[M * nb])};
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {  // rows are independent
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* src = x + m * K + b * QK;
        const float d = block_amax(src) / 127.f;
        const int32_t total = quantize_block(src, d, a.q.get() + m * K + b * QK);
        a.dx[m * nb + b] = d;
        a.dsum[m * nb + b] = d * static_cast<float>(total);
        a.sum8[m * nb + b] = 8 * total;
      }
    }
  });
  return a;
}

// ------------------------------------------------------------------------------------------------ tiles

// Tiles write y[r * ldy + j]: rows m0.. of `a` against columns of one panel, whose records start at `panel`.
#if defined(MULTISERVE_AVX2)

inline __m256i bcast4(const int8_t* p) {  // four activation bytes into every int32 lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline void store_cols(float* y, __m256 v, int64_t cols) {
  if (cols == 8) {
    _mm256_storeu_ps(y, v);
    return;
  }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  std::memcpy(y, tmp, cols * sizeof(float));
}

// j = 0..count-1 through f: unrolled for a small tile, rolled for a large one (unrolled, GCC regroups a large tile's
// integer sums into a tree and spills most of its terms to the stack: 54 against 72 GMAC/s at 512 rows).
template <int64_t count, bool unroll, typename F>
inline void steps(F&& f) {
  if constexpr (unroll) {
#pragma GCC unroll 8
    for (int64_t j = 0; j < count; ++j) f(j);
  } else {
#pragma GCC unroll 1
    for (int64_t j = 0; j < count; ++j) f(j);
  }
}

// A decode step's one or two rows spend a few instructions per weight byte, so its loop is bound by memory; asking
// for the records 4 blocks ahead measured 1.07-1.39x faster per SmolLM2 projection at one row than the hardware
// prefetcher alone (2-core AMD EPYC; 8 ahead was no better). Prefetches never fault and change no arithmetic.
constexpr int64_t PREFETCH_RECORDS = 4;

// R rows x H halves (8 columns each) of one panel, from half h0 on; `cols` of the last half are written.
template <int64_t KIND, int64_t R, int64_t H>
void tile(const uint8_t* panel, const Activations& a, int64_t m0, int h0, float* y, int64_t ldy, int64_t cols) {
  constexpr bool small = R * H <= 4;
  const int64_t rec = record_bytes(KIND), vb = value_bytes(KIND), nb = a.nb, K = a.K;
  const int8_t* xq = a.q.get() + m0 * K;
  __m256 acc[R][H];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
#if !defined(MULTISERVE_VNNI)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = panel + b * rec + h0 * 32;
    const int8_t* xb = xq + b * QK;
    if constexpr (R <= 2) {  // a decode's rows: bound by reading the weights (past a panel's end: the next one's)
      const char* ahead = reinterpret_cast<const char*>(panel) + (b + PREFETCH_RECORDS) * rec;
      for (int64_t line = 0; line < rec; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    __m256i dot[R][H];  // int32 lanes (VNNI, and 8-bit weights), else int16 pair sums
    for (int64_t r = 0; r < R; ++r)
      for (int64_t h = 0; h < H; ++h) dot[r][h] = _mm256_setzero_si256();
    if constexpr (KIND == Q8_0) {
      steps<8, small>([&](int64_t j) {
        __m256i v[H], u[H];
        for (int64_t h = 0; h < H; ++h) {
          v[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * 64 + h * 32));
          u[h] = _mm256_abs_epi8(v[h]);
        }
        for (int64_t r = 0; r < R; ++r) {
          const __m256i x = bcast4(xb + r * K + 4 * j);
          for (int64_t h = 0; h < H; ++h) {
            const __m256i sx = _mm256_sign_epi8(x, v[h]);
#if defined(MULTISERVE_VNNI)
            dot[r][h] = MULTISERVE_DPBUSD(dot[r][h], u[h], sx);
#else
            dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(u[h], sx), ones));
#endif
          }
        }
      });
    } else {
      const __m256i mask = _mm256_set1_epi8(0x0f);
      steps<4, small>([&](int64_t j) {
        __m256i lo[H], hi[H];
        for (int64_t h = 0; h < H; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * 64 + h * 32));
          lo[h] = _mm256_and_si256(v, mask);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        }
        for (int64_t r = 0; r < R; ++r) {
          const __m256i s_lo = bcast4(xb + r * K + 4 * j), s_hi = bcast4(xb + r * K + 16 + 4 * j);
          for (int64_t h = 0; h < H; ++h) {
#if defined(MULTISERVE_VNNI)
            dot[r][h] = MULTISERVE_DPBUSD(MULTISERVE_DPBUSD(dot[r][h], lo[h], s_lo), hi[h], s_hi);
#else
            dot[r][h] = _mm256_add_epi16(dot[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], s_lo),
                                                                     _mm256_maddubs_epi16(hi[h], s_hi)));
#endif
          }
        }
      });
#if !defined(MULTISERVE_VNNI)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t h = 0; h < H; ++h) dot[r][h] = _mm256_madd_epi16(dot[r][h], ones);
#endif
    }
    const uint16_t* dp = reinterpret_cast<const uint16_t*>(panel + b * rec + vb) + h0 * 8;
    for (int64_t h = 0; h < H; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dp + h * 8)));
      for (int64_t r = 0; r < R; ++r) {
        const int64_t at = (m0 + r) * nb + b;
        __m256i idot = dot[r][h];
        if constexpr (KIND == Q4_0) idot = _mm256_sub_epi32(idot, _mm256_set1_epi32(a.sum8[at]));
        const __m256 sc = _mm256_mul_ps(d, _mm256_set1_ps(a.dx[at]));
        acc[r][h] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(idot), acc[r][h]);
      }
      if constexpr (KIND == Q4_1) {
        const __m256 c = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dp + PANEL + h * 8)));
        for (int64_t r = 0; r < R; ++r) {
          acc[r][h] = _mm256_fmadd_ps(c, _mm256_set1_ps(a.dsum[(m0 + r) * nb + b]), acc[r][h]);
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t h = 0; h < H; ++h) store_cols(y + r * ldy + h * 8, acc[r][h], h + 1 < H ? 8 : cols);
  }
}


#if defined(MULTISERVE_AVX512)
// With AVX-512: R rows x the panel's 16 columns in one 512-bit register each (`cols` of them written). The same
// integer sums and the same float operations per column as `tile` (one lane per column), half the instructions.
// 8-bit weights go in unsigned (q + 128) and the sum is corrected by 128 times the activations' sum (exact).
template <int64_t KIND, int64_t R>
void tile16(const uint8_t* panel, const Activations& a, int64_t m0, float* y, int64_t ldy, int64_t cols) {
  constexpr bool small = R <= 2;
  const int64_t rec = record_bytes(KIND), vb = value_bytes(KIND), nb = a.nb, K = a.K;
  const int8_t* xq = a.q.get() + m0 * K;
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = panel + b * rec;
    const int8_t* xb = xq + b * QK;
    if constexpr (R <= 2) {
      const char* ahead = reinterpret_cast<const char*>(panel) + (b + PREFETCH_RECORDS) * rec;
      for (int64_t line = 0; line < rec; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    __m512i dot[R];
    for (int64_t r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    if constexpr (KIND == Q8_0) {
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      steps<8, small>([&](int64_t j) {
        const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(w + j * 64), flip);
        for (int64_t r = 0; r < R; ++r) {
          int32_t v;
          std::memcpy(&v, xb + r * K + 4 * j, 4);
          dot[r] = _mm512_dpbusd_epi32(dot[r], u, _mm512_set1_epi32(v));
        }
      });
    } else {
      const __m512i mask = _mm512_set1_epi8(0x0f);
      steps<4, small>([&](int64_t j) {
        const __m512i v = _mm512_loadu_si512(w + j * 64);
        const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        for (int64_t r = 0; r < R; ++r) {
          int32_t s0, s1;
          std::memcpy(&s0, xb + r * K + 4 * j, 4);
          std::memcpy(&s1, xb + r * K + 16 + 4 * j, 4);
          dot[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(s0)), hi,
                                       _mm512_set1_epi32(s1));
        }
      });
    }
    const uint16_t* dp = reinterpret_cast<const uint16_t*>(w + vb);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dp)));
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * nb + b;
      __m512i idot = dot[r];
      if constexpr (KIND == Q4_0) idot = _mm512_sub_epi32(idot, _mm512_set1_epi32(a.sum8[at]));
      if constexpr (KIND == Q8_0) idot = _mm512_sub_epi32(idot, _mm512_set1_epi32(16 * a.sum8[at]));
      const __m512 sc = _mm512_mul_ps(d, _mm512_set1_ps(a.dx[at]));
      acc[r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(idot), acc[r]);
    }
    if constexpr (KIND == Q4_1) {
      const __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dp + PANEL)));
      for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(a.dsum[(m0 + r) * nb + b]), acc[r]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}
#endif

#else  // scalar: the definition itself

template <int64_t KIND, int64_t R, int64_t H>
void tile(const uint8_t* panel, const Activations& a, int64_t m0, int h0, float* y, int64_t ldy, int64_t cols) {
  const int64_t rec = record_bytes(KIND), vb = value_bytes(KIND), nb = a.nb, K = a.K;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    for (int64_t j = 0; j < (H - 1) * 8 + cols; ++j) {
      const int64_t c = h0 * 8 + j;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* w = panel + b * rec;
        const int8_t* p = a.q.get() + m * K + b * QK;
        int32_t idot = 0;
        for (int64_t k = 0; k < QK; ++k) {
          int32_t wi;
          if constexpr (KIND == Q8_0) {
            wi = static_cast<int8_t>(w[(k / 4) * 64 + c * 4 + k % 4]);
          } else {
            const int64_t kk = k % 16;
            const uint8_t byte = w[(kk / 4) * 64 + c * 4 + kk % 4];
            wi = k < 16 ? (byte & 0x0f) : (byte >> 4);
            if constexpr (KIND == Q4_0) wi -= 8;
          }
          idot += wi * p[k];
        }
        const uint16_t* dp = reinterpret_cast<const uint16_t*>(w + vb);
        acc = std::fma(half_to_float(dp[c]) * a.dx[m * nb + b], static_cast<float>(idot), acc);
        if constexpr (KIND == Q4_1) acc = std::fma(half_to_float(dp[PANEL + c]), a.dsum[m * nb + b], acc);
      }
      y[r * ldy + j] = acc;
    }
  }
}

#endif

// f(std::integral_constant<int64_t, rows>{}) for 1 <= rows <= TILE: the tile's row count is a compile-time constant,
// so each row's accumulators stay in registers.
template <int64_t N = TILE, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (N == 1) {
    f(std::integral_constant<int64_t, 1>{});
  } else if (rows >= N) {
    f(std::integral_constant<int64_t, N>{});
  } else {
    with_rows<N - 1>(rows, f);
  }
}

template <int64_t KIND>
void run(const Activations& a, const uint8_t* panels, int64_t num_panels, int64_t N, float* y) {
  const int64_t M = a.rows, panel_bytes = a.nb * record_bytes(KIND);
  // panels per group: ~64 KB, which stays in L2 beside a prefill's activations while every tile of rows passes
  const int64_t group = std::max<int64_t>(1, (64 << 10) / panel_bytes);
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p0 = begin; p0 < end; p0 += group) {
      const int64_t p1 = std::min(end, p0 + group);
      const int64_t tiles = (M + TILE - 1) / TILE;
      for (int64_t t = 0, m = 0, take = 0; t < tiles; ++t, m += take) {
        take = (M - m + (tiles - t) - 1) / (tiles - t);
        with_rows(take, [&](auto rows) {
          for (int64_t p = p0; p < p1; ++p) {
            constexpr int64_t R = decltype(rows)::value;
            const uint8_t* panel = panels + p * panel_bytes;
            const int64_t n = p * PANEL, left = N - n;
#if defined(MULTISERVE_AVX512)
            tile16<KIND, R>(panel, a, m, y + m * N + n, N, std::min<int64_t>(PANEL, left));
#else
            if (R <= 2 && left > 8) {  // a few rows: both halves at once, twice the independent sums in flight
              tile<KIND, R, 2>(panel, a, m, 0, y + m * N + n, N, std::min<int64_t>(8, left - 8));
              continue;
            }
            for (int half = 0; half < 2 && half * 8 < left; ++half) {
              tile<KIND, R, 1>(panel, a, m, half, y + m * N + n + half * 8, N, std::min<int64_t>(8, left - half * 8));
            }
#endif
          }
        });
      }
    }
  });
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& panels, int64_t kind, int64_t in_features,
                        int64_t out_features) {
  check_kind(kind);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_cpu(), "x must be a 2-D fp32 CPU tensor");
  const int64_t K = in_features, M = x.size(0), N = out_features, nb = K / QK;
  const int64_t num_panels = (N + PANEL - 1) / PANEL;
  TORCH_CHECK(K % QK == 0 && x.size(1) == K, "in_features must be a multiple of 32 and match x");
  TORCH_CHECK(panels.dim() == 2 && panels.scalar_type() == at::kByte && panels.is_contiguous() &&
              panels.size(0) == num_panels && panels.size(1) == nb * record_bytes(kind),
              "panels must be the contiguous uint8 [", num_panels, ", ", nb * record_bytes(kind),
              "] that pack_panels makes for ", N, " x ", K);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const Activations a = quantize_activations(xc.data_ptr<float>(), M, K);
  const uint8_t* w = panels.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  if (kind == Q4_0) {
    run<Q4_0>(a, w, num_panels, N, y);
  } else if (kind == Q4_1) {
    run<Q4_1>(a, w, num_panels, N, y);
  } else {
    run<Q8_0>(a, w, num_panels, N, y);
  }
  return out;
}

// ------------------------------------------------------------------------------------------------ layouts

// The row layout (formats.py: per row its values, then nbp float16 scales d, then nbp float16 offsets c, the block
// count nbp padded to even; 4-bit: GGUF's bytes, 8-bit: u = q + 128) -> panels.
at::Tensor pack_panels(const at::Tensor& rows, int64_t kind, int64_t in_features) {
  check_kind(kind);
  const int64_t K = in_features, N = rows.size(0), nb = K / QK, nbp = nb + (nb & 1);
  const bool four_bit = kind != Q8_0;
  const int64_t row_value_bytes = four_bit ? QK / 2 : QK, rec = record_bytes(kind), vb = value_bytes(kind);
  TORCH_CHECK(K % QK == 0, "in_features must be a multiple of 32");
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kByte && rows.is_contiguous() &&
              rows.size(1) == nbp * (row_value_bytes + 4), "rows must be contiguous packed uint8 rows of ", K,
              " values");
  const int64_t num_panels = (N + PANEL - 1) / PANEL, row_bytes = rows.size(1);
  at::Tensor out = at::zeros({num_panels, nb * rec}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, num_panels, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < PANEL && p * PANEL + c < N; ++c) {
        const uint8_t* row = src + (p * PANEL + c) * row_bytes;
        const uint16_t* d = reinterpret_cast<const uint16_t*>(row + nbp * row_value_bytes);
        for (int64_t b = 0; b < nb; ++b) {
          uint8_t* r = dst + (p * nb + b) * rec;
          const uint8_t* values = row + b * row_value_bytes;
          for (int64_t k = 0; k < row_value_bytes; ++k) {
            // 4-bit: row byte 4j + i (values 4j + i and 16 + 4j + i); 8-bit: value 4j + i, u - 128 = q
            r[(k / 4) * 64 + c * 4 + k % 4] = four_bit ? values[k] : static_cast<uint8_t>(values[k] ^ 0x80);
          }
          uint16_t* scales = reinterpret_cast<uint16_t*>(r + vb);
          scales[c] = d[b];
          if (kind == Q4_1) scales[PANEL + c] = d[nbp + b];
        }
      }
    }
  });
  return out;
}

// Rows `ids` of the weight held as panels, dequantized to fp32 [len(ids), K] (a tied embedding's lookups): the
// values formats.dequantize_rows gives from the row layout, d u + c.
at::Tensor panel_rows(const at::Tensor& panels, const at::Tensor& ids, int64_t kind, int64_t in_features) {
  check_kind(kind);
  const int64_t K = in_features, nb = K / QK, rec = record_bytes(kind), vb = value_bytes(kind);
  TORCH_CHECK(panels.dim() == 2 && panels.scalar_type() == at::kByte && panels.is_contiguous() &&
              panels.size(1) == nb * rec, "panels must be contiguous uint8 panels of ", K, " inputs");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be a 1-D int64 tensor");
  const at::Tensor idc = ids.contiguous();
  const int64_t count = idc.size(0), limit = panels.size(0) * PANEL;
  const int64_t* id = idc.data_ptr<int64_t>();
  at::Tensor out = at::empty({count, K}, panels.options().dtype(at::kFloat));
  const uint8_t* base = panels.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < limit, "id ", id[i], " out of range");
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = id[i] / PANEL, c = id[i] % PANEL;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* r = base + (p * nb + b) * rec;
        const uint16_t* scales = reinterpret_cast<const uint16_t*>(r + vb);
        const float d = half_to_float(scales[c]);
        float* out_row = y + i * K + b * QK;
        if (kind == Q8_0) {
          for (int64_t k = 0; k < QK; ++k) {
            out_row[k] = d * static_cast<float>(static_cast<int8_t>(r[(k / 4) * 64 + c * 4 + k % 4]));
          }
          continue;
        }
        const float offset = kind == Q4_1 ? half_to_float(scales[PANEL + c]) : -8.f * d;
        for (int64_t k = 0; k < QK / 2; ++k) {
          const uint8_t byte = r[(k / 4) * 64 + c * 4 + k % 4];
          out_row[k] = d * static_cast<float>(byte & 0x0f) + offset;
          out_row[k + QK / 2] = d * static_cast<float>(byte >> 4) + offset;
        }
      }
    }
  });
  return out;
}

}  // namespace

// The op namespace: multiserve_quant, or another one where a test builds this file for another instruction set too.
#ifndef MULTISERVE_QUANT_NS
#define MULTISERVE_QUANT_NS multiserve_quant
#endif
#define MULTISERVE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

MULTISERVE_LIBRARY(MULTISERVE_QUANT_NS, m) {
  m.def("quant_linear(Tensor x, Tensor panels, int kind, int in_features, int out_features) -> Tensor");
  m.def("pack_panels(Tensor rows, int kind, int in_features) -> Tensor");
  m.def("panel_rows(Tensor panels, Tensor ids, int kind, int in_features) -> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, TORCH_FN(quant_linear));
  m.impl("pack_panels", c10::DispatchKey::CPU, TORCH_FN(pack_panels));
  m.impl("panel_rows", c10::DispatchKey::CPU, TORCH_FN(panel_rows));
}
