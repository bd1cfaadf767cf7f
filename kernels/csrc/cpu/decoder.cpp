// Every decoder layer of a step in one call: the same kernels, in the same order and with
// the same arguments as compute/models/decoder.py's per-op path (so the results are
// bit-identical), without ~9 Python launcher calls per layer (~1.4 ms of a ~8 ms decode
// step on 2 cores).
//
// The call reads named structs, mirrored field for field by ctypes Structures in
// kernels/cpu/decoder.py (the order is the ABI: hr_decoder_abi reports every size and
// offset, tests/kernels/test_cpu_decoder_abi.py compares them): a LayerRow per layer, one
// DecoderStatics of what every step passes alike, and per step an AttentionStep and a
// DecoderScratch. A LayerRow's per-head q and k norms (Qwen3, Gemma 3) are applied to the
// fused q|k|v row before RoPE, as compute/models/decoder.py's _qk_norm does; Gemma's norms
// of the attention and MLP outputs before each residual add; a mixture-of-experts MLP
// (moe.router set) runs router and experts in one hr_moe call, in place of gate_up and down.
#include <cstddef>

#include "common.h"

// One projection: out[n, rows] = x[n, k] @ W^T (+ bias). W: blocks of `format` (Format).
struct ProjectionRow {
  const uint8_t* weight;
  int64_t format;
  int64_t rows;
  const float* bias;  // null: none
};

// A mixture-of-experts MLP; router null: the layer's MLP is dense.
struct MoeRow {
  const float* router;  // [experts, H]
  int64_t experts, top_k, normalize;
  const int64_t* table;  // the experts' table (moe.cpp)
  int64_t inter;         // the experts' intermediate size
  int64_t* runs;         // += the number of experts run
};

struct LayerRow {
  ProjectionRow qkv, o_proj, gate_up, down;
  const float* post_norm;
  const float* next_norm;  // the next layer's input norm; the final norm after the last
  void* key_cache;
  void* value_cache;
  int64_t window;  // the sliding window; 0: none
  const float* q_norm;  // null: none (both, or neither)
  const float* k_norm;
  const float* attn_out_norm;  // null: none
  const float* mlp_out_norm;
  const float* cos;  // the layer's own RoPE tables; null: DecoderStatics'
  const float* sin;
  MoeRow moe;
};

struct DecoderStatics {
  int64_t num_layers, hidden, heads, kv_heads, dim;
  int64_t inter;  // the dense layers' intermediate size
  int64_t int8;   // int8 activations (hr_quant_linear_int8), else exact fp32
  int64_t gelu;   // the MLP's activation: tanh GELU, else SiLU
  int64_t kv_dtype, block_size;
  const float* cos;  // RoPE tables [positions, dim]
  const float* sin;
  float eps, scale, softcap;  // softcap 0: none
};

// A step's attention metadata, as hr_paged_attention takes it; every query row must belong
// to a sequence (no padding rows).
struct AttentionStep {
  const int64_t* slot_mapping;
  const int32_t* block_tables;
  const int32_t* context_lens;
  const int32_t* query_start;
  int64_t num_seqs, table_width;
};

// A step's buffers: qkv [T, (heads + 2 kv_heads) dim], q and attn [T, heads dim], tmp
// [T, H], gate_up [T, 2 inter], act [T, inter], the MoE layers' scratch
// (hr_moe_scratch_size of their shape; unused without them).
struct DecoderScratch {
  float* qkv;
  float* q;
  float* attn;
  float* tmp;
  float* gate_up;
  float* act;
  float* moe;
  int64_t* moe_int;
};

static_assert(sizeof(ProjectionRow) == 4 * 8 && sizeof(MoeRow) == 7 * 8);
static_assert(sizeof(LayerRow) == 4 * sizeof(ProjectionRow) + 11 * 8 + sizeof(MoeRow));
static_assert(sizeof(DecoderStatics) == 12 * 8 + 2 * 8);  // 3 floats, padded to 8
static_assert(sizeof(AttentionStep) == 6 * 8 && sizeof(DecoderScratch) == 8 * 8);

