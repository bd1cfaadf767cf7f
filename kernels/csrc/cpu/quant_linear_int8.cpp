// Linear layers over GGUF-quantized weights with int8 activations (llama.cpp's CPU numerics).
//
// Each input row is quantized per block of 32 like llama.cpp's Q8_1: dx = max|x| / 127,
// xq = round(x / dx). A block's contribution to an output is then an integer dot
// product scaled once:  d * dx * sum(q * xq) + m * dx * sum(xq), so the weights are never
// expanded to floats. Only the activations are approximated (~0.4% per element), which is
// what llama.cpp computes for this model. Every format is read as unsigned codes with a
// min: Q4_1 and Q5_1 store m; Q4_0 is q - 8, so m = -8d; Q5_0 is q - 16 (codes 0..31), so
// m = -16d; Q8_0's signed codes are read as q + 128 (the top bit flipped), so m = -128d.
//
// Weight rows are in the "tiled" layout (kernels/cpu/quant.py QuantizedWeight.tiled): rows in
// tiles of 16 (the last one zero-padded), and within a tile, block by block, 4-byte lane i
// of a 64-byte vector holds 4 codes of row i:
//   Q4_0/Q4_1: 4 vectors per block; byte 4i + k of vector s
//     = q[i][8s + k] | q[i][8s + 4 + k] << 4 (its low nibbles give codes 8s.., high 8s + 4..)
//   Q8_0: 8 vectors per block; byte 4i + k of vector t = q[i][4t + k]
//   Q5_0: the low 4 bits of the codes as Q4_0's 4 vectors, then the high-bit plane: 8
//     64-bit words, bit 4i + k of word t = bit 4 of q[i][4t + k], so word t is the 5th bit
//     of the 64 bytes of the t-th unpacked code vector (one masked byte move and an or)
//   Q6_K: the low 4 bits as Q4_0's 4 vectors, then 2 vectors of the top 2 bits: bits
//     2j, 2j + 1 of byte 4i + k of vector h = bits 4, 5 of q[i][4(4h + j) + k]
// then the tile's scales: [nb][16] fp16 d, and (Q4_1, Q5_1) [nb][16] fp16 m; Q6_K: [nb][2][16]
// int8 sub-block scales (the two halves of 16 of each block), then [nb / 8][16] fp16 d of
// each super-block of 256. A tile is as many bytes as 16 rows of the per-row layout (Q5_0:
// 22 per 32 weights, Q5_1 (Q5_0's codes) 24, Q6_K 210 per 256, as in the file).
//
// Q4_K: the nibbles as Q4_0's 4 vectors; then per super-block of 256 [8][16] bytes of the
// 8 blocks' 6-bit scale and min, low 4 bits (byte b * 16 + i = sc_b & 15 | (m_b & 15) << 4
// of row i), [4][16] bytes of their top 2 bits (byte c * 16 + i: bits 0-1 sc_c, 2-3 m_c,
// 4-5 sc_c+4, 6-7 m_c+4) (192 bytes per super-block), then per super-block [2][16] fp16:
// d, then dmin. The file's 144 bytes per 256 weights and row.
//   Q5_K: as Q4_K, each block's nibbles followed by Q5_0's plane of 5th bits (176 bytes).
//
// Q4_K (w = d * sc_b * q - dmin * m_b, q in 0..15 (Q5_K 0..31), one sc and m per block):
// Q4_1's operations with the block's scale d * sc_b and min -dmin * m_b, both exact in fp32
// (an fp16 times 6 bits), where Q4_1 stores them rounded to fp16: acc = fma(S_b, (d * sc_b)
// * dx_b, acc), then acc = fma(-dmin * m_b, dx_b * sum(xq_b), acc). (sc_b * S_b in int32,
// then d * dx_b, rounds as often but costs a vpmulld per input row and block: 6% slower at
// 16 rows, measured alternately.)
//
// IQ4_NL (w = d * v[q], q a 4-bit index into llama.cpp's table v of 16 int8 values): Q4_0's
// layout (the nibbles, then [nb][16] fp16 d), 18 bytes per 32 weights as in the file.
// IQ4_XS (w = d * (ls_b - 32) * v[q], ls_b 6 bits per block of 32, d per super-block of
// 256): the nibbles as Q4_0's 4 vectors; then per super-block 128 bytes: [4][16] bytes of
// the file's scales_l (byte c * 16 + i: the low 4 bits of ls_2c | ls_2c+1 << 4 of row i),
// [2][16] bytes of its scales_h (byte h * 16 + i: bits 2j, 2j + 1 = the top bits of
// ls_4h+j), [16] fp16 d: the file's 136 bytes per 256 weights and row.
// Both are read as the unsigned codes u = v[q] + 128 (1..241; one byte shuffle per vector
// of nibbles), so S = sum(u * xq) is Q8_0's dot product; the 128 is taken off in int32
// (the sum starts at -128 * sum(xq), computed with the activations' codes), so it ends at
// T = S - 128 * sum(xq) = sum(v * xq) exactly, and acc = fma(T, scale_b * dx_b, acc), one
// float operation per block (scale_b: d, or IQ4_XS's d * (ls_b - 32), exact in fp32: an
// fp16 times 6 bits). Q8_0's two (S * d * dx, then the min -128 d * dx * sum(xq)) would
// round two terms that mostly cancel (S is near 128 * sum(xq)) where T is rounded once.
//
// Q6_K (w = d * sc_h * (q - 32), q in 0..63, one sc per half-block of 16): the integer
// sum of each half apart, T = sc_0 * (S_0 - 32 X_0) + sc_1 * (S_1 - 32 X_1) exact in int32
// (X_h: the half's sum of activation codes), then acc = fma(T, d * dx_b, acc): one float
// operation per block, in the same order for any batch and ISA.
//
// One integer dot-product instruction (VNNI vpdpbusd) multiplies 4 codes of each of the 16
// rows by the same 4 activation bytes (broadcast), so 8 of them leave a block's whole dot
// product for 16 rows in 16 int32 lanes, with no horizontal reduction; the scaling is one
// multiply and two multiply-adds per block for 16 rows. A weight block is unpacked once for
// up to kRows input rows (a GEMM register tile of 16 outputs x kRows rows with AVX-512; on
// AVX2, tile_dot_halves: passes of 8 outputs over kRows = 4 rows).
//
// One order of sums for any number of input rows (a row's result does not depend on the
// rows batched beside it) and on every ISA (the integer sums are exact, the float
// operations the same): per output, block by block, acc = fma(S_b, d_b * dx_b, acc), then
// acc = fma(m_b, dx_b * sum(xq_b), acc); the bias is added last.
#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kTile = 16;     // weight rows per tile (one int32 / float lane each)
#ifdef __AVX512F__
constexpr int kRows = 8;          // input rows sharing one unpacked weight block
#else
// AVX2 (tile_dot_halves): 4 rows' sums leave registers for the codes and scales (8 rows
// were 13% slower on 8 rows of a Q4_K 1024 x 1024, 9% on 48, alternated in one process),
// and up to 2 rows run both halves of a tile in one pass.
constexpr int kRows = 4;
constexpr int kBothHalves = 2;
#endif
constexpr int64_t kXTile = 64;    // input rows a thread runs its tiles over (~37 KB at k = 576)
// Bytes ahead to prefetch, into L2: decode streams every weight from DRAM once per step.
// Prefetches into L1 (T0) hold the core's few L1 miss buffers and capped a one-row pass
// over all of a step's weights (2 cores) near 20 GB/s; into L2, 32 KB ahead, it ran 1.5x
// faster (5.8 -> 3.9 ms for every projection of the default model, alternated in one
// process, against T0 16 KB). The prefetch sweeps a tile's bytes evenly, its scales too
// (a sweep of the codes alone left each tile's scale lines to demand misses); with that,
// 12 KB ahead beat 32 KB by 5-12% a decode step (engine steps alternated in one process:
// SmolLM2 Q4_1 5.13 -> 4.86 ms, Q4_K_M 5.33 -> 4.95, the 64-expert MoE 7.90 -> 7.03);
// 8 KB and 48 KB were slower than 16 KB.
constexpr int64_t kAhead = 12288;

