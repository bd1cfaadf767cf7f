// Shared helpers of the CPU kernels (kernels/cpu/build.py builds them, library.py loads them).
//
// The kernels are written with GCC vector extensions, 16 floats wide: built with
// -march=x86-64-v4 they become AVX-512, with -march=x86-64-v3 pairs of AVX2 ops, so
// one source serves both. Every entry point is `extern "C"` with plain pointers and
// int64 sizes; the Python launchers check dtypes, shapes and contiguity first.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#define HR_EXPORT extern "C" __attribute__((visibility("default")))

// Multiply-adds below which a kernel runs on the calling thread alone: a fork-join costs
// a few microseconds on idle cores, and far more when the cores are shared (another
// replica, a CPU quota), while this much work takes ~10 us on one core. Tiny models and
// short decode contexts then never wake the OpenMP team.
constexpr int64_t kParallelWork = int64_t{1} << 17;

typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int8_t v16i8 __attribute__((vector_size(16)));

#ifdef __AVX512F__
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef v16i v16m;  // a lane-wise comparison: -1 where true, else 0

static inline v16f splat(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// Unaligned loads and stores through memcpy: the compiler emits one vmovups.
static inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

static inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }
#else
// Without AVX-512 GCC has no 64-byte vector mode, so a vector_size(64) variable lives on
// the stack: every loop-carried accumulator, every scalar broadcast and every conversion
// went through memory (stores of one width read back at another, which stall store
// forwarding), and the exact kernel ran at 1 GB/s, 10x slower than the int8 one. Two
// __m256 in a struct stay in registers; the operators below are the same lane-wise
// operations, so the sums and their bits are the AVX-512 build's. (GCC's C++ default,
// -ffp-contract=fast, fuses a multiply and an add into one FMA in either form, alike.)
struct v16m {
  __m256 lo, hi;  // all-ones lanes where true
};

struct v16f {
  __m256 lo, hi;  // lanes 0-7, 8-15
  float operator[](int i) const { return reinterpret_cast<const float*>(this)[i]; }
  float& operator[](int i) { return reinterpret_cast<float*>(this)[i]; }
};

static inline v16f splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }

static inline v16f load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }

static inline void store16(float* p, v16f v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}

#define HR_V16_BINARY(op, fn)                                                              \
  static inline v16f operator op(v16f a, v16f b) { return {fn(a.lo, b.lo), fn(a.hi, b.hi)}; } \
  static inline v16f operator op(v16f a, float b) { return a op splat(b); }               \
  static inline v16f operator op(float a, v16f b) { return splat(a) op b; }               \
  static inline v16f& operator op##=(v16f & a, v16f b) { return a = a op b; }             \
  static inline v16f& operator op##=(v16f & a, float b) { return a = a op splat(b); }
HR_V16_BINARY(+, _mm256_add_ps)
HR_V16_BINARY(-, _mm256_sub_ps)
HR_V16_BINARY(*, _mm256_mul_ps)
HR_V16_BINARY(/, _mm256_div_ps)
#undef HR_V16_BINARY

static inline v16f operator-(v16f a) {  // the sign bit flipped, as GCC's vector negation
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_xor_ps(a.lo, sign), _mm256_xor_ps(a.hi, sign)};
}

// Comparisons as GCC's vector extension defines them: ordered, except != (true for NaN).
#define HR_V16_COMPARE(op, imm)                                                              \
  static inline v16m operator op(v16f a, v16f b) {                                         \
    return {_mm256_cmp_ps(a.lo, b.lo, imm), _mm256_cmp_ps(a.hi, b.hi, imm)};               \
  }                                                                                          \
  static inline v16m operator op(v16f a, float b) { return a op splat(b); }               \
  static inline v16m operator op(float a, v16f b) { return splat(a) op b; }
HR_V16_COMPARE(<, _CMP_LT_OQ)
HR_V16_COMPARE(<=, _CMP_LE_OQ)
HR_V16_COMPARE(>, _CMP_GT_OQ)
HR_V16_COMPARE(>=, _CMP_GE_OQ)
HR_V16_COMPARE(==, _CMP_EQ_OQ)
HR_V16_COMPARE(!=, _CMP_NEQ_UQ)
#undef HR_V16_COMPARE