namespace {

inline void project(const ProjectionRow& p, bool int8, const float* x, int64_t n, int64_t k,
                    float* out) {
  (int8 ? hr_quant_linear_int8 : hr_quant_linear)(p.format, x, n, k, p.weight, p.rows, out,
                                                  p.bias);
}

// In place: y = rms_norm(y) * weight when the layer has that norm (rms_row reads a row
// whole before it writes it).
inline void out_norm(const float* weight, float* y, int64_t tokens, int64_t h, float eps) {
  if (weight != nullptr) hr_rms_norm(y, weight, y, tokens, h, eps);
}

// x (the layer's normed input) -> the attention's output projection in w.tmp (its output
// norm applied), the step's K and V written to the layer's caches.
void attention(const LayerRow& layer, const DecoderStatics& s, const float* x, int64_t tokens,
               const int64_t* positions, const AttentionStep& m, const DecoderScratch& w) {
  project(layer.qkv, s.int8 != 0, x, tokens, s.hidden, w.qkv);
  if (layer.q_norm != nullptr) {
    const int64_t width = (s.heads + 2 * s.kv_heads) * s.dim;
    hr_head_rms_norm(w.qkv, layer.q_norm, tokens, width, s.heads, s.dim, s.eps);
    hr_head_rms_norm(w.qkv + s.heads * s.dim, layer.k_norm, tokens, width, s.kv_heads, s.dim,
                     s.eps);
  }
  const bool own_rope = layer.cos != nullptr;
  hr_rope_and_cache(w.qkv, positions, own_rope ? layer.cos : s.cos, own_rope ? layer.sin : s.sin,
                    m.slot_mapping, tokens, s.heads, s.kv_heads, s.dim, w.q, layer.key_cache,
                    layer.value_cache, s.kv_dtype);
  hr_paged_attention(w.q, layer.key_cache, layer.value_cache, m.block_tables, m.context_lens,
                     m.query_start, m.num_seqs, s.heads, s.kv_heads, s.dim, s.block_size,
                     m.table_width, s.scale, w.attn, s.kv_dtype, layer.window, s.softcap);
  project(layer.o_proj, s.int8 != 0, w.attn, tokens, s.heads * s.dim, w.tmp);
  out_norm(layer.attn_out_norm, w.tmp, tokens, s.hidden, s.eps);
}

// x (the MLP's normed input) -> the MLP's output in w.tmp (its output norm applied).
void mlp(const LayerRow& layer, const DecoderStatics& s, const float* x, int64_t tokens,
         const DecoderScratch& w) {
  const MoeRow& moe = layer.moe;
  if (moe.router != nullptr) {
    hr_moe(moe.router, moe.experts, moe.top_k, moe.normalize, moe.table, s.int8, x, tokens,
           s.hidden, moe.inter, w.tmp, w.moe, w.moe_int, moe.runs);
  } else {
    project(layer.gate_up, s.int8 != 0, x, tokens, s.hidden, w.gate_up);
    (s.gelu ? hr_gelu_tanh_mul : hr_silu_mul)(w.gate_up, w.act, tokens, s.inter);
    project(layer.down, s.int8 != 0, w.act, tokens, s.inter, w.tmp);
  }
  out_norm(layer.mlp_out_norm, w.tmp, tokens, s.hidden, s.eps);
}

}  // namespace

// x [T, H]: the first layer's normed input; on return the last layer's output after the
// final norm. hidden [T, H]: the residual stream, updated in place.
HR_EXPORT void hr_decoder_layers(const LayerRow* layers, const DecoderStatics* statics,
                                 float* x, float* hidden, int64_t tokens,
                                 const int64_t* positions, const AttentionStep* step,
                                 const DecoderScratch* scratch) {
  const DecoderStatics& s = *statics;
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const LayerRow& layer = layers[i];
    attention(layer, s, x, tokens, positions, *step, *scratch);
    hr_add_rms_norm(scratch->tmp, hidden, layer.post_norm, x, tokens, s.hidden, s.eps);
    mlp(layer, s, x, tokens, *scratch);
    hr_add_rms_norm(scratch->tmp, hidden, layer.next_norm, x, tokens, s.hidden, s.eps);
  }
}

// The layout of the structs above, for the test that kernels/cpu/decoder.py's mirrors
// agree: per struct (ProjectionRow, MoeRow, LayerRow, DecoderStatics, AttentionStep,
// DecoderScratch), its size, its field count, then each field's offset.
HR_EXPORT void hr_decoder_abi(int64_t* out) {
#define HR_LAYOUT(T, ...)                                         \
  do {                                                            \
    const int64_t offsets[] = {__VA_ARGS__};                      \
    *out++ = sizeof(T);                                           \
    *out++ = sizeof offsets / sizeof offsets[0];                  \
    for (const int64_t o : offsets) *out++ = o;                   \
  } while (0)
#define O(T, f) static_cast<int64_t>(offsetof(T, f))
  HR_LAYOUT(ProjectionRow, O(ProjectionRow, weight), O(ProjectionRow, format),
            O(ProjectionRow, rows), O(ProjectionRow, bias));
  HR_LAYOUT(MoeRow, O(MoeRow, router), O(MoeRow, experts), O(MoeRow, top_k),
            O(MoeRow, normalize), O(MoeRow, table), O(MoeRow, inter), O(MoeRow, runs));
  HR_LAYOUT(LayerRow, O(LayerRow, qkv), O(LayerRow, o_proj), O(LayerRow, gate_up),
            O(LayerRow, down), O(LayerRow, post_norm), O(LayerRow, next_norm),
            O(LayerRow, key_cache), O(LayerRow, value_cache), O(LayerRow, window),
            O(LayerRow, q_norm), O(LayerRow, k_norm), O(LayerRow, attn_out_norm),
            O(LayerRow, mlp_out_norm), O(LayerRow, cos), O(LayerRow, sin), O(LayerRow, moe));
  HR_LAYOUT(DecoderStatics, O(DecoderStatics, num_layers), O(DecoderStatics, hidden),
            O(DecoderStatics, heads), O(DecoderStatics, kv_heads), O(DecoderStatics, dim),
            O(DecoderStatics, inter), O(DecoderStatics, int8), O(DecoderStatics, gelu),
            O(DecoderStatics, kv_dtype), O(DecoderStatics, block_size), O(DecoderStatics, cos),
            O(DecoderStatics, sin), O(DecoderStatics, eps), O(DecoderStatics, scale),
            O(DecoderStatics, softcap));
  HR_LAYOUT(AttentionStep, O(AttentionStep, slot_mapping), O(AttentionStep, block_tables),
            O(AttentionStep, context_lens), O(AttentionStep, query_start),
            O(AttentionStep, num_seqs), O(AttentionStep, table_width));
  HR_LAYOUT(DecoderScratch, O(DecoderScratch, qkv), O(DecoderScratch, q), O(DecoderScratch, attn),
            O(DecoderScratch, tmp), O(DecoderScratch, gate_up), O(DecoderScratch, act),
            O(DecoderScratch, moe), O(DecoderScratch, moe_int));
#undef O
#undef HR_LAYOUT
}