// Rows of activations the quantized codes interleave (AVX2's tile_dot_halves reads 8 rows'
// codes of a block at constant offsets from one pointer; tile_dot one row's 32 codes).
#ifdef __AVX512F__
constexpr int64_t kGroupRows = 1;
#else
constexpr int64_t kGroupRows = 8;
#endif

// The activations, quantized, in groups of kGroupRows rows (the last padded): block b of
// row j is unit u = ((j / G) * nb + b) * G + j % G (G = kGroupRows; with G = 1, j * nb + b),
// its dx, dxs, xm at u, x16 at 2u, and its codes 4t .. 4t + 3 at
// ((j / G) * nb + b) * 32 G + 4 G t + 4 (j % G) (G = 1: row by row, in plain order).
struct QuantizedRows {
  std::vector<int8_t> q;     // [units][32]
  std::vector<float> dx;     // [units]
  std::vector<float> dxs;    // [units]: dx * the codes' sum
  std::vector<int32_t> x16;  // [units][2]: the codes' sum over each half of 16 (Q6_K)
  std::vector<int32_t> xm;   // [units]: -128 * the codes' sum (IQ4's sums start there)
};

// Block b of row j: its unit, and the offset of its codes 4t .. 4t + 3 in q.
inline int64_t unit_of(int64_t j, int64_t b, int64_t nb) {
  return (j / kGroupRows * nb + b) * kGroupRows + j % kGroupRows;
}
inline int64_t codes_at(int64_t j, int64_t b, int t, int64_t nb) {
  return (j / kGroupRows * nb + b) * 32 * kGroupRows + 4 * kGroupRows * t + 4 * (j % kGroupRows);
}

// One block of 32 activations: amax over |x|, codes nearbyint(x * 127 / amax) (round half
// to even), their sums. The AVX-512 and AVX2 paths compute the same bits as the scalar one:
// max is exact in any order, each product is one rounding, cvtps rounds as nearbyint does.
void quantize_block(const float* x, int8_t* q, float* dx, float* dxs, int32_t* x16,
                    int32_t* xm) {
#ifdef __AVX512F__
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  const int halves[2] = {_mm512_reduce_add_epi32(qa), _mm512_reduce_add_epi32(qb)};
#elif defined(__AVX2__)
  __m256 v[4], m = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  __m256i c[4];
  for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
  // int32 -> int8 (|c| <= 127: no saturation); packs interleave 128-bit lanes: undo it.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                           _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  auto total = [](__m256i a) {
    const __m128i b = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    const __m128i d = _mm_add_epi32(b, _mm_shuffle_epi32(b, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(d, _mm_shuffle_epi32(d, _MM_SHUFFLE(2, 3, 0, 1))));
  };
  const int halves[2] = {total(_mm256_add_epi32(c[0], c[1])), total(_mm256_add_epi32(c[2], c[3]))};
#else
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int halves[2] = {0, 0};
  for (int i = 0; i < 32; ++i) {
    const int v = static_cast<int>(std::nearbyint(x[i] * inv));
    q[i] = static_cast<int8_t>(v);
    halves[i / 16] += v;
  }
#endif
  *dx = amax / 127.0f;
  *dxs = *dx * static_cast<float>(halves[0] + halves[1]);
  x16[0] = halves[0];
  x16[1] = halves[1];
  *xm = -128 * (halves[0] + halves[1]);
}

void quantize_rows(const float* x, int64_t n, int64_t k, QuantizedRows& out) {
  const int64_t nb = k / 32;
  const int64_t units = (n + kGroupRows - 1) / kGroupRows * kGroupRows * nb;
  out.q.resize(units * 32);
  out.dx.resize(units);
  out.dxs.resize(units);
  out.x16.resize(units * 2);
  out.xm.resize(units);
#pragma omp parallel for schedule(static) if (n >= 16)
  for (int64_t i = 0; i < n * nb; ++i) {
    const int64_t j = i / nb, b = i % nb, group = j / kGroupRows * nb + b;
    const int64_t u = group * kGroupRows + j % kGroupRows;
    alignas(32) int8_t codes[32];
    int8_t* q = kGroupRows == 1 ? out.q.data() + 32 * u : codes;
    quantize_block(x + i * 32, q, out.dx.data() + u, out.dxs.data() + u, out.x16.data() + 2 * u,
                   out.xm.data() + u);
    if (kGroupRows > 1) {
      int8_t* to = out.q.data() + group * 32 * kGroupRows + 4 * (j % kGroupRows);
      for (int t = 0; t < 8; ++t) std::memcpy(to + 4 * kGroupRows * t, codes + 4 * t, 4);
    }
  }
}

// 16 int32 lanes: one zmm with AVX-512, two ymm with AVX2.
#ifdef __AVX512F__
struct I16 {
  __m512i v;
};
inline I16 zero16() { return {_mm512_setzero_si512()}; }
inline I16 load64(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline I16 low_nibbles(I16 a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(15))}; }
inline I16 high_nibbles(I16 a) {
  return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(15))};
}
inline I16 flip_sign(I16 a) { return {_mm512_xor_si512(a.v, _mm512_set1_epi8(-128))}; }
inline v16f to_float(I16 a) { return (v16f)_mm512_cvtepi32_ps(a.v); }
// a | 16 in the bytes whose bit of `bits` is set (Q5_0's 5th bit).
inline I16 with_high(I16 a, uint64_t bits) {
  return {_mm512_or_si512(a.v, _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(16)))};
}
// Bits 4, 5 of each byte: bits 2j, 2j + 1 of h's bytes (Q6_K's top bits), else 0.
inline I16 top2(I16 h, int j) {
  const __m512i v = j == 0   ? _mm512_slli_epi16(h.v, 4)
                    : j == 1 ? _mm512_slli_epi16(h.v, 2)
                    : j == 2 ? h.v
                             : _mm512_srli_epi16(h.v, 2);
  return {_mm512_and_si512(v, _mm512_set1_epi8(0x30))};
}
inline I16 or16(I16 a, I16 b) { return {_mm512_or_si512(a.v, b.v)}; }
// Byte j of each 128-bit lane of `table`, for each byte j (0..15) of a (IQ4's values).
inline I16 lookup16(I16 a, __m128i table) {
  return {_mm512_shuffle_epi8(_mm512_broadcast_i32x4(table), a.v)};
}
inline I16 splat16(int32_t c) { return {_mm512_set1_epi32(c)}; }
// IQ4_XS's top bits of ls for 4 blocks x 16 rows (`h`: the tile's [2][16] scales_h bytes):
// 128-bit lane c holds bits s, s + 1 of byte c / 2 of each row's scales_h, at bits 4, 5,
// s = 4 (c % 2) + `odd` (blocks 2c + odd).
inline I16 iq4xs_tops(const uint8_t* h, int odd) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
  const __m512i two = _mm512_castsi256_si512(bytes);
  const __m512i lanes = _mm512_shuffle_i64x2(two, two, _MM_SHUFFLE(1, 1, 0, 0));
  const __m512i shift = _mm512_add_epi32(
      _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4), _mm512_set1_epi32(odd));
  const __m512i v = _mm512_slli_epi32(_mm512_srlv_epi32(lanes, shift), 4);
  return {_mm512_and_si512(v, _mm512_set1_epi8(0x30))};
}
// 16 uint8 at p, one per int32 lane.
inline I16 ubytes16(const uint8_t* p) {
  return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline void store64(uint8_t* p, I16 a) { _mm512_storeu_si512(p, a.v); }
// 16 int8 at p, one per int32 lane.
inline I16 bytes16(const int8_t* p) {
  return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
// sc0 * (s0 - c0) + sc1 * (s1 - c1), per int32 lane.
inline I16 scaled_pair(I16 sc0, I16 s0, int32_t c0, I16 sc1, I16 s1, int32_t c1) {
  const __m512i a = _mm512_mullo_epi32(sc0.v, _mm512_sub_epi32(s0.v, _mm512_set1_epi32(c0)));
  const __m512i b = _mm512_mullo_epi32(sc1.v, _mm512_sub_epi32(s1.v, _mm512_set1_epi32(c1)));
  return {_mm512_add_epi32(a, b)};
}
// acc + per lane the sum of 4 products u8(u) * s8(x4's bytes); `wide`: u may exceed 127.
inline I16 dot4(I16 acc, I16 u, int32_t x4, bool wide) {
  const __m512i x = _mm512_set1_epi32(x4);
#ifdef __AVX512VNNI__
  (void)wide;
  return {_mm512_dpbusd_epi32(acc.v, u.v, x)};
#else
  const __m512i ones = _mm512_set1_epi16(1);
  if (!wide)  // |15 * 127 * 2| fits int16: maddubs does not saturate
    return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(u.v, x), ones))};
  // 255 * 127 * 2 would saturate: the high and low nibbles apart, the high ones x 16.
  const __m512i lo = _mm512_maddubs_epi16(_mm512_and_si512(u.v, _mm512_set1_epi8(15)), x);
  const __m512i hi = _mm512_maddubs_epi16(
      _mm512_and_si512(_mm512_srli_epi16(u.v, 4), _mm512_set1_epi8(15)), x);
  const __m512i sum = _mm512_add_epi32(_mm512_madd_epi16(lo, ones),
                                       _mm512_slli_epi32(_mm512_madd_epi16(hi, ones), 4));
  return {_mm512_add_epi32(acc.v, sum)};
