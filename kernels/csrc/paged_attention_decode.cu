// Decode paged attention: one query token per sequence over its block table.
//
// Layout and mask semantics: kernels/metadata.py. A sequence is a decode
// sequence when it owns exactly one query row (query_start_loc[s+1] -
// query_start_loc[s] == 1); blocks of other sequences return at once, so the
// prefill kernel can serve them in the same step without an index list.
//
// Kernel 1, paged_attention_decode_<dtype>_d<D>_b<B>:
//   grid  (num_kv_heads * group_chunks, num_seqs, max_partitions)
//   block 128 threads (4 warps)
//   One thread block serves one (sequence, KV head, partition of
//   partition_size tokens: 64, 128, 256 or 512, chosen per launch)
//   and up to kMaxGroup query heads of that KV head's group, so each K/V byte
//   is read once per group (group_chunks = ceil(group / kMaxGroup) is 1 for
//   every group size up to 8). Warps take whole cache blocks in turn. Within
//   a warp, kLanesPerKey lanes hold one key row, 16 bytes each, and every lane
//   holds kKeysPerLane keys at a time so that one query read from shared
//   memory serves four keys, and the per-key sums across lanes are done by a
//   reduce-scatter (5 shuffles for 4 keys over 16 lanes instead of 16).
//   Scores, softmax and accumulators are fp32; the softmax runs in base 2
//   on scores pre-multiplied by log2(e).
//   The launcher picks the partition size from the batch and the longest
//   context (kernels/cuda/launch.py, decode_partition_size): 512 whenever that
//   already gives every SM a block, smaller for small batches so that they
//   fill the GPU. A sequence's result depends on the partition size (the
//   merge rounds differently), so it is bit-identical across batches that
//   launch with the same size, which every batch that fills the GPU does.
//   A sequence with one partition writes its output directly; with several,
//   each partition writes (max, sum, normalized output) to fp32 workspaces
//   for kernel 2. Context length 0 (CUDA-graph padding rows) writes zeros.
//
// Sliding window W (window > 0; 0 or less = none): the query at position
// ctx - 1 sees keys ctx - W .. ctx - 1 only (kernels/reference.py's rule,
// p - W < key <= p). Partitions stay aligned to multiples of partition_size
// from position 0, but only those holding a visible key run: grid.z counts
// from the first of them, so partitions and blocks wholly before the window
// are never read, and a partition that starts before the window starts at
// its first visible key instead (the slots before it are neither read nor
// weighted). Soft-cap (softcap_log2 > 0, Gemma 2): a score s (scaled, in
// base 2 like every score here) becomes C2 tanh(s / C2) with C2 = cap * log2(e),
// which is log2(e) * cap * tanh(s_e / cap) of the natural-base score s_e:
// the reference's tanh(s / cap) * cap, after the scale and before the mask.
//
// Kernel 2, paged_attention_decode_reduce_<dtype>_d<D>:
//   grid (num_heads, num_seqs), block D threads. Merges the partitions of
//   sequences with more than one: M = max_p m_p, w_p = l_p * 2^(m_p - M),
//   out = sum_p w_p o_p / sum_p w_p (over the partitions kernel 1 ran: those
//   holding a key inside the window).
#include "common.cuh"

