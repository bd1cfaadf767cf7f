// Paged attention on the CPU, reading the KV cache in place through the block tables.
//
// Layout and mask follow kernels/metadata.py: caches [num_blocks, B, Hkv, D], the slot
// of position p is table[p / B] * B + p % B, and query j of a sequence with context
// ctx and query length Q sits at position ctx - Q + j and sees keys 0..ctx - Q + j.
// Slots past a sequence's context are never read, so whatever they hold (tests fill them
// with NaN) cannot reach the result; keys past a query's last visible one (later queries
// of its tile see them) are masked before the softmax and skipped in the sum over V.
// Sliding window W (0 = none): query at position p sees keys p - W + 1..p only; chunks
// wholly before a query's first key are not read for it (nor at all when no row of the
// item needs them), keys before it in its first chunk are masked like those past its last.
// Soft-cap C (0 = none, Gemma 2): every score s becomes tanh(s / C) * C before the mask.
//
// One work item is (sequence, KV head, tile of queries): its query rows (queries x the KV
// head's query heads, GQA) share every K/V row it loads. Keys go in chunks of 16 with an
// online softmax (running max, rescaled sums), fp32 throughout.
//
// The arithmetic of one (query, head) row is fixed, whichever of two vectorizations runs it:
//   score(q, k) = (fma(q[D-1], k[D-1], ... fma(q[1], k[1], fma(q[0], k[0], 0)))) * scale:
//                 one fused multiply-add per dimension, in order
//   per chunk:    keys past the row's last visible one score -inf; m' = max(m, chunk max);
//                 c = exp16(m - m'); p = exp16(s - m'); sum = fma(sum, c, hsum(p));
//                 acc = acc * c, then acc = fma(v_i, p_i, acc) for each visible key in order
//   at the end:   out = acc * (1 / sum); chunks past the row's last visible key are skipped
// - few rows (decode): lanes over the chunk's 16 keys (its K rows transposed once per
//   chunk, shared by the item's rows), rows one after another;
// - many rows (prefill): lanes over 16 rows (the queries transposed once per item), keys
//   one after another, so max, exp and sums of 16 rows take one instruction each.
// Both run the same operations per (row, key) in the same order, and sum a chunk's 16
// probabilities in the same pairwise tree (hsum's).
// So a query gives the same bits alone or batched, decoded or in a prefill chunk of any
// length, on every ISA (tests/kernels/test_cpu_kernels.py checks all three).
//
// Keys come in fixed partitions of kPart positions ([p kPart, (p + 1) kPart), whatever the
// batch): each partition runs the loop above from a fresh state (max -inf, sum 0, acc 0),
// and a row's partitions are then folded in ascending order (a partition where the row saw
// no key is skipped; the first one seen is taken as it is; the next ones merged by
//   M = max(m, m_p); c = exp16(m - M); c_p = exp16(m_p - M);
//   sum = fma(sum, c, sum_p * c_p); acc = fma(acc, c, acc_p * c_p)),
// before out = acc * (1 / sum). A context within one partition is the loop above alone.
// Because the partitions do not depend on how the work is shared, a few long sequences
// (one decoding stream at 4k tokens has 3 items on 2 cores) are split into one work item per
// partition, run on every thread and folded afterwards (split-K), with the same bits as one
// thread running the partitions in turn.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace {

constexpr int kChunk = 16;      // keys per softmax step
constexpr int64_t kQTile = 16;  // queries of one sequence per work item
constexpr int64_t kLaneRows = 8;  // an item with at least this many rows puts rows in lanes
// Prefetch distance in chunks, into L2: one stream at 4k context, one thread, measured 12-20%
// faster than the next chunk into L1 (2, 4 and 8 alike).
constexpr int64_t kAheadChunks = 4;
constexpr int64_t kPart = 256;    // keys per partition (a multiple of kChunk)
constexpr int64_t kSplitItems = 4;  // split items in partitions below this many per thread

struct Shape {
  int64_t heads, kv_heads, dim, block_size, table_width;
  int64_t kv_dtype;  // KvDtype (common.h): what the caches hold
  int64_t window;    // keys a query sees, itself included; 0 = all
  float softcap;     // 0 = none
};

// tanh(s / cap) * cap, with tanh(y) = 1 - 2 / (exp(2y) + 1) (exp16 saturates: +-1 far out).
inline v16f softcap16(v16f s, float cap) {
  const v16f y = s / cap;
  return (1.0f - 2.0f / (exp16(y + y) + 1.0f)) * cap;
}

// The scaled (and soft-capped) scores of one chunk.
inline v16f finish_scores(v16f dots, const Shape& s, float scale) {
  const v16f sv = dots * scale;
  return s.softcap > 0.0f ? softcap16(sv, s.softcap) : sv;
}