#endif
}
#else
struct I16 {
  __m256i lo, hi;
};
inline I16 zero16() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I16 load64(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline __m256i and15(__m256i a) { return _mm256_and_si256(a, _mm256_set1_epi8(15)); }
inline I16 low_nibbles(I16 a) { return {and15(a.lo), and15(a.hi)}; }
inline I16 high_nibbles(I16 a) {
  return {and15(_mm256_srli_epi16(a.lo, 4)), and15(_mm256_srli_epi16(a.hi, 4))};
}
inline I16 flip_sign(I16 a) {
  const __m256i s = _mm256_set1_epi8(-128);
  return {_mm256_xor_si256(a.lo, s), _mm256_xor_si256(a.hi, s)};
}
// 16 in byte j of 32 where bit j of `bits` is set, else 0.
inline __m256i high_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                       3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}
inline I16 with_high(I16 a, uint64_t bits) {
  return {_mm256_or_si256(a.lo, high_bytes(static_cast<uint32_t>(bits))),
          _mm256_or_si256(a.hi, high_bytes(static_cast<uint32_t>(bits >> 32)))};
}
inline __m256i top2_half(__m256i h, int j) {
  const __m256i v = j == 0   ? _mm256_slli_epi16(h, 4)
                    : j == 1 ? _mm256_slli_epi16(h, 2)
                    : j == 2 ? h
                             : _mm256_srli_epi16(h, 2);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x30));
}
inline I16 top2(I16 h, int j) { return {top2_half(h.lo, j), top2_half(h.hi, j)}; }
inline I16 or16(I16 a, I16 b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline I16 lookup16(I16 a, __m128i table) {
  const __m256i t = _mm256_broadcastsi128_si256(table);
  return {_mm256_shuffle_epi8(t, a.lo), _mm256_shuffle_epi8(t, a.hi)};
}
inline I16 splat16(int32_t c) { return {_mm256_set1_epi32(c), _mm256_set1_epi32(c)}; }
// As the AVX-512 one: lo holds blocks of lanes c = 0, 1 (byte 0 of scales_h), hi c = 2, 3.
inline __m256i iq4xs_tops_half(const uint8_t* h, int odd) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h));
  const __m256i lanes = _mm256_broadcastsi128_si256(bytes);
  const __m256i shift =
      _mm256_add_epi32(_mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4), _mm256_set1_epi32(odd));
  const __m256i v = _mm256_slli_epi32(_mm256_srlv_epi32(lanes, shift), 4);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x30));
}
inline I16 iq4xs_tops(const uint8_t* h, int odd) {
  return {iq4xs_tops_half(h, odd), iq4xs_tops_half(h + 16, odd)};
}
inline I16 ubytes16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))};
}
inline void store64(uint8_t* p, I16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), a.hi);
}
inline I16 bytes16(const int8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))};
}
inline __m256i scaled_half(__m256i sc0, __m256i s0, int32_t c0, __m256i sc1, __m256i s1,
                           int32_t c1) {
  const __m256i a = _mm256_mullo_epi32(sc0, _mm256_sub_epi32(s0, _mm256_set1_epi32(c0)));
  const __m256i b = _mm256_mullo_epi32(sc1, _mm256_sub_epi32(s1, _mm256_set1_epi32(c1)));
  return _mm256_add_epi32(a, b);
}
inline I16 scaled_pair(I16 sc0, I16 s0, int32_t c0, I16 sc1, I16 s1, int32_t c1) {
  return {scaled_half(sc0.lo, s0.lo, c0, sc1.lo, s1.lo, c1),
          scaled_half(sc0.hi, s0.hi, c0, sc1.hi, s1.hi, c1)};
}
inline v16f to_float(I16 a) {
  __m256 halves[2] = {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)};
  v16f out;
  std::memcpy(&out, halves, sizeof out);
  return out;
}
inline __m256i dot4_half(__m256i acc, __m256i u, __m256i x, bool wide) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (!wide) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones));
  const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(and15(u), x), ones);
  const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(and15(_mm256_srli_epi16(u, 4)), x), ones);
  return _mm256_add_epi32(acc, _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 4)));
}
inline I16 dot4(I16 acc, I16 u, int32_t x4, bool wide) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {dot4_half(acc.lo, u.lo, x, wide), dot4_half(acc.hi, u.hi, x, wide)};
}
#endif

// 16 fp16 values at p as floats.
inline v16f halves16(const uint8_t* p) {
#ifdef __AVX512F__
  // One conversion in registers: two 256-bit stores read back as one 512-bit vector would
  // miss store forwarding, in the chain of every block.
  return (v16f)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  v16f out;
  halves_to_float(p, 16, reinterpret_cast<float*>(&out));
  return out;
#endif
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

struct Q4 {  // Q4_0 and Q4_1: nibbles, 4 vectors per block
  static constexpr int64_t kBlockBytes = 16;  // code bytes per block and row
  static constexpr bool kWide = false;
  static inline void unpack(const uint8_t* p, I16 (&u)[8]) {
    for (int s = 0; s < 4; ++s) {
      const I16 b = load64(p + 64 * s);
      u[2 * s] = low_nibbles(b);
      u[2 * s + 1] = high_nibbles(b);
    }
  }
};

struct Q5 {  // Q5_0: Q4_0's nibble vectors, then 8 words of the 5th bits
  static constexpr int64_t kBlockBytes = 20;
  static constexpr bool kWide = false;  // codes <= 31: 31 * 127 * 2 fits maddubs' int16
  static inline void unpack(const uint8_t* p, I16 (&u)[8]) {
    Q4::unpack(p, u);
    uint64_t bits[8];
    std::memcpy(bits, p + 256, sizeof bits);
    for (int t = 0; t < 8; ++t) u[t] = with_high(u[t], bits[t]);
  }
};

struct Q4K : Q4 {};  // Q4_K: Q4_0's nibble vectors; 6-bit scales and mins per block
struct Q5K : Q5 {};  // Q5_K: Q5_0's nibble vectors and 5th bits; Q4_K's scales and mins
template <class C>
constexpr bool kKQuant = std::is_same_v<C, Q4K> || std::is_same_v<C, Q5K>;

// The 6-bit scales and mins of one super-block of a Q4_K / Q5_K tile (`s`: its 192 bytes),
// as bytes [8][16] each: byte-wise on 64 bytes (4 blocks) at a time, once per super-block.
inline void unpack_qk_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  const I16 low0 = load64(s), low1 = load64(s + 64), top = load64(s + 128);
  store64(sc, or16(low_nibbles(low0), top2(top, 0)));  // blocks 0-3: top bits 0-1, 2-3
  store64(mn, or16(high_nibbles(low0), top2(top, 1)));
  store64(sc + 64, or16(low_nibbles(low1), top2(top, 2)));  // blocks 4-7: bits 4-5, 6-7
  store64(mn + 64, or16(high_nibbles(low1), top2(top, 3)));
}

