// reshape_and_cache: writes a step's new keys and values into the paged KV cache.
//
// key/value [num_tokens, Hkv, D] (contiguous) -> key_cache/value_cache
// [num_blocks, block_size, Hkv, D]. A cache slot s is the row
// `s = block * block_size + offset` of the cache viewed as
// [num_blocks * block_size, Hkv * D], so token t's whole row of Hkv * D
// elements is one contiguous copy to row slot_mapping[t]. Slot -1 (padding)
// is skipped. The copy is dtype-blind: only the element width matters, so
// the entry points are named by the copy word (16, 4 or 2 bytes) and the
// launcher picks the widest word that the row size and the four pointers'
// alignment allow.
//
// Grid: (num_tokens). Block: any multiple of 32 threads; each thread copies
// words threadIdx.x, threadIdx.x + blockDim.x, ... of its token's row.
#include "common.cuh"

namespace hr {

template <typename Word>
__device__ __forceinline__ void copy_token_row(const Word* __restrict__ key,
                                               const Word* __restrict__ value,
                                               Word* __restrict__ key_cache,
                                               Word* __restrict__ value_cache,
                                               const long long* __restrict__ slot_mapping,
                                               int words_per_token) {
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  // int64: slot * row words exceeds 2^31 for caches over 2^31 words.
  const i64 src = static_cast<i64>(blockIdx.x) * words_per_token;
  const i64 dst = slot * words_per_token;
  for (int i = threadIdx.x; i < words_per_token; i += blockDim.x) {
    key_cache[dst + i] = key[src + i];
    value_cache[dst + i] = value[src + i];
  }
}

}  // namespace hr

#define HR_DEFINE_RESHAPE_AND_CACHE(NAME, WORD)                                            \
  extern "C" __global__ void __launch_bounds__(256)                                        \
      NAME(const WORD* __restrict__ key, const WORD* __restrict__ value,                   \
           WORD* __restrict__ key_cache, WORD* __restrict__ value_cache,                   \
           const long long* __restrict__ slot_mapping, int words_per_token) {              \
    hr::copy_token_row<WORD>(key, value, key_cache, value_cache, slot_mapping,             \
                             words_per_token);                                             \
  }

HR_DEFINE_RESHAPE_AND_CACHE(reshape_and_cache_w16, uint4)
HR_DEFINE_RESHAPE_AND_CACHE(reshape_and_cache_w4, unsigned int)
HR_DEFINE_RESHAPE_AND_CACHE(reshape_and_cache_w2, unsigned short)