namespace hr {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / kWarpSize;
constexpr int kPartitionSize = 512;  // the largest partition: sizes the logits buffer
constexpr int kMaxGroup = 8;
constexpr int kKeysPerLane = 4;

template <typename T, int D, int B>
struct DecodeShape {
  static constexpr int kVec = Vec16<T>::kSize;                  // elements per 16-byte load
  static constexpr int kLanesPerKey = D / kVec;                 // lanes holding one key row
  static constexpr int kKeysPerRow = kWarpSize / kLanesPerKey;  // keys one warp load covers
  static constexpr int kKeysPerIter = kKeysPerLane * kKeysPerRow;
  // A lane's query slice sits at a padded stride (in float4s) so that the 8
  // lanes of a quarter-warp reading 32 bytes each hit distinct banks.
  static constexpr int kQStride4 = kVec > 4 ? kVec / 4 + 1 : kVec / 4;
  static_assert(D % kVec == 0 && kLanesPerKey <= kWarpSize, "head dim vs warp");
  static_assert(kLanesPerKey >= kKeysPerLane, "reduce-scatter needs a lane per key");
  static_assert(B % kKeysPerIter == 0, "block size vs keys per warp iteration");
  static_assert(kDecodeWarps * D <= kPartitionSize, "output reduction reuses the logits");
};

// Shared memory of one thread block (about 20 KB for D = 128).
template <int D>
struct DecodeSmem {
  float4 q[kMaxGroup][(D + D / 2) / 4];     // scaled queries, padded stride (see kQStride4)
  float logits[kMaxGroup][kPartitionSize];  // scores, then probabilities, then partial outputs
  float head_max[kMaxGroup];
  float head_sum[kMaxGroup];
};

// Which (sequence, heads, partition) this thread block serves. `part` and
// `parts` count only the partitions holding a visible key (the workspace slots),
// [tok_begin, tok_end) are this partition's visible keys.
struct DecodeWork {
  int seq, part, kv_head, head0, heads, q_row, ctx, parts, tok_begin, tok_end;
};

// The first key the query at position ctx - 1 sees (window <= 0: none, key 0).
__device__ __forceinline__ int window_start(int ctx, int window) {
  return window > 0 && ctx > window ? ctx - window : 0;
}

// Soft-capped score in base 2 (see the header); softcap_log2 <= 0 leaves it.
__device__ __forceinline__ float soft_cap(float s, float softcap_log2) {
  return softcap_log2 > 0.0f ? softcap_log2 * tanhf(s / softcap_log2) : s;
}

// Sums N values per lane over groups of LANES lanes; afterwards this lane
// holds the full sum of key `which` (the lanes of a group split the keys).
template <int N, int LANES>
__device__ __forceinline__ float reduce_scatter_sum(float (&v)[N], int lane, int& which) {
  which = 0;
#pragma unroll
  for (int half = N / 2, mask = LANES / 2; half >= 1; half /= 2, mask /= 2) {
    const bool upper = (lane & mask) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      // Lower lanes keep keys [0, half), upper lanes [half, 2 * half); each
      // sends its partner the half the partner keeps.
      const float send = upper ? v[i] : v[i + half];
      const float keep = upper ? v[i + half] : v[i];
      v[i] = keep + __shfl_xor_sync(kFullMask, send, mask);
    }
    which += upper ? half : 0;
  }
  float sum = v[0];
#pragma unroll
  for (int mask = LANES / (2 * N); mask >= 1; mask /= 2) {
    sum += __shfl_xor_sync(kFullMask, sum, mask);
  }
  return sum;
}

template <typename T, int D, int B, typename Smem>
__device__ __forceinline__ void load_queries(Smem& sm, const DecodeWork& w,
                                             const T* __restrict__ query, int num_heads,
                                             float scale_log2) {
  using S = DecodeShape<T, D, B>;
  const T* q = query + static_cast<i64>(w.q_row) * num_heads * D + static_cast<i64>(w.head0) * D;
  for (int i = threadIdx.x; i < w.heads * D; i += kDecodeThreads) {
    const int g = i / D, d = i % D;
    float* row = reinterpret_cast<float*>(sm.q[g]);
    row[(d / S::kVec) * S::kQStride4 * 4 + d % S::kVec] = to_float(q[i]) * scale_log2;
  }
}

// The soft-capped, scaled base-2 score of query head row `q` (shared memory, padded) with
// one of the lane's kKeysPerLane keys `k`: after the reduce-scatter this lane holds key
// `which`'s (every lane of its key row holds one key's, kLanesPerKey / 4 lanes each).
template <typename T, int D, int B>
__device__ __forceinline__ float score(const float4* q_row,
                                       const float (&k)[kKeysPerLane][Vec16<T>::kSize],
                                       int chunk, int lane, float softcap_log2, int& which) {
  using S = DecodeShape<T, D, B>;
  float q[S::kVec];
#pragma unroll
  for (int j = 0; j < S::kVec / 4; ++j) {
    const float4 q4 = q_row[chunk * S::kQStride4 + j];
    q[4 * j] = q4.x;
    q[4 * j + 1] = q4.y;
    q[4 * j + 2] = q4.z;
    q[4 * j + 3] = q4.w;
  }
  float dots[kKeysPerLane];
#pragma unroll
  for (int j = 0; j < kKeysPerLane; ++j) {
    dots[j] = 0.0f;
#pragma unroll
    for (int e = 0; e < S::kVec; ++e) dots[j] = fmaf(q[e], k[j][e], dots[j]);
  }
  return soft_cap(reduce_scatter_sum<kKeysPerLane, S::kLanesPerKey>(dots, lane, which),
                  softcap_log2);
}