struct Q6K {  // Q6_K: Q4_0's nibble vectors, then 2 vectors of the top 2 bits
  static constexpr int64_t kBlockBytes = 24;
  static constexpr bool kWide = false;  // codes <= 63: 63 * 127 * 2 fits maddubs' int16
  static inline void unpack(const uint8_t* p, I16 (&u)[8]) {
    Q4::unpack(p, u);
    const I16 h[2] = {load64(p + 256), load64(p + 320)};
    for (int t = 0; t < 8; ++t) u[t] = or16(u[t], top2(h[t / 4], t % 4));
  }
};

// llama.cpp's kvalues_iq4nl + 128: IQ4_NL / IQ4_XS's values as unsigned codes.
alignas(16) constexpr uint8_t kIQ4Codes[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                               129, 141, 153, 166, 181, 197, 217, 241};

struct IQ4 {  // IQ4_NL, IQ4_XS: Q4_0's nibble vectors, each index mapped to v + 128
  static constexpr int64_t kBlockBytes = 16;
  static constexpr bool kWide = true;  // codes up to 241: maddubs splits them as Q8_0's
  static inline void unpack(const uint8_t* p, I16 (&u)[8]) {
    Q4::unpack(p, u);
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Codes));
    for (int t = 0; t < 8; ++t) u[t] = lookup16(u[t], table);
  }
};
struct IQ4XS : IQ4 {};  // IQ4_XS: IQ4_NL's codes; per super-block 6-bit block scales, d
template <class C>
constexpr bool kIQ4 = std::is_same_v<C, IQ4> || std::is_same_v<C, IQ4XS>;

// The 6-bit ls of one super-block of an IQ4_XS tile (`s`: its [4][16] scales_l bytes, then
// [2][16] scales_h), as bytes [2][4][16]: even blocks 0, 2, 4, 6, then odd ones 1, 3, 5, 7
// (block b at (b % 2) * 64 + (b / 2) * 16), byte-wise on 64 bytes, once per super-block.
inline void unpack_iq4xs_scales(const uint8_t* s, uint8_t* ls) {
  const I16 low = load64(s);
  store64(ls, or16(low_nibbles(low), iq4xs_tops(s + 64, 0)));
  store64(ls + 64, or16(high_nibbles(low), iq4xs_tops(s + 64, 2)));
}

struct Q8 {  // Q8_0: signed bytes, 8 vectors per block, read as q + 128
  static constexpr int64_t kBlockBytes = 32;
  static constexpr bool kWide = true;
  static inline void unpack(const uint8_t* p, I16 (&u)[8]) {
    for (int t = 0; t < 8; ++t) u[t] = flip_sign(load64(p + 64 * t));
  }
};

