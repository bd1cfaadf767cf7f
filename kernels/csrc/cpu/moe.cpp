// The mixture-of-experts MLP of one layer for one step (compute/models/moe.py), in one call: the
// router, then the chosen experts. hr_decoder_layers (decoder.cpp) runs the same code for
// its MoE layers, so the per-op path and the fused one give the same bits.
//
// Router: per token, the logits over the E experts (each a dot product over the hidden
// size in one fixed order: 16 lanes, two accumulators, one horizontal sum, then the tail),
// softmax in fp32, the top_k probabilities (ties to the lower expert id, as torch.topk),
// renormalised to sum to 1 when `normalize`. Nothing depends on the rows beside a token's,
// so a token's expert ids and weights are the same bits alone or in any batch.
//
// Experts: the tokens are grouped by expert (a counting sort: experts ascending, each
// expert's tokens in batch order); every expert some token chose runs once, on all its
// tokens: gather their rows, gate|up projection from the expert's blocks, silu(gate) * up,
// down projection, each row times its weight, added to the token's output. An expert no
// token chose is not read. The projections are hr_quant_linear (or its int8 twin), so each
// row's sums do not depend on the rows beside it, and each token's experts are added in
// ascending expert order: a token's output is the same bits alone or in any batch.
//
// Experts table: int64 [num_experts, 4]: gate|up weight pointer and block format, down
// weight pointer and block format (kernels/cpu/moe.py moe_table).
#include <omp.h>

#include "common.h"