// Phase 1: logits[g][t - tok_begin] = log2(e) * scale * q_g . k_t (soft-capped)
// for the partition's tokens tok_begin <= t < tok_end.
template <typename T, int D, int B>
__device__ __forceinline__ void score_keys(DecodeSmem<D>& sm, const DecodeWork& w,
                                           const T* __restrict__ key_cache,
                                           const int* __restrict__ table, int num_kv_heads,
                                           float softcap_log2) {
  using S = DecodeShape<T, D, B>;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int key_in_row = lane / S::kLanesPerKey, chunk = lane % S::kLanesPerKey;
  const i64 token_stride = static_cast<i64>(num_kv_heads) * D;
  const int last_block = (w.tok_end - 1) / B;
  for (int blk = w.tok_begin / B + warp; blk <= last_block; blk += kDecodeWarps) {
    const T* base = key_cache + static_cast<i64>(table[blk]) * B * token_stride +
                    static_cast<i64>(w.kv_head) * D + chunk * S::kVec;
    for (int it = 0; it < B; it += S::kKeysPerIter) {
      float k[kKeysPerLane][S::kVec];
#pragma unroll
      for (int j = 0; j < kKeysPerLane; ++j) {
        const int slot = it + j * S::kKeysPerRow + key_in_row;
        const int pos = blk * B + slot;
        load16_or_zero(base + slot * token_stride, pos >= w.tok_begin && pos < w.tok_end, k[j]);
      }
      for (int g = 0; g < w.heads; ++g) {
        int which;
        const float s = score<T, D, B>(sm.q[g], k, chunk, lane, softcap_log2, which);
        const int tok = blk * B + it + which * S::kKeysPerRow + key_in_row;
        // Lanes holding the same key hold the same sum: the first one writes.
        const bool writer = (chunk & (S::kLanesPerKey / kKeysPerLane - 1)) == 0;
        if (writer && tok >= w.tok_begin && tok < w.tok_end) sm.logits[g][tok - w.tok_begin] = s;
      }
    }
  }
}

// Phase 2: per head, logits -> 2^(logit - max) in place; keeps max and sum.
// Only the partition's valid tokens [0, n) take part in either.
template <int D>
__device__ __forceinline__ void softmax_rows(DecodeSmem<D>& sm, const DecodeWork& w) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int n = w.tok_end - w.tok_begin;
  for (int g = warp; g < w.heads; g += kDecodeWarps) {
    float m = neg_inf();
    for (int t = lane; t < n; t += kWarpSize) m = fmaxf(m, sm.logits[g][t]);
    m = warp_max(m);
    float sum = 0.0f;
    for (int t = lane; t < n; t += kWarpSize) {
      const float p = exp2f(sm.logits[g][t] - m);
      sm.logits[g][t] = p;
      sum += p;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      sm.head_max[g] = m;
      sm.head_sum[g] = sum;
    }
  }
}

