// Prefill paged attention: the queries of a chunk over the cached prefix and
// the chunk itself (already written to the cache), bottom-right causal mask.
//
// Layout and mask semantics: kernels/metadata.py. Sequence s owns query rows
// [query_start_loc[s], query_start_loc[s+1]); its j-th query sits at position
// context_lens[s] - query_len + j and sees keys at positions <= that one.
// Only sequences with query_len >= 2 are served here; single-token rows
// belong to the decode kernel, which runs in the same step.
//
// paged_attention_prefill_<dtype>_d<D>:
//   grid  (ceil(max_query_len * group / 64), num_seqs, num_kv_heads)
//   block 128 threads
//   A thread block owns a tile of 64 rows of one KV head's group, a row being
//   a (query token, query head) pair, token-major, so a tile covers every head
//   of its tokens and each K/V tile staged in shared memory serves the whole
//   group. Two threads share a row, each holding half of the head dim (the
//   query slice and the output accumulator live in registers). K/V stream
//   through shared memory in tiles of 32 tokens (16 for D = 128, to bound
//   registers), converted to fp32 once; scores, online softmax (base 2) and
//   accumulation are fp32 (flash-attention's running max and sum).
//   Slots past the tile's last visible key are never read.
//
// Sliding window W (window > 0; 0 or less = none): the query at position p
// sees keys p - W + 1 .. p only (kernels/reference.py: p - W < key <= p), each
// query by its own position. A tile's K/V stream starts at its first row's
// first visible key, so blocks wholly before every row's window are never
// read; keys before a row's window score -inf like those past its position.
// Soft-cap (softcap_log2 > 0, Gemma 2): each score, scaled and in base 2,
// becomes C2 tanh(s / C2), C2 = cap * log2(e): the reference's
// tanh(s / cap) * cap in natural units, after the scale and before the mask.
#include "common.cuh"

namespace hr {

constexpr int kPrefillThreads = 128;
constexpr int kPrefillRows = kPrefillThreads / 2;  // two threads per row

template <typename T, int D>
struct PrefillShape {
  static constexpr int kVec = Vec16<T>::kSize;  // elements per 16-byte load
  static constexpr int kHalf = D / 2;           // dims held by one thread of a row's pair
  // Each thread owns every other float4 of the head dim: chunk c covers dims
  // [(2c + half) * 4, +4), so the pair's two reads of a K/V row are 16 bytes
  // apart and never hit the same bank.
  static constexpr int kChunks = D / 8;
  static constexpr int kKvTile = D >= 128 ? 16 : 32;
  static_assert(D % 8 == 0 && D % kVec == 0, "head dim");
};

// float4 elements, so that reads compile to 16-byte shared loads.
template <int D, int KV>
struct PrefillSmem {
  float4 k[KV][D / 4];
  float4 v[KV][D / 4];
};

// What one thread works on.
struct PrefillWork {
  int seq, kv_head, row, head;
  int q_pos, q_lo;  // this row sees keys q_lo .. q_pos
  int kv_begin, kv_len;  // keys [kv_begin, kv_len) are visible to some row of the tile
  bool active;  // false for the padding rows of a sequence's last tile
};

__device__ __forceinline__ bool prefill_work(PrefillWork& w, const int* __restrict__ context_lens,
                                             const int* __restrict__ query_start_loc,
                                             int group_size, int window) {
  w.seq = blockIdx.y;
  w.kv_head = blockIdx.z;
  const int q_begin = query_start_loc[w.seq];
  const int qlen = query_start_loc[w.seq + 1] - q_begin;
  if (qlen < 2) return false;
  const int rows = qlen * group_size;
  const int row0 = blockIdx.x * kPrefillRows;
  if (row0 >= rows) return false;
  const int ctx = context_lens[w.seq];
  const int row = row0 + static_cast<int>(threadIdx.x) / 2;
  const int tok = row / group_size;
  w.active = row < rows;
  w.row = q_begin + tok;
  w.head = w.kv_head * group_size + row % group_size;
  w.q_pos = w.active ? ctx - qlen + tok : -1;  // -1: sees nothing
  w.q_lo = window > 0 ? w.q_pos - window + 1 : 0;
  // Keys [kv_begin, kv_len) are visible to at least one row of the tile: from
  // the first row's first key to the last row's position.
  const int first_pos = ctx - qlen + row0 / group_size;
  w.kv_begin = window > 0 && first_pos >= window ? first_pos - window + 1 : 0;
  const int last_row = imin(row0 + kPrefillRows, rows) - 1;
  w.kv_len = ctx - qlen + last_row / group_size + 1;
  return true;
}

template <typename T, int D>
__device__ __forceinline__ void load_query_half(float (&q)[D / 2], const PrefillWork& w,
                                                const T* __restrict__ query, int num_heads,
                                                float scale_log2) {
  using S = PrefillShape<T, D>;
  const int half = threadIdx.x & 1;
  const T* src = query + static_cast<i64>(w.row) * num_heads * D + static_cast<i64>(w.head) * D;
#pragma unroll
  for (int c = 0; c < S::kChunks; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      q[4 * c + e] = w.active ? to_float(src[(2 * c + half) * 4 + e]) * scale_log2 : 0.0f;
    }
  }
}

