// Linear layers over GGUF-quantized weights, computed in fp32: out[n, m] = x[n, :] . W[m, :].
//
// The weights keep the file's quantization, repacked per row at load time
// (kernels/cpu_weights.py) so that the codes of consecutive blocks are contiguous:
//   Q4_0 row: nb * 16 bytes of nibbles, then nb fp16 scales d (weight = d[b] * (q - 8))
//   Q4_1 row: nb * 16 bytes of nibbles, then nb fp16 scales d, then nb fp16 mins m
//             (weight = d[b] * q + m[b])
//   Q8_0 row: nb * 32 int8 codes, then nb fp16 scales d (weight = d[b] * q)
// (in a block of 32 weights, low nibbles are weights 0-15 and high nibbles 16-31)
// with nb = k / 32. Q5_0, Q5_1, the K-quants (Q4_K, Q5_K, Q6_K) and IQ4_NL / IQ4_XS keep
// the file's blocks as they are (their layouts are spelled out above their expansions
// below); each format gives every block of 32 weights a d and an m, so they all run
// through the same kernels. d * q is exact in fp32 (an 11-bit mantissa times a 4- or 8-bit
// integer) and so is Q4_0's d*q - 8d, so each weight is bit-identical to the fp32
// value gguf.quants.dequantize gives.
//
// Every output is one dot product summed in one fixed order (16 lanes over k, in
// steps of 16, then hsum), whatever the number of input rows and whichever of the two
// kernels runs, so a row's result does not depend on the rows batched beside it.
//   - few input rows (decode): blocks are expanded in registers and used for each row;
//     the bytes read are the quantized ones, ~5x fewer than fp32 weights;
//   - many rows (prefill, large batches): a group of weight rows is expanded once into a
//     small buffer and a register-blocked kernel runs every input row against it.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace {

constexpr int kGroup = 4;        // weight rows per group (both kernels)
constexpr int kDirectMax = 5;    // input rows up to which the register kernel runs
#ifdef __AVX512F__
constexpr int kDirectGroup = 4;  // weight rows the register kernel expands at once
constexpr int kTileRows = 6;     // input rows per tile of the buffered kernel
#else
// AVX2's 16 registers: the register kernel expands 2 rows at a time, not 4, and the
// buffered kernel keeps G x 3 sums of half a vector beside G weights and one input row.
// Against 4 and 6 (which spill), alternated in one process over 30 layers of SmolLM2's
// projections: 1 row 0.89-0.98x the time, 48 rows 0.83x, 256 rows 0.83x.
constexpr int kDirectGroup = 2;
constexpr int kTileRows = 3;
#endif
constexpr int64_t kXTile = 96;   // input rows a thread keeps hot in L2 (buffered kernel)
// Bytes ahead to prefetch: decode streams every weight from DRAM once per step, and the
// hardware prefetcher alone left ~40% of the bandwidth unused (2 threads). The G rows of a
// group are contiguous, so the prefetch sweeps their bytes evenly, one block's share per
// block, kAheadBytes ahead. That replaced one prefetch per row and block, 4 KB ahead along
// each row (which asked for most lines twice): Q8_0 rows, memory-bound in this kernel,
// 1.7x faster (a 3072 x 576 projection, 1 row, 2 threads, cold: 106 -> 63 us); with the
// vectorized K-quant scales below, an exact decode step of SmolLM2 Q4_K_M 0.90x the time
// (7.88 -> 7.06 ms), alternated in one process. Into L1 (T0) beat L2 (T1) by 2% there.
constexpr int64_t kAheadBytes = 12288;