// Phase 3: acc[g][e] += p[g][t] * v_t over this warp's blocks, for this
// lane's 16-byte slice of the head dim; then summed over the warp's rows.
template <typename T, int D, int B>
__device__ __forceinline__ void accumulate_values(const DecodeSmem<D>& sm, const DecodeWork& w,
                                                  const T* __restrict__ value_cache,
                                                  const int* __restrict__ table, int num_kv_heads,
                                                  float (&acc)[kMaxGroup][Vec16<T>::kSize]) {
  using S = DecodeShape<T, D, B>;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int key_in_row = lane / S::kLanesPerKey, chunk = lane % S::kLanesPerKey;
  const i64 token_stride = static_cast<i64>(num_kv_heads) * D;
  const int last_block = (w.tok_end - 1) / B;
  for (int blk = w.tok_begin / B + warp; blk <= last_block; blk += kDecodeWarps) {
    const T* base = value_cache + static_cast<i64>(table[blk]) * B * token_stride +
                    static_cast<i64>(w.kv_head) * D + chunk * S::kVec;
    for (int it = 0; it < B; it += S::kKeysPerIter) {
      float v[kKeysPerLane][S::kVec];
#pragma unroll
      for (int j = 0; j < kKeysPerLane; ++j) {
        const int slot = it + j * S::kKeysPerRow + key_in_row;
        const int pos = blk * B + slot;
        load16_or_zero(base + slot * token_stride, pos >= w.tok_begin && pos < w.tok_end, v[j]);
      }
#pragma unroll
      for (int j = 0; j < kKeysPerLane; ++j) {
        const int t = blk * B + it + j * S::kKeysPerRow + key_in_row - w.tok_begin;
        const bool valid = t >= 0 && t < w.tok_end - w.tok_begin;
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g >= w.heads) break;
          const float p = valid ? sm.logits[g][t] : 0.0f;
#pragma unroll
          for (int e = 0; e < S::kVec; ++e) acc[g][e] = fmaf(p, v[j][e], acc[g][e]);
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
    for (int e = 0; e < S::kVec; ++e) {
#pragma unroll
      for (int mask = S::kLanesPerKey; mask < kWarpSize; mask *= 2) {
        acc[g][e] += __shfl_xor_sync(kFullMask, acc[g][e], mask);
      }
    }
  }
}

// Element i (head i / D, dim i % D) of this thread block's normalized output `o`: straight
// into `out` when the sequence has one partition, else into this partition's workspace
// slot with the head's max and sum (base 2) for kernel 2.
template <typename T, int D>
__device__ __forceinline__ void write_output(const DecodeWork& w, int i, float o, float max,
                                             float sum, T* __restrict__ out,
                                             float* __restrict__ ws_out,
                                             float* __restrict__ ws_max,
                                             float* __restrict__ ws_sum, int num_heads,
                                             int max_partitions) {
  if (w.parts == 1) {
    out[static_cast<i64>(w.q_row) * num_heads * D + static_cast<i64>(w.head0) * D + i] =
        from_float<T>(o);
    return;
  }
  const int g = i / D, d = i % D;
  const i64 slot = (static_cast<i64>(w.seq) * num_heads + w.head0 + g) * max_partitions + w.part;
  ws_out[slot * D + d] = o;
  if (d == 0) {
    ws_max[slot] = max;
    ws_sum[slot] = sum;
  }
}

// Sums the warps' partial outputs (through the logits buffer, free by now)
// and writes out[q_row] directly, or this partition's slot of the workspaces.
template <typename T, int D, int B>
__device__ __forceinline__ void store_output(DecodeSmem<D>& sm, const DecodeWork& w,
                                             const float (&acc)[kMaxGroup][Vec16<T>::kSize],
                                             T* __restrict__ out, float* __restrict__ ws_out,
                                             float* __restrict__ ws_max,
                                             float* __restrict__ ws_sum, int num_heads,
                                             int max_partitions) {
  using S = DecodeShape<T, D, B>;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  float* partial = &sm.logits[0][0];  // [kDecodeWarps][kMaxGroup][D]
  __syncthreads();                    // every warp is done reading probabilities
  if (lane < S::kLanesPerKey) {
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
      for (int e = 0; e < S::kVec; ++e) {
        partial[(warp * kMaxGroup + g) * D + lane * S::kVec + e] = acc[g][e];
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < w.heads * D; i += kDecodeThreads) {
    const int g = i / D, d = i % D;
    float o = 0.0f;
#pragma unroll
    for (int k = 0; k < kDecodeWarps; ++k) o += partial[(k * kMaxGroup + g) * D + d];
    o /= sm.head_sum[g];
    write_output<T, D>(w, i, o, sm.head_max[g], sm.head_sum[g], out, ws_out, ws_max, ws_sum,
                       num_heads, max_partitions);
  }
}

// Fills in DecodeWork; false when this thread block has nothing to do.
__device__ __forceinline__ bool decode_work(DecodeWork& w, const int* __restrict__ context_lens,
                                           const int* __restrict__ query_start_loc,
                                           int group_size, int partition_size, int window) {
  w.seq = blockIdx.y;
  w.part = blockIdx.z;
  w.q_row = query_start_loc[w.seq];
  if (query_start_loc[w.seq + 1] - w.q_row != 1) return false;
  const int chunks = (group_size + kMaxGroup - 1) / kMaxGroup;
  const int chunk = blockIdx.x % chunks;
  w.kv_head = blockIdx.x / chunks;
  w.head0 = w.kv_head * group_size + chunk * kMaxGroup;
  w.heads = imin(kMaxGroup, group_size - chunk * kMaxGroup);
  w.ctx = context_lens[w.seq];
  const int lo = window_start(w.ctx, window);
  const int first = lo / partition_size;  // partitions before it hold no visible key
  w.parts = (w.ctx + partition_size - 1) / partition_size - first;
  // Partition 0 of an empty context still runs: it writes the zeros.
  if (w.part >= (w.parts > 0 ? w.parts : 1)) return false;
  const int begin = (first + w.part) * partition_size;
  w.tok_begin = begin > lo ? begin : lo;
  w.tok_end = imin(begin + partition_size, w.ctx);
  return true;
}

// What both decode kernels do first: find their work (false from decode_work: none), write
// zeros for an empty context (CUDA-graph padding rows), stage the scaled queries in shared
// memory. The sequence's block table, or nullptr when the thread block is done.
template <typename T, int D, int B, typename Smem>
__device__ __forceinline__ const int* decode_prologue(
    Smem& sm, DecodeWork& w, T* __restrict__ out, const T* __restrict__ query,
    const int* __restrict__ block_tables, const int* __restrict__ context_lens,
    const int* __restrict__ query_start_loc, float scale_log2, int window, int num_kv_heads,
    int group_size, int table_width, int partition_size) {
  if (!decode_work(w, context_lens, query_start_loc, group_size, partition_size, window)) {
    return nullptr;
  }
  const int num_heads = num_kv_heads * group_size;
  if (w.ctx == 0) {
    T* row = out + static_cast<i64>(w.q_row) * num_heads * D + static_cast<i64>(w.head0) * D;
    for (int i = threadIdx.x; i < w.heads * D; i += kDecodeThreads) row[i] = from_float<T>(0.0f);
    return nullptr;
  }
  load_queries<T, D, B>(sm, w, query, num_heads, scale_log2);
  __syncthreads();
  return block_tables + static_cast<i64>(w.seq) * table_width;
}

template <typename T, int D, int B>
__device__ __forceinline__ void decode_partition(
    T* __restrict__ out, float* __restrict__ ws_out, float* __restrict__ ws_max,
    float* __restrict__ ws_sum, const T* __restrict__ query, const T* __restrict__ key_cache,
    const T* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ context_lens, const int* __restrict__ query_start_loc,
    float scale_log2, float softcap_log2, int window, int num_kv_heads, int group_size,
    int table_width, int max_partitions, int partition_size) {
  __shared__ DecodeSmem<D> sm;
  DecodeWork w;
  const int* table = decode_prologue<T, D, B>(sm, w, out, query, block_tables, context_lens,
                                              query_start_loc, scale_log2, window, num_kv_heads,
                                              group_size, table_width, partition_size);
  if (table == nullptr) return;
  const int num_heads = num_kv_heads * group_size;
  score_keys<T, D, B>(sm, w, key_cache, table, num_kv_heads, softcap_log2);
  __syncthreads();
  softmax_rows<D>(sm, w);
  __syncthreads();
  float acc[kMaxGroup][Vec16<T>::kSize] = {};
  accumulate_values<T, D, B>(sm, w, value_cache, table, num_kv_heads, acc);
  store_output<T, D, B>(sm, w, acc, out, ws_out, ws_max, ws_sum, num_heads, max_partitions);
}

// ---------------------------------------------------------------------------------------
// Kernel 1b, paged_attention_decode_onepass_<dtype>_d<D>_b<B>_g<G>: kernel 1's work, grid,
// arguments and outputs (the same workspace format for kernel 2), in one pass over the keys.
// Each warp keeps a running max, sum and output per query head (online softmax, base 2)
// over the cache blocks it takes, reading a block's K and V rows together, and loads the
// next item's K and V (and its block's table entry) before computing the current one, so
// twice kernel 1's bytes are in flight per warp and no barrier separates K from V. The
// warps' partial results are merged once at the end. G (4 or 8) is the most query heads a
// thread block serves (the launcher picks 4 for groups of up to 4): it sizes the
// accumulators, so small groups keep fewer registers. No logits buffer, so no partition
// size limit either. Scores are kernel 1's to the bit; the softmax rounds differently.

// Thread blocks per SM the one-pass kernel is built for (caps its registers: 170 and 256 a
// thread). G = 4 needs ~168 registers, G = 8 ~222; without the cap ptxas may pick fewer and
// spill. Host and device: NVRTC (the launcher's compiler) refuses a host function here,
// where nvcc allows it.
__host__ __device__ constexpr int onepass_min_blocks(int G) { return G <= 4 ? 3 : 2; }

template <int D>
struct OnePassSmem {
  float4 q[kMaxGroup][(D + D / 2) / 4];  // scaled queries, as kernel 1 (kQStride4)
  float part_max[kDecodeWarps][kMaxGroup];
  float part_sum[kDecodeWarps][kMaxGroup];
  float part_out[kDecodeWarps][kMaxGroup][D];
};

// One warp item: kKeysPerLane keys' K and V rows (16 bytes of each per lane), as loaded.
struct KvRaw {
  uint4 k[kKeysPerLane];
  uint4 v[kKeysPerLane];
};

__device__ __forceinline__ void unpack16(const uint4& raw, __half, float* out) {
  unpack2(raw.x, __half(), out + 0);
  unpack2(raw.y, __half(), out + 2);
  unpack2(raw.z, __half(), out + 4);
  unpack2(raw.w, __half(), out + 6);
}
__device__ __forceinline__ void unpack16(const uint4& raw, __nv_bfloat16, float* out) {
  unpack2(raw.x, __nv_bfloat16(), out + 0);
  unpack2(raw.y, __nv_bfloat16(), out + 2);
  unpack2(raw.z, __nv_bfloat16(), out + 4);
  unpack2(raw.w, __nv_bfloat16(), out + 6);
}

// Loads item `item` of this warp: block first + warp + (item / iters) * kDecodeWarps, keys
// from (item % iters) * kKeysPerIter; slots outside [tok_begin, tok_end) read as zeros.
template <typename T, int D, int B>
__device__ __forceinline__ void load_item(KvRaw& raw, int item, const DecodeWork& w,
                                          const T* __restrict__ key_cache,
                                          const T* __restrict__ value_cache,
                                          const int* __restrict__ table, i64 token_stride,
                                          i64 lane_offset, int warp, int key_in_row) {
  using S = DecodeShape<T, D, B>;
  constexpr int kIters = B / S::kKeysPerIter;
  const int blk = w.tok_begin / B + warp + (item / kIters) * kDecodeWarps;
  const int it = (item % kIters) * S::kKeysPerIter;
  const i64 base = static_cast<i64>(table[blk]) * B * token_stride + lane_offset;
#pragma unroll
  for (int j = 0; j < kKeysPerLane; ++j) {
    const int slot = it + j * S::kKeysPerRow + key_in_row;
    const int pos = blk * B + slot;
    const i64 at = base + slot * token_stride;
    const bool valid = pos >= w.tok_begin && pos < w.tok_end;
    raw.k[j] = valid ? *reinterpret_cast<const uint4*>(key_cache + at) : make_uint4(0, 0, 0, 0);
    raw.v[j] = valid ? *reinterpret_cast<const uint4*>(value_cache + at) : make_uint4(0, 0, 0, 0);
  }
}

template <typename T, int D, int B, int G>
__device__ __forceinline__ void decode_partition_onepass(
    T* __restrict__ out, float* __restrict__ ws_out, float* __restrict__ ws_max,
    float* __restrict__ ws_sum, const T* __restrict__ query, const T* __restrict__ key_cache,
    const T* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ context_lens, const int* __restrict__ query_start_loc,
    float scale_log2, float softcap_log2, int window, int num_kv_heads, int group_size,
    int table_width, int max_partitions, int partition_size) {
  using S = DecodeShape<T, D, B>;
  static_assert(kKeysPerLane == 4, "score gather assumes reduce_scatter_sum over 4 keys");
  static_assert(S::kVec == 8, "16-bit K/V only");
  constexpr int kIters = B / S::kKeysPerIter;
  __shared__ OnePassSmem<D> sm;
  DecodeWork w;
  const int* table = decode_prologue<T, D, B>(sm, w, out, query, block_tables, context_lens,
                                              query_start_loc, scale_log2, window, num_kv_heads,
                                              group_size, table_width, partition_size);
  if (table == nullptr) return;
  const int num_heads = num_kv_heads * group_size;

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int key_in_row = lane / S::kLanesPerKey, chunk = lane % S::kLanesPerKey;
  const i64 token_stride = static_cast<i64>(num_kv_heads) * D;
  const i64 lane_offset = static_cast<i64>(w.kv_head) * D + chunk * S::kVec;
  const int first = w.tok_begin / B + warp, last = (w.tok_end - 1) / B;
  const int items = first <= last ? ((last - first) / kDecodeWarps + 1) * kIters : 0;
  // The lane holding key j's full score after reduce_scatter_sum, in this lane's key row.
  int holder[kKeysPerLane];
#pragma unroll
  for (int j = 0; j < kKeysPerLane; ++j) {
    holder[j] = key_in_row * S::kLanesPerKey + (j >> 1) * (S::kLanesPerKey / 2) +
                (j & 1) * (S::kLanesPerKey / 4);
  }

  float m[G], l[G], acc[G][S::kVec];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = neg_inf();
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < S::kVec; ++e) acc[g][e] = 0.0f;
  }
  KvRaw cur;
  if (items > 0) {
    load_item<T, D, B>(cur, 0, w, key_cache, value_cache, table, token_stride, lane_offset,
                       warp, key_in_row);
  }
  for (int item = 0; item < items; ++item) {
    KvRaw next;
    if (item + 1 < items) {
      load_item<T, D, B>(next, item + 1, w, key_cache, value_cache, table, token_stride,
                         lane_offset, warp, key_in_row);
    }
    const int blk = first + (item / kIters) * kDecodeWarps;
    const int key0 = blk * B + (item % kIters) * S::kKeysPerIter + key_in_row;
    float k[kKeysPerLane][S::kVec], v[kKeysPerLane][S::kVec];
    bool valid[kKeysPerLane];
#pragma unroll
    for (int j = 0; j < kKeysPerLane; ++j) {
      unpack16(cur.k[j], T(), k[j]);
      unpack16(cur.v[j], T(), v[j]);
      const int pos = key0 + j * S::kKeysPerRow;
      valid[j] = pos >= w.tok_begin && pos < w.tok_end;
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= w.heads) break;
      int which;
      const float mine = score<T, D, B>(sm.q[g], k, chunk, lane, softcap_log2, which);
      float s[kKeysPerLane];
      float top = neg_inf();
#pragma unroll
      for (int j = 0; j < kKeysPerLane; ++j) {
        s[j] = __shfl_sync(kFullMask, mine, holder[j]);
        s[j] = valid[j] ? s[j] : neg_inf();
        top = fmaxf(top, s[j]);
      }
#pragma unroll
      for (int mask = S::kLanesPerKey; mask < kWarpSize; mask *= 2) {
        top = fmaxf(top, __shfl_xor_sync(kFullMask, top, mask));
      }
      const float m_new = fmaxf(m[g], top);
      if (m_new == neg_inf()) continue;  // no visible key yet (warp-uniform)
      const float alpha = exp2f(m[g] - m_new);
      float p[kKeysPerLane], sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kKeysPerLane; ++j) {
        p[j] = exp2f(s[j] - m_new);
        sum += p[j];
      }
      l[g] = fmaf(l[g], alpha, sum);
#pragma unroll
      for (int e = 0; e < S::kVec; ++e) {
        float a = acc[g][e] * alpha;
#pragma unroll
        for (int j = 0; j < kKeysPerLane; ++j) a = fmaf(p[j], v[j][e], a);
        acc[g][e] = a;
      }
      m[g] = m_new;
    }
    cur = next;
  }
  // This warp's totals: lanes of one key row hold that row's keys only.
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int mask = S::kLanesPerKey; mask < kWarpSize; mask *= 2) {
      l[g] += __shfl_xor_sync(kFullMask, l[g], mask);
#pragma unroll
      for (int e = 0; e < S::kVec; ++e) acc[g][e] += __shfl_xor_sync(kFullMask, acc[g][e], mask);
    }
  }
  if (lane < S::kLanesPerKey) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= w.heads) break;
      if (lane == 0) {
        sm.part_max[warp][g] = m[g];
        sm.part_sum[warp][g] = l[g];
      }