// One tile (16 weight rows from r0, `valid` of them real) against NR input rows from j0.
// `prefetch`: the first pass over the tile for this x-tile (later passes find it cached).
template <class C, int NR>
void tile_dot(const uint8_t* tile, int64_t nb, int64_t format, const QuantizedRows& xr,
              int64_t j0, float* out, int64_t ldo, int64_t r0, int64_t valid, const float* bias,
              bool prefetch) {
  const uint8_t* dh = tile + nb * kTile * C::kBlockBytes;
  const uint8_t* mh = dh + nb * kTile * 2;
  const bool stored_min = format_traits(format).stored_min;  // Q4_1, Q5_1: m, else m / d
  const float min_per_d = format_traits(format).min_per_d;
  const int64_t share = row_bytes_of(format, nb) * kTile / nb;  // bytes of the tile per block
  v16f acc[NR];
  for (int j = 0; j < NR; ++j) acc[j] = splat(0.0f);
  alignas(64) uint8_t scales[2][128];  // a super-block's scales and mins (IQ4_XS: its ls)
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* codes = tile + b * kTile * C::kBlockBytes;
    if (prefetch) {  // the tile's bytes (codes and scales) swept evenly, one block's share
      const char* from = reinterpret_cast<const char*>(tile) + kAhead + b * share;
      const char* line =
          reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(from) & ~uintptr_t{63});
      for (; line < from + share; line += 64) _mm_prefetch(line, _MM_HINT_T1);
    }
    I16 u[8];
    C::unpack(codes, u);
    if constexpr (kKQuant<C>) {
      I16 s[NR];
      for (int j = 0; j < NR; ++j) s[j] = zero16();
      for (int t = 0; t < 8; ++t)
        for (int j = 0; j < NR; ++j)
          s[j] = dot4(s[j], u[t], load4(xr.q.data() + codes_at(j0 + j, b, t, nb)), false);
      if (b % 8 == 0) unpack_qk_scales(dh + 192 * (b / 8), scales[0], scales[1]);
      const I16 sc = ubytes16(scales[0] + 16 * (b % 8)), mn = ubytes16(scales[1] + 16 * (b % 8));
      const uint8_t* halves = dh + nb / 8 * 192 + 64 * (b / 8);  // d, then dmin
      // d * sc and -dmin * m: exact in fp32 (an fp16 times 6 bits)
      const v16f dsc = to_float(sc) * halves16(halves);
      const v16f mneg = to_float(mn) * -halves16(halves + 32);
      for (int j = 0; j < NR; ++j) {
        const int64_t at = unit_of(j0 + j, b, nb);
        acc[j] = fma16(to_float(s[j]), dsc * xr.dx[at], acc[j]);
        acc[j] = fma16(mneg, splat(xr.dxs[at]), acc[j]);
      }
      continue;
    }
    if constexpr (kIQ4<C>) {
      // Each sum starts at -128 * sum(xq): it ends at sum(v * xq), exact in int32.
      I16 s[NR];
      for (int j = 0; j < NR; ++j) s[j] = splat16(xr.xm[unit_of(j0 + j, b, nb)]);
      for (int t = 0; t < 8; ++t)
        for (int j = 0; j < NR; ++j)
          s[j] = dot4(s[j], u[t], load4(xr.q.data() + codes_at(j0 + j, b, t, nb)), true);
      v16f scale;
      if constexpr (std::is_same_v<C, IQ4XS>) {
        const uint8_t* sb = dh + 128 * (b / 8);  // scales_l, scales_h, d
        if (b % 8 == 0) unpack_iq4xs_scales(sb, scales[0]);
        const I16 ls = ubytes16(scales[0] + 64 * (b % 2) + 16 * (b % 8 / 2));
        scale = (to_float(ls) - 32.0f) * halves16(sb + 96);  // exact: fp16 times 6 bits
      } else {
        scale = halves16(dh + 32 * b);
      }
      for (int j = 0; j < NR; ++j) {
        const int64_t at = unit_of(j0 + j, b, nb);
        acc[j] = fma16(to_float(s[j]), scale * xr.dx[at], acc[j]);
      }
      continue;
    }
    if constexpr (std::is_same_v<C, Q6K>) {
      // Each half of 16 apart (vectors 0-3: codes 0-15; 4-7: codes 16-31), then scaled.
      const int8_t* sc = reinterpret_cast<const int8_t*>(dh) + 32 * b;
      const v16f d = halves16(dh + nb * 2 * kTile + 32 * (b / 8));
      I16 s0[NR], s1[NR];
      for (int j = 0; j < NR; ++j) s0[j] = s1[j] = zero16();
      for (int t = 0; t < 8; ++t)
        for (int j = 0; j < NR; ++j) {
          const int32_t x4 = load4(xr.q.data() + codes_at(j0 + j, b, t, nb));
          if (t < 4) s0[j] = dot4(s0[j], u[t], x4, false);
          else s1[j] = dot4(s1[j], u[t], x4, false);
        }
      const I16 sc0 = bytes16(sc), sc1 = bytes16(sc + 16);
      for (int j = 0; j < NR; ++j) {
        const int64_t at = unit_of(j0 + j, b, nb);
        const int32_t* x16 = xr.x16.data() + 2 * at;
        const I16 sum = scaled_pair(sc0, s0[j], 32 * x16[0], sc1, s1[j], 32 * x16[1]);
        acc[j] = fma16(to_float(sum), d * xr.dx[at], acc[j]);
      }
      continue;
    }
    I16 s[NR];
    for (int j = 0; j < NR; ++j) s[j] = zero16();
    for (int t = 0; t < 8; ++t)
      for (int j = 0; j < NR; ++j)
        s[j] = dot4(s[j], u[t], load4(xr.q.data() + codes_at(j0 + j, b, t, nb)), C::kWide);
    const v16f d = halves16(dh + 32 * b);
    const v16f m = stored_min ? halves16(mh + 32 * b) : d * min_per_d;
    for (int j = 0; j < NR; ++j) {
      const int64_t at = unit_of(j0 + j, b, nb);
      acc[j] = fma16(to_float(s[j]), d * xr.dx[at], acc[j]);
      acc[j] = fma16(m, splat(xr.dxs[at]), acc[j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    float lanes[kTile];
    store16(lanes, acc[j]);
    float* o = out + (j0 + j) * ldo + r0;
    for (int64_t i = 0; i < valid; ++i) o[i] = lanes[i] + (bias ? bias[r0 + i] : 0.0f);
  }
}

#ifndef __AVX512F__
// AVX2. A tile's 8 unpacked code vectors and NR rows' sums of 16 lanes are two ymm each
// here, far more than the 16 registers: in tile_dot's form every dot4 spilled and
// reloaded its sums. So a tile runs as two passes of 8 rows (lanes 0-7, then 8-15: the
// low, then the high 32 bytes of each 64-byte vector, and the matching halves of the
// scales) with one ymm of int32 sums per input row, each code vector unpacked where it is
// used, and the activations in groups of 8 rows (QuantizedRows), so that every broadcast
// is at a constant offset from one pointer. The maddubs products are summed in int16 over
// as many code vectors as cannot overflow (pairs of u * x up to umax * 127 * 2: 4-bit
// codes 8 vectors, 5-bit 4, 6-bit 2; IQ4's and Q8_0's bytes as two nibbles, 8 each), then
// widened by one madd, where dot4 widens every product. The int32 sums are the same exact
// integers and each lane's float operations the same, so the bits are tile_dot's.
inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline __m128i load8(const void* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}
inline __m256 halves8(const uint8_t* p) {  // 8 fp16 as floats
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 ubytes8(const uint8_t* p) {  // 8 uint8 as floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8(p)));
}

// Code vector t of a block (C::unpack's u[t]) for pass h's 8 rows.
template <class C>
inline __m256i code_vector(const uint8_t* p, int h, int t) {
  if constexpr (std::is_same_v<C, Q8>) {
    return _mm256_xor_si256(load32(p + 64 * t + 32 * h), _mm256_set1_epi8(-128));
  } else {
    const __m256i b = load32(p + 64 * (t / 2) + 32 * h);
    __m256i u = and15(t % 2 ? _mm256_srli_epi16(b, 4) : b);
    if constexpr (std::is_same_v<C, Q5> || std::is_same_v<C, Q5K>) {
      uint32_t bits;  // the pass's half of word t of the plane of 5th bits
      std::memcpy(&bits, p + 256 + 8 * t + 4 * h, 4);
      u = _mm256_or_si256(u, high_bytes(bits));
    }
    if constexpr (std::is_same_v<C, Q6K>)
      u = _mm256_or_si256(u, top2_half(load32(p + 256 + 64 * (t / 4) + 32 * h), t % 4));
    if constexpr (kIQ4<C>)
      u = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(kIQ4Codes))),
                              u);
    return u;
  }
}

// Code vectors summed in int16 before one madd, so that no int16 sum can overflow.
template <class C>
constexpr int kInt16Sums = std::is_same_v<C, Q6K>                           ? 2
                           : std::is_same_v<C, Q5> || std::is_same_v<C, Q5K> ? 4
                                                                              : 8;

// s[j] += per lane the sum over code vectors t0 .. t1 - 1 of u[t] . row j's 4 codes t
// (xq: row 0's codes of the block in the grouped layout: codes t of row j at 32 t + 4 j).
// Inlined with t0, t1 constants and the loops unrolled, so each code vector's unpacking is
// fixed at compile time (left as a loop, GCC computed t % 2, t / 4 and branched on them).
// Wide codes (IQ4, Q8_0: up to 255) as two nibbles, the high ones times 16. `scale`: each
// lane's int16 multiplier of its sums (both halves of the lane alike: Q6_K's sub-block
// scale, so s[j] += sc * sum), or 1.
template <class C, int NR>
inline void sums_half(const uint8_t* codes, int h, const int8_t* xq, int t0, int t1,
                      __m256i (&s)[NR], __m256i scale = _mm256_set1_epi16(1)) {
  const __m256i ones = _mm256_set1_epi16(1);
  auto x = [&](int t, int j) { return _mm256_set1_epi32(load4(xq + 32 * t + 4 * j)); };
  if constexpr (C::kWide) {
    __m256i lo[NR], hi[NR];
#pragma GCC unroll 8
    for (int t = t0; t < t1; ++t) {
      const __m256i u = code_vector<C>(codes, h, t);
      const __m256i ul = and15(u), uh = and15(_mm256_srli_epi16(u, 4));
      for (int j = 0; j < NR; ++j) {
        const __m256i a = _mm256_maddubs_epi16(ul, x(t, j)), b = _mm256_maddubs_epi16(uh, x(t, j));
        lo[j] = t == t0 ? a : _mm256_add_epi16(lo[j], a);
        hi[j] = t == t0 ? b : _mm256_add_epi16(hi[j], b);
      }
    }
    for (int j = 0; j < NR; ++j)
      s[j] = _mm256_add_epi32(
          s[j], _mm256_add_epi32(_mm256_madd_epi16(lo[j], ones),
                                 _mm256_slli_epi32(_mm256_madd_epi16(hi[j], ones), 4)));
  } else {
    // The block's code vectors once, then row by row: with the rows inner, GCC turned each
    // row's int16 sum into a tree over every product and spilled the products.
    __m256i u[8];
#pragma GCC unroll 8
    for (int t = t0; t < t1; ++t) u[t] = code_vector<C>(codes, h, t);
    for (int j = 0; j < NR; ++j) {
#pragma GCC unroll 8
      for (int t = t0; t < t1; t += kInt16Sums<C>) {
        __m256i p = _mm256_maddubs_epi16(u[t], x(t, j));
#pragma GCC unroll 8
        for (int g = 1; g < kInt16Sums<C>; ++g)
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u[t + g], x(t + g, j)));
        s[j] = _mm256_add_epi32(s[j], _mm256_madd_epi16(p, scale));
      }
    }
  }
}