namespace {

enum Field : int64_t { kGateUp = 0, kGateUpFormat = 1, kDown = 2, kDownFormat = 3, kFields = 4 };

inline const uint8_t* weight(const int64_t* expert, int64_t field) {
  return reinterpret_cast<const uint8_t*>(static_cast<intptr_t>(expert[field]));
}

// Token-expert pairs up to which the chosen experts run side by side, one per thread
// (dynamically scheduled), each projection on one thread; more run one after another, each
// projection on every thread. A decode step's few rows leave each projection too small to
// share among threads, and so do 48 decodes: a top-8 model's 384 pairs are ~6 rows for
// each of 64 experts, and one expert after another made each of their 2 projections a
// fork-join (1,536 a step over 12 layers): the threads spun in libgomp for 16% of a
// 48-stream run on 2 AVX2 cores, and 1,024 pairs side by side ran it 1.05x faster.
// Scratch: pairs x (2 hidden + 3 intermediate) floats, 15 MB at 1,024 pairs of
// bench/moe_gguf.py's shape. A projection's rows are the same bits on any number of
// threads, and the outputs are added in ascending expert order either way.
constexpr int64_t kSideBySide = 1024;

// Rows of each per-row scratch buffer: every pair side by side, or one expert's tokens.
inline int64_t scratch_rows(int64_t tokens, int64_t top_k) {
  const int64_t pairs = tokens * top_k;
  return pairs <= kSideBySide ? pairs : tokens;
}

// The scratch buffers, carved from one float and one int64 buffer (hr_moe_scratch_size).
struct Scratch {
  float *probs, *weights, *xs, *gate_up, *act, *ys;
  int64_t *ids, *order, *start, *fill, *chosen;
};

Scratch carve(float* f, int64_t* i, int64_t tokens, int64_t h, int64_t inter, int64_t top_k,
              int64_t num_experts) {
  const int64_t rows = scratch_rows(tokens, top_k), pairs = tokens * top_k;
  Scratch s;
  s.probs = f;
  s.weights = s.probs + tokens * num_experts;
  s.xs = s.weights + pairs;
  s.gate_up = s.xs + rows * h;
  s.act = s.gate_up + rows * 2 * inter;
  s.ys = s.act + rows * inter;
  s.ids = i;
  s.order = s.ids + pairs;
  s.start = s.order + pairs;
  s.fill = s.start + num_experts + 1;
  s.chosen = s.fill + num_experts;
  return s;
}

// x . w over h values, in an order that depends on h alone.
inline float dot(const float* x, const float* w, int64_t h) {
  v16f a{}, b{};
  int64_t c = 0;
  for (; c + 32 <= h; c += 32) {
    a = fma16(load16(x + c), load16(w + c), a);
    b = fma16(load16(x + c + 16), load16(w + c + 16), b);
  }
  if (c + 16 <= h) {
    a = fma16(load16(x + c), load16(w + c), a);
    c += 16;
  }
  float sum = hsum(a + b);
  for (; c < h; ++c) sum = std::fma(x[c], w[c], sum);
  return sum;
}

// One token's router logits (in place: its probabilities, then scratch) -> its top_k.
void choose(float* p, int64_t num_experts, int64_t top_k, bool normalize, int64_t* ids,
            float* weights) {
  float top = p[0];
  for (int64_t e = 1; e < num_experts; ++e) top = std::max(top, p[e]);
  float sum = 0.0f;
  for (int64_t e = 0; e < num_experts; ++e) {
    p[e] = std::exp(p[e] - top);
    sum += p[e];
  }
  for (int64_t e = 0; e < num_experts; ++e) p[e] /= sum;
  float chosen = 0.0f;
  for (int64_t j = 0; j < top_k; ++j) {
    int64_t best = 0;
    for (int64_t e = 1; e < num_experts; ++e)
      if (p[e] > p[best]) best = e;  // strict: a tie keeps the lower id
    ids[j] = best;
    weights[j] = p[best];
    chosen += p[best];
    p[best] = -1.0f;  // below every probability: not chosen again
  }
  if (normalize)
    for (int64_t j = 0; j < top_k; ++j) weights[j] /= chosen;
}

// One expert on its n rows: gather them, gate|up, silu(gate) * up, down (into ys).
void run_expert(const int64_t* expert, bool int8, const float* x, const int64_t* picks,
                int64_t n, int64_t h, int64_t inter, int64_t top_k, float* xs, float* gate_up,
                float* act, float* ys) {
  const auto linear = int8 ? hr_quant_linear_int8 : hr_quant_linear;
  for (int64_t r = 0; r < n; ++r)
    std::memcpy(xs + r * h, x + picks[r] / top_k * h, h * sizeof(float));
  linear(expert[kGateUpFormat], xs, n, h, weight(expert, kGateUp), 2 * inter, gate_up, nullptr);
  hr_silu_mul(gate_up, act, n, inter);
  linear(expert[kDownFormat], act, n, inter, weight(expert, kDown), h, ys, nullptr);
}

// Each of the expert's rows times its weight, then added to its token's output
// (compute/models/moe.py's two ops).
__attribute__((optimize("fp-contract=off"))) void add_expert(
    const int64_t* picks, int64_t n, int64_t h, int64_t top_k, const float* weights, float* ys,
    float* out) {
  for (int64_t r = 0; r < n; ++r) {
    float* y = ys + r * h;
    float* o = out + picks[r] / top_k * h;
    const float w = weights[picks[r]];
    for (int64_t c = 0; c < h; ++c) y[c] *= w;
    for (int64_t c = 0; c < h; ++c) o[c] += y[c];
  }
}

// out [T, h] (zeroed by the caller) += each token's experts; returns how many ran.
int64_t experts(const int64_t* table, int64_t num_experts, bool int8, const float* x,
                int64_t tokens, int64_t h, int64_t inter, int64_t top_k, const int64_t* ids,
                const float* weights, float* out, const Scratch& s) {
  const int64_t pairs = tokens * top_k;
  int64_t* start = s.start;
  std::fill(start, start + num_experts + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) ++start[ids[i] + 1];
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::copy(start, start + num_experts, s.fill);
  for (int64_t i = 0; i < pairs; ++i) s.order[s.fill[ids[i]]++] = i;  // stable
  int64_t count = 0;
  for (int64_t e = 0; e < num_experts; ++e)
    if (start[e + 1] > start[e]) s.chosen[count++] = e;
  if (pairs <= kSideBySide && omp_get_max_threads() > 1) {
    // Each pair's rows at its place in `order`.
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t c = 0; c < count; ++c) {
      const int64_t e = s.chosen[c], s0 = start[e];
      run_expert(table + e * kFields, int8, x, s.order + s0, start[e + 1] - s0, h, inter,
                 top_k, s.xs + s0 * h, s.gate_up + s0 * 2 * inter, s.act + s0 * inter,
                 s.ys + s0 * h);
    }
    for (int64_t c = 0; c < count; ++c) {
      const int64_t e = s.chosen[c], s0 = start[e];
      add_expert(s.order + s0, start[e + 1] - s0, h, top_k, weights, s.ys + s0 * h, out);
    }
    return count;
  }
  for (int64_t c = 0; c < count; ++c) {
    const int64_t e = s.chosen[c], n = start[e + 1] - start[e];
    const int64_t* picks = s.order + start[e];
    run_expert(table + e * kFields, int8, x, picks, n, h, inter, top_k, s.xs, s.gate_up, s.act,
               s.ys);
    add_expert(picks, n, h, top_k, weights, s.ys, out);
  }
  return count;
}

}  // namespace