#ifdef __AVX512F__
// With AVX-512 a block's codes become weights through a table: the block's 16 (or 32)
// possible weights are computed once (d * q + m for every q, the same fp32 operations as
// expanding each code), then one permute per 16 codes picks them. That replaces a
// conversion and a multiply-add per 16 weights; the weights, so the sums, are the same
// bits as the conversion path the AVX2 build keeps.
static inline __m512i iota16() {
  return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

// The table of q = 0..15: lane q holds q * d + m (fused: q * d is exact, one rounding).
static inline __m512 table16(float d, float m, float q0 = 0.0f) {
  const __m512 q = _mm512_add_ps(_mm512_cvtepi32_ps(iota16()), _mm512_set1_ps(q0));
  return _mm512_fmadd_ps(q, _mm512_set1_ps(d), _mm512_set1_ps(m));
}

// 16 bytes zero-extended to 16 lanes (byte i in lane i).
static inline __m512i widen_bytes(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Lanes whose bit 4 is taken from `high`, bits 0-3 from `low` (a permute index of 5 bits;
// the permutes ignore the bits above).
static inline __m512i with_bit4(__m512i low, __m512i high) {
  return _mm512_ternarylogic_epi32(low, high, _mm512_set1_epi32(15), 0xE4);
}
#endif

// Q4_0 and Q4_1 expand alike, d * q + m; Q4_0's m is -8d (gguf's d * (q - 8), exactly).
struct Nibbles {
  static constexpr int64_t kCodeBytes = 16, kBlocks = 1;
  static inline void expand(const uint8_t* row, int64_t b, float d, float m, v16f& lo,
                            v16f& hi) {
#ifdef __AVX512F__
    const __m512 table = table16(d, m);
    const __m512i q = widen_bytes(row + b * 16);
    lo = (v16f)_mm512_permutexvar_ps(q, table);
    hi = (v16f)_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
#else
    nibbles_to_float(row + b * 16, lo, hi);
    lo = lo * d + m;
    hi = hi * d + m;
#endif
  }
};

struct Q4_0 : Nibbles {
  static constexpr int64_t kBytes = kFormats[kQ4_0].block_bytes;
  static void scales(const uint8_t* row, int64_t nb, float* d, float* m) {
    halves_to_float(row + nb * 16, nb, d, m, kFormats[kQ4_0].min_per_d);
  }
};

struct Q4_1 : Nibbles {
  static constexpr int64_t kBytes = kFormats[kQ4_1].block_bytes;
  static void scales(const uint8_t* row, int64_t nb, float* d, float* m) {
    halves_to_float(row + nb * 16, nb, d);
    halves_to_float(row + nb * 18, nb, m);
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = kFormats[kQ8_0].block_bytes, kCodeBytes = 32, kBlocks = 1;
  static void scales(const uint8_t* row, int64_t nb, float* d, float*) {
    halves_to_float(row + nb * 32, nb, d);
  }
  static inline void expand(const uint8_t* row, int64_t b, float d, float, v16f& lo,
                            v16f& hi) {
    lo = int8_to_float(row + b * 32) * d;
    hi = int8_to_float(row + b * 32 + 16) * d;
  }
};

// Q5_0 and Q5_1: 32-value blocks kept as in the file (d, [m,] 4 bytes of high bits,
// 16 bytes of nibbles); code i = nibble | bit i of the high-bit word << 4. Q5_0's weight
// is d * (q - 16): expanded as d * q - 16d, exact like Q4_0's (both terms and their sum
// fit fp32's mantissa); Q5_1's is d * q + m, as gguf computes it.
// 16 bytes: lane i is 16 when bit i of `bits` (16 bits) is set, else 0.
static inline __m128i high_bits16(uint32_t bits) {
  const __m128i spread = _mm_shuffle_epi8(
      _mm_cvtsi32_si128(static_cast<int>(bits)),
      _mm_set_epi8(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
  const __m128i select = _mm_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(spread, select), select);
  return _mm_and_si128(set, _mm_set1_epi8(16));
}

template <int64_t kHeader>  // bytes before the high bits: 2 (d) or 4 (d, m)
struct Q5 {
  static constexpr Format kFormat = kHeader == 4 ? kQ5_1 : kQ5_0;
  static constexpr int64_t kBytes = kFormats[kFormat].block_bytes, kBlocks = 1;
  static_assert(kBytes == kHeader + 20, "d (and m), 4 bytes of high bits, 16 of nibbles");
  static constexpr float kMinPerD = kFormats[kFormat].min_per_d;  // Q5_0: m = -16d
  static void scales(const uint8_t* row, int64_t nb, float* d, float* m) {
    int64_t b = 0;
#ifdef __AVX512F__
    // 16 blocks' d (and m) in one gather (2% of a decode step against the scalar loop).
    const __m512i offsets = _mm512_mullo_epi32(iota16(), _mm512_set1_epi32(kBytes));
    for (; b + 16 <= nb; b += 16) {
      const __m512i words = _mm512_i32gather_epi32(offsets, row + b * kBytes, 1);
      const __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
      _mm512_storeu_ps(d + b, dv);
      _mm512_storeu_ps(m + b, kHeader == 4 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(
                                                 _mm512_srli_epi32(words, 16)))
                                           : _mm512_mul_ps(dv, _mm512_set1_ps(kMinPerD)));
    }
#endif
    for (; b < nb; ++b) {
      d[b] = half_to_float(row + b * kBytes);
      m[b] = kHeader == 4 ? half_to_float(row + b * kBytes + 2) : kMinPerD * d[b];
    }
  }
  static inline void expand(const uint8_t* row, int64_t b, float d, float m, v16f& lo,
                            v16f& hi) {
    const uint8_t* block = row + b * kBytes;
    uint32_t qh;
    std::memcpy(&qh, block + kHeader, 4);
#ifdef __AVX512F__
    // The codes' high bits as lane masks (bit i of qh for lane i, 16 + i for the high
    // half), then the table of q = 0..15; a set bit adds 16: Q5_0's d (q - 16) + 16 d is
    // exact, so its weights come from one table and an add; Q5_1's d q + m is rounded,
    // so it looks q + 16 up in a second table.
    const __mmask16 k_lo = _cvtu32_mask16(qh & 0xffff), k_hi = _cvtu32_mask16(qh >> 16);
    const __m512 t0 = table16(d, m);
    const __m512i q_lo = widen_bytes(block + kHeader + 4), q_hi = _mm512_srli_epi32(q_lo, 4);
    if (kHeader == 2) {
      const __m512 minus16d = _mm512_set1_ps(m);  // m = -16d: w - m adds 16d
      const __m512 w_lo = _mm512_permutexvar_ps(q_lo, t0), w_hi = _mm512_permutexvar_ps(q_hi, t0);
      lo = (v16f)_mm512_mask_sub_ps(w_lo, k_lo, w_lo, minus16d);
      hi = (v16f)_mm512_mask_sub_ps(w_hi, k_hi, w_hi, minus16d);
    } else {
      const __m512 t1 = table16(d, m, 16.0f);
      const __m512i sixteen = _mm512_set1_epi32(16);
      // (q_lo's bits 4-7 are the high nibble: replaced; q_hi's are zero)
      lo = (v16f)_mm512_permutex2var_ps(
          t0, with_bit4(q_lo, _mm512_maskz_mov_epi32(k_lo, sixteen)), t1);
      hi = (v16f)_mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(q_hi, k_hi, q_hi, sixteen), t1);
    }
#else
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kHeader + 4));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i q_lo = _mm_or_si128(_mm_and_si128(qs, mask), high_bits16(qh & 0xffff));
    const __m128i q_hi =
        _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qs, 4), mask), high_bits16(qh >> 16));
    lo = bytes_to_float(q_lo, false) * d + m;
    hi = bytes_to_float(q_hi, false) * d + m;
