// Linear layers over GGUF-quantized weights with int8 activations (llama.cpp's CPU numerics).
//
// Each input row is quantized per block of 32 like llama.cpp's Q8_1: dx = max|x| / 127,
// xq = round(x / dx). A block's contribution to an output is then an integer dot
// product scaled once:  d * dx * sum(q * xq) + m * dx * sum(xq)  (Q4_0: m = -8d, Q8_0: m = 0),
// so the weights are never expanded to floats. Only the activations are approximated
// (~0.4% per element), which is what llama.cpp computes for this model.
//
// Weight rows are in the "grouped" layout (kernels/quant.py QuantizedWeight.grouped): the
// blocks of a row in groups of 8 (the last group holds the nb % 8 left, T blocks), the
// codes of a group interleaved 4 at a time, so that lane i (4 bytes) of the t-th vector
// holds codes 4t..4t+3 of block i. Then 8 integer dot-product instructions (VNNI
// vpdpbusd, or AVX2 maddubs) leave block i's whole dot product in int32 lane i, with no
// horizontal reduction, and one multiply-add scales the group's blocks at once.
//   Q4_0/Q4_1 codes: per group, 4 vectors of 4T bytes; byte 4i + k of vector s
//     = q[i][8s + k] | q[i][8s + 4 + k] << 4 (its low nibbles give vector 2s, high 2s + 1)
//   Q8_0 codes: per group, 8 vectors of 4T bytes; byte 4i + k of vector t = q[i][4t + k]
// A partial group is loaded with a lane mask, so nothing is padded in memory. Scales follow
// the codes as in quant_linear.cpp: nb fp16 d, then (Q4_1) nb fp16 m. The activations are
// quantized into the same layout.
//
// One order of sums for any number of input rows: a row's result does not depend on the
// rows batched beside it.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace {

constexpr int kGroup = 8;  // blocks per interleaved group (one int32 lane each)
constexpr int kRows = 4;   // input rows sharing one expansion of a weight group
constexpr int64_t kAhead = 2048;  // bytes ahead to prefetch a row's codes

// The activations, quantized: per row, every group of 8 blocks interleaved like the weights
// but always 8 lanes wide (a partial last group zero-padded), so they load without masks.
struct QuantizedRows {
  std::vector<int8_t> q;   // [n][nbp * 32]
  std::vector<float> dx;   // [n][nbp]
  std::vector<float> dxs;  // [n][nbp]: dx * sum(xq) of the block
  int64_t nb = 0, nbp = 0;  // blocks, and blocks padded to whole groups
};

// Quantizes one block of 32; q[k * stride] receives code k (stride 1: plain order).
inline void quantize_block(const float* x, int8_t* q, float* dx, float* dxs) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int sum = 0;
  for (int i = 0; i < 32; ++i) {
    const int v = static_cast<int>(std::nearbyint(x[i] * inv));
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
  *dx = amax / 127.0f;
  *dxs = *dx * static_cast<float>(sum);
}

void quantize_row(const float* x, int64_t nb, int8_t* q, float* dx, float* dxs) {
  int8_t codes[32];
  for (int64_t b = 0; b < nb; ++b) {
    quantize_block(x + b * 32, codes, dx + b, dxs + b);
    int8_t* group = q + b / kGroup * kGroup * 32;
    for (int t = 0; t < 8; ++t) std::memcpy(group + 32 * t + 4 * (b % kGroup), codes + 4 * t, 4);
  }
}

void quantize_rows(const float* x, int64_t n, int64_t k, QuantizedRows& out) {
  out.nb = k / 32;
  out.nbp = (out.nb + kGroup - 1) / kGroup * kGroup;
  out.q.assign(n * out.nbp * 32, 0);
  out.dx.assign(n * out.nbp, 0.0f);
  out.dxs.assign(n * out.nbp, 0.0f);
#pragma omp parallel for schedule(static) if (n >= 8)
  for (int64_t j = 0; j < n; ++j)
    quantize_row(x + j * k, out.nb, out.q.data() + j * out.nbp * 32,
                 out.dx.data() + j * out.nbp, out.dxs.data() + j * out.nbp);
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// The first `lanes` 4-byte lanes at p (the rest zero, and not read): a partial group.
inline __m256i load_lanes(const void* p, int64_t lanes) {
  if (lanes == kGroup) return load32(p);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(lanes)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), mask);
}