// sizes[0] floats and sizes[1] int64s of the scratch the calls below take.
HR_EXPORT void hr_moe_scratch_size(int64_t tokens, int64_t h, int64_t inter, int64_t top_k,
                                   int64_t num_experts, int64_t* sizes) {
  const int64_t rows = scratch_rows(tokens, top_k), pairs = tokens * top_k;
  sizes[0] = tokens * num_experts + pairs + rows * (2 * h + 3 * inter);
  sizes[1] = 2 * pairs + 3 * num_experts + 1;
}

// Each token's top_k expert ids [T, top_k] and weights [T, top_k]; probs: [T, E] scratch.
HR_EXPORT void hr_moe_route(const float* router, int64_t num_experts, const float* x,
                            int64_t tokens, int64_t h, int64_t top_k, int64_t normalize,
                            float* probs, int64_t* ids, float* weights) {
  const int64_t dots = tokens * num_experts;
#pragma omp parallel for schedule(static) if (dots * h >= kParallelWork)
  for (int64_t i = 0; i < dots; ++i)
    probs[i] = dot(x + i / num_experts * h, router + i % num_experts * h, h);
  for (int64_t t = 0; t < tokens; ++t)
    choose(probs + t * num_experts, num_experts, top_k, normalize != 0, ids + t * top_k,
           weights + t * top_k);
}

// out [T, h] (zeroed by the caller) += sum over each token's experts (ids, weights [T, k])
// of weight * MLP(x); *runs += the number of experts run (runs may be null).
HR_EXPORT void hr_moe_experts(const int64_t* table, int64_t num_experts, int64_t int8,
                              const float* x, int64_t tokens, int64_t h, int64_t inter,
                              int64_t top_k, const int64_t* ids, const float* weights, float* out,
                              float* scratch, int64_t* int_scratch, int64_t* runs) {
  const Scratch s = carve(scratch, int_scratch, tokens, h, inter, top_k, num_experts);
  const int64_t count =
      experts(table, num_experts, int8 != 0, x, tokens, h, inter, top_k, ids, weights, out, s);
  if (runs != nullptr) *runs += count;
}

HR_EXPORT void hr_moe(const float* router, int64_t num_experts, int64_t top_k, int64_t normalize,
            const int64_t* table, int64_t int8, const float* x, int64_t tokens, int64_t h,
            int64_t inter, float* out, float* scratch, int64_t* int_scratch, int64_t* runs) {
  const Scratch s = carve(scratch, int_scratch, tokens, h, inter, top_k, num_experts);
  hr_moe_route(router, num_experts, x, tokens, h, top_k, normalize, s.probs, s.ids, s.weights);
  std::memset(out, 0, tokens * h * sizeof(float));
  *runs += experts(table, num_experts, int8 != 0, x, tokens, h, inter, top_k, s.ids, s.weights,
                   out, s);
}