// Halves h0 .. h0 + H - 1 (rows 8h .. 8h + 7) of tile_dot for NR input rows from j0, all
// in one group of kGroupRows (tile_rows' row counts halve from 8 at a multiple of 64).
// Many rows run one half per pass (H = 1: their sums fill the registers); one or two rows
// both halves in one pass (H = 2), which unpacks each block's scales once.
template <class C, int NR, int H>
void tile_dot_halves(const uint8_t* tile, int64_t nb, int64_t format, const QuantizedRows& xr,
                     int64_t j0, float* out, int64_t ldo, int64_t r0, int64_t valid,
                     const float* bias, bool prefetch, int h0) {
  const uint8_t* dh = tile + nb * kTile * C::kBlockBytes;
  const uint8_t* mh = dh + nb * kTile * 2;
  const bool stored_min = format_traits(format).stored_min;
  const float min_per_d = format_traits(format).min_per_d;
  const int64_t share = row_bytes_of(format, nb) * kTile / nb;
  const int64_t g0 = j0 / kGroupRows * nb * kGroupRows, slot = j0 % kGroupRows;
  const int8_t* xq0 = xr.q.data() + g0 * 32 + 4 * slot;  // + block b: 32 kGroupRows b
  const float* dx0 = xr.dx.data() + g0 + slot;           // + block b: kGroupRows b
  const float* dxs0 = xr.dxs.data() + g0 + slot;
  __m256 acc[H][NR];
  for (int hh = 0; hh < H; ++hh)
    for (int j = 0; j < NR; ++j) acc[hh][j] = _mm256_setzero_ps();
  alignas(64) uint8_t scales[2][128];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* codes = tile + b * kTile * C::kBlockBytes;
    if (prefetch) {
      const char* from = reinterpret_cast<const char*>(tile) + kAhead + b * share;
      const char* line =
          reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(from) & ~uintptr_t{63});
      for (; line < from + share; line += 64) _mm_prefetch(line, _MM_HINT_T1);
    }
    const int8_t* xq = xq0 + 32 * kGroupRows * b;
    auto dx = [&](int j) { return _mm256_set1_ps(dx0[kGroupRows * b + j]); };
    auto dxs = [&](int j) { return _mm256_set1_ps(dxs0[kGroupRows * b + j]); };
    if constexpr (kKQuant<C>) {
      if (b % 8 == 0) unpack_qk_scales(dh + 192 * (b / 8), scales[0], scales[1]);
    }
    if constexpr (std::is_same_v<C, IQ4XS>) {
      if (b % 8 == 0) unpack_iq4xs_scales(dh + 128 * (b / 8), scales[0]);
    }
    for (int hh = 0; hh < H; ++hh) {
      const int h = h0 + hh;
      __m256(&a)[NR] = acc[hh];
      if constexpr (std::is_same_v<C, Q6K>) {
        // T = sc0 (S0 - 32 X0) + sc1 (S1 - 32 X1) (tile_dot's integers) as
        // sc0 S0 + sc1 S1 - 32 (sc0 X0 + sc1 X1): the scales multiply the int16 sums in
        // the madds that widen them, and one madd of (sc0, sc1) by (X0, X1) (|X| <= 16 *
        // 127 fits int16) takes the offset, where tile_dot spends two vpmulld a row.
        const int8_t* sc = reinterpret_cast<const int8_t*>(dh) + 32 * b + 8 * h;
        const __m256i sc0 = _mm256_cvtepi8_epi32(load8(sc));
        const __m256i sc1 = _mm256_cvtepi8_epi32(load8(sc + 16));
        const __m256i low = _mm256_set1_epi32(0xffff);
        auto pair = [&](__m256i a, __m256i b) {  // int16 a | b << 16 in each lane
          return _mm256_or_si256(_mm256_and_si256(a, low), _mm256_slli_epi32(b, 16));
        };
        __m256i s[NR];
        for (int j = 0; j < NR; ++j) s[j] = _mm256_setzero_si256();
        sums_half<C, NR>(codes, h, xq, 0, 4, s, pair(sc0, sc0));
        sums_half<C, NR>(codes, h, xq, 4, 8, s, pair(sc1, sc1));
        const __m256i scs = pair(sc0, sc1);
        const __m256 d = halves8(dh + nb * 2 * kTile + 32 * (b / 8) + 16 * h);
        for (int j = 0; j < NR; ++j) {
          const int32_t* x16 = xr.x16.data() + 2 * (g0 + slot + kGroupRows * b + j);
          const uint32_t xs16 = (static_cast<uint32_t>(x16[0]) & 0xffffu) |
                                static_cast<uint32_t>(x16[1]) << 16;
          const __m256i xs = _mm256_set1_epi32(static_cast<int32_t>(xs16));
          const __m256i sum =
              _mm256_sub_epi32(s[j], _mm256_slli_epi32(_mm256_madd_epi16(scs, xs), 5));
          a[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, dx(j)), a[j]);
        }
        continue;
      }
      __m256i s[NR];
      for (int j = 0; j < NR; ++j)
        s[j] = kIQ4<C> ? _mm256_set1_epi32(xr.xm[g0 + slot + kGroupRows * b + j])
                       : _mm256_setzero_si256();
      sums_half<C, NR>(codes, h, xq, 0, 8, s);
      if constexpr (kKQuant<C>) {
        const uint8_t* halves = dh + nb / 8 * 192 + 64 * (b / 8) + 16 * h;  // d, then dmin
        // d * sc and -dmin * m (tile_dot's, on 8 lanes)
        const __m256 dsc =
            _mm256_mul_ps(ubytes8(scales[0] + 16 * (b % 8) + 8 * h), halves8(halves));
        const __m256 mneg =
            _mm256_mul_ps(ubytes8(scales[1] + 16 * (b % 8) + 8 * h),
                          _mm256_xor_ps(halves8(halves + 32), _mm256_set1_ps(-0.0f)));
        for (int j = 0; j < NR; ++j) {
          a[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[j]), _mm256_mul_ps(dsc, dx(j)), a[j]);
          a[j] = _mm256_fmadd_ps(mneg, dxs(j), a[j]);
        }
        continue;
      }
      if constexpr (kIQ4<C>) {
        __m256 scale;
        if constexpr (std::is_same_v<C, IQ4XS>) {
          const __m256 ls = ubytes8(scales[0] + 64 * (b % 2) + 16 * (b % 8 / 2) + 8 * h);
          scale = _mm256_mul_ps(_mm256_sub_ps(ls, _mm256_set1_ps(32.0f)),
                                halves8(dh + 128 * (b / 8) + 96 + 16 * h));
        } else {
          scale = halves8(dh + 32 * b + 16 * h);
        }
        for (int j = 0; j < NR; ++j)
          a[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[j]), _mm256_mul_ps(scale, dx(j)), a[j]);
        continue;
      }
      const __m256 d = halves8(dh + 32 * b + 16 * h);
      const __m256 m = stored_min ? halves8(mh + 32 * b + 16 * h)
                                  : _mm256_mul_ps(d, _mm256_set1_ps(min_per_d));
      for (int j = 0; j < NR; ++j) {
        a[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[j]), _mm256_mul_ps(d, dx(j)), a[j]);
        a[j] = _mm256_fmadd_ps(m, dxs(j), a[j]);
      }
    }
  }
  for (int hh = 0; hh < H; ++hh) {
    const int h = h0 + hh;
    const int64_t lanes = std::min<int64_t>(8, valid - 8 * h);
    for (int j = 0; j < NR; ++j) {
      float v[8];
      _mm256_storeu_ps(v, acc[hh][j]);
      float* o = out + (j0 + j) * ldo + r0 + 8 * h;
      for (int64_t i = 0; i < lanes; ++i) o[i] = v[i] + (bias ? bias[r0 + 8 * h + i] : 0.0f);
    }
  }
}
#endif

