// The small per-token steps of a decoder layer, fused so that each is one call:
// RMSNorm (with the residual add before it), SiLU(gate) * up, and the embedding
// lookup of quantized rows lives in quant_linear.cpp. All fp32, rows in parallel.
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "common.h"

namespace {

// Rows of `h` floats: worth a parallel region only past a few rows.
inline bool parallel_rows(int64_t n, int64_t h) { return n * h >= 8 * 4096; }

// y = x * rsqrt(mean(x^2) + eps) * weight, in HF LlamaRMSNorm's order (normalise, then
// scale by the weight). h % 16 == 0.
inline void rms_row(const float* x, const float* weight, float* y, int64_t h, float eps) {
  v16f acc = {};
  for (int64_t c = 0; c < h; c += 16) {
    const v16f v = load16(x + c);
    acc += v * v;
  }
  const float inv = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(h) + eps);
  for (int64_t c = 0; c < h; c += 16) store16(y + c, load16(weight + c) * (load16(x + c) * inv));
}

}  // namespace

// out[i] = rms_norm(x[i]) * weight for n rows of h floats.
HR_EXPORT void hr_rms_norm(const float* x, const float* weight, float* out, int64_t n, int64_t h,
                           float eps) {
#pragma omp parallel for schedule(static) if (parallel_rows(n, h))
  for (int64_t i = 0; i < n; ++i) rms_row(x + i * h, weight, out + i * h, h, eps);
}

// In place, for each of n rows (row_stride floats apart): RMSNorm of each of its `heads`
// consecutive head slices of `dim` floats, scaled by weight [dim] (Qwen3's and Gemma 3's
// q/k norms, on the q or k part of a fused q|k|v row). dim % 16 == 0.
HR_EXPORT void hr_head_rms_norm(float* x, const float* weight, int64_t n, int64_t row_stride,
                                int64_t heads, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (parallel_rows(n * heads, dim))
  for (int64_t i = 0; i < n * heads; ++i) {
    float* row = x + (i / heads) * row_stride + (i % heads) * dim;
    rms_row(row, weight, row, dim, eps);  // reads every value before it writes one
  }
}

// residual[i] += x[i]; out[i] = rms_norm(residual[i]) * weight (the residual stream kept
// in `residual`, the next sublayer's input in `out`).
HR_EXPORT void hr_add_rms_norm(const float* x, float* residual, const float* weight, float* out,
                               int64_t n, int64_t h, float eps) {
#pragma omp parallel for schedule(static) if (parallel_rows(n, h))
  for (int64_t i = 0; i < n; ++i) {
    float* r = residual + i * h;
    for (int64_t c = 0; c < h; c += 16) store16(r + c, load16(r + c) + load16(x + i * h + c));
    rms_row(r, weight, out + i * h, h, eps);
  }
}

// out[i, :] = silu(gate_up[i, :inter]) * gate_up[i, inter:]; silu(g) = g / (1 + exp(-g)).
HR_EXPORT void hr_silu_mul(const float* gate_up, float* out, int64_t n, int64_t inter) {
#pragma omp parallel for schedule(static) if (parallel_rows(n, inter))
  for (int64_t i = 0; i < n; ++i) {
    const float* g = gate_up + i * 2 * inter;
    for (int64_t c = 0; c < inter; c += 16) {
      const v16f gv = load16(g + c);
      store16(out + i * inter + c, gv / (1.0f + exp16(-gv)) * load16(g + inter + c));
    }
  }
}

// out[i, :] = gelu_tanh(gate) * up, gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715
// g^3))) (Gemma's gelu_pytorch_tanh), tanh(y) = 1 - 2 / (exp(2y) + 1).
HR_EXPORT void hr_gelu_tanh_mul(const float* gate_up, float* out, int64_t n, int64_t inter) {
#pragma omp parallel for schedule(static) if (parallel_rows(n, inter))
  for (int64_t i = 0; i < n; ++i) {
    const float* g = gate_up + i * 2 * inter;
    for (int64_t c = 0; c < inter; c += 16) {
      const v16f x = load16(g + c);
      const v16f y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
      const v16f t = 1.0f - 2.0f / (exp16(y + y) + 1.0f);
      store16(out + i * inter + c, 0.5f * x * (1.0f + t) * load16(g + inter + c));
    }
  }
}

// out[i] = the index of the largest of x[i, 0:n], the lowest of equal ones, a NaN counting
// as the largest (torch.argmax's answer, bits for bits: greedy sampling). torch's CPU argmax
// reduces a row on one thread at ~5 GB/s (1.9 ms for 48 rows of SmolLM2's 49,152 logits);
// here a vector max, then the first index holding it, rows on every thread.
HR_EXPORT void hr_argmax_rows(const float* x, int64_t rows, int64_t n, int64_t* out) {
#pragma omp parallel for schedule(static) if (rows * n >= (int64_t{1} << 18))
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * n;
    v16f top = splat(-INFINITY), nan = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const v16f v = load16(row + i);
      top = select16(v > top, v, top);  // a NaN lane compares false: kept out of the max
      nan = select16(v != v, splat(1.0f), nan);
    }
    float best = -INFINITY;
    bool any_nan = false;
    for (int j = 0; j < 16; ++j) {
      best = std::max(best, top[j]);
      any_nan = any_nan || nan[j] != 0.0f;
    }
    for (; i < n; ++i) {
      any_nan = any_nan || row[i] != row[i];
      best = row[i] > best ? row[i] : best;
    }
    int64_t at = 0;  // a row of -inf (or of n == 0) answers 0
    for (int64_t j = 0; j < n; ++j)
      if (any_nan ? row[j] != row[j] : row[j] == best) {
        at = j;
        break;
      }
    out[r] = at;
  }
}

// OpenMP's thread count is per calling thread: the engine's step loop runs in its own
// thread, so it sets the count torch uses before its first kernel (kernels/cpu/library.py).
HR_EXPORT void hr_set_num_threads(int64_t n) { omp_set_num_threads(static_cast<int>(n)); }
