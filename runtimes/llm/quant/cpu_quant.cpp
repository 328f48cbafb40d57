// Weight-quantized linear layers on CPU: y[M, N] = x[M, K] @ W[N, K]^T, W in 4- or 8-bit blocks of 32 values.
//
// Weight layout (runtimes/llm/quant/formats.py packs GGUF's Q4_0, Q4_1 and Q8_0 into it at load), one row per output
// feature, its K / 32 blocks padded to an even count nbp with zero blocks:
//
//   [ values: nbp * 16 bytes (4-bit: byte j of a block = value j | value j+16 << 4) or nbp * 32 bytes (8-bit)
//   | d: nbp float16 scales | c: nbp float16 offsets ]          w = d * u + c, u unsigned (0..15 or 0..255)
//
// (Q4_1: c is the block's min; Q4_0: c = -8 d; Q8_0 is stored as u = q + 128 with c = -128 d.) Activations are
// quantized on the fly, per row and block of 32, to int8 p with scale dx (as ggml's q8_1), so a block's dot product
// is an integer one plus an offset term:
//
//   w . x  ~=  sum_b d_b dx_b (u . p)_b  +  sum_b c_b (dx_b sum(p)_b)
//
// u . p is `vpdpbusd` (unsigned x signed bytes, summed in fours into int32 lanes): 512-bit with AVX-512 VNNI, 256-bit
// with AVX-VNNI or AVX512-VL VNNI, else AVX2's maddubs + madd, else scalar code; the build targets the machine it
// runs on (-march=native, cached per machine). 4-bit values are split into low and high nibbles in registers and
// multiplied by the activations rearranged to match (each block's first and second halves, contiguous per block).
// Each thread takes a range of weight rows and runs all activation rows against a weight row, a tile of them at a
// time (8 with AVX-512 VNNI, else 4; the count a compile-time constant, see `with_rows`), while
// it is in registers and L1: the weights are read from memory once per call whatever M is. For many activation
// rows (a prefill) the weight rows go in blocks of ~128 KB: each tile passes over a block while it sits in L2, and
// the tile's quantized activations stay in L1 (1.2x at 136 rows, measured here, bit for bit the same results). With AVX-512 a full tile
// of eight rows ends with one transposed reduction and one vector of offset terms for all eight (`finish_tile`).
// Activations are quantized with AVX2 where there is AVX2 (bit-identical to the scalar rounding), rows in parallel.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define MULTISERVE_VNNI512 1  // the 512-bit path, which scales by `spread`; the others scale by `d`
#endif

namespace {

constexpr int64_t QK = 32;
// activation rows per pass over a weight row (their sums stay in registers)
#if defined(MULTISERVE_VNNI512)
constexpr int64_t TILE = 8;
#else
constexpr int64_t TILE = 4;
#endif

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

// The activation rows quantized per block, in the layout the weights need: for 8-bit weights each block's 32 values
// in order (`q`); for 4-bit ones the first 16 values of each block (`lo`) and the last 16 (`hi`), so that a vector of
// packed weight bytes and a vector of `lo` (or `hi`) bytes cover the same blocks. Padding blocks are zero.
struct Activations {
  int64_t nb, nbp;
  std::vector<int8_t> q, lo, hi;  // [M, nbp * 32] or 2 x [M, nbp * 16]
  std::vector<float> d, dsum;     // [M, nbp]: scale, scale * sum of the block's int8 values
  std::vector<float> spread;      // [M, nbp * lanes]: each block's scale repeated over the int32 lanes its dot
                                  // product fills (4-bit: 4, 8-bit: 8), to multiply whole vectors by
  std::vector<float> dsum_t;      // [nb, M]: dsum transposed, a block's values for a tile of rows side by side
  int64_t rows = 0;               // M
};

// A block's scale: its largest |value| / 127.
inline float block_scale(const float* src) {
  float amax = 0.f;
  for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(src[i]));
  return amax / 127.f;
}