// n fp16 scales at p as 8 floats (the rest zero).
inline __m256 load_halves(const uint8_t* p, int64_t n) {
  if (n == kGroup) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  uint16_t h[kGroup] = {};
  std::memcpy(h, p, 2 * n);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

// acc + (u8 x s8: 8 int32 lanes, each the sum of 4 products).
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  // |u| <= 128, |s| <= 127: maddubs's pair sums stay inside int16.
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

struct Q4 {  // Q4_0 and Q4_1: unsigned 4-bit codes
  static constexpr int64_t kBlockBytes = 16;  // code bytes per block
  static constexpr bool kHasMin = true;
  // The 8 code vectors of a group of `lanes` blocks (unsigned, the dot's first operand).
  static inline void group(const uint8_t* p, int64_t lanes, __m256i (&v)[8]) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int s = 0; s < 4; ++s) {
      const __m256i b = load_lanes(p + 4 * lanes * s, lanes);
      v[2 * s] = _mm256_and_si256(b, low);
      v[2 * s + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    }
  }
  static inline __m256i sign(__m256i x, __m256i) { return x; }
};

struct Q8 {  // Q8_0: signed codes, multiplied as |q| x (xq * sign(q))
  static constexpr int64_t kBlockBytes = 32;
  static constexpr bool kHasMin = false;
  static inline void group(const uint8_t* p, int64_t lanes, __m256i (&v)[8]) {
    for (int t = 0; t < 8; ++t) v[t] = load_lanes(p + 4 * lanes * t, lanes);
  }
  static inline __m256i sign(__m256i x, __m256i q) { return _mm256_sign_epi8(x, q); }
};

template <class C>
inline __m256i unsigned_codes(__m256i q) {
  if constexpr (C::kHasMin) return q;
  return _mm256_abs_epi8(q);
}

// A row's scales for a group (and mins: Q4_1 stored, Q4_0 = -8d, Q8_0 none).
inline void group_scales(const uint8_t* dh, const uint8_t* mh, bool q4_0, int64_t b0,
                         int64_t lanes, __m256& dv, __m256& mv) {
  dv = load_halves(dh + 2 * b0, lanes);
  mv = mh ? load_halves(mh + 2 * b0, lanes) : _mm256_setzero_ps();
  if (q4_0) mv = _mm256_mul_ps(dv, _mm256_set1_ps(-8.0f));
}

// One weight row against NR input rows (j0..j0+NR-1 of xr).
template <class C, int NR>
void row_dot(const uint8_t* row, int64_t nb, int64_t format, const QuantizedRows& xr,
             int64_t j0, float* out, int64_t ldo, int64_t r, float bias) {
  const uint8_t* dh = row + nb * C::kBlockBytes;
  const uint8_t* mh = format == 1 ? dh + 2 * nb : nullptr;
  const bool q4_0 = format == 0;
  __m256 acc[NR], acc_m[NR];
  for (int j = 0; j < NR; ++j) acc[j] = acc_m[j] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += kGroup) {
    const int64_t lanes = std::min<int64_t>(kGroup, nb - b0);
    const uint8_t* codes = row + b0 * C::kBlockBytes;
    _mm_prefetch(reinterpret_cast<const char*>(codes) + kAhead, _MM_HINT_T0);
    __m256i v[8], u[8];
    C::group(codes, lanes, v);
    for (int t = 0; t < 8; ++t) u[t] = unsigned_codes<C>(v[t]);
    __m256 dv, mv;
    group_scales(dh, mh, q4_0, b0, lanes, dv, mv);
    for (int j = 0; j < NR; ++j) {
      const int8_t* x = xr.q.data() + (j0 + j) * xr.nbp * 32 + b0 * 32;
      __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
      for (int t = 0; t < 8; t += 2) {  // two chains: half the dependency latency
        a = dot_acc(a, u[t], C::sign(load32(x + 32 * t), v[t]));
        b = dot_acc(b, u[t + 1], C::sign(load32(x + 32 * (t + 1)), v[t + 1]));
      }
      const int64_t at = (j0 + j) * xr.nbp + b0;
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_add_epi32(a, b));
      acc[j] = _mm256_fmadd_ps(sums, _mm256_mul_ps(dv, _mm256_loadu_ps(xr.dx.data() + at)), acc[j]);
      if (C::kHasMin) acc_m[j] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xr.dxs.data() + at), acc_m[j]);
    }
  }
  for (int j = 0; j < NR; ++j)
    out[(j0 + j) * ldo + r] = hsum_ps(_mm256_add_ps(acc[j], acc_m[j])) + bias;
}