#ifdef __AVX512F__
// kt[d * 16 + i] = r[i][d]: 16 rows of 16 values, transposed in registers.
inline void transpose16_regs(__m512 (&r)[16], float* kt) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows, 32-bit interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // quads of rows, 64-bit interleaved
    const __m512d a = _mm512_castps_pd(t[g]), b = _mm512_castps_pd(t[g + 1]);
    const __m512d x = _mm512_castps_pd(t[g + 2]), y = _mm512_castps_pd(t[g + 3]);
    r[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, x));      // columns 0, 4, 8, 12
    r[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, x));  // 1, 5, 9, 13
    r[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, y));  // 2, 6, 10, 14
    r[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, y));  // 3, 7, 11, 15
  }
  // r[4q + j]: columns j, j + 4, j + 8, j + 12 of rows 4q..4q + 3, one per 128 bits.
  for (int j = 0; j < 4; ++j) {
    const __m512 lo0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);  // cols j, j+8: rows 0-7
    const __m512 hi0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);  // cols j+4, j+12
    const __m512 lo1 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);  // rows 8-15
    const __m512 hi1 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    _mm512_storeu_ps(kt + 16 * j, _mm512_shuffle_f32x4(lo0, lo1, 0x88));
    _mm512_storeu_ps(kt + 16 * (j + 8), _mm512_shuffle_f32x4(lo0, lo1, 0xdd));
    _mm512_storeu_ps(kt + 16 * (j + 4), _mm512_shuffle_f32x4(hi0, hi1, 0x88));
    _mm512_storeu_ps(kt + 16 * (j + 12), _mm512_shuffle_f32x4(hi0, hi1, 0xdd));
  }
}
#else
// kt[(c0 + d) * 16 + r0 + i] = r[i][d]: an 8 x 8 block of the 16 x 16 transpose. (The scalar
// loop it replaces, 256 loads and stores per block, was a third of a decode step's
// attention on AVX2.)
inline void transpose8_regs(__m256 (&r)[8], float* kt, int c0, int r0) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {  // pairs of rows, 32-bit interleaved
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int g = 0; g < 8; g += 4) {  // quads: columns 0, 1, 2, 3 of each 128-bit half
    u[g] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
    u[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xee);
    u[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
    u[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xee);
  }
  for (int j = 0; j < 4; ++j) {  // rows 0-3 beside rows 4-7: columns j and j + 4
    _mm256_storeu_ps(kt + (c0 + j) * 16 + r0, _mm256_permute2f128_ps(u[j], u[4 + j], 0x20));
    _mm256_storeu_ps(kt + (c0 + j + 4) * 16 + r0, _mm256_permute2f128_ps(u[j], u[4 + j], 0x31));
  }
}
#endif

// kt[d * 16 + i] = rows[i][c + d] for d < 16: one 16 x 16 block of a chunk's transpose.
inline void transpose16(const float* const* rows, int64_t c, float* kt) {
#ifdef __AVX512F__
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(rows[i] + c);
  transpose16_regs(r, kt);
#else
  for (int r0 = 0; r0 < 16; r0 += 8)
    for (int c0 = 0; c0 < 16; c0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[r0 + i] + c + c0);
      transpose8_regs(r, kt, c0, r0);
    }
#endif
}

// transpose16 of int8 rows widened on the way (code * scale, kv_widen's values): the
// widened K rows of a chunk never go through memory.
inline void transpose16_i8(const int8_t* const* rows, const float* scales, int64_t c,
                           float* kt) {
#ifdef __AVX512F__
  __m512 r[16];
  for (int i = 0; i < 16; ++i) {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + c));
    r[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)),
                         _mm512_set1_ps(scales[i]));
  }
  transpose16_regs(r, kt);
#else
  for (int r0 = 0; r0 < 16; r0 += 8)
    for (int c0 = 0; c0 < 16; c0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[r0 + i] + c + c0));
        r[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)),
                             _mm256_set1_ps(scales[r0 + i]));
      }
      transpose8_regs(r, kt, c0, r0);
    }
#endif
}

#ifndef __AVX512F__
// transpose16 of fp16 rows widened on the way (exactly): an fp16 chunk's K rows are never
// widened into memory first (AVX2: a decode's few rows per chunk made the widening and its
// reload as costly as the transpose).
inline void transpose16_f16(const uint16_t* const* rows, int64_t c, float* kt) {
  for (int r0 = 0; r0 < 16; r0 += 8)
    for (int c0 = 0; c0 < 16; c0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i)
        r[i] = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r0 + i] + c + c0)));
      transpose8_regs(r, kt, c0, r0);
    }
}
#endif

// s[r] = sum over d of a[r][d] * b[d], one fused multiply-add per d in order: a[r] are NR
// scalar streams, b vectors at b + 16 d. NR independent chains keep the FMA units busy.
template <int NR>
inline void fma_chains(const float* const* a, const float* b, int64_t dim, v16f* s) {
  v16f acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = splat(0.0f);
  for (int64_t d = 0; d < dim; ++d) {
    const v16f bv = load16(b + 16 * d);
    for (int r = 0; r < NR; ++r) acc[r] = fma16(splat(a[r][d]), bv, acc[r]);
  }
  for (int r = 0; r < NR; ++r) s[r] = acc[r];
}

// fma_chains for up to 8 streams.
inline void fma_chains_n(const float* const* a, int n, const float* b, int64_t dim, v16f* s) {
  switch (n) {
    case 8: return fma_chains<8>(a, b, dim, s);
    case 7: return fma_chains<7>(a, b, dim, s);
    case 6: return fma_chains<6>(a, b, dim, s);
    case 5: return fma_chains<5>(a, b, dim, s);
    case 4: return fma_chains<4>(a, b, dim, s);
    case 3: return fma_chains<3>(a, b, dim, s);
    case 2: return fma_chains<2>(a, b, dim, s);
    default: return fma_chains<1>(a, b, dim, s);
  }
}

// One query row of an item: where it reads and writes, and how many keys it sees.
struct Row {
  const float* q;
  float* out;
  int64_t first, visible;  // keys first..visible - 1
};