#endif
  }
};
using Q5_0 = Q5<2>;
using Q5_1 = Q5<4>;

// K-quants: super-blocks of 256 values (8 blocks of 32) kept as in the file (ggml-common.h).
// scales() gives each block of 32 its own d and m, computed as gguf does (exact products:
// an fp16 times a 6- or 8-bit integer), so expand() reads like the 32-value formats.
//   Q4_K (144 bytes): d, dmin, 12 bytes of packed 6-bit scales and mins, 128 bytes of
//     nibbles (block j: bytes 32 (j / 2).., low nibbles for even j, high for odd);
//     weight = (d sc_j) q - (dmin m_j).
//   Q5_K (176 bytes): as Q4_K with 32 bytes of high bits before the nibbles (value l of
//     block j: bit j of byte l).
//   Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d;
//     block j = 4h + s: nibbles of bytes 64h + 32 (s & 1).., shifted by 4 (s >> 1), high
//     bits of bytes 32h.. shifted by 2s; weight = (d sc) (q - 32), sc = scales[2j] for
//     values 0-15 and scales[2j + 1] for 16-31 (held in d and m: Q6_K has no min).

// All 8 scales and mins of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4 for j =
// 0..7) from its 12 bytes, four at a time in 32-bit words: bytes 0-3 hold scales 0-3 (low
// 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for the mins; bytes 8-11
// the low 4 bits of scales 4-7 (low nibbles) and of mins 4-7 (high nibbles).
static inline void unpack_scale_min_k4(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  uint32_t w[3];
  std::memcpy(w, q, 12);
  const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, top2 = 0x03030303u;
  const uint32_t s[2] = {w[0] & low6, (w[2] & low4) | (((w[0] >> 6) & top2) << 4)};
  const uint32_t n[2] = {w[1] & low6, ((w[2] >> 4) & low4) | (((w[1] >> 6) & top2) << 4)};
  std::memcpy(sc, s, 8);
  std::memcpy(mn, n, 8);
}