// tile_dot over rows x0 .. x1 - 1: NR at a time, then halving. The AVX-512 kernel; on AVX2
// the 16-lane form that tile_dot_halves must give the bits of (hr_quant_linear_int8_tile16).
template <class C, int NR>
void tile_rows16(const uint8_t* tile, int64_t nb, int64_t format, const QuantizedRows& xr,
                 int64_t x0, int64_t x1, float* out, int64_t ldo, int64_t m, int64_t r0,
                 const float* bias) {
  const int64_t valid = std::min(kTile, m - r0);
  int64_t j = x0;
  for (; j + NR <= x1; j += NR)
    tile_dot<C, NR>(tile, nb, format, xr, j, out, ldo, r0, valid, bias, j == x0);
  if constexpr (NR > 1) {
    if (j < x1) tile_rows16<C, NR / 2>(tile, nb, format, xr, j, x1, out, ldo, m, r0, bias);
  }
}

#ifdef __AVX512F__
template <class C, int NR>
void tile_rows(const uint8_t* tile, int64_t nb, int64_t format, const QuantizedRows& xr,
               int64_t x0, int64_t x1, float* out, int64_t ldo, int64_t m, int64_t r0,
               const float* bias) {
  tile_rows16<C, NR>(tile, nb, format, xr, x0, x1, out, ldo, m, r0, bias);
}
#else
template <class C, int NR>
void tile_rows_of(const uint8_t* tile, int64_t nb, int64_t format, const QuantizedRows& xr,
                  int64_t j, float* out, int64_t ldo, int64_t r0, int64_t valid,
                  const float* bias, bool prefetch) {
  if constexpr (NR <= kBothHalves) {
    tile_dot_halves<C, NR, 2>(tile, nb, format, xr, j, out, ldo, r0, valid, bias, prefetch, 0);
  } else {
    tile_dot_halves<C, NR, 1>(tile, nb, format, xr, j, out, ldo, r0, valid, bias, prefetch, 0);
    if (valid > 8)
      tile_dot_halves<C, NR, 1>(tile, nb, format, xr, j, out, ldo, r0, valid, bias, false, 1);
  }
}

// kRows rows at a time, then the 1 to 3 left in one pass over the tile (an expert's few
// rows are often 3, 5 or 7: halving them read its weights once more).
template <class C, int NR>
void tile_rows(const uint8_t* tile, int64_t nb, int64_t format, const QuantizedRows& xr,
               int64_t x0, int64_t x1, float* out, int64_t ldo, int64_t m, int64_t r0,
               const float* bias) {
  static_assert(NR == 4, "the rows left are 1 to 3");
  const int64_t valid = std::min(kTile, m - r0);
  int64_t j = x0;
  for (; j + NR <= x1; j += NR)
    tile_rows_of<C, NR>(tile, nb, format, xr, j, out, ldo, r0, valid, bias, j == x0);
  const bool first = j == x0;
  if (x1 - j == 3) tile_rows_of<C, 3>(tile, nb, format, xr, j, out, ldo, r0, valid, bias, first);
  if (x1 - j == 2) tile_rows_of<C, 2>(tile, nb, format, xr, j, out, ldo, r0, valid, bias, first);
  if (x1 - j == 1) tile_rows_of<C, 1>(tile, nb, format, xr, j, out, ldo, r0, valid, bias, first);
}
#endif

// ldo: the row stride of out (m, or wider when W is one part of a stacked weight).
// kTile16: tile_rows16 on every ISA (the AVX2 build's check of tile_dot_halves).
template <class C, bool kTile16 = false>
void linear(int64_t format, const QuantizedRows& xr, int64_t n, int64_t k, const uint8_t* w,
            int64_t m, float* out, int64_t ldo, const float* bias, int64_t row_bytes) {
  const int64_t nb = k / 32, tiles = (m + kTile - 1) / kTile;
#pragma omp parallel if (n * k * m >= kParallelWork)
  {
    const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t t0 = tiles * id / threads, t1 = tiles * (id + 1) / threads;
    // The loop prefetches kAhead bytes ahead of where it reads; the first kAhead bytes of
    // this thread's tiles are asked for at once here, not missed one by one.
    const char* first = reinterpret_cast<const char*>(w + t0 * kTile * row_bytes);
    const int64_t warm = std::min<int64_t>(kAhead, (t1 - t0) * kTile * row_bytes);
    for (int64_t b = 0; b < warm; b += 64) _mm_prefetch(first + b, _MM_HINT_T1);
    for (int64_t x0 = 0; x0 < n; x0 += kXTile) {
      const int64_t x1 = std::min(n, x0 + kXTile);
      for (int64_t t = t0; t < t1; ++t)
        if constexpr (kTile16)
          tile_rows16<C, kRows>(w + t * kTile * row_bytes, nb, format, xr, x0, x1, out, ldo,
                                m, t * kTile, bias);
        else
          tile_rows<C, kRows>(w + t * kTile * row_bytes, nb, format, xr, x0, x1, out, ldo, m,
                              t * kTile, bias);
    }
  }
}

// Code j of block b of row r of a tiled weight (for dequantizing: the embedding lookup).
template <class C>
inline int code_at(const uint8_t* tile, int64_t i, int64_t b, int j) {
  const int t = j / 4, k = j % 4;
  const uint8_t* block = tile + b * kTile * C::kBlockBytes;
  if constexpr (C::kWide) return static_cast<int8_t>(block[64 * t + 4 * i + k]);
  const uint8_t byte = block[64 * (t / 2) + 4 * i + k];  // vector s = t / 2, nibble t % 2
  const int low = t % 2 ? byte >> 4 : byte & 15;
  if constexpr (C::kBlockBytes == 24) {  // Q6_K: bits 2(t % 4).. of vector t / 4's byte
    return low | ((block[256 + 64 * (t / 4) + 4 * i + k] >> (2 * (t % 4))) & 3) << 4;
  }
  if constexpr (C::kBlockBytes == 20) {  // Q5_0: bit 4i + k of word t of the plane
    const int bit = 4 * static_cast<int>(i) + k;
    return low | ((block[256 + 8 * t + bit / 8] >> (bit % 8)) & 1) << 4;
  }
  return low;
}

// fn(tile, i, nb, o) for each of the `count` rows to dequantize (`rows`, else 0..count - 1):
// the row's tile, its lane in the tile, blocks per row, and its output row of k floats.
template <class Fn>
void for_each_tiled_row(int64_t format, const uint8_t* w, int64_t k, const int64_t* rows,
                        int64_t count, float* out, Fn fn) {
  const int64_t nb = k / 32, row_bytes = row_bytes_of(format, nb);
#pragma omp parallel for schedule(static) if (count * k > (1 << 16))
  for (int64_t c = 0; c < count; ++c) {
    const int64_t r = rows ? rows[c] : c;
    fn(w + r / kTile * kTile * row_bytes, r % kTile, nb, out + c * k);
  }
}

void dequantize_tiled_q6k(const uint8_t* w, int64_t k, const int64_t* rows, int64_t count,
                          float* out) {
  for_each_tiled_row(kQ6_K, w, k, rows, count, out,
                     [](const uint8_t* tile, int64_t i, int64_t nb, float* o) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(tile + nb * kTile * Q6K::kBlockBytes);
    const uint8_t* dh = tile + nb * kTile * (Q6K::kBlockBytes + 2);
    for (int64_t b = 0; b < nb; ++b) {
      const float d = half_to_float(dh + 2 * (b / 8 * kTile + i));
      for (int j = 0; j < 32; ++j) {
        // As gguf computes them: (d * sc) * (q - 32), exact in fp32.
        const float scale = d * static_cast<float>(sc[32 * b + 16 * (j / 16) + i]);
        const int q = code_at<Q6K>(tile, i, b, j);
        o[b * 32 + j] = scale * static_cast<float>(q - 32);
      }
    }
  });
}