// The first chunk an item reads: the one holding its first row's first key (rows come in
// order of visible keys, so of first keys too).
inline int64_t first_chunk(const Row* rows) { return rows[0].first / kChunk * kChunk; }

struct Item {
  int32_t seq, h0, h1;  // query heads [h0, h1), all of one KV head's group
  int64_t q0, q1;       // queries [q0, q1) of the sequence
};

// Per-thread scratch, reused across items.
struct Scratch {
  std::vector<Row> rows;
  std::vector<float> kt, qt, probs, acc, zeros, maxes, sums, states;
  std::vector<float> kw, vw;  // a 16- or 8-bit chunk's K and V rows widened to fp32
};

// The pairwise tree of hsum (common.h), lane by lane over 16 vectors: out[r] = hsum of
// (x[0][r], ..., x[15][r]). x is overwritten.
inline v16f tree_sum(v16f (&x)[16]) {
  for (int i = 0; i < 8; ++i) x[i] = x[i] + x[i + 8];
  for (int i = 0; i < 4; ++i) x[i] = x[i] + x[i + 4];
  for (int i = 0; i < 2; ++i) x[i] = x[i] + x[i + 2];
  return x[0] + x[1];
}

inline float hmax(v16f v) {  // any order: max is exact
#ifdef __AVX512F__
  return _mm512_reduce_max_ps((__m512)v);
#else
  const __m256 a = _mm256_max_ps(v.lo, v.hi);
  __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_max_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_movehdup_ps(b)));
#endif
}

inline float exp1(float x) { return exp16(splat(x))[0]; }

// The chunk's K and V rows (keys t0..t0 + n - 1) of one KV head.
struct Chunk {
  const float* k[kChunk];
  const float* v[kChunk];
  int64_t n;
  bool k_codes;  // int8 K left as codes (kq, ks) for transpose16_i8; k unset
  bool k_halves;  // AVX2: fp16 K left in the cache (kh) for transpose16_f16; k unset
  const uint16_t* kh[kChunk];
  const int8_t* kq[kChunk];
  float ks[kChunk];
};

// Into L2: the K and V rows of keys [t_from, t_to) of one KV head, a block at a time (one
// table lookup each). Prefetches into L1 would hold the core's few miss buffers, as in
// quant_linear_int8.cpp. Always inlined, as every function that only prefetches must be:
// GCC takes a call whose callee does nothing but prefetch for one without effect, and drops it.
#define HR_PREFETCHER __attribute__((always_inline)) inline
HR_PREFETCHER void prefetch_keys(const uint8_t* kc, const uint8_t* vc, const int32_t* table,
                                 const Shape& s, int64_t kv_head, int64_t t_from, int64_t t_to) {
  const int64_t row_bytes = kv_row_bytes(s.kv_dtype, s.dim);
  const int64_t slot_bytes = s.kv_heads * row_bytes;
  for (int64_t t = t_from; t < t_to;) {
    const int64_t in_block = t % s.block_size, n = std::min(s.block_size - in_block, t_to - t);
    const int64_t base =
        (static_cast<int64_t>(table[t / s.block_size]) * s.block_size + in_block) * slot_bytes +
        kv_head * row_bytes;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t b = 0; b < row_bytes; b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(kc + base + i * slot_bytes + b), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vc + base + i * slot_bytes + b), _MM_HINT_T1);
      }
    t += n;
  }
}

// The chunk's rows as fp32 (keys before `last`), and a prefetch of a later chunk's (up to
// `prefetch_end`, the item's last key, past the partition's end): decode at
// long contexts streams the cache from DRAM, one scattered row per key and head. An fp32
// cache is read in place; a 16- or 8-bit one is widened into the scratch rows (so the
// arithmetic that follows is the fp32 kernel's on the rounded values).
inline void chunk_rows(const uint8_t* kc, const uint8_t* vc, const int32_t* table,
                       const Shape& s, int64_t kv_head, int64_t t0, int64_t last,
                       int64_t prefetch_end, Chunk& ch, Scratch& sc,
                       bool k_codes = false) {
  const int64_t row_bytes = kv_row_bytes(s.kv_dtype, s.dim);
  const int64_t slot_bytes = s.kv_heads * row_bytes;
  auto at = [&](int64_t pos) {
    return (static_cast<int64_t>(table[pos / s.block_size]) * s.block_size +
            pos % s.block_size) * slot_bytes + kv_head * row_bytes;
  };
  // Blocks of a multiple of kChunk slots hold whole chunks (t0 is a multiple of kChunk): one
  // table lookup per chunk, the keys' rows slot_bytes apart; else one per key.
  const bool whole = s.block_size % kChunk == 0;
  ch.k_codes = false;
  ch.k_halves = false;
  auto offset_of = [&](int64_t base, int64_t t, int64_t i) {
    return whole ? base + i * slot_bytes : at(t + i);
  };
  ch.n = std::min<int64_t>(kChunk, last - t0);
  const int64_t base = whole ? at(t0) : 0;
  if (s.kv_dtype == kKvF32) {
    for (int64_t i = 0; i < ch.n; ++i) {
      const int64_t offset = offset_of(base, t0, i);
      ch.k[i] = reinterpret_cast<const float*>(kc + offset);
      ch.v[i] = reinterpret_cast<const float*>(vc + offset);
    }
  } else {
    ch.k_codes = k_codes && s.kv_dtype == kKvI8;
#ifndef __AVX512F__
    ch.k_halves = k_codes && s.kv_dtype == kKvF16;
#endif
    sc.kw.resize(kChunk * s.dim);
    sc.vw.resize(kChunk * s.dim);
    for (int64_t i = 0; i < ch.n; ++i) {
      const int64_t offset = offset_of(base, t0, i);
      float* v = sc.vw.data() + i * s.dim;
      kv_widen(vc + offset, s.kv_dtype, s.dim, v);
      ch.v[i] = v;
      if (ch.k_codes) {
        ch.kq[i] = reinterpret_cast<const int8_t*>(kc + offset);
        ch.ks[i] = kv_i8_scale(ch.kq[i], s.dim);
      } else if (ch.k_halves) {
        ch.kh[i] = reinterpret_cast<const uint16_t*>(kc + offset);
      } else {
        float* k = sc.kw.data() + i * s.dim;
        kv_widen(kc + offset, s.kv_dtype, s.dim, k);
        ch.k[i] = k;
      }
    }
  }
  // The chunk kAheadChunks ahead (the first kAheadChunks of a work unit were asked for while
  // the unit before it ran: prefetch_unit); whole chunks with the one table lookup above.
  const int64_t t_next = t0 + kAheadChunks * kChunk;
  const int64_t n_next = std::min<int64_t>(prefetch_end, t_next + kChunk) - t_next;
  const int64_t next_base = whole && n_next > 0 ? at(t_next) : 0;
  for (int64_t i = 0; i < n_next; ++i) {
    const int64_t offset = offset_of(next_base, t_next, i);
    for (int64_t b = 0; b < row_bytes; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(kc + offset + b), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(vc + offset + b), _MM_HINT_T1);
    }
  }
}