// 8 unsigned bytes as 8 floats.
static inline __m256 bytes8_to_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

static inline __m128i load128(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// 16 bytes shifted right by `shift` bits (per 16-bit lane), low `mask` bits kept per byte.
static inline __m128i bits_at(__m128i v, int shift, int mask) {
  return _mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(mask));
}

template <bool kHighBits>  // Q5_K when true, Q4_K otherwise
struct QK {
  static constexpr Format kFormat = kHighBits ? kQ5_K : kQ4_K;
  static constexpr int64_t kBytes = kFormats[kFormat].block_bytes;
  static constexpr int64_t kBlocks = kFormats[kFormat].block_values / 32;
  static constexpr int64_t kCodes = kHighBits ? 48 : 16;  // offset of the nibbles
  static void scales(const uint8_t* row, int64_t nb, float* d, float* m) {
    for (int64_t s = 0; s < nb / 8; ++s) {
      const uint8_t* sb = row + s * kBytes;
      const float dd = half_to_float(sb), dmin = half_to_float(sb + 2);
      uint8_t sc[8], mn[8];
      unpack_scale_min_k4(sb + 4, sc, mn);
      // The same products as the scalar loop (an fp16 times a 6-bit integer: exact).
      const __m256 vd = _mm256_mul_ps(_mm256_set1_ps(dd), bytes8_to_float(sc));
      const __m256 vm = _mm256_mul_ps(_mm256_set1_ps(dmin), bytes8_to_float(mn));
      _mm256_storeu_ps(d + 8 * s, vd);
      _mm256_storeu_ps(m + 8 * s, _mm256_xor_ps(vm, _mm256_set1_ps(-0.0f)));  // -(dmin mn)
    }
  }
  static inline void expand(const uint8_t* row, int64_t b, float d, float m, v16f& lo,
                            v16f& hi) {
    const uint8_t* sb = row + (b >> 3) * kBytes;
    const int j = static_cast<int>(b & 7);
    const uint8_t* qs = sb + kCodes + 32 * (j >> 1);
#ifdef __AVX512F__
    const __m128i shift = _mm_cvtsi32_si128(4 * (j & 1));
    const __m512i c_lo = _mm512_srl_epi32(widen_bytes(qs), shift);
    const __m512i c_hi = _mm512_srl_epi32(widen_bytes(qs + 16), shift);
    const __m512 t0 = table16(d, m);
    if (kHighBits) {  // bit j of each high-bit byte to bit 4
      const __m128i to4 = _mm_cvtsi32_si128(j);
      const __m512i h_lo = _mm512_srl_epi32(_mm512_slli_epi32(widen_bytes(sb + 16), 4), to4);
      const __m512i h_hi = _mm512_srl_epi32(_mm512_slli_epi32(widen_bytes(sb + 32), 4), to4);
      const __m512 t1 = table16(d, m, 16.0f);
      lo = (v16f)_mm512_permutex2var_ps(t0, with_bit4(c_lo, h_lo), t1);
      hi = (v16f)_mm512_permutex2var_ps(t0, with_bit4(c_hi, h_hi), t1);
    } else {
      lo = (v16f)_mm512_permutexvar_ps(c_lo, t0);
      hi = (v16f)_mm512_permutexvar_ps(c_hi, t0);
    }
#else
    __m128i q_lo = bits_at(load128(qs), 4 * (j & 1), 15);
    __m128i q_hi = bits_at(load128(qs + 16), 4 * (j & 1), 15);
    if (kHighBits) {
      q_lo = _mm_or_si128(q_lo, _mm_slli_epi16(bits_at(load128(sb + 16), j, 1), 4));
      q_hi = _mm_or_si128(q_hi, _mm_slli_epi16(bits_at(load128(sb + 32), j, 1), 4));
    }
    lo = bytes_to_float(q_lo, false) * d + m;
    hi = bytes_to_float(q_hi, false) * d + m;
#endif
  }
};
using Q4_K = QK<false>;
using Q5_K = QK<true>;

