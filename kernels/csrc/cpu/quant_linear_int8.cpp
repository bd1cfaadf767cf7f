// Linear layers over GGUF-quantized weights with int8 activations (llama.cpp's CPU numerics).
//
// Each input row is quantized per block of 32 like llama.cpp's Q8_1: dx = max|x| / 127,
// xq = round(x / dx). A block's contribution to an output is then an integer dot
// product scaled once:  d * dx * sum(q * xq) + m * dx * sum(xq)  (Q4_0: m = -8d, Q8_0: m = 0),
// so the weights are never expanded to floats: 32 multiply-adds are one or two integer
// instructions (VNNI's vpdpbusd, or AVX2's maddubs + madd). The weights are the same
// packed rows quant_linear.cpp reads; only the activations are approximated (~0.4% per
// element), which is what llama.cpp computes for this model.
//
// Per (weight row, input row) the dot products of 8 blocks are reduced to one vector of 8
// block sums, converted and scaled together; the same code runs for any number of input
// rows, so a row's result does not depend on the rows batched beside it.
#include <algorithm>
#include <vector>

#include "common.h"

namespace {

constexpr int kBlocks = 8;  // blocks per reduction step (one ymm of block sums)
constexpr int kRows = 4;    // input rows sharing one expansion of a weight block
constexpr int64_t kAhead = 8;

struct QuantizedRows {
  std::vector<int8_t> q;   // [n][nbp * 32]
  std::vector<float> dx;   // [n][nbp]
  std::vector<float> dxs;  // [n][nbp]: dx * sum(xq) of the block
  int64_t nbp = 0;         // blocks, padded to a multiple of kBlocks (zeros)
};

void quantize_row(const float* x, int64_t nb, int8_t* q, float* dx, float* dxs) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
      q[b * 32 + i] = static_cast<int8_t>(v);
      sum += v;
    }
    dx[b] = d;
    dxs[b] = d * static_cast<float>(sum);
  }
}

void quantize_rows(const float* x, int64_t n, int64_t k, QuantizedRows& out) {
  const int64_t nb = k / 32;
  out.nbp = (nb + kBlocks - 1) / kBlocks * kBlocks;
  out.q.assign(n * out.nbp * 32, 0);
  out.dx.assign(n * out.nbp, 0.0f);
  out.dxs.assign(n * out.nbp, 0.0f);
#pragma omp parallel for schedule(static) if (n >= 8)
  for (int64_t j = 0; j < n; ++j)
    quantize_row(x + j * k, nb, out.q.data() + j * out.nbp * 32, out.dx.data() + j * out.nbp,
                 out.dxs.data() + j * out.nbp);
}

// u8 x s8 -> 8 int32 lanes, each the sum of 4 products.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  // |u| <= 15 (nibbles) or 128 (|int8|), |s| <= 127: pair sums stay inside int16.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// 8 vectors of 8 int32 -> one vector of their 8 sums, in a fixed order.
inline __m256i reduce8(const __m256i (&p)[kBlocks]) {
  const __m256i t0 = _mm256_hadd_epi32(p[0], p[1]), t1 = _mm256_hadd_epi32(p[2], p[3]);
  const __m256i t2 = _mm256_hadd_epi32(p[4], p[5]), t3 = _mm256_hadd_epi32(p[6], p[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                          _mm256_permute2x128_si256(u0, u1, 0x31));
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline __m256i nibbles32(const uint8_t* p) {
  // [low nibbles | high nibbles] = weights 0-15 then 16-31 of the block.
  const __m256i both =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                          _mm256_set1_epi8(15));
}

struct Q4 {  // Q4_0 and Q4_1: 16 bytes of nibbles per block, unsigned codes
  static constexpr int64_t kCodeBytes = 16;
  static constexpr bool kHasMin = true;
  static inline __m256i codes(const uint8_t* p, int64_t b) { return nibbles32(p + b * 16); }
  static inline __m256i dot(__m256i q, __m256i xq) { return dot_u8s8(q, xq); }
};

struct Q8 {  // Q8_0: 32 signed codes per block
  static constexpr int64_t kCodeBytes = 32;
  static constexpr bool kHasMin = false;
  static inline __m256i codes(const uint8_t* p, int64_t b) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + b * 32));
  }
  static inline __m256i dot(__m256i q, __m256i xq) {
    // s8 x s8 as |q| x (xq * sign(q)).
    return dot_u8s8(_mm256_abs_epi8(q), _mm256_sign_epi8(xq, q));
  }
};