// acc[0:dim] = acc * c, then + v_i * p[i * stride] for i < seen: per lane one chain of
// fused multiply-adds over the keys in order. Head dims up to 128 keep every slab's chain in
// registers and advance them together (independent chains, one V row load per key).
template <int S>
inline void accumulate_slabs(float* acc, const Chunk& ch, const float* p, int64_t stride,
                             int64_t seen, float c) {
  v16f a[S];
  for (int j = 0; j < S; ++j) a[j] = load16(acc + 16 * j) * c;
  for (int64_t i = 0; i < seen; ++i) {
    const v16f pi = splat(p[i * stride]);
    for (int j = 0; j < S; ++j) a[j] = fma16(load16(ch.v[i] + 16 * j), pi, a[j]);
  }
  for (int j = 0; j < S; ++j) store16(acc + 16 * j, a[j]);
}

inline void accumulate(float* acc, const Chunk& ch, const float* p, int64_t stride,
                       int64_t seen, float c, int64_t dim) {
  switch (dim) {
    case 64: return accumulate_slabs<4>(acc, ch, p, stride, seen, c);
    case 128: return accumulate_slabs<8>(acc, ch, p, stride, seen, c);
    default:
      for (int64_t d = 0; d < dim; d += 16) {
        v16f a = load16(acc + d) * c;
        for (int64_t i = 0; i < seen; ++i)
          a = fma16(load16(ch.v[i] + d), splat(p[i * stride]), a);
        store16(acc + d, a);
      }
  }
}

// Where a group of rows reads: one KV head of one sequence's cache.
struct Source {
  const uint8_t* kc;
  const uint8_t* vc;
  const int32_t* table;
  const Shape& s;
  int64_t kv_head;
  float scale;
};

// Each form below runs the keys [t0, t1) of its rows (t0 a multiple of kChunk, t1 at most
// the last row's visible keys) from a fresh state, and leaves every row's running max, sum
// and unnormalised acc in sc.maxes, sc.sums, sc.acc.

// Lanes over the chunk's keys: few rows share the item (decode).
void attend_rows(const Row* rows, int64_t n_rows, const Source& src, int64_t t_begin,
                 int64_t t_end, Scratch& sc) {
  const Shape& s = src.s;
  const int64_t dim = s.dim, prefetch_end = rows[n_rows - 1].visible;
  const float scale = src.scale;
  sc.kt.resize(dim * kChunk);
  sc.zeros.assign(dim, 0.0f);
  Chunk ch;
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kChunk) {
    chunk_rows(src.kc, src.vc, src.table, s, src.kv_head, t0, t_end, prefetch_end, ch, sc,
               true);
    if (ch.k_codes) {
      for (int64_t i = ch.n; i < kChunk; ++i) {  // never past the context: zero codes
        ch.kq[i] = reinterpret_cast<const int8_t*>(sc.zeros.data());
        ch.ks[i] = 0.0f;
      }
      for (int64_t d = 0; d < dim; d += 16) transpose16_i8(ch.kq, ch.ks, d, sc.kt.data() + 16 * d);
#ifndef __AVX512F__
    } else if (ch.k_halves) {
      for (int64_t i = ch.n; i < kChunk; ++i)  // never past the context: +0.0 halves
        ch.kh[i] = reinterpret_cast<const uint16_t*>(sc.zeros.data());
      for (int64_t d = 0; d < dim; d += 16) transpose16_f16(ch.kh, d, sc.kt.data() + 16 * d);
#endif
    } else {
      for (int64_t i = ch.n; i < kChunk; ++i) ch.k[i] = sc.zeros.data();  // never past the context
      for (int64_t d = 0; d < dim; d += 16) transpose16(ch.k, d, sc.kt.data() + 16 * d);
    }
    for (int64_t r0 = 0; r0 < n_rows; r0 += 8) {
      const int nr = static_cast<int>(std::min<int64_t>(8, n_rows - r0));
      const float* q[8];
      v16f scores[8];
      for (int r = 0; r < nr; ++r) q[r] = rows[r0 + r].q;
      fma_chains_n(q, nr, sc.kt.data(), dim, scores);
      for (int j = 0; j < nr; ++j) {
        const int64_t r = r0 + j, seen = std::min(ch.n, rows[r].visible - t0);
        const int64_t skip = rows[r].first - t0;  // keys of the chunk before the window
        if (seen <= 0 || skip >= kChunk) continue;
        v16f sv = finish_scores(scores[j], s, scale);
        for (int64_t i = seen; i < kChunk; ++i) sv[i] = -INFINITY;
        for (int64_t i = 0; i < skip; ++i) sv[i] = -INFINITY;
        const float new_max = std::max(sc.maxes[r], hmax(sv));
        const float c = exp1(sc.maxes[r] - new_max);  // 0 at the first chunk (max = -inf)
        const v16f p = exp16(sv - new_max);
        sc.sums[r] = std::fma(sc.sums[r], c, hsum(p));  // explicit: the same rounding in both forms
        sc.maxes[r] = new_max;
        float probs[kChunk];
        store16(probs, p);
        accumulate(sc.acc.data() + r * dim, ch, probs, 1, seen, c, dim);
      }
    }
  }
}