// Input rows a thread keeps in L1 while it runs its weight rows over them (~30 KB).
constexpr int64_t kXTile = 32;

template <class C>
void linear(int64_t format, const QuantizedRows& xr, int64_t n, int64_t k, const uint8_t* w,
            int64_t m, float* out, const float* bias, int64_t row_bytes) {
  const int64_t nb = k / 32;
#pragma omp parallel if (n * k * m >= kParallelWork)
  {
    const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t r0 = m * id / threads, r1 = m * (id + 1) / threads;
    for (int64_t x0 = 0; x0 < n; x0 += kXTile) {
      const int64_t x1 = std::min(n, x0 + kXTile);
      for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = w + r * row_bytes;
        const float add = bias ? bias[r] : 0.0f;
        int64_t j = x0;
        for (; j + kRows <= x1; j += kRows)
          row_dot<C, kRows>(row, nb, format, xr, j, out, m, r, add);
        for (; j < x1; ++j) row_dot<C, 1>(row, nb, format, xr, j, out, m, r, add);
      }
    }
  }
}

// Code j of block b of a grouped row (for dequantizing: the embedding lookup).
template <class C>
inline int code_at(const uint8_t* row, int64_t nb, int64_t b, int j) {
  const int64_t b0 = b / kGroup * kGroup, lanes = std::min<int64_t>(kGroup, nb - b0);
  const uint8_t* p = row + b0 * C::kBlockBytes;
  const int64_t i = b - b0, t = j / 4, k = j % 4;
  if (!C::kHasMin) return static_cast<int8_t>(p[4 * lanes * t + 4 * i + k]);
  const uint8_t byte = p[4 * lanes * (t / 2) + 4 * i + k];  // vector s = t / 2, nibble t % 2
  return t % 2 ? byte >> 4 : byte & 15;
}

template <class C>
void dequantize_grouped(int64_t format, const uint8_t* w, int64_t k, const int64_t* rows,
                        int64_t count, float* out) {
  const int64_t nb = k / 32;
  const int64_t row_bytes = nb * (format == 2 ? 34 : format == 1 ? 20 : 18);
#pragma omp parallel for schedule(static) if (count * k > (1 << 16))
  for (int64_t i = 0; i < count; ++i) {
    const uint8_t* row = w + (rows ? rows[i] : i) * row_bytes;
    const uint8_t* dh = row + nb * C::kBlockBytes;
    for (int64_t b = 0; b < nb; ++b) {
      const float d = half_to_float(dh + 2 * b);
      const float mn = format == 1 ? half_to_float(dh + 2 * nb + 2 * b) : 0.0f;
      for (int j = 0; j < 32; ++j) {
        const int q = code_at<C>(row, nb, b, j);
        // As gguf computes them: d * q (+ m), Q4_0 as d * (q - 8); all exact in fp32.
        out[i * k + b * 32 + j] = format == 0 ? d * static_cast<float>(q - 8)
                                              : d * static_cast<float>(q) + mn;
      }
    }
  }
}

}  // namespace

// out[n, m] = q8(x[n, k]) @ W[m, k]^T (+ bias[m]); W in the grouped layout of `format`
// (0 Q4_0, 1 Q4_1, 2 Q8_0); k % 32 == 0.
HR_EXPORT void hr_quant_linear_int8(int64_t format, const float* x, int64_t n, int64_t k,
                                    const uint8_t* w, int64_t m, float* out, const float* bias) {
  QuantizedRows xr;
  quantize_rows(x, n, k, xr);
  const int64_t nb = k / 32;
  if (format == 2) return linear<Q8>(format, xr, n, k, w, m, out, bias, nb * 34);
  linear<Q4>(format, xr, n, k, w, m, out, bias, nb * (format == 0 ? 18 : 20));
}

// out[i, :] = W[rows[i], :] in fp32 for W in the grouped layout (rows == nullptr: all).
HR_EXPORT void hr_dequantize_grouped(int64_t format, const uint8_t* w, int64_t k,
                                     const int64_t* rows, int64_t count, float* out) {
  if (format == 2) return dequantize_grouped<Q8>(format, w, k, rows, count, out);
  dequantize_grouped<Q4>(format, w, k, rows, count, out);
}