template <class C>  // Q4K, Q5K
void dequantize_tiled_qk(int64_t format, const uint8_t* w, int64_t k, const int64_t* rows,
                         int64_t count, float* out) {
  for_each_tiled_row(format, w, k, rows, count, out,
                     [](const uint8_t* tile, int64_t i, int64_t nb, float* o) {
    const uint8_t* sm = tile + nb * kTile * C::kBlockBytes;
    const uint8_t* dh = sm + nb / 8 * 192;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* s = sm + b / 8 * 192;
      const int j = static_cast<int>(b % 8), t = 4 * (j / 4);
      const int low = s[16 * j + i], top = s[128 + 16 * (j % 4) + i];
      const int sc = (low & 15) | ((top >> t) & 3) << 4;
      const int mn = (low >> 4) | ((top >> (t + 2)) & 3) << 4;
      const float d = half_to_float(dh + 64 * (b / 8) + 2 * i);
      const float dmin = half_to_float(dh + 64 * (b / 8) + 32 + 2 * i);
      // As gguf computes them: (d * sc) * q - dmin * m, each product exact in fp32.
      const float scale = d * static_cast<float>(sc), offset = dmin * static_cast<float>(mn);
      for (int q = 0; q < 32; ++q)
        o[b * 32 + q] = scale * static_cast<float>(code_at<C>(tile, i, b, q)) - offset;
    }
  });
}

void dequantize_tiled_iq4(int64_t format, const uint8_t* w, int64_t k, const int64_t* rows,
                          int64_t count, float* out) {
  for_each_tiled_row(format, w, k, rows, count, out,
                     [format](const uint8_t* tile, int64_t i, int64_t nb, float* o) {
    const uint8_t* dh = tile + nb * kTile * IQ4::kBlockBytes;
    for (int64_t b = 0; b < nb; ++b) {
      float scale;  // as gguf computes it: d, or d * (ls - 32) (exact in fp32)
      if (format == kIQ4_XS) {
        const uint8_t* sb = dh + 128 * (b / 8);
        const int j = static_cast<int>(b % 8);
        const int ls = ((sb[16 * (j / 2) + i] >> (4 * (j % 2))) & 15) |
                       ((sb[64 + 16 * (j / 4) + i] >> (2 * (j % 4))) & 3) << 4;
        scale = half_to_float(sb + 96 + 2 * i) * static_cast<float>(ls - 32);
      } else {
        scale = half_to_float(dh + 2 * (b * kTile + i));
      }
      for (int j = 0; j < 32; ++j)  // indices as Q4_0's codes
        o[b * 32 + j] = scale * static_cast<float>(kIQ4Values[code_at<Q4>(tile, i, b, j)]);
    }
  });
}

template <class C>
void dequantize_tiled(int64_t format, const uint8_t* w, int64_t k, const int64_t* rows,
                      int64_t count, float* out) {
  for_each_tiled_row(format, w, k, rows, count, out,
                     [format](const uint8_t* tile, int64_t i, int64_t nb, float* o) {
    const uint8_t* dh = tile + nb * kTile * C::kBlockBytes;
    for (int64_t b = 0; b < nb; ++b) {
      const float d = half_to_float(dh + 2 * (b * kTile + i));
      const float mn = format_traits(format).stored_min
                           ? half_to_float(dh + 2 * (nb * kTile + b * kTile + i))
                           : 0.0f;
      for (int j = 0; j < 32; ++j) {
        const int q = code_at<C>(tile, i, b, j);
        // As gguf computes them: d * q (+ m: Q4_1, Q5_1), Q4_0 as d * (q - 8), Q5_0 as
        // d * (q - 16); all exact in fp32.
        o[b * 32 + j] = format == kQ4_0   ? d * static_cast<float>(q - 8)
                        : format == kQ5_0 ? d * static_cast<float>(q - 16)
                                          : d * static_cast<float>(q) + mn;
      }
    }
  });
}

template <bool kTile16>
void linear_of(int64_t format, const QuantizedRows& xr, int64_t n, int64_t k, const uint8_t* w,
               int64_t m, float* out, int64_t ldo, const float* bias) {
  const int64_t rb = row_bytes_of(format, k / 32);
  auto run = [&](auto kind) {
    linear<decltype(kind), kTile16>(format, xr, n, k, w, m, out, ldo, bias, rb);
  };
  switch (format) {
    case kQ8_0: return run(Q8{});
    case kQ5_0: case kQ5_1: return run(Q5{});
    case kQ6_K: return run(Q6K{});
    case kQ4_K: return run(Q4K{});
    case kQ5_K: return run(Q5K{});
    case kIQ4_NL: return run(IQ4{});
    case kIQ4_XS: return run(IQ4XS{});
    default: return run(Q4{});  // kQ4_0, kQ4_1
  }
}

template <bool kTile16>
void quant_linear_int8(int64_t format, const float* x, int64_t n, int64_t k, const uint8_t* w,
                       int64_t m, float* out, const float* bias) {
  QuantizedRows xr;
  quantize_rows(x, n, k, xr);
  if (format != kStacked) return linear_of<kTile16>(format, xr, n, k, w, m, out, m, bias);
  // A stack of tiled parts (Q8_0 v rows beside Q5_0 q and k), as hr_quant_linear's.
  for_each_part(w, [&](int64_t f, const uint8_t* weight, int64_t rows, int64_t r) {
    linear_of<kTile16>(f, xr, n, k, weight, rows, out + r, m, bias ? bias + r : nullptr);
  });
}

}  // namespace

// out[n, m] = q8(x[n, k]) @ W[m, k]^T (+ bias[m]); W in the tiled layout of `format` (Format;
// ceil(m / 16) tiles), or (kStacked) a table of tiled parts; k % 32 == 0 (k % block_values).
HR_EXPORT void hr_quant_linear_int8(int64_t format, const float* x, int64_t n, int64_t k,
                                    const uint8_t* w, int64_t m, float* out, const float* bias) {
  quant_linear_int8<false>(format, x, n, k, w, m, out, bias);
}

// hr_quant_linear_int8 through tile_dot's 16-lane form on every ISA: in the AVX2 build, the
// same bits as its tile_dot_halves must give (tests/kernels/test_cpu_kquants.py), so an
// AVX2-only machine checks them without an AVX-512 build to compare with.
HR_EXPORT void hr_quant_linear_int8_tile16(int64_t format, const float* x, int64_t n,
                                           int64_t k, const uint8_t* w, int64_t m, float* out,
                                           const float* bias) {
  quant_linear_int8<true>(format, x, n, k, w, m, out, bias);
}

// out[i, :] = W[rows[i], :] in fp32 for W in the tiled layout (rows == nullptr: all).
HR_EXPORT void hr_dequantize_tiled(int64_t format, const uint8_t* w, int64_t k,
                                   const int64_t* rows, int64_t count, float* out) {
  switch (format) {
    case kQ8_0: return dequantize_tiled<Q8>(format, w, k, rows, count, out);
    case kQ5_0: case kQ5_1: return dequantize_tiled<Q5>(format, w, k, rows, count, out);
    case kQ6_K: return dequantize_tiled_q6k(w, k, rows, count, out);
    case kQ4_K: return dequantize_tiled_qk<Q4K>(format, w, k, rows, count, out);
    case kQ5_K: return dequantize_tiled_qk<Q5K>(format, w, k, rows, count, out);
    case kIQ4_NL: case kIQ4_XS: return dequantize_tiled_iq4(format, w, k, rows, count, out);
    default: return dequantize_tiled<Q4>(format, w, k, rows, count, out);  // kQ4_0, kQ4_1
  }
}