// A block of 32 values as int8 at scale d (rounded to nearest, ties to even, as nearbyint does), into q; returns
// their sum.
inline int32_t quantize_block(const float* src, float d, int8_t* q) {
  const float inv = d > 0.f ? 1.f / d : 0.f;
#if defined(__AVX2__)
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

Activations quantize_activations(const float* x, int64_t M, int64_t K, bool four_bit) {
  const int64_t nb = K / QK, nbp = nb + (nb & 1);
  [[maybe_unused]] const int64_t lanes = four_bit ? 4 : 8;
  Activations a{nb, nbp, {}, {}, {}, {}, std::vector<float>(M * nbp, 0.f), {}, {}, M};
#if defined(MULTISERVE_VNNI512)
  a.spread.assign(M * nbp * lanes, 0.f);
  if (M >= TILE) a.dsum_t.assign(nb * M, 0.f);
#else
  a.d.assign(M * nbp, 0.f);
#endif
  if (four_bit) {
    a.lo.assign(M * nbp * QK / 2, 0);
    a.hi.assign(M * nbp * QK / 2, 0);
  } else {
    a.q.assign(M * nbp * QK, 0);
  }
  // rows are independent: a few per thread
  at::parallel_for(0, M, 4, [&](int64_t m_begin, int64_t m_end) {
    alignas(32) int8_t block[QK];
    for (int64_t m = m_begin; m < m_end; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* src = x + m * K + b * QK;
        const float d = block_scale(src);
        const int32_t total = quantize_block(src, d, block);
        const int64_t at = m * nbp + b;
        if (four_bit) {
          std::memcpy(a.lo.data() + at * QK / 2, block, QK / 2);
          std::memcpy(a.hi.data() + at * QK / 2, block + QK / 2, QK / 2);
        } else {
          std::memcpy(a.q.data() + at * QK, block, QK);
        }
        a.dsum[at] = d * static_cast<float>(total);
#if defined(MULTISERVE_VNNI512)
        std::fill_n(a.spread.data() + at * lanes, lanes, d);
        if (M >= TILE) a.dsum_t[b * M + m] = a.dsum[at];
#else
        a.d[at] = d;
#endif
      }
    }
  });
  return a;
}

// sum_b c_b * dsum_b over a row's blocks (the offset terms).
inline float offsets(const uint16_t* c, const float* dsum, int64_t nb) {
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) total += half_to_float(c[b]) * dsum[b];
  return total;
}

constexpr int64_t PREFETCH_ROWS = 8;  // how far ahead weight rows are prefetched

#if defined(__AVX2__)
inline float hsum(__m256 v) {  // the sum of a vector's eight lanes
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(MULTISERVE_VNNI512)

// Lanes 4k..4k+3 <- element k: one block's scale over the four int32 lanes its 16 bytes sum into.
inline __m512 spread4(__m128 v) {
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}

inline __m128 halves4(const uint16_t* p) {  // four float16 -> float
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// acc + the offset terms c_b * dsum_b of a row's nb blocks, sixteen at a time.
inline __m512 add_offsets(__m512 acc, const uint16_t* c, const float* dsum, int64_t nb) {
  int64_t b = 0;
  for (; b + 16 <= nb; b += 16) {
    acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + b))),
                          _mm512_loadu_ps(dsum + b), acc);
  }
  if (b < nb) {
    const __mmask16 left = static_cast<__mmask16>((1u << (nb - b)) - 1);
    acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(left, c + b)), _mm512_maskz_loadu_ps(left, dsum + b),
                          acc);
  }
  return acc;
}

