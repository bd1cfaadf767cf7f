// The experts of one mixture-of-experts layer for one step (compute/moe.py), in one call.
//
// Each token has top_k (expert id, weight) pairs, chosen by the router in Python. The
// tokens are grouped by expert (a counting sort: experts ascending, each expert's tokens in
// batch order); every expert some token chose runs once, on all its tokens: gather their
// rows, gate|up projection from the expert's blocks, silu(gate) * up, down projection,
// each row times its weight, added to the token's output. An expert no token chose is not
// read. The projections are hr_quant_linear (or its int8 twin), so each row's sums do not
// depend on the rows beside it, and each token's experts are added in ascending expert
// order: the output of a token is the same bits alone or in any batch, and the same bits
// as compute/moe.py's per-op path (the same kernels, the same operations in its order).
//
// Table: int64 [num_experts, 4]: gate|up weight pointer and block format, down weight
// pointer and block format (kernels/cpu/launch.py moe_table).
#include <omp.h>

#include <vector>

#include "common.h"

namespace {

enum Field : int64_t { kGateUp = 0, kGateUpFormat = 1, kDown = 2, kDownFormat = 3, kFields = 4 };

inline const uint8_t* weight(const int64_t* expert, int64_t field) {
  return reinterpret_cast<const uint8_t*>(static_cast<intptr_t>(expert[field]));
}

// One expert on its n rows: gather them, gate|up, silu(gate) * up, down (into ys).
void run_expert(const int64_t* expert, int64_t int8, const float* x, const int64_t* picks,
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
// (compute/moe.py's two ops).
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

// Token-expert pairs up to which the chosen experts run side by side, one per thread (a
// decode step's few rows leave each projection too small to share among threads), each
// projection on one thread; more run one after another, each projection on every thread.
// A projection's rows are the same bits on any number of threads, and the outputs are
// added in ascending expert order either way.
constexpr int64_t kSideBySide = 64;

}  // namespace

// out [T, h] (zeroed by the caller) += sum over each token's experts of weight * MLP(x).
// Scratch: xs and ys [T, h], gate_up [T, 2 inter], act [T, inter].
HR_EXPORT __attribute__((optimize("fp-contract=off"))) void hr_moe_experts(
    const int64_t* table, int64_t num_experts, int64_t int8, const float* x, int64_t tokens,
    int64_t h, int64_t inter, int64_t top_k, const int64_t* ids, const float* weights,
    float* out, float* xs, float* gate_up, float* act, float* ys) {
  const int64_t pairs = tokens * top_k;
  std::vector<int64_t> start(num_experts + 1, 0), order(pairs);
  for (int64_t i = 0; i < pairs; ++i) ++start[ids[i] + 1];
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < pairs; ++i) order[fill[ids[i]]++] = i;  // stable
  if (pairs <= kSideBySide && omp_get_max_threads() > 1) {
    std::vector<int64_t> chosen;
    for (int64_t e = 0; e < num_experts; ++e)
      if (start[e + 1] > start[e]) chosen.push_back(e);
    // Each pair's rows at its place in `order`.
    std::vector<float> xs_all(pairs * h), gate_up_all(pairs * 2 * inter),
        act_all(pairs * inter), ys_all(pairs * h);
    const int64_t count = static_cast<int64_t>(chosen.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t c = 0; c < count; ++c) {
      const int64_t e = chosen[c], s0 = start[e];
      run_expert(table + e * kFields, int8, x, order.data() + s0, start[e + 1] - s0, h, inter,
                 top_k, xs_all.data() + s0 * h, gate_up_all.data() + s0 * 2 * inter,
                 act_all.data() + s0 * inter, ys_all.data() + s0 * h);
    }
    for (int64_t c = 0; c < count; ++c) {
      const int64_t e = chosen[c], s0 = start[e];
      add_expert(order.data() + s0, start[e + 1] - s0, h, top_k, weights,
                 ys_all.data() + s0 * h, out);
    }
    return;
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int64_t* picks = order.data() + start[e];
    run_expert(table + e * kFields, int8, x, picks, n, h, inter, top_k, xs, gate_up, act, ys);
    add_expert(picks, n, h, top_k, weights, ys, out);
  }
}