#pragma unroll
      for (int e = 0; e < S::kVec; ++e) sm.part_out[warp][g][lane * S::kVec + e] = acc[g][e];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < w.heads * D; i += kDecodeThreads) {
    const int g = i / D, d = i % D;
    float top = neg_inf();
#pragma unroll
    for (int k = 0; k < kDecodeWarps; ++k) top = fmaxf(top, sm.part_max[k][g]);
    float total = 0.0f, o = 0.0f;
#pragma unroll
    for (int k = 0; k < kDecodeWarps; ++k) {
      // A warp that saw no visible key has max -inf, sum 0 and output 0: weight 0.
      const float weight = sm.part_max[k][g] == neg_inf() ? 0.0f : exp2f(sm.part_max[k][g] - top);
      total = fmaf(sm.part_sum[k][g], weight, total);
      o = fmaf(sm.part_out[k][g][d], weight, o);
    }
    o /= total;
    write_output<T, D>(w, i, o, top, total, out, ws_out, ws_max, ws_sum, num_heads,
                       max_partitions);
  }
}

template <typename T, int D>
__device__ __forceinline__ void decode_reduce(T* __restrict__ out,
                                              const float* __restrict__ ws_out,
                                              const float* __restrict__ ws_max,
                                              const float* __restrict__ ws_sum,
                                              const int* __restrict__ context_lens,
                                              const int* __restrict__ query_start_loc,
                                              int window, int num_heads, int max_partitions,
                                              int partition_size) {
  const int head = blockIdx.x, seq = blockIdx.y;
  const int q_row = query_start_loc[seq];
  if (query_start_loc[seq + 1] - q_row != 1) return;
  const int ctx = context_lens[seq];
  // As decode_work counts them: the partitions holding a visible key.
  const int parts =
      (ctx + partition_size - 1) / partition_size - window_start(ctx, window) / partition_size;
  if (parts <= 1) return;  // written directly by the partition kernel
  const i64 base = (static_cast<i64>(seq) * num_heads + head) * max_partitions;
  float global_max = neg_inf();
  for (int p = 0; p < parts; ++p) global_max = fmaxf(global_max, ws_max[base + p]);
  // Every thread recomputes the few weights itself: cheaper than a barrier.
  float total = 0.0f;
  for (int p = 0; p < parts; ++p) total += ws_sum[base + p] * exp2f(ws_max[base + p] - global_max);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.0f;
    for (int p = 0; p < parts; ++p) {
      const float weight = ws_sum[base + p] * exp2f(ws_max[base + p] - global_max);
      o = fmaf(weight, ws_out[(base + p) * D + d], o);
    }
    out[static_cast<i64>(q_row) * num_heads * D + static_cast<i64>(head) * D + d] =
        from_float<T>(o / total);
  }
}

}  // namespace hr