struct Q6_K {
  static constexpr int64_t kBytes = kFormats[kQ6_K].block_bytes;
  static constexpr int64_t kBlocks = kFormats[kQ6_K].block_values / 32;
  static void scales(const uint8_t* row, int64_t nb, float* d, float* m) {
    for (int64_t s = 0; s < nb / 8; ++s) {
      const uint8_t* sb = row + s * kBytes;
      // dd times each of the 16 int8 scales (exact), the even ones to d, the odd to m.
      const __m256 dd = _mm256_set1_ps(half_to_float(sb + 208));
      const __m128i sc = load128(sb + 192);
      const __m128i even = _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3,
                                                              5, 7, 9, 11, 13, 15));
      const __m256 d_even = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(even));
      const __m256 d_odd = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(even, 8)));
      _mm256_storeu_ps(d + 8 * s, _mm256_mul_ps(dd, d_even));
      _mm256_storeu_ps(m + 8 * s, _mm256_mul_ps(dd, d_odd));
    }
  }
  static inline void expand(const uint8_t* row, int64_t b, float d, float m, v16f& lo,
                            v16f& hi) {
    const uint8_t* sb = row + (b >> 3) * kBytes;
    const int j = static_cast<int>(b & 7), h = j >> 2, s = j & 3;
    const uint8_t* ql = sb + 64 * h + 32 * (s & 1);
    const uint8_t* qh = sb + 128 + 32 * h;
    const __m128i bias = _mm_set1_epi8(32);
    const __m128i q_lo = _mm_sub_epi8(
        _mm_or_si128(bits_at(load128(ql), 4 * (s >> 1), 15),
                     _mm_slli_epi16(bits_at(load128(qh), 2 * s, 3), 4)),
        bias);
    const __m128i q_hi = _mm_sub_epi8(
        _mm_or_si128(bits_at(load128(ql + 16), 4 * (s >> 1), 15),
                     _mm_slli_epi16(bits_at(load128(qh + 16), 2 * s, 3), 4)),
        bias);
    lo = bytes_to_float(q_lo, true) * d;
    hi = bytes_to_float(q_hi, true) * m;
  }
};

// IQ4_NL and IQ4_XS: 4-bit indices into llama.cpp's fixed non-linear table of 16 int8
// values (kvalues_iq4nl), nibble order as Q4_0's (low nibbles weights 0-15, high 16-31).
//   IQ4_NL (18 bytes per 32): d, 16 bytes of indices; weight = d * table[q].
//   IQ4_XS (136 bytes per 256): d, scales_h (16 bits), scales_l (4 bytes), 128 bytes of
//     indices (block j: bytes 16 j..); block j's 6-bit scale ls = nibble j of scales_l |
//     bits 2j, 2j + 1 of scales_h << 4, weight = (d * (ls - 32)) * table[q].
// Every product is exact in fp32 (fp16 x 6-bit x 7-bit integers < 2^24), so the weights
// are gguf's bit for bit.
static inline __m128i iq4_values(__m128i idx) {
  return _mm_shuffle_epi8(load128(reinterpret_cast<const uint8_t*>(kIQ4Values)), idx);
}

static inline void iq4_expand(const uint8_t* qs, float d, v16f& lo, v16f& hi) {
#ifdef __AVX512F__
  const __m512 values = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(load128(reinterpret_cast<const uint8_t*>(kIQ4Values))));
  const __m512 table = _mm512_mul_ps(values, _mm512_set1_ps(d));
  const __m512i q = widen_bytes(qs);
  lo = (v16f)_mm512_permutexvar_ps(q, table);
  hi = (v16f)_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
#else
  const __m128i q = load128(qs), mask = _mm_set1_epi8(15);
  lo = bytes_to_float(iq4_values(_mm_and_si128(q, mask)), true) * d;
  hi = bytes_to_float(iq4_values(_mm_and_si128(_mm_srli_epi16(q, 4), mask)), true) * d;
#endif
}

struct IQ4_NL {
  static constexpr int64_t kBytes = kFormats[kIQ4_NL].block_bytes, kBlocks = 1;
  static void scales(const uint8_t* row, int64_t nb, float* d, float* m) {
    for (int64_t b = 0; b < nb; ++b) {
      d[b] = half_to_float(row + b * kBytes);
      m[b] = 0.0f;
    }
  }
  static inline void expand(const uint8_t* row, int64_t b, float d, float, v16f& lo,
                            v16f& hi) {
    iq4_expand(row + b * kBytes + 2, d, lo, hi);
  }
};