// Copies keys/values [t0, t0 + KV) of this KV head into shared memory as
// fp32; rows at or past kv_len become zeros without touching the cache.
template <typename T, int D, int KV>
__device__ __forceinline__ void stage_kv(PrefillSmem<D, KV>& sm, const PrefillWork& w,
                                         const T* __restrict__ key_cache,
                                         const T* __restrict__ value_cache,
                                         const int* __restrict__ table, int num_kv_heads,
                                         int block_size, int t0) {
  constexpr int kVec = Vec16<T>::kSize, kPerRow = D / kVec;
  const i64 token_stride = static_cast<i64>(num_kv_heads) * D;
  for (int i = threadIdx.x; i < KV * kPerRow; i += kPrefillThreads) {
    const int r = i / kPerRow, c = i % kPerRow, t = t0 + r;
    const bool valid = t < w.kv_len;
    i64 offset = 0;
    if (valid) {
      const i64 slot = static_cast<i64>(table[t / block_size]) * block_size + t % block_size;
      offset = slot * token_stride + static_cast<i64>(w.kv_head) * D + c * kVec;
    }
    float k[kVec], v[kVec];
    load16_or_zero(key_cache + offset, valid, k);
    load16_or_zero(value_cache + offset, valid, v);
#pragma unroll
    for (int j = 0; j < kVec / 4; ++j) {
      sm.k[r][c * (kVec / 4) + j] = make_float4(k[4 * j], k[4 * j + 1], k[4 * j + 2], k[4 * j + 3]);
      sm.v[r][c * (kVec / 4) + j] = make_float4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
    }
  }
}

template <int D, int KV>
__device__ __forceinline__ void score_tile(float (&s)[KV], const PrefillSmem<D, KV>& sm,
                                           const float (&q)[D / 2], int t0, int q_lo, int q_pos,
                                           float softcap_log2) {
  const int half = threadIdx.x & 1;
#pragma unroll
  for (int k = 0; k < KV; ++k) {
    float part = 0.0f;
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
      const float4 kk = sm.k[k][2 * c + half];
      part = fmaf(q[4 * c + 0], kk.x, part);
      part = fmaf(q[4 * c + 1], kk.y, part);
      part = fmaf(q[4 * c + 2], kk.z, part);
      part = fmaf(q[4 * c + 3], kk.w, part);
    }
    part += __shfl_xor_sync(kFullMask, part, 1);  // the pair's two halves of the dot
    if (softcap_log2 > 0.0f) part = softcap_log2 * tanhf(part / softcap_log2);
    s[k] = t0 + k >= q_lo && t0 + k <= q_pos ? part : neg_inf();
  }
}