// Up to 16 rows in the lanes of each vector.
void attend_lanes(const Row* rows, int64_t n_rows, const Source& src, int64_t t_begin,
                  int64_t t_end, Scratch& sc) {
  const Shape& s = src.s;
  const int64_t dim = s.dim, prefetch_end = rows[n_rows - 1].visible;
  const float scale = src.scale;
  // qt[d][r] = rows[r].q[d], unused lanes 0.
  sc.qt.assign(dim * 16, 0.0f);
  for (int64_t r = 0; r < n_rows; ++r)
    for (int64_t d = 0; d < dim; ++d) sc.qt[d * 16 + r] = rows[r].q[d];
  sc.probs.resize(kChunk * 16);
  v16f visible, first, max = splat(-INFINITY), sum = splat(0.0f);
  for (int64_t r = 0; r < 16; ++r) {
    visible[r] = static_cast<float>(r < n_rows ? rows[r].visible : 0);  // exact below 2^24
    first[r] = static_cast<float>(r < n_rows ? rows[r].first : 0);
  }
  Chunk ch;
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kChunk) {
    chunk_rows(src.kc, src.vc, src.table, s, src.kv_head, t0, t_end, prefetch_end, ch, sc);
    v16f sc16[kChunk];  // scores: sc16[i][r] = row r against key i
    for (int64_t i0 = 0; i0 < ch.n; i0 += 8) {
      const int nk = static_cast<int>(std::min<int64_t>(8, ch.n - i0));
      fma_chains_n(ch.k + i0, nk, sc.qt.data(), dim, sc16 + i0);
    }
    for (int64_t i = 0; i < kChunk; ++i) {
      const float pos = static_cast<float>(t0 + i);
      if (i >= ch.n)
        sc16[i] = splat(-INFINITY);
      else
        sc16[i] = select16((pos < visible) & (pos >= first), finish_scores(sc16[i], s, scale),
                           splat(-INFINITY));
    }
    v16f chunk_max = sc16[0];
    for (int i = 1; i < kChunk; ++i) chunk_max = select16(chunk_max > sc16[i], chunk_max, sc16[i]);
    const v16f new_max = select16(max > chunk_max, max, chunk_max);
    // Rows whose keys ended before this chunk skip it in the per-row form; here their
    // lanes get c = exp16(0) = 1 and p = 0, which leaves sum and acc bit for bit as
    // they were. Rows whose window starts after this chunk (max still -inf) get c = 0 and
    // p = 0 from a max taken as 0: sum and acc stay 0, max -inf, as if skipped. Unused
    // lanes (visible 0) hold NaN and are never stored.
    const v16f safe_max = select16(new_max == -INFINITY, splat(0.0f), new_max);
    const v16f c = exp16(max - safe_max);
    v16f p[kChunk];
    for (int i = 0; i < kChunk; ++i) {
      p[i] = exp16(sc16[i] - safe_max);
      store16(sc.probs.data() + i * 16, p[i]);
    }
    sum = fma16(sum, c, tree_sum(p));
    max = new_max;
    for (int64_t r = 0; r < n_rows; ++r) {
      const int64_t seen = std::min(ch.n, rows[r].visible - t0);
      if (seen > 0 && rows[r].first - t0 < kChunk)
        accumulate(sc.acc.data() + r * dim, ch, sc.probs.data() + r, 16, seen, c[r], dim);
    }
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    sc.maxes[r] = max[r];
    sc.sums[r] = sum[r];
  }
}