// A full tile's results: y[r * ys] = (the sum of acc[r]'s sixteen lanes) + sum_b c_b dsum_b for r < 8. The eight
// vectors are folded into one in three shuffle-and-add steps, and the offset terms of the eight rows are one vector
// of multiply-adds over the blocks (dsum transposed), instead of a horizontal sum and an offsets pass per row.
inline void finish_tile(const __m512* acc, const uint16_t* c, const Activations& a, int64_t m0, float* y, int64_t ys) {
  __m512 pairs[4];  // 128-bit lanes 0-1: partial sums of row 2i, lanes 2-3: of row 2i + 1
  for (int i = 0; i < 4; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // 128-bit lane j: four partial sums of row j (lo) or of row 4 + j (hi)
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(pairs[2], pairs[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(pairs[2], pairs[3], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 sums = _mm512_add_ps(_mm512_unpacklo_ps(lo, hi), _mm512_unpackhi_ps(lo, hi));
  sums = _mm512_add_ps(sums, _mm512_shuffle_ps(sums, sums, _MM_SHUFFLE(1, 0, 3, 2)));  // lane 4j: row j, 4j+1: 4+j
  const __m512i order = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 13, 9, 5, 1, 12, 8, 4, 0);
  __m256 total = _mm512_castps512_ps256(_mm512_permutexvar_ps(order, sums));
  const float* dsum_t = a.dsum_t.data() + m0;
  for (int64_t b0 = 0; b0 < a.nb; b0 += 16) {
    const int64_t count = std::min<int64_t>(16, a.nb - b0);
    alignas(64) float cf[16];
    _mm512_store_ps(cf, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << count) - 1), c + b0)));
    for (int64_t j = 0; j < count; ++j) {
      total = _mm256_fmadd_ps(_mm256_set1_ps(cf[j]), _mm256_loadu_ps(dsum_t + (b0 + j) * a.rows), total);
    }
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, total);
  for (int r = 0; r < 8; ++r) y[r * ys] = out[r];
}

// y[r * ys] = w . x[m0 + r] for r < rows, one 4-bit weight row: four blocks per 512-bit step (64 bytes of values),
// a last pair of blocks in 256-bit registers.
template <int64_t rows>
void row4(const uint8_t* w, const Activations& a, int64_t m0, float* y, int64_t ys) {
  const int64_t nbp = a.nbp;
  const uint16_t* d = reinterpret_cast<const uint16_t*>(w + nbp * 16);
  const uint16_t* c = d + nbp;
  const __m512i mask = _mm512_set1_epi8(0x0f);
  __m512 acc[TILE];
  __m256 tail[TILE];
  for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps(), tail[r] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 4 <= nbp; b += 4) {
    const __m512i v = _mm512_loadu_si512(w + b * 16);
    const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    const __m512 wd = spread4(halves4(d + b));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = (m0 + r) * nbp + b;
      __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(a.lo.data() + at * 16));
      dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(a.hi.data() + at * 16));
      const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(a.spread.data() + at * 4));
      acc[r] = _mm512_fmadd_ps(scaled, wd, acc[r]);
    }
  }
  if (b < nbp) {  // two blocks left
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 16));
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    const float d0 = half_to_float(d[b]), d1 = half_to_float(d[b + 1]);
    const __m256 wd = _mm256_setr_ps(d0, d0, d0, d0, d1, d1, d1, d1);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = (m0 + r) * nbp + b;
      __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo,
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.lo.data() + at * 16)));
      dot = _mm256_dpbusd_epi32(dot, hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.hi.data() + at * 16)));
      const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_loadu_ps(a.spread.data() + at * 4));
      tail[r] = _mm256_fmadd_ps(scaled, wd, tail[r]);
    }
  }
  if constexpr (rows == TILE) {
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_add_ps(acc[r], _mm512_zextps256_ps512(tail[r]));
    return finish_tile(acc, c, a, m0, y, ys);
  }
  for (int64_t r = 0; r < rows; ++r) {
    y[r * ys] = _mm512_reduce_add_ps(add_offsets(acc[r], c, a.dsum.data() + (m0 + r) * nbp, a.nb)) + hsum(tail[r]);
  }
}