static inline v16m operator&(v16m a, v16m b) {
  return {_mm256_and_ps(a.lo, b.lo), _mm256_and_ps(a.hi, b.hi)};
}
#endif

// Lane by lane, x where m is true, else y (the vector extension's m ? x : y).
static inline v16f select16(v16m m, v16f x, v16f y) {
#ifdef __AVX512F__
  return m ? x : y;
#else
  return {_mm256_blendv_ps(y.lo, x.lo, m.lo), _mm256_blendv_ps(y.hi, x.hi, m.hi)};
#endif
}

// The sum of 16 lanes, by pairwise halving: the same order on every ISA and in every
// kernel, so a dot product gives the same bits whichever kernel computed it.
static inline float hsum(v16f v) {
#ifdef __AVX512F__
  const __m512 z = (__m512)v;
  const __m256 a = _mm256_add_ps(_mm512_extractf32x8_ps(z, 0), _mm512_extractf32x8_ps(z, 1));
#else
  const __m256 a = _mm256_add_ps(v.lo, v.hi);
#endif
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  const __m128 d = _mm_add_ss(c, _mm_movehdup_ps(c));
  return _mm_cvtss_f32(d);
}

// n fp16 values to floats, exactly: 16 at a time, then one by one.
static inline void halves_to_float(const uint8_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i))));
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    dst[i] = _cvtsh_ss(h);
  }
}

// The same, and each value times `factor` into scaled (from registers: reading back the
// values just stored would stall on store forwarding).
static inline void halves_to_float(const uint8_t* src, int64_t n, float* dst, float* scaled,
                                   float factor) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i)));
    _mm256_storeu_ps(dst + i, v);
    _mm256_storeu_ps(scaled + i, _mm256_mul_ps(v, _mm256_set1_ps(factor)));
  }
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    dst[i] = _cvtsh_ss(h);
    scaled[i] = dst[i] * factor;
  }
}

// The weights' block formats, by the code the launchers pass (kernels/cpu/quant.py FORMATS
// holds the same codes; tests/kernels/test_cpu_formats.py compares the two tables).
enum Format : int64_t {
  kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7,
  kStacked = 8,  // a table of parts, each in its own format (for_each_part)
  kIQ4_NL = 9, kIQ4_XS = 10,
};

// What the kernels need to know of a format (ggml's type_traits, at this scale).
struct FormatTraits {
  int64_t block_bytes;   // bytes of one block of block_values weights: in the file, and per
                         // row (the exact kernel's layout) or 16 rows (the int8 kernel's tiles)
  int64_t block_values;  // weights per block: 32, or 256 (the K-quants' and IQ4_XS's
                         // super-blocks)
  bool stored_min;       // each block of 32 stores its min m: w = d * q + m (Q4_1, Q5_1)
  // Else, in the int8 kernel, which reads every code unsigned: the block's min over its d
  // (Q4_0 q - 8, Q5_0 q - 16, Q8_0's signed q read as q + 128); 0 where the kernel has a
  // rule of its own (the K-quants, IQ4).
  float min_per_d;
};

constexpr FormatTraits kFormats[] = {
    {18, 32, false, -8.0f},    // kQ4_0
    {20, 32, true, 0.0f},      // kQ4_1
    {34, 32, false, -128.0f},  // kQ8_0
    {22, 32, false, -16.0f},   // kQ5_0
    {24, 32, true, 0.0f},      // kQ5_1
    {144, 256, false, 0.0f},   // kQ4_K
    {176, 256, false, 0.0f},   // kQ5_K
    {210, 256, false, 0.0f},   // kQ6_K
    {0, 32, false, 0.0f},      // kStacked: no blocks of its own
    {18, 32, false, 0.0f},     // kIQ4_NL
    {136, 256, false, 0.0f},   // kIQ4_XS
};
static_assert(sizeof kFormats / sizeof kFormats[0] == kIQ4_XS + 1, "a row per Format");

constexpr const FormatTraits& format_traits(int64_t format) { return kFormats[format]; }

// Bytes of a weight row of nb blocks of 32 in `format`, codes and scales (either layout):
// nb / (block_values / 32) blocks, the division a shift (block_values is 32 or 256).
constexpr int64_t row_bytes_of(int64_t format, int64_t nb) {
  const FormatTraits& f = kFormats[format];
  return (nb >> __builtin_ctzll(static_cast<uint64_t>(f.block_values / 32))) * f.block_bytes;
}