struct IQ4_XS {
  static constexpr int64_t kBytes = kFormats[kIQ4_XS].block_bytes;
  static constexpr int64_t kBlocks = kFormats[kIQ4_XS].block_values / 32;
  static void scales(const uint8_t* row, int64_t nb, float* d, float* m) {
    for (int64_t s = 0; s < nb / 8; ++s) {
      const uint8_t* sb = row + s * kBytes;
      const float dd = half_to_float(sb);
      const int high = sb[2] | (sb[3] << 8);
      for (int j = 0; j < 8; ++j) {
        const int ls = ((sb[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4);
        d[8 * s + j] = dd * static_cast<float>(ls - 32);
        m[8 * s + j] = 0.0f;
      }
    }
  }
  static inline void expand(const uint8_t* row, int64_t b, float d, float, v16f& lo,
                            v16f& hi) {
    iq4_expand(row + (b >> 3) * kBytes + 8 + 16 * (b & 7), d, lo, hi);
  }
};

// One group of G weight rows, its scales converted once.
template <class F, int G>
struct Group {
  const uint8_t* rows[G];
  const float* d;  // [G][nb]
  const float* m;  // [G][nb]
  int64_t nb;
};

template <int G, int NB>
inline void store_group(v16f (&acc)[G][NB], float* out, int64_t ldo, int64_t r,
                        const float* bias) {
  for (int i = 0; i < G; ++i) {
    const float add = bias ? bias[r + i] : 0.0f;
    for (int j = 0; j < NB; ++j) out[j * ldo + r + i] = hsum(acc[i][j]) + add;
  }
}

// NB input rows (x, row stride k) against a group, blocks expanded in registers.
template <class F, int G, int NB>
void group_direct(const Group<F, G>& g, const float* x, int64_t k, float* out, int64_t ldo,
                  int64_t r, const float* bias) {
  v16f acc[G][NB] = {};
  // The group's G rows are contiguous: one block's share of their bytes, kAheadBytes on.
  const int64_t share = G * F::kBytes / F::kBlocks;
  const char* sweep = reinterpret_cast<const char*>(g.rows[0]) + kAheadBytes;
  for (int64_t b = 0; b < g.nb; ++b) {
    {
      const char* from = sweep + b * share;
      const char* line =
          reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(from) & ~uintptr_t{63});
      for (; line < from + share; line += 64) _mm_prefetch(line, _MM_HINT_T0);
    }
    v16f lo[G], hi[G];
    for (int i = 0; i < G; ++i)
      F::expand(g.rows[i], b, g.d[i * g.nb + b], g.m[i * g.nb + b], lo[i], hi[i]);
    for (int j = 0; j < NB; ++j) {
      const v16f xv = load16(x + j * k + b * 32);
      for (int i = 0; i < G; ++i) acc[i][j] += lo[i] * xv;
    }
    for (int j = 0; j < NB; ++j) {
      const v16f xv = load16(x + j * k + b * 32 + 16);
      for (int i = 0; i < G; ++i) acc[i][j] += hi[i] * xv;
    }
  }
  store_group<G, NB>(acc, out, ldo, r, bias);
}

// NB input rows against G expanded weight rows (wbuf, row stride k).
template <int G, int NB>
void group_buffered(const float* wbuf, const float* x, int64_t k, float* out, int64_t ldo,
                    int64_t r, const float* bias) {
  v16f acc[G][NB] = {};
#ifdef __AVX512F__
  for (int64_t c = 0; c < k; c += 16) {
    v16f wv[G];
    for (int i = 0; i < G; ++i) wv[i] = load16(wbuf + i * k + c);
    for (int j = 0; j < NB; ++j) {
      const v16f xv = load16(x + j * k + c);
      for (int i = 0; i < G; ++i) acc[i][j] += wv[i] * xv;
    }
  }
#else
  // AVX2 has 16 registers, too few for G x NB accumulators of two halves: lanes 0-7 of
  // every accumulator over all of k, then lanes 8-15. Each lane sums the same products in
  // the same order as the 16-lane loop (a multiply and an add, which GCC contracts to one
  // fused multiply-add here as there: tests/kernels' batch invariance compares the two).
  for (int half = 0; half < 2; ++half) {
    __m256 a[G][NB];
    for (int i = 0; i < G; ++i)
      for (int j = 0; j < NB; ++j) a[i][j] = _mm256_setzero_ps();
    for (int64_t c = 8 * half; c < k; c += 16) {
      __m256 wv[G];
      for (int i = 0; i < G; ++i) wv[i] = _mm256_loadu_ps(wbuf + i * k + c);
      for (int j = 0; j < NB; ++j) {
        const __m256 xv = _mm256_loadu_ps(x + j * k + c);
        for (int i = 0; i < G; ++i) a[i][j] = _mm256_add_ps(a[i][j], _mm256_mul_ps(wv[i], xv));
      }
    }
    for (int i = 0; i < G; ++i)
      for (int j = 0; j < NB; ++j) (half ? acc[i][j].hi : acc[i][j].lo) = a[i][j];
  }
#endif
  store_group<G, NB>(acc, out, ldo, r, bias);
}

template <class F, int G>
void expand_group(const Group<F, G>& g, float* wbuf) {
  const int64_t k = g.nb * 32;
  for (int i = 0; i < G; ++i)
    for (int64_t b = 0; b < g.nb; ++b) {
      v16f lo, hi;
      F::expand(g.rows[i], b, g.d[i * g.nb + b], g.m[i * g.nb + b], lo, hi);
      store16(wbuf + i * k + b * 32, lo);
      store16(wbuf + i * k + b * 32 + 16, hi);
    }
}

template <class F, int G>
void run_direct(const Group<F, G>& g, const float* x, int64_t n, int64_t k, float* out,
                int64_t ldo, int64_t r, const float* bias) {
  switch (n) {
    case 1: return group_direct<F, G, 1>(g, x, k, out, ldo, r, bias);
    case 2: return group_direct<F, G, 2>(g, x, k, out, ldo, r, bias);
    case 3: return group_direct<F, G, 3>(g, x, k, out, ldo, r, bias);
    case 4: return group_direct<F, G, 4>(g, x, k, out, ldo, r, bias);
    default: return group_direct<F, G, 5>(g, x, k, out, ldo, r, bias);
  }
}

template <int G>
void run_buffered(const float* wbuf, const float* x, int64_t n0, int64_t n1, int64_t k,
                  float* out, int64_t ldo, int64_t r, const float* bias) {
  int64_t j = n0;
  for (; j + kTileRows <= n1; j += kTileRows)
    group_buffered<G, kTileRows>(wbuf, x + j * k, k, out + j * ldo, ldo, r, bias);
  for (; j < n1; ++j) group_buffered<G, 1>(wbuf, x + j * k, k, out + j * ldo, ldo, r, bias);
}

struct Scratch {
  std::vector<float> d, m, wbuf;
};

template <class F, int G>
Group<F, G> make_group(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t r,
                       Scratch& s) {
  Group<F, G> g;
  g.nb = nb;
  for (int i = 0; i < G; ++i) {
    g.rows[i] = w + (r + i) * row_bytes;
    F::scales(g.rows[i], nb, s.d.data() + i * nb, s.m.data() + i * nb);
  }
  g.d = s.d.data();
  g.m = s.m.data();
  return g;
}

// Weight rows [r0, r1) of one thread, groups of G rows.
template <class F, int G>
void rows_range(const float* x, int64_t n, int64_t k, const uint8_t* w, int64_t ldo,
                int64_t r0, int64_t r1, float* out, const float* bias, Scratch& s) {
  const int64_t nb = k / 32, row_bytes = nb / F::kBlocks * F::kBytes;
  if (n <= kDirectMax) {
    constexpr int D = G < kDirectGroup ? G : kDirectGroup;  // divides G
    for (int64_t r = r0; r + D <= r1; r += D)
      run_direct<F, D>(make_group<F, D>(w, row_bytes, nb, r, s), x, n, k, out, ldo, r, bias);
    return;
  }
  for (int64_t t0 = 0; t0 < n; t0 += kXTile) {
    const int64_t t1 = std::min(n, t0 + kXTile);
    for (int64_t r = r0; r + G <= r1; r += G) {
      expand_group<F, G>(make_group<F, G>(w, row_bytes, nb, r, s), s.wbuf.data());
      run_buffered<G>(s.wbuf.data(), x, t0, t1, k, out, ldo, r, bias);
    }
  }
}

// ldo: the row stride of out (m, or wider when W is one part of a stacked weight).
template <class F>
void linear(const float* x, int64_t n, int64_t k, const uint8_t* w, int64_t m, float* out,
            int64_t ldo, const float* bias) {
  const int64_t groups = m / kGroup, tail = groups * kGroup;
#pragma omp parallel if (n * k * m >= kParallelWork)
  {
    const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
    Scratch s;
    s.d.resize(kGroup * (k / 32));
    s.m.resize(kGroup * (k / 32));
    if (n > kDirectMax) s.wbuf.resize(kGroup * k);
    const int64_t r0 = groups * id / threads * kGroup, r1 = groups * (id + 1) / threads * kGroup;
    rows_range<F, kGroup>(x, n, k, w, ldo, r0, r1, out, bias, s);
    if (id == threads - 1)  // the m % kGroup rows left over, one at a time
      rows_range<F, 1>(x, n, k, w, ldo, tail, m, out, bias, s);
  }
}

template <class F>
void dequantize_rows(const uint8_t* w, int64_t k, const int64_t* rows, int64_t count,
                     float* out) {
  const int64_t nb = k / 32, row_bytes = nb / F::kBlocks * F::kBytes;
#pragma omp parallel if (count * k > (1 << 16))
  {
    Scratch s;
    s.d.resize(nb);
    s.m.resize(nb);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; ++i) {
      const int64_t r = rows ? rows[i] : i;
      expand_group<F, 1>(make_group<F, 1>(w, row_bytes, nb, r, s), out + i * k);
    }
  }
}