// The same for an 8-bit weight row: two blocks per 512-bit step.
template <int64_t rows>
void row8(const uint8_t* w, const Activations& a, int64_t m0, float* y, int64_t ys) {
  const int64_t nbp = a.nbp;
  const uint16_t* d = reinterpret_cast<const uint16_t*>(w + nbp * 32);
  const uint16_t* c = d + nbp;
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[TILE];
  for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nbp; b += 2) {
    const __m512i v = _mm512_loadu_si512(w + b * 32);
    const __m128 wd2 = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(d + b)));
    const __m512 wd = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(wd2));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = (m0 + r) * nbp + b;
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_loadu_si512(a.q.data() + at * 32));
      const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(a.spread.data() + at * 8));
      acc[r] = _mm512_fmadd_ps(scaled, wd, acc[r]);
    }
  }
  if constexpr (rows == TILE) return finish_tile(acc, c, a, m0, y, ys);
  for (int64_t r = 0; r < rows; ++r) {
    y[r * ys] = _mm512_reduce_add_ps(add_offsets(acc[r], c, a.dsum.data() + (m0 + r) * nbp, a.nb));
  }
}

#elif defined(__AVX2__)

inline __m256i dot_us(__m256i acc, __m256i u, __m256i s) {  // acc + four-byte sums of u * s (u unsigned)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// The sum of acc's lanes plus the offset terms c_b * dsum_b of a row's nb blocks, eight at a time.
inline float sum_with_offsets(__m256 acc, const uint16_t* c, const float* dsum, int64_t nb) {
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b))),
                          _mm256_loadu_ps(dsum + b), acc);
  }
  return hsum(acc) + offsets(c + b, dsum + b, nb - b);
}

// 4-bit weight row: two blocks per 256-bit step. (maddubs saturates pairs at 16 bits: 15 * 127 * 2 fits.)
template <int64_t rows>
void row4(const uint8_t* w, const Activations& a, int64_t m0, float* y, int64_t ys) {
  const int64_t nbp = a.nbp;
  const uint16_t* d = reinterpret_cast<const uint16_t*>(w + nbp * 16);
  const uint16_t* c = d + nbp;
  const __m256i mask = _mm256_set1_epi8(0x0f);
  const __m256i idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[TILE];
  for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nbp; b += 2) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 16));
    const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    const __m128 wd = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(d + b)));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = (m0 + r) * nbp + b;
      __m256i dot = dot_us(_mm256_setzero_si256(), lo,
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.lo.data() + at * 16)));
      dot = dot_us(dot, hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.hi.data() + at * 16)));
      const __m128 s = _mm_mul_ps(wd, _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
                                          a.d.data() + at))));
      acc[r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(s), idx), _mm256_cvtepi32_ps(dot),
                               acc[r]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) y[r * ys] = sum_with_offsets(acc[r], c, a.dsum.data() + (m0 + r) * nbp, a.nb);
}

// 8-bit weight row: one block per 256-bit step. maddubs would saturate (255 * 127 * 2 > 32767), so without VNNI
// both operands are widened to 16 bits and multiplied with madd.
template <int64_t rows>
void row8(const uint8_t* w, const Activations& a, int64_t m0, float* y, int64_t ys) {
  const int64_t nbp = a.nbp;
  const uint16_t* d = reinterpret_cast<const uint16_t*>(w + nbp * 32);
  const uint16_t* c = d + nbp;
  __m256 acc[TILE];
  for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nbp; ++b) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32));
    const float wd = half_to_float(d[b]);
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__)) && !defined(__AVXVNNI__)
    const __m256i v_lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v));
    const __m256i v_hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1));
#endif
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = (m0 + r) * nbp + b;
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + at * 32));
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
      const __m256i dot = dot_us(_mm256_setzero_si256(), v, p);
#else
      const __m256i p_lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(p));
      const __m256i p_hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(p, 1));
      const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(v_lo, p_lo), _mm256_madd_epi16(v_hi, p_hi));
#endif
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd * a.d[at]), _mm256_cvtepi32_ps(dot), acc[r]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) y[r * ys] = sum_with_offsets(acc[r], c, a.dsum.data() + (m0 + r) * nbp, a.nb);
}