// llama.cpp's kvalues_iq4nl: the 16 values an IQ4_NL / IQ4_XS index picks.
alignas(16) constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};

static inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // exact: every fp16 value is a float
}

// a * b + c, fused, lane by lane (explicit, so no ISA or flag changes the rounding).
static inline v16f fma16(v16f a, v16f b, v16f c) {
#ifdef __AVX512F__
  return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
#endif
}

// 16 bytes to 16 floats. Intrinsics, because GCC scalarises a vector-extension
// conversion from bytes (a lane at a time through general registers).
static inline v16f widen_i32(__m128i lo8, __m128i hi8, bool is_signed) {
#ifdef __AVX512F__
  (void)hi8;
  const __m512i w = is_signed ? _mm512_cvtepi8_epi32(lo8) : _mm512_cvtepu8_epi32(lo8);
  return (v16f)_mm512_cvtepi32_ps(w);
#else
  const __m256i a = is_signed ? _mm256_cvtepi8_epi32(lo8) : _mm256_cvtepu8_epi32(lo8);
  const __m256i b = is_signed ? _mm256_cvtepi8_epi32(hi8) : _mm256_cvtepu8_epi32(hi8);
  return {_mm256_cvtepi32_ps(a), _mm256_cvtepi32_ps(b)};
#endif
}

static inline v16f bytes_to_float(__m128i bytes, bool is_signed) {
  return widen_i32(bytes, _mm_srli_si128(bytes, 8), is_signed);
}

// Low and high nibbles of 16 bytes, as two vectors of 16 floats.
static inline void nibbles_to_float(const uint8_t* p, v16f& lo, v16f& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  lo = bytes_to_float(_mm_and_si128(bytes, mask), false);
  hi = bytes_to_float(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), false);
}

static inline v16f int8_to_float(const uint8_t* p) {
  return bytes_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), true);
}

// expf for a vector, Cephes-style: exp(x) = 2^n * p(r), r = x - n ln2, |r| <= ln2/2.
// Relative error < 2 ulp; x < -87.3 gives 0, x is clamped at 88.3 (~2e38, finite).
static inline v16f exp16(v16f x) {
  const v16f lo = splat(-87.3f), hi = splat(88.3f);
  const v16f under = select16(x <= lo, splat(1.0f), v16f{});
  x = select16(x < lo, lo, x);
  x = select16(x > hi, hi, x);
  v16f n = x * 1.44269504088896341f;
  // Round to nearest without libm: add and subtract 1.5 * 2^23.
  n = (n + 12582912.0f) - 12582912.0f;
  v16f r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16f p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
#ifdef __AVX512F__
  v16i e = __builtin_convertvector(n, v16i) + 127;
  e = e << 23;
  v16f scale;
  std::memcpy(&scale, &e, sizeof scale);
#else  // the same: truncate to int32 (n is integral), + 127, into the exponent's bits
  const auto pow2 = [](__m256 h) {
    const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(h), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  };
  const v16f scale = {pow2(n.lo), pow2(n.hi)};
#endif
  v16f out = p * scale;
  return select16(under != 0.0f, v16f{}, out);
}

// The entry points, declared once so that every file (decoder.cpp chains them) sees the
// same signatures the definitions have.
HR_EXPORT void hr_quant_linear(int64_t format, const float* x, int64_t n, int64_t k,
                               const uint8_t* w, int64_t m, float* out, const float* bias);
HR_EXPORT void hr_quant_linear_int8(int64_t format, const float* x, int64_t n, int64_t k,
                                    const uint8_t* w, int64_t m, float* out, const float* bias);
HR_EXPORT void hr_rms_norm(const float* x, const float* weight, float* out, int64_t n, int64_t h,
                           float eps);
HR_EXPORT void hr_add_rms_norm(const float* x, float* residual, const float* weight, float* out,
                               int64_t n, int64_t h, float eps);
HR_EXPORT void hr_silu_mul(const float* gate_up, float* out, int64_t n, int64_t inter);
HR_EXPORT void hr_head_rms_norm(float* x, const float* weight, int64_t n, int64_t row_stride,
                                int64_t heads, int64_t dim, float eps);