#define HR_DEFINE_DECODE(SUFFIX, T, D, B)                                                       \
  extern "C" __global__ void __launch_bounds__(hr::kDecodeThreads)                              \
      paged_attention_decode_##SUFFIX##_d##D##_b##B(                                            \
          T* __restrict__ out, float* __restrict__ ws_out, float* __restrict__ ws_max,          \
          float* __restrict__ ws_sum, const T* __restrict__ query,                              \
          const T* __restrict__ key_cache, const T* __restrict__ value_cache,                   \
          const int* __restrict__ block_tables, const int* __restrict__ context_lens,           \
          const int* __restrict__ query_start_loc, float scale_log2, float softcap_log2,        \
          int window, int num_kv_heads, int group_size, int table_width, int max_partitions,     \
          int partition_size) {                                                                 \
    hr::decode_partition<T, D, B>(out, ws_out, ws_max, ws_sum, query, key_cache, value_cache,   \
                                  block_tables, context_lens, query_start_loc, scale_log2,      \
                                  softcap_log2, window, num_kv_heads, group_size, table_width,  \
                                  max_partitions, partition_size);                              \
  }

#define HR_DEFINE_DECODE_ONEPASS(SUFFIX, T, D, B, G)                                           \
  extern "C" __global__ void __launch_bounds__(hr::kDecodeThreads, hr::onepass_min_blocks(G))   \
      paged_attention_decode_onepass_##SUFFIX##_d##D##_b##B##_g##G(                             \
          T* __restrict__ out, float* __restrict__ ws_out, float* __restrict__ ws_max,          \
          float* __restrict__ ws_sum, const T* __restrict__ query,                              \
          const T* __restrict__ key_cache, const T* __restrict__ value_cache,                   \
          const int* __restrict__ block_tables, const int* __restrict__ context_lens,           \
          const int* __restrict__ query_start_loc, float scale_log2, float softcap_log2,        \
          int window, int num_kv_heads, int group_size, int table_width, int max_partitions,     \
          int partition_size) {                                                                 \
    hr::decode_partition_onepass<T, D, B, G>(                                                   \
        out, ws_out, ws_max, ws_sum, query, key_cache, value_cache, block_tables, context_lens, \
        query_start_loc, scale_log2, softcap_log2, window, num_kv_heads, group_size,            \
        table_width, max_partitions, partition_size);                                           \
  }