// The rows of an item, in order of visible keys (so of first keys too).
void item_rows(const Item& w, const float* query, const int32_t* context_lens,
               const int32_t* query_start, const Shape& s, float* out, std::vector<Row>& rows) {
  const int64_t dim = s.dim;
  const int64_t qlen = query_start[w.seq + 1] - query_start[w.seq], ctx = context_lens[w.seq];
  rows.clear();
  for (int64_t j = w.q0; j < w.q1; ++j) {
    const int64_t t = query_start[w.seq] + j;
    const int64_t visible = ctx - qlen + j + 1;
    const int64_t first = s.window > 0 ? std::max<int64_t>(0, visible - s.window) : 0;
    for (int64_t h = w.h0; h < w.h1; ++h)
      rows.push_back({query + (t * s.heads + h) * dim, out + (t * s.heads + h) * dim, first,
                      visible});
  }
}

// An item's rows go in groups: all of them in the per-row form when fewer than kLaneRows,
// else 16 at a time in lanes.
struct Group {
  int64_t r0, n;
  bool lanes;
};

inline std::vector<Group> groups_of(int64_t n_rows) {
  if (n_rows < kLaneRows) return {{0, n_rows, false}};
  std::vector<Group> groups;
  for (int64_t r0 = 0; r0 < n_rows; r0 += 16)
    groups.push_back({r0, std::min<int64_t>(16, n_rows - r0), true});
  return groups;
}

// The partitions holding a group's keys: first_part..last_part.
inline int64_t first_part(const Row* rows) { return first_chunk(rows) / kPart; }
inline int64_t last_part(const Row* rows, int64_t n) { return (rows[n - 1].visible - 1) / kPart; }

// Partition p of a group from a fresh state (sc.maxes, sc.sums, sc.acc); a partition outside
// the group's keys leaves every row unseen (max -inf).
void attend_part(const Row* rows, const Group& g, const Source& src, int64_t p, Scratch& sc) {
  const int64_t t0 = std::max(p * kPart, first_chunk(rows));
  const int64_t t1 = std::min((p + 1) * kPart, rows[g.n - 1].visible);
  sc.acc.assign(g.n * src.s.dim, 0.0f);
  sc.maxes.assign(g.n, -INFINITY);
  sc.sums.assign(g.n, 0.0f);
  if (t0 >= t1) return;
  if (g.lanes)
    attend_lanes(rows, g.n, src, t0, t1, sc);
  else
    attend_rows(rows, g.n, src, t0, t1, sc);
}

// A row's state across partitions: [max, sum, acc[dim]].
inline int64_t state_size(int64_t dim) { return dim + 2; }

// Fold one partition's (max m, sum, acc) of a row into its state (see top).
inline void fold(float m, float sum, const float* acc, int64_t dim, float* state) {
  if (m == -INFINITY) return;  // the row saw no key there
  if (state[0] == -INFINITY) {
    state[0] = m;
    state[1] = sum;
    std::copy(acc, acc + dim, state + 2);
    return;
  }
  const float top = std::max(state[0], m);
  const float c = exp1(state[0] - top), cp = exp1(m - top);
  state[0] = top;
  state[1] = std::fma(state[1], c, sum * cp);
  for (int64_t d = 0; d < dim; d += 16)
    store16(state + 2 + d, fma16(load16(state + 2 + d), splat(c), load16(acc + d) * cp));
}

inline void fresh_states(int64_t n, int64_t dim, std::vector<float>& states) {
  states.assign(n * state_size(dim), 0.0f);
  for (int64_t r = 0; r < n; ++r) states[r * state_size(dim)] = -INFINITY;
}

inline void finish(const float* acc, float sum, int64_t dim, float* out) {
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  for (int64_t d = 0; d < dim; d += 16) store16(out + d, load16(acc + d) * inv);
}

inline Source source_of(const Item& w, const uint8_t* kc, const uint8_t* vc,
                        const int32_t* block_tables, const Shape& s, float scale) {
  const int64_t group = s.heads / s.kv_heads;
  return {kc, vc, block_tables + w.seq * s.table_width, s, w.h0 / group, scale};
}

// One whole item: each group's partitions in turn, folded as they come.
void attend_item(const Item& w, const float* query, const uint8_t* kc, const uint8_t* vc,
                 const int32_t* block_tables, const int32_t* context_lens,
                 const int32_t* query_start, const Shape& s, float scale, float* out,
                 Scratch& sc) {
  const int64_t dim = s.dim;
  const Source src = source_of(w, kc, vc, block_tables, s, scale);
  item_rows(w, query, context_lens, query_start, s, out, sc.rows);
  for (const Group& g : groups_of(static_cast<int64_t>(sc.rows.size()))) {
    const Row* rows = sc.rows.data() + g.r0;
    const int64_t lo = first_part(rows), hi = last_part(rows, g.n);
    if (lo == hi) {  // one partition: its state is the result's
      attend_part(rows, g, src, lo, sc);
      for (int64_t r = 0; r < g.n; ++r)
        finish(sc.acc.data() + r * dim, sc.sums[r], dim, rows[r].out);
      continue;
    }
    fresh_states(g.n, dim, sc.states);
    for (int64_t p = lo; p <= hi; ++p) {
      attend_part(rows, g, src, p, sc);
      for (int64_t r = 0; r < g.n; ++r)
        fold(sc.maxes[r], sc.sums[r], sc.acc.data() + r * dim, dim,
             sc.states.data() + r * state_size(dim));
    }
    for (int64_t r = 0; r < g.n; ++r) {
      const float* st = sc.states.data() + r * state_size(dim);
      finish(st + 2, st[1], dim, rows[r].out);
    }
  }
}