HR_EXPORT void hr_gelu_tanh_mul(const float* gate_up, float* out, int64_t n, int64_t inter);
// A mixture-of-experts MLP (moe.cpp): the router, then the chosen experts, into out [T, h]
// (overwritten); *runs += the number of experts run. Scratch of hr_moe_scratch_size.
HR_EXPORT void hr_moe(const float* router, int64_t num_experts, int64_t top_k, int64_t normalize,
                      const int64_t* table, int64_t int8, const float* x, int64_t tokens,
                      int64_t h, int64_t inter, float* out, float* scratch, int64_t* int_scratch,
                      int64_t* runs);

// A stack of weights of different formats (fused q|k|v of a Q4_K_M file: Q6_K v rows
// beside Q4_K q and k): w is int64 [parts, then per part format, weight, rows]. Calls
// run(format, weight, rows, column offset) for each part in order, so that each part fills
// its own columns of the output (the same sums as if it ran alone).
template <class Run>
static inline void for_each_part(const uint8_t* w, Run run) {
  const int64_t* table = reinterpret_cast<const int64_t*>(w);
  int64_t r = 0;
  for (int64_t i = 0; i < table[0]; ++i) {
    const int64_t* part = table + 1 + 3 * i;
    run(part[0], reinterpret_cast<const uint8_t*>(static_cast<intptr_t>(part[1])), part[2], r);
    r += part[2];
  }
}

// KV cache element types (kernels/cpu/attention.py KV_DTYPE_CODES): the cache holds K and V rounded
// once to this type when written; every read widens them back to fp32 (exactly), so the
// attention arithmetic after the read is the same whatever the type.
// int8: one row (a token's head, D values, D a multiple of 16) is D int8 codes and nothing
// else: value = code * d. The row's scale d is a bf16, the smallest one >= max|x| / 127,
// and its 16 bits ride in the parities of the codes: bit j is the parity of the sum of
// codes j g .. j g + g - 1 (g = D / 16). Each code is round(x / d) (ties to even); where a
// group's parity is wrong, the one code of the group that costs least moves a step (toward
// x / d, so the least cost is the code nearest a tie). A row takes exactly D bytes (4x fewer
// than fp32), and a token's codes depend on nothing but its own K/V row (written alone or in
// any chunk, the same bytes). code * d is exact in fp32 (8-bit by 8-bit significands).
// kernels/reference.py quantize_kv_rows writes the same bytes.
enum KvDtype : int64_t { kKvF32 = 0, kKvF16 = 1, kKvBf16 = 2, kKvI8 = 3 };

// Bytes of one cache row of `dim` values.
static inline int64_t kv_row_bytes(int64_t kv_dtype, int64_t dim) {
  switch (kv_dtype) {
    case kKvF32: return 4 * dim;
    case kKvI8: return dim;
    default: return 2 * dim;
  }
}

// The scale d of an int8 cache row of n codes (the layout above).
static inline float kv_i8_scale(const int8_t* codes, int64_t n) {
  const int64_t g = n / 16;
  uint32_t bits = 0;
#ifdef __AVX512BW__
  if (n == 64) {  // a group per 32-bit lane: the parity of its 4 bytes' sum
    const __m512i v = _mm512_loadu_si512(codes);
#ifdef __AVX512VNNI__
    const __m512i x = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_set1_epi8(1));
#else
    __m512i x = _mm512_xor_si512(v, _mm512_srli_epi32(v, 8));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
#endif
    bits = _mm512_test_epi32_mask(x, _mm512_set1_epi32(1));
  } else if (n == 128) {  // a group per 64-bit lane: the sum of its 8 low bits
    for (int h = 0; h < 2; ++h) {
      const __m512i v =
          _mm512_and_si512(_mm512_loadu_si512(codes + 64 * h), _mm512_set1_epi8(1));
      const __m512i sums = _mm512_sad_epu8(v, _mm512_setzero_si512());
      bits |= static_cast<uint32_t>(_mm512_test_epi64_mask(sums, _mm512_set1_epi64(1)))
              << (8 * h);
    }
  } else
#endif
  {
    for (int64_t j = 0; j < 16; ++j) {
      uint32_t p = 0;
      for (int64_t i = j * g; i < (j + 1) * g; ++i) p ^= static_cast<uint8_t>(codes[i]);
      bits |= (p & 1u) << j;
    }
  }
  bits <<= 16;
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}