// One step of the online softmax: rescales (o, l) to the new running max and
// adds this tile's probabilities times values.
template <int D, int KV>
__device__ __forceinline__ void attend_tile(const PrefillSmem<D, KV>& sm, const float (&q)[D / 2],
                                            int t0, const PrefillWork& w, float softcap_log2,
                                            float (&o)[D / 2], float& m, float& l) {
  const int half = threadIdx.x & 1;
  float s[KV];
  score_tile<D, KV>(s, sm, q, t0, w.q_lo, w.q_pos, softcap_log2);
  float tile_max = neg_inf();
#pragma unroll
  for (int k = 0; k < KV; ++k) tile_max = fmaxf(tile_max, s[k]);
  const float m_new = fmaxf(m, tile_max);
  // A row that sees no key yet has m_new = -inf: measuring from 0 instead
  // keeps every factor at exp2(-inf) = 0 rather than exp2(-inf + inf) = NaN.
  const float m_ref = m_new == neg_inf() ? 0.0f : m_new;
  const float alpha = exp2f(m - m_ref);
  l *= alpha;
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] *= alpha;
#pragma unroll
  for (int k = 0; k < KV; ++k) {
    const float p = exp2f(s[k] - m_ref);
    l += p;
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
      const float4 vv = sm.v[k][2 * c + half];
      o[4 * c + 0] = fmaf(p, vv.x, o[4 * c + 0]);
      o[4 * c + 1] = fmaf(p, vv.y, o[4 * c + 1]);
      o[4 * c + 2] = fmaf(p, vv.z, o[4 * c + 2]);
      o[4 * c + 3] = fmaf(p, vv.w, o[4 * c + 3]);
    }
  }
  m = m_new;
}

template <typename T, int D>
__device__ __forceinline__ void prefill_attention(
    T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ key_cache,
    const T* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ context_lens, const int* __restrict__ query_start_loc,
    float scale_log2, float softcap_log2, int window, int num_kv_heads, int group_size,
    int block_size, int table_width) {
  using S = PrefillShape<T, D>;
  constexpr int KV = S::kKvTile;
  __shared__ PrefillSmem<D, KV> sm;
  PrefillWork w;
  if (!prefill_work(w, context_lens, query_start_loc, group_size, window)) return;
  const int num_heads = num_kv_heads * group_size;
  const int* table = block_tables + static_cast<i64>(w.seq) * table_width;
  float q[D / 2], o[D / 2];
  load_query_half<T, D>(q, w, query, num_heads, scale_log2);
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float m = neg_inf(), l = 0.0f;
  for (int t0 = w.kv_begin; t0 < w.kv_len; t0 += KV) {
    __syncthreads();  // every thread is done with the previous tile
    stage_kv<T, D, KV>(sm, w, key_cache, value_cache, table, num_kv_heads, block_size, t0);
    __syncthreads();
    attend_tile<D, KV>(sm, q, t0, w, softcap_log2, o, m, l);
  }
  if (!w.active) return;
  const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
  const int half = threadIdx.x & 1;
  T* dst = out + static_cast<i64>(w.row) * num_heads * D + static_cast<i64>(w.head) * D;
#pragma unroll
  for (int c = 0; c < S::kChunks; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dst[(2 * c + half) * 4 + e] = from_float<T>(o[4 * c + e] * inv_l);
  }
}

}  // namespace hr

#define HR_DEFINE_PREFILL(SUFFIX, T, D)                                                       \
  extern "C" __global__ void __launch_bounds__(hr::kPrefillThreads)                           \
      paged_attention_prefill_##SUFFIX##_d##D(                                                \
          T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ key_cache,  \
          const T* __restrict__ value_cache, const int* __restrict__ block_tables,            \
          const int* __restrict__ context_lens, const int* __restrict__ query_start_loc,      \
          float scale_log2, float softcap_log2, int window, int num_kv_heads, int group_size,  \
          int block_size, int table_width) {                                                  \
    hr::prefill_attention<T, D>(out, query, key_cache, value_cache, block_tables,             \
                                context_lens, query_start_loc, scale_log2, softcap_log2,      \
                                window, num_kv_heads, group_size, block_size, table_width);   \
  }

HR_DEFINE_PREFILL(f16, __half, 64)
HR_DEFINE_PREFILL(f16, __half, 128)
HR_DEFINE_PREFILL(bf16, __nv_bfloat16, 64)
HR_DEFINE_PREFILL(bf16, __nv_bfloat16, 128)
