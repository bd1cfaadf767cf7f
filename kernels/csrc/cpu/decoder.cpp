// Every decoder layer of a step in one call: the same kernels, in the same order and with
// the same arguments as compute/models/decoder.py's per-op path (so the results are bit-identical),
// without ~9 Python launcher calls per layer (~1.4 ms of a ~8 ms decode step on 2 cores).
//
// The layers come as a table of int64, kLayerFields per layer (kernels/cpu/launch.py
// decoder_table): the four projections (weight pointer, block format, output rows, bias
// pointer or 0), then the post-attention norm, the next layer's input norm (the final
// norm after the last layer), the layer's key and value caches, its sliding window
// (0 = none), its per-head q and k RMSNorm weights (Qwen3, Gemma 3; 0 = none), applied to
// the fused q|k|v row before RoPE as compute/models/decoder.py's _qk_norm does, and Gemma's deltas:
// the RMSNorms of the attention and MLP outputs before each residual add (0 = none), the
// MLP's activation (0 SiLU, 1 tanh GELU), the attention soft-cap (a float's bits; 0 =
// none) and the layer's own RoPE tables (Gemma 3's sliding layers; 0 = the call's); then a
// mixture-of-experts layer's MLP (0 router = a dense MLP, from the gate|up and down
// fields): router weight [E, H], E, top_k, whether the top_k are renormalised, the experts'
// table (moe.cpp), the experts' intermediate size and the int64 its runs are added to.
#include <cstring>

#include "common.h"

namespace {

enum Field : int64_t {
  kQkv = 0, kO = 4, kGateUp = 8, kDown = 12,  // each: weight, format, rows, bias
  kPostNorm = 16, kNextNorm = 17, kKeyCache = 18, kValueCache = 19, kWindow = 20,
  kQNorm = 21, kKNorm = 22, kAttnOutNorm = 23, kMlpOutNorm = 24, kGelu = 25, kSoftcap = 26,
  kCos = 27, kSin = 28, kMoeRouter = 29, kMoeExperts = 30, kMoeTopK = 31, kMoeNormalize = 32,
  kMoeTable = 33, kMoeInter = 34, kMoeRuns = 35, kLayerFields = 36,
};

template <class T>
inline T* ptr(const int64_t* layer, int64_t field) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(layer[field]));
}

// out[n, rows] = x[n, k] @ W^T (+ bias) for projection `p` of `layer`.
inline void project(const int64_t* layer, int64_t p, bool int8, const float* x, int64_t n,
                    int64_t k, float* out) {
  const auto fn = int8 ? hr_quant_linear_int8 : hr_quant_linear;
  fn(layer[p + 1], x, n, k, ptr<const uint8_t>(layer, p), layer[p + 2], out,
     ptr<const float>(layer, p + 3));
}

// The float whose bits a table field holds in its low 32 bits.
inline float float_field(const int64_t* layer, int64_t field) {
  const uint32_t bits = static_cast<uint32_t>(layer[field]);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// In place: y = rms_norm(y) * weight when the layer has that norm (rms_row reads a row
// whole before it writes it).
inline void out_norm(const int64_t* layer, int64_t field, float* y, int64_t tokens, int64_t h,
                     float eps) {
  if (layer[field] != 0) hr_rms_norm(y, ptr<const float>(layer, field), y, tokens, h, eps);
}

}  // namespace

// x [T, H]: the first layer's normed input; on return the last layer's output after the
// final norm. hidden [T, H]: the residual stream, updated in place. Scratch: qkv
// [T, (heads + 2 kv_heads) dim], q and attn [T, heads dim], tmp [T, H], gate_up [T, 2 I],
// act [T, I] (I: the dense layers' intermediate size), moe_scratch and moe_int_scratch
// (hr_moe_scratch_size of the MoE layers' shape; unused without them). Caches of kv_dtype
// (KvDtype). Attention metadata as hr_paged_attention takes it; every query row must
// belong to a sequence (no padding rows).
HR_EXPORT void hr_decoder_layers(const int64_t* layers, int64_t num_layers, int64_t int8,
                                 float* x, float* hidden, int64_t tokens, int64_t h,
                                 int64_t heads, int64_t kv_heads, int64_t dim, int64_t inter,
                                 float eps, const int64_t* positions, const float* cos,
                                 const float* sin, const int64_t* slot_mapping,
                                 const int32_t* block_tables, const int32_t* context_lens,
                                 const int32_t* query_start, int64_t num_seqs,
                                 int64_t block_size, int64_t table_width, float scale,
                                 float* qkv, float* q, float* attn, float* tmp, float* gate_up,
                                 float* act, int64_t kv_dtype, float* moe_scratch,
                                 int64_t* moe_int_scratch) {
  const bool q8 = int8 != 0;
  for (int64_t i = 0; i < num_layers; ++i) {
    const int64_t* layer = layers + i * kLayerFields;
    void* key_cache = ptr<void>(layer, kKeyCache);
    void* value_cache = ptr<void>(layer, kValueCache);
    project(layer, kQkv, q8, x, tokens, h, qkv);
    if (layer[kQNorm] != 0) {
      const int64_t width = (heads + 2 * kv_heads) * dim;
      hr_head_rms_norm(qkv, ptr<const float>(layer, kQNorm), tokens, width, heads, dim, eps);
      hr_head_rms_norm(qkv + heads * dim, ptr<const float>(layer, kKNorm), tokens, width,
                       kv_heads, dim, eps);
    }
    const bool own_rope = layer[kCos] != 0;
    hr_rope_and_cache(qkv, positions, own_rope ? ptr<const float>(layer, kCos) : cos,
                      own_rope ? ptr<const float>(layer, kSin) : sin, slot_mapping, tokens,
                      heads, kv_heads, dim, q, key_cache, value_cache, kv_dtype);
    hr_paged_attention(q, key_cache, value_cache, block_tables, context_lens, query_start,
                       num_seqs, heads, kv_heads, dim, block_size, table_width, scale, attn,
                       kv_dtype, layer[kWindow], float_field(layer, kSoftcap));
    project(layer, kO, q8, attn, tokens, heads * dim, tmp);
    out_norm(layer, kAttnOutNorm, tmp, tokens, h, eps);
    hr_add_rms_norm(tmp, hidden, ptr<const float>(layer, kPostNorm), x, tokens, h, eps);
    if (layer[kMoeRouter] != 0) {
      hr_moe(ptr<const float>(layer, kMoeRouter), layer[kMoeExperts], layer[kMoeTopK],
             layer[kMoeNormalize], ptr<const int64_t>(layer, kMoeTable), int8, x, tokens, h,
             layer[kMoeInter], tmp, moe_scratch, moe_int_scratch, ptr<int64_t>(layer, kMoeRuns));
    } else {
      project(layer, kGateUp, q8, x, tokens, h, gate_up);
      (layer[kGelu] ? hr_gelu_tanh_mul : hr_silu_mul)(gate_up, act, tokens, inter);
      project(layer, kDown, q8, act, tokens, inter, tmp);
    }
    out_norm(layer, kMlpOutNorm, tmp, tokens, h, eps);
    hr_add_rms_norm(tmp, hidden, ptr<const float>(layer, kNextNorm), x, tokens, h, eps);
  }
}
