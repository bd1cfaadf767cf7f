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
#include <vector>

#include "common.h"

namespace {

enum Field : int64_t { kGateUp = 0, kGateUpFormat = 1, kDown = 2, kDownFormat = 3, kFields = 4 };

inline const uint8_t* weight(const int64_t* expert, int64_t field) {
  return reinterpret_cast<const uint8_t*>(static_cast<intptr_t>(expert[field]));
}

}  // namespace

// out [T, h] (zeroed by the caller) += sum over each token's experts of weight * MLP(x).
// Scratch: xs and ys [T, h], gate_up [T, 2 inter], act [T, inter].
HR_EXPORT __attribute__((optimize("fp-contract=off"))) void hr_moe_experts(
    const int64_t* table, int64_t num_experts, int64_t int8, const float* x, int64_t tokens,
    int64_t h, int64_t inter, int64_t top_k, const int64_t* ids, const float* weights,
    float* out, float* xs, float* gate_up, float* act, float* ys) {
  const auto linear = int8 ? hr_quant_linear_int8 : hr_quant_linear;
  std::vector<int64_t> start(num_experts + 1, 0), order(tokens * top_k);
  for (int64_t i = 0; i < tokens * top_k; ++i) ++start[ids[i] + 1];
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < tokens * top_k; ++i) order[fill[ids[i]]++] = i;  // stable
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int64_t* picks = order.data() + start[e];
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(xs + r * h, x + picks[r] / top_k * h, h * sizeof(float));
    const int64_t* expert = table + e * kFields;
    linear(expert[kGateUpFormat], xs, n, h, weight(expert, kGateUp), 2 * inter, gate_up,
           nullptr);
    hr_silu_mul(gate_up, act, n, inter);
    linear(expert[kDownFormat], act, n, inter, weight(expert, kDown), h, ys, nullptr);
    for (int64_t r = 0; r < n; ++r) {  // y * w, then added (compute/moe.py's two ops)
      float* y = ys + r * h;
      float* o = out + picks[r] / top_k * h;
      const float w = weights[picks[r]];
      for (int64_t c = 0; c < h; ++c) y[c] *= w;
      for (int64_t c = 0; c < h; ++c) o[c] += y[c];
    }
  }
}
