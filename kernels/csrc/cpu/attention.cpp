// Paged attention on the CPU, reading the KV cache in place through the block tables.
//
// Layout and mask follow kernels/metadata.py: caches [num_blocks, B, Hkv, D], the slot
// of position p is table[p / B] * B + p % B, and query j of a sequence with context
// ctx and query length Q sits at position ctx - Q + j and sees keys 0..ctx - Q + j.
// Keys past a query's last visible position are never read, so whatever the unused
// slots hold (tests fill them with NaN) cannot reach the result.
//
// One work item is (sequence, KV head, tile of queries); its query heads share every
// K/V row it loads (GQA). Scores, softmax and accumulators are fp32, softmax online in
// chunks of up to 16 keys (running max, rescaled sums).
#include <omp.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace {

constexpr int kChunk = 16;       // keys per softmax step
constexpr int64_t kQTile = 8;    // queries of one sequence per work item

struct Shape {
  int64_t heads, kv_heads, dim, block_size, table_width;
};

// Dot product of two rows of `dim` floats (dim % 16 == 0).
inline float dot(const float* a, const float* b, int64_t dim) {
  v16f acc = load16(a) * load16(b);
  for (int64_t c = 16; c < dim; c += 16) acc += load16(a + c) * load16(b + c);
  return hsum(acc);
}

// Online-softmax state of one (query, head).
struct Running {
  float max = -INFINITY, sum = 0.0f;
};

// One query head over keys [0, visible) of a sequence; acc receives softmax(qK^T) V.
void attend(const float* q, const float* kc, const float* vc, const int32_t* table,
            const Shape& s, int64_t kv_head, int64_t visible, float scale, float* acc) {
  const int64_t row = s.kv_heads * s.dim;  // floats per token slot
  Running run;
  std::fill(acc, acc + s.dim, 0.0f);
  float scores[kChunk];
  const float* rows[kChunk];
  for (int64_t t0 = 0; t0 < visible; t0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, visible - t0);
    float chunk_max = -INFINITY;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = t0 + i;
      const int64_t slot = static_cast<int64_t>(table[pos / s.block_size]) * s.block_size +
                           pos % s.block_size;
      rows[i] = kc + slot * row + kv_head * s.dim;
      scores[i] = dot(q, rows[i], s.dim) * scale;
      chunk_max = std::max(chunk_max, scores[i]);
    }
    const float new_max = std::max(run.max, chunk_max);
    const float correction = std::exp(run.max - new_max);  // exp(-inf) = 0 at the start
    v16f sv = load16(scores);
    for (int64_t i = n; i < kChunk; ++i) sv[i] = -INFINITY;
    const v16f p = exp16(sv - new_max);
    float probs[kChunk];
    store16(probs, p);
    run.sum = run.sum * correction + hsum(p);
    run.max = new_max;
    for (int64_t c = 0; c < s.dim; c += 16) {
      v16f a = load16(acc + c) * correction;
      for (int64_t i = 0; i < n; ++i) {
        const float* v = vc + (rows[i] - kc) + c;
        a += load16(v) * probs[i];
      }
      store16(acc + c, a);
    }
  }
  const float inv = run.sum > 0.0f ? 1.0f / run.sum : 0.0f;
  for (int64_t c = 0; c < s.dim; c += 16) store16(acc + c, load16(acc + c) * inv);
}

struct Item {
  int32_t seq, h0, h1;  // query heads [h0, h1), all of one KV head's group
  int64_t q0, q1;       // queries [q0, q1) of the sequence
};

}  // namespace

// out[t, h, :] = attention of query t, head h over its sequence's cache (see top).
// query/out [T, H, D] fp32; caches [N, B, Hkv, D] fp32; block_tables int32 [S, W];
// context_lens int32 [S]; query_start int32 [S + 1]. D % 16 == 0, H % Hkv == 0.
HR_EXPORT void hr_paged_attention(const float* query, const float* key_cache,
                                  const float* value_cache, const int32_t* block_tables,
                                  const int32_t* context_lens, const int32_t* query_start,
                                  int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                                  int64_t block_size, int64_t table_width, float scale,
                                  float* out) {
  const Shape s{heads, kv_heads, dim, block_size, table_width};
  const int64_t group = heads / kv_heads;
  // One item per (sequence, KV head, query tile): its heads share each K/V row loaded. With
  // too few of those to keep every thread busy (one decoding sequence has 3), one per
  // query head instead.
  int64_t tiles = 0;
  for (int32_t i = 0; i < num_seqs; ++i)
    tiles += (query_start[i + 1] - query_start[i] + kQTile - 1) / kQTile;
  const int64_t split = tiles * kv_heads < 4 * omp_get_max_threads() ? group : 1;
  std::vector<Item> items;
  for (int32_t i = 0; i < num_seqs; ++i) {
    const int64_t qlen = query_start[i + 1] - query_start[i];
    for (int64_t q0 = 0; q0 < qlen; q0 += kQTile)
      for (int32_t h = 0; h < heads; h += static_cast<int32_t>(group / split))
        items.push_back({i, h, h + static_cast<int32_t>(group / split), q0,
                         std::min(qlen, q0 + kQTile)});
  }
  const int64_t count = static_cast<int64_t>(items.size());
  int64_t work = 0;  // query x visible-key pairs, times the head dimension, over all heads
  for (int32_t i = 0; i < num_seqs; ++i)
    work += (query_start[i + 1] - query_start[i]) * context_lens[i] * heads * dim;
#pragma omp parallel for schedule(dynamic, 1) if (count > 1 && work >= kParallelWork)
  for (int64_t it = 0; it < count; ++it) {
    const Item& w = items[it];
    const int64_t qlen = query_start[w.seq + 1] - query_start[w.seq];
    const int64_t ctx = context_lens[w.seq];
    const int32_t* table = block_tables + w.seq * table_width;
    for (int64_t j = w.q0; j < w.q1; ++j) {
      const int64_t t = query_start[w.seq] + j;
      const int64_t visible = ctx - qlen + j + 1;
      for (int64_t h = w.h0; h < w.h1; ++h) {
        const float* q = query + (t * heads + h) * dim;
        attend(q, key_cache, value_cache, table, s, h / group, visible, scale,
               out + (t * heads + h) * dim);
      }
    }
  }
}

// Rotary embedding (HF rotate_half layout) of the q and k parts of a fused q|k|v row,
// then the cache write: q_out [T, H, D] gets rotated q; k (rotated) and v go to the
// caches at slot_mapping[t] (-1 = skip). cos/sin tables [max_pos, D].
HR_EXPORT void hr_rope_and_cache(const float* qkv, const int64_t* positions, const float* cos,
                                 const float* sin, const int64_t* slot_mapping, int64_t tokens,
                                 int64_t heads, int64_t kv_heads, int64_t dim, float* q_out,
                                 float* key_cache, float* value_cache) {
  const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
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
    float* kdst = key_cache + slot * kv_heads * dim;
    float* vdst = value_cache + slot * kv_heads * dim;
    for (int64_t g = 0; g < kv_heads; ++g) {
      rotate(row + (heads + g) * dim, kdst + g * dim);
      std::memcpy(vdst + g * dim, row + (heads + kv_heads + g) * dim, dim * sizeof(float));
    }
  }
}