#else

void row_scalar(const uint8_t* w, int bits, const Activations& a, int64_t m0, int64_t rows, float* y, int64_t ys) {
  const int64_t nbp = a.nbp, value_bytes = bits == 4 ? 16 : 32;
  const uint16_t* d = reinterpret_cast<const uint16_t*>(w + nbp * value_bytes);
  const uint16_t* c = d + nbp;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = (m0 + r) * nbp;
    float total = 0.f;
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint8_t* u = w + b * value_bytes;
      int32_t dot = 0;
      if (bits == 4) {
        const int8_t* lo = a.lo.data() + (row + b) * 16;
        const int8_t* hi = a.hi.data() + (row + b) * 16;
        for (int i = 0; i < 16; ++i) dot += int32_t(u[i] & 0x0f) * lo[i] + int32_t(u[i] >> 4) * hi[i];
      } else {
        const int8_t* p = a.q.data() + (row + b) * 32;
        for (int i = 0; i < 32; ++i) dot += int32_t(u[i]) * p[i];
      }
      total += half_to_float(d[b]) * a.d[row + b] * float(dot);
    }
    y[r * ys] = total + offsets(c, a.dsum.data() + row, a.nb);
  }
}

template <int64_t rows>
void row4(const uint8_t* w, const Activations& a, int64_t m0, float* y, int64_t ys) {
  row_scalar(w, 4, a, m0, rows, y, ys);
}

template <int64_t rows>
void row8(const uint8_t* w, const Activations& a, int64_t m0, float* y, int64_t ys) {
  row_scalar(w, 8, a, m0, rows, y, ys);
}

#endif

// f(std::integral_constant<int64_t, rows>{}) for 1 <= rows <= TILE: the row functions take their number of activation
// rows as a constant, so the compiler keeps each row's accumulator in a register (with a run-time count they went
// through the stack: measured here at one row, ~30% slower)
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

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t bits, int64_t in_features) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_cpu(), "x must be a 2-D fp32 CPU tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "weight must be a contiguous 2-D uint8 tensor of packed blocks");
  const int64_t K = in_features, M = x.size(0), N = weight.size(0), nb = K / QK, nbp = nb + (nb & 1);
  TORCH_CHECK(K % QK == 0 && x.size(1) == K, "in_features must be a multiple of 32 and match x");
  TORCH_CHECK(weight.size(1) == nbp * (bits == 4 ? 20 : 36), "weight rows must hold the packed blocks of K values");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const Activations a = quantize_activations(xc.data_ptr<float>(), M, K, bits == 4);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const int64_t row_bytes = weight.size(1);
  float* y = out.data_ptr<float>();
  // Weight rows in blocks small enough to stay in L2 while every tile of activation rows passes over them: the
  // tile's quantized activations then stay in L1, and each weight row comes from memory once per call.
  const int64_t block_rows = std::max<int64_t>(16, (128 << 10) / row_bytes);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += block_rows) {
      const int64_t n1 = std::min(end, n0 + block_rows);
      for (int64_t m = 0; m < M; m += TILE) {
        with_rows(std::min(TILE, M - m), [&](auto rows) {
          for (int64_t n = n0; n < n1; ++n) {
#if defined(__AVX2__)
            if (m == 0 && n + PREFETCH_ROWS < end) {  // first pass: rows come from L3 or memory
              const char* next = reinterpret_cast<const char*>(w + (n + PREFETCH_ROWS) * row_bytes);
              for (int64_t line = 0; line < row_bytes; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
            }
#endif
            if (bits == 4) {
              row4<decltype(rows)::value>(w + n * row_bytes, a, m, y + m * N + n, N);
            } else {
              row8<decltype(rows)::value>(w + n * row_bytes, a, m, y + m * N + n, N);
            }
          }
        });
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
  m.def("quant_linear(Tensor x, Tensor weight, int bits, int in_features) -> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, TORCH_FN(quant_linear));
}