void linear_of(int64_t format, const float* x, int64_t n, int64_t k, const uint8_t* w,
               int64_t m, float* out, int64_t ldo, const float* bias) {
  switch (format) {
    case kQ4_0: return linear<Q4_0>(x, n, k, w, m, out, ldo, bias);
    case kQ4_1: return linear<Q4_1>(x, n, k, w, m, out, ldo, bias);
    case kQ5_0: return linear<Q5_0>(x, n, k, w, m, out, ldo, bias);
    case kQ5_1: return linear<Q5_1>(x, n, k, w, m, out, ldo, bias);
    case kQ4_K: return linear<Q4_K>(x, n, k, w, m, out, ldo, bias);
    case kQ5_K: return linear<Q5_K>(x, n, k, w, m, out, ldo, bias);
    case kQ6_K: return linear<Q6_K>(x, n, k, w, m, out, ldo, bias);
    case kIQ4_NL: return linear<IQ4_NL>(x, n, k, w, m, out, ldo, bias);
    case kIQ4_XS: return linear<IQ4_XS>(x, n, k, w, m, out, ldo, bias);
    default: return linear<Q8_0>(x, n, k, w, m, out, ldo, bias);
  }
}

}  // namespace

// out[n, m] = x[n, k] @ W[m, k]^T (+ bias[m]); W in `format`'s (Format) packed rows; k % 32 == 0
// (k % 256 == 0 for the K-quants), or (kStacked) a table of parts.
HR_EXPORT void hr_quant_linear(int64_t format, const float* x, int64_t n, int64_t k,
                               const uint8_t* w, int64_t m, float* out, const float* bias) {
  if (format != kStacked) return linear_of(format, x, n, k, w, m, out, m, bias);
  for_each_part(w, [&](int64_t f, const uint8_t* weight, int64_t rows, int64_t r) {
    linear_of(f, x, n, k, weight, rows, out + r, m, bias ? bias + r : nullptr);
  });
}