#define HR_DEFINE_DECODE_REDUCE(SUFFIX, T, D)                                                   \
  extern "C" __global__ void __launch_bounds__(D) paged_attention_decode_reduce_##SUFFIX##_d##D( \
      T* __restrict__ out, const float* __restrict__ ws_out, const float* __restrict__ ws_max,  \
      const float* __restrict__ ws_sum, const int* __restrict__ context_lens,                   \
      const int* __restrict__ query_start_loc, int window, int num_heads, int max_partitions,   \
      int partition_size) {                                                                     \
    hr::decode_reduce<T, D>(out, ws_out, ws_max, ws_sum, context_lens, query_start_loc, window, \
                            num_heads, max_partitions, partition_size);                         \
  }

#define HR_DEFINE_DECODE_ONEPASS_G(SUFFIX, T, D, B) \
  HR_DEFINE_DECODE_ONEPASS(SUFFIX, T, D, B, 4)       \
  HR_DEFINE_DECODE_ONEPASS(SUFFIX, T, D, B, 8)

#define HR_DEFINE_DECODE_DTYPE(SUFFIX, T)        \
  HR_DEFINE_DECODE(SUFFIX, T, 64, 16)            \
  HR_DEFINE_DECODE(SUFFIX, T, 64, 32)            \
  HR_DEFINE_DECODE(SUFFIX, T, 128, 16)           \
  HR_DEFINE_DECODE(SUFFIX, T, 128, 32)           \
  HR_DEFINE_DECODE_ONEPASS_G(SUFFIX, T, 64, 16)  \
  HR_DEFINE_DECODE_ONEPASS_G(SUFFIX, T, 64, 32)  \
  HR_DEFINE_DECODE_ONEPASS_G(SUFFIX, T, 128, 16) \
  HR_DEFINE_DECODE_ONEPASS_G(SUFFIX, T, 128, 32) \
  HR_DEFINE_DECODE_REDUCE(SUFFIX, T, 64)         \
  HR_DEFINE_DECODE_REDUCE(SUFFIX, T, 128)

HR_DEFINE_DECODE_DTYPE(f16, __half)
HR_DEFINE_DECODE_DTYPE(bf16, __nv_bfloat16)