// 8 blocks of one weight row against NR input rows (blocks b0..b0+7 of xr): codes at
// `codes`, fp16 scales d (and mins m, Q4_1) at `dh` / `mh`, 8 of each.
template <class C, int NR>
inline void chunk(const uint8_t* codes, const uint8_t* dh, const uint8_t* mh, bool q4_0,
                  const QuantizedRows& xr, int64_t j0, int64_t b0, __m256 (&acc)[NR],
                  __m256 (&acc_m)[NR]) {
  __m256i q[kBlocks];
  for (int i = 0; i < kBlocks; ++i) q[i] = C::codes(codes, i);
  const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh)));
  __m256 mv = _mm256_setzero_ps();
  if (mh) mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mh)));
  if (q4_0) mv = _mm256_mul_ps(dv, _mm256_set1_ps(-8.0f));
  for (int j = 0; j < NR; ++j) {
    const int8_t* xq = xr.q.data() + (j0 + j) * xr.nbp * 32 + b0 * 32;
    __m256i p[kBlocks];
    for (int i = 0; i < kBlocks; ++i)
      p[i] = C::dot(q[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * 32)));
    const int64_t at = (j0 + j) * xr.nbp + b0;
    const __m256 sums = _mm256_cvtepi32_ps(reduce8(p));
    acc[j] = _mm256_fmadd_ps(sums, _mm256_mul_ps(dv, _mm256_loadu_ps(xr.dx.data() + at)), acc[j]);
    if (C::kHasMin) acc_m[j] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xr.dxs.data() + at), acc_m[j]);
  }
}

// One weight row (packed as quant_linear.cpp describes) against NR input rows.
template <class C, int NR>
void row_dot(const uint8_t* row, int64_t nb, int64_t format, const QuantizedRows& xr,
             int64_t j0, float* out, int64_t ldo, int64_t r, float bias) {
  const uint8_t* dh = row + nb * C::kCodeBytes;
  const uint8_t* mh = format == 1 ? dh + 2 * nb : nullptr;
  const bool q4_0 = format == 0;
  __m256 acc[NR], acc_m[NR];
  for (int j = 0; j < NR; ++j) acc[j] = acc_m[j] = _mm256_setzero_ps();
  int64_t b0 = 0;
  for (; b0 + kBlocks <= nb; b0 += kBlocks) {
    _mm_prefetch(reinterpret_cast<const char*>(row) + (b0 + kAhead) * C::kCodeBytes, _MM_HINT_T0);
    chunk<C, NR>(row + b0 * C::kCodeBytes, dh + 2 * b0, mh ? mh + 2 * b0 : nullptr, q4_0, xr, j0,
                 b0, acc, acc_m);
  }
  float tail[NR] = {};
  for (; b0 < nb; ++b0) {  // the last nb % 8 blocks, one at a time
    const __m256i q = C::codes(row, b0);
    const float d = half_to_float(dh + 2 * b0);
    const float mn = mh ? half_to_float(mh + 2 * b0) : (q4_0 ? -8.0f * d : 0.0f);
    for (int j = 0; j < NR; ++j) {
      const int8_t* xq = xr.q.data() + (j0 + j) * xr.nbp * 32 + b0 * 32;
      const __m256i p = C::dot(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
      const int64_t at = (j0 + j) * xr.nbp + b0;
      tail[j] += static_cast<float>(hsum_i32(p)) * (d * xr.dx[at]) + mn * xr.dxs[at];
    }
  }
  for (int j = 0; j < NR; ++j) {
    const __m256 v = _mm256_add_ps(acc[j], acc_m[j]);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    out[(j0 + j) * ldo + r] = _mm_cvtss_f32(s) + tail[j] + bias;
  }
}

template <class C>
void linear(int64_t format, const QuantizedRows& xr, int64_t n, int64_t k, const uint8_t* w,
            int64_t m, float* out, const float* bias, int64_t row_bytes) {
  const int64_t nb = k / 32;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    const uint8_t* row = w + r * row_bytes;
    const float add = bias ? bias[r] : 0.0f;
    int64_t j = 0;
    for (; j + kRows <= n; j += kRows) row_dot<C, kRows>(row, nb, format, xr, j, out, m, r, add);
    for (; j < n; ++j) row_dot<C, 1>(row, nb, format, xr, j, out, m, r, add);
  }
}

}  // namespace

// out[n, m] = q8(x[n, k]) @ W[m, k]^T (+ bias[m]); W in quant_linear.cpp's packed rows
// of `format` (0 Q4_0, 1 Q4_1, 2 Q8_0); k % 32 == 0.
HR_EXPORT void hr_quant_linear_int8(int64_t format, const float* x, int64_t n, int64_t k,
                                    const uint8_t* w, int64_t m, float* out, const float* bias) {
  QuantizedRows xr;
  quantize_rows(x, n, k, xr);
  const int64_t nb = k / 32;
  if (format == 2) return linear<Q8>(format, xr, n, k, w, m, out, bias, nb * 34);
  linear<Q4>(format, xr, n, k, w, m, out, bias, nb * (format == 0 ? 18 : 20));
}