// out[i, :] = W[rows[i], :] in fp32 (rows == nullptr: rows 0..count-1), bit-exact.
HR_EXPORT void hr_dequantize_rows(int64_t format, const uint8_t* w, int64_t k,
                                  const int64_t* rows, int64_t count, float* out) {
  if (format == kQ4_0) return dequantize_rows<Q4_0>(w, k, rows, count, out);
  if (format == kQ4_1) return dequantize_rows<Q4_1>(w, k, rows, count, out);
  if (format == kQ5_0) return dequantize_rows<Q5_0>(w, k, rows, count, out);
  if (format == kQ5_1) return dequantize_rows<Q5_1>(w, k, rows, count, out);
  if (format == kQ4_K) return dequantize_rows<Q4_K>(w, k, rows, count, out);
  if (format == kQ5_K) return dequantize_rows<Q5_K>(w, k, rows, count, out);
  if (format == kQ6_K) return dequantize_rows<Q6_K>(w, k, rows, count, out);
  if (format == kIQ4_NL) return dequantize_rows<IQ4_NL>(w, k, rows, count, out);
  if (format == kIQ4_XS) return dequantize_rows<IQ4_XS>(w, k, rows, count, out);
  return dequantize_rows<Q8_0>(w, k, rows, count, out);
}

// The traits of every Format, for the test that kernels/cpu/quant.py's FORMATS agree: the
// number of formats, then per format (by code) block_bytes, block_values, stored_min.
HR_EXPORT void hr_format_traits(int64_t* out) {
  *out++ = sizeof kFormats / sizeof kFormats[0];
  for (const FormatTraits& f : kFormats) {
    *out++ = f.block_bytes;
    *out++ = f.block_values;
    *out++ = f.stored_min;
  }
}