// One cache row of n values at src (of type kv_dtype) widened to floats at dst.
static inline void kv_widen(const void* src, int64_t kv_dtype, int64_t n, float* dst) {
  if (kv_dtype == kKvI8) {
    const int8_t* codes = static_cast<const int8_t*>(src);
    const float d = kv_i8_scale(codes, n);
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 dv = _mm512_set1_ps(d);  // 16 codes: one sign extension, one conversion
    for (; i + 16 <= n; i += 16) {
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
      _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), dv));
    }
#endif
    for (; i < n; ++i) dst[i] = static_cast<float>(codes[i]) * d;
  } else if (kv_dtype == kKvF32) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (kv_dtype == kKvF16) {
    halves_to_float(static_cast<const uint8_t*>(src), n, dst);
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(h[i]) << 16;
      std::memcpy(dst + i, &bits, 4);
    }
  }
}

// A row of n floats rounded to the cache type (to nearest, ties to even: torch's .to()
// rounding; int8 as kernels/reference.py quantizes a row).
static inline void kv_narrow(const float* src, int64_t kv_dtype, int64_t n, void* dst) {
  if (kv_dtype == kKvI8) {
    int8_t* codes = static_cast<int8_t*>(dst);
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(src[i]));
    const float d32 = amax / 127.0f;
    uint32_t dbits;  // rounded up to a bf16, so no |x| / d exceeds 127 by more than rounding
    std::memcpy(&dbits, &d32, 4);
    if (dbits & 0xffffu) dbits += 0x10000u;
    dbits &= 0xffff0000u;
    float d;
    std::memcpy(&d, &dbits, 4);
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    const int64_t g = n / 16;
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t i0 = j * g;
      uint32_t parity = 0;
      int64_t best = -1;
      int32_t move = 1;
      float best_cost = 0.0f;
      for (int64_t i = i0; i < i0 + g; ++i) {
        float y = src[i] * inv;
        asm("" : "+x"(y));  // y rounded, as torch computes it (no fused y * inv - r below)
        const float r = std::min(127.0f, std::max(-127.0f, std::nearbyint(y)));  // ties even
        const int32_t c = static_cast<int32_t>(r);
        codes[i] = static_cast<int8_t>(c);
        parity ^= static_cast<uint32_t>(c) & 1u;
        // A step toward y costs 1 - |y - r| (away, where toward leaves +-127: 1 + |y - r|).
        const float a = std::fabs(y - r);
        int32_t s = y >= r ? 1 : -1;
        const bool out = std::abs(c + s) > 127;
        if (out) s = -s;
        const float cost = out ? 1.0f + a : 1.0f - a;
        if (best < 0 || cost < best_cost) {  // the first of the cheapest
          best = i;
          best_cost = cost;
          move = s;
        }
      }
      if (parity != ((dbits >> (16 + j)) & 1u)) codes[best] = static_cast<int8_t>(codes[best] + move);
    }
  } else if (kv_dtype == kKvF32) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (kv_dtype == kKvF16) {
    uint8_t* out = static_cast<uint8_t*>(dst);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) {
      const uint16_t h = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
      std::memcpy(out + 2 * i, &h, 2);
    }
  } else {
    uint16_t* out = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, src + i, 4);
      if ((bits & 0x7fffffffu) > 0x7f800000u)  // NaN: keep it a (quiet) NaN
        out[i] = static_cast<uint16_t>((bits >> 16) | 0x40);
      else
        out[i] = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
  }
}

// The attention entry points (attention.cpp), caches of KvDtype kv_dtype.
HR_EXPORT void hr_paged_attention(const float* query, const void* key_cache,
                                  const void* value_cache, const int32_t* block_tables,
                                  const int32_t* context_lens, const int32_t* query_start,
                                  int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                                  int64_t block_size, int64_t table_width, float scale,
                                  float* out, int64_t kv_dtype, int64_t window, float softcap);
HR_EXPORT void hr_rope_and_cache(const float* qkv, const int64_t* positions, const float* cos,
                                 const float* sin, const int64_t* slot_mapping, int64_t tokens,
                                 int64_t heads, int64_t kv_heads, int64_t dim, float* q_out,
                                 void* key_cache, void* value_cache, int64_t kv_dtype);