// The keys an item reads: from its first row's first visible key to its last row's last
// (first..end - 1).
inline void item_keys(const Item& w, const int32_t* context_lens, const int32_t* query_start,
                      const Shape& s, int64_t& first, int64_t& end) {
  const int64_t qlen = query_start[w.seq + 1] - query_start[w.seq], ctx = context_lens[w.seq];
  const int64_t first_visible = ctx - qlen + w.q0 + 1;
  first = s.window > 0 ? std::max<int64_t>(0, first_visible - s.window) : 0;
  end = ctx - qlen + w.q1;
}

// The partitions of an item: those of its first row's first key to its last row's last.
inline void item_parts(const Item& w, const int32_t* context_lens, const int32_t* query_start,
                       const Shape& s, int64_t& lo, int64_t& hi) {
  int64_t first, end;
  item_keys(w, context_lens, query_start, s, first, end);
  lo = first / kPart;
  hi = (end - 1) / kPart;
}

// The first kAheadChunks chunks a work unit reads (an item's within partition `part`, or
// from its first key when part < 0), asked for before the unit ahead of it runs: chunk_rows
// prefetches only kAheadChunks ahead within a unit, so a unit's first chunks (all of them
// at the short contexts of most decodes) were read on demand. Measured on SmolLM2's shape,
// fp16 cache, 30 layers, old and new alternated in one process: 48 decoding streams of
// 35-135 keys 27% less time, one stream of that length 14%, 16 of 200-600 and one of 3-4k
// (split-K) 7%. Asking for a unit's own first chunks as it starts gained nothing.
HR_PREFETCHER void prefetch_unit(const Item& w, int64_t part, const uint8_t* kc,
                                 const uint8_t* vc, const int32_t* block_tables,
                                 const int32_t* context_lens, const int32_t* query_start,
                                 const Shape& s) {
  int64_t t0, t1;
  item_keys(w, context_lens, query_start, s, t0, t1);
  t0 = t0 / kChunk * kChunk;  // the chunk holding the first key, where the item starts reading
  if (part >= 0) {
    t0 = std::max(t0, part * kPart);
    t1 = std::min(t1, (part + 1) * kPart);
  }
  prefetch_keys(kc, vc, block_tables + w.seq * s.table_width, s, w.h0 / (s.heads / s.kv_heads),
                t0, std::min(t1, t0 + kAheadChunks * kChunk));
}

// Split-K: one work unit per (item, partition); units write their rows' states to `states`
// (unit u's at offsets[u]), then each item folds its units in partition order.
struct Unit {
  int64_t item, part, offset;
};

void attend_split(const std::vector<Item>& items, const float* query, const uint8_t* kc,
                  const uint8_t* vc, const int32_t* block_tables, const int32_t* context_lens,
                  const int32_t* query_start, const Shape& s, float scale, float* out) {
  const int64_t dim = s.dim, width = state_size(dim);
  std::vector<Unit> units;
  std::vector<int64_t> first_unit(items.size() + 1);
  int64_t size = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    int64_t lo, hi;
    item_parts(items[i], context_lens, query_start, s, lo, hi);
    const int64_t n_rows = (items[i].q1 - items[i].q0) * (items[i].h1 - items[i].h0);
    first_unit[i] = static_cast<int64_t>(units.size());
    for (int64_t p = lo; p <= hi; ++p) {
      units.push_back({static_cast<int64_t>(i), p, size});
      size += n_rows * width;
    }
  }
  first_unit[items.size()] = static_cast<int64_t>(units.size());
  std::vector<float> states(size);
  const int64_t n_units = static_cast<int64_t>(units.size());
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel
  {
    Scratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < n_units; ++u) {
      if (u + 1 < n_units)
        prefetch_unit(items[units[u + 1].item], units[u + 1].part, kc, vc, block_tables,
                      context_lens, query_start, s);
      const Item& w = items[units[u].item];
      const Source src = source_of(w, kc, vc, block_tables, s, scale);
      item_rows(w, query, context_lens, query_start, s, out, sc.rows);
      for (const Group& g : groups_of(static_cast<int64_t>(sc.rows.size()))) {
        attend_part(sc.rows.data() + g.r0, g, src, units[u].part, sc);
        float* dst = states.data() + units[u].offset + g.r0 * width;
        for (int64_t r = 0; r < g.n; ++r) {
          dst[r * width] = sc.maxes[r];
          dst[r * width + 1] = sc.sums[r];
          std::copy(sc.acc.data() + r * dim, sc.acc.data() + (r + 1) * dim, dst + r * width + 2);
        }
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      item_rows(items[i], query, context_lens, query_start, s, out, sc.rows);
      const int64_t n_rows = static_cast<int64_t>(sc.rows.size());
      fresh_states(n_rows, dim, sc.states);
      for (int64_t u = first_unit[i]; u < first_unit[i + 1]; ++u)
        for (int64_t r = 0; r < n_rows; ++r) {
          const float* part = states.data() + units[u].offset + r * width;
          fold(part[0], part[1], part + 2, dim, sc.states.data() + r * width);
        }
      for (int64_t r = 0; r < n_rows; ++r) {
        const float* st = sc.states.data() + r * width;
        finish(st + 2, st[1], dim, sc.rows[r].out);
      }
    }
  }
}

// Work (query x visible-key pairs x head dimension, over all heads) from which attention
// runs its items on every thread. Lower than the linears' kParallelWork: a key costs ~30
// of a linear's multiply-adds here (the fp16/int8 conversion, the online softmax), and
// at kParallelWork one decoding stream's attention over ~100 keys ran on one thread
// (16 heads: 37 µs per layer, 18 µs on both threads, alternated in one process). The
// items and their arithmetic are the same either way, so are the bits.
constexpr int64_t kAttentionParallelWork = int64_t{1} << 14;

}  // namespace

// out[t, h, :] = attention of query t, head h over its sequence's cache (see top).
// query/out [T, H, D] fp32; caches [N, B, Hkv, D] of kv_dtype (KvDtype: fp32, fp16,
// bf16); block_tables int32 [S, W]; context_lens int32 [S]; query_start int32 [S + 1].
// D % 16 == 0, H % Hkv == 0.
HR_EXPORT void hr_paged_attention(const float* query, const void* key_cache,
                                  const void* value_cache, const int32_t* block_tables,
                                  const int32_t* context_lens, const int32_t* query_start,
                                  int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                                  int64_t block_size, int64_t table_width, float scale,
                                  float* out, int64_t kv_dtype, int64_t window, float softcap) {
  const Shape s{heads, kv_heads, dim, block_size, table_width, kv_dtype, window, softcap};
  const uint8_t* kc = static_cast<const uint8_t*>(key_cache);
  const uint8_t* vc = static_cast<const uint8_t*>(value_cache);
  const int64_t group = heads / kv_heads;
  int64_t work = 0;  // query x visible-key pairs, times the head dimension, over all heads
  for (int32_t i = 0; i < num_seqs; ++i)
    work += (query_start[i + 1] - query_start[i]) *
            (window > 0 ? std::min<int64_t>(window, context_lens[i]) : context_lens[i]) *
            heads * dim;
  const bool parallel = work >= kAttentionParallelWork;
  // One item per (sequence, KV head, query tile): each item transposes what it reads
  // (splitting a decoding sequence's 3 items per query head measured slower on 2 cores
  // than the imbalance). Too few items for the threads, and some spanning partitions:
  // split them per partition instead (same bits).
  std::vector<Item> items;
  bool spans = false;
  for (int32_t i = 0; i < num_seqs; ++i) {
    const int64_t qlen = query_start[i + 1] - query_start[i];
    spans = spans || context_lens[i] > kPart;
    for (int64_t q0 = 0; q0 < qlen; q0 += kQTile)
      for (int32_t h = 0; h < heads; h += static_cast<int32_t>(group))
        items.push_back({i, h, h + static_cast<int32_t>(group), q0, std::min(qlen, q0 + kQTile)});
  }
  const int64_t count = static_cast<int64_t>(items.size());
  const int threads = omp_get_max_threads();
  if (parallel && spans && threads > 1 && count < kSplitItems * threads)
    return attend_split(items, query, kc, vc, block_tables, context_lens, query_start, s, scale,
                        out);
#pragma omp parallel if (count > 1 && parallel)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < count; ++it) {
      if (it + 1 < count)
        prefetch_unit(items[it + 1], -1, kc, vc, block_tables, context_lens, query_start, s);
      attend_item(items[it], query, kc, vc, block_tables, context_lens,
                  query_start, s, scale, out, scratch);
    }
  }
}

// Rotary embedding (HF rotate_half layout) of the q and k parts of a fused q|k|v row,
// then the cache write: q_out [T, H, D] gets rotated q; k (rotated) and v go to the
// caches (of kv_dtype, rounded to nearest once) at slot_mapping[t] (-1 = skip). cos/sin
// tables [max_pos, D].
HR_EXPORT void hr_rope_and_cache(const float* qkv, const int64_t* positions, const float* cos,
                                 const float* sin, const int64_t* slot_mapping, int64_t tokens,
                                 int64_t heads, int64_t kv_heads, int64_t dim, float* q_out,
                                 void* key_cache, void* value_cache, int64_t kv_dtype) {
  const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
  const int64_t row_bytes = kv_row_bytes(kv_dtype, dim);
#pragma omp parallel for schedule(static) if (tokens >= 16)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = qkv + t * width;
    const float* c = cos + positions[t] * dim;
    const float* sn = sin + positions[t] * dim;
    const int64_t slot = slot_mapping[t];
    auto rotate = [&](const float* x, float* y) {
      for (int64_t i = 0; i < half; ++i) {
        y[i] = x[i] * c[i] - x[i + half] * sn[i];
        y[i + half] = x[i + half] * c[i + half] + x[i] * sn[i + half];
      }
    };
    for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, q_out + (t * heads + h) * dim);
    if (slot < 0) continue;
    uint8_t* kdst = static_cast<uint8_t*>(key_cache) + slot * kv_heads * row_bytes;
    uint8_t* vdst = static_cast<uint8_t*>(value_cache) + slot * kv_heads * row_bytes;
    std::vector<float> k(kv_dtype == kKvF32 ? 0 : dim);
    for (int64_t g = 0; g < kv_heads; ++g) {
      const float* v = row + (heads + kv_heads + g) * dim;
      if (kv_dtype == kKvF32) {
        rotate(row + (heads + g) * dim, reinterpret_cast<float*>(kdst + g * row_bytes));
      } else {
        rotate(row + (heads + g) * dim, k.data());
        kv_narrow(k.data(), kv_dtype, dim, kdst + g * row_bytes);
      }
      kv_narrow(v, kv_dtype, dim, vdst + g * row_bytes);
    }
  }
}
