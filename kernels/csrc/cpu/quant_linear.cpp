// Linear layers over GGUF-quantized weights, computed in fp32: out[n, m] = x[n, :] . W[m, :].
//
// The weights keep the file's quantization, repacked per row at load time
// (kernels/cpu_weights.py) so that the codes of consecutive blocks are contiguous:
//   Q4_0 row: nb * 16 bytes of nibbles, then nb fp16 scales d (weight = d[b] * (q - 8))
//   Q4_1 row: nb * 16 bytes of nibbles, then nb fp16 scales d, then nb fp16 mins m
//             (weight = d[b] * q + m[b])
//   Q8_0 row: nb * 32 int8 codes, then nb fp16 scales d (weight = d[b] * q)
// (in a block of 32 weights, low nibbles are weights 0-15 and high nibbles 16-31)
// with nb = k / 32. d * q is exact in fp32 (an 11-bit mantissa times a 4- or 8-bit
// integer) and so is Q4_0's d*q - 8d, so each weight is bit-identical to the fp32
// value gguf.quants.dequantize gives.
//
// Every output is one dot product summed in one fixed order (16 lanes over k, in
// steps of 16, then hsum), whatever the number of input rows and whichever of the two
// kernels runs, so a row's result does not depend on the rows batched beside it.
//   - few input rows (decode): blocks are expanded in registers and used for each row;
//     the bytes read are the quantized ones, ~5x fewer than fp32 weights;
//   - many rows (prefill, large batches): a group of weight rows is expanded once into a
//     small buffer and a register-blocked kernel runs every input row against it.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace {

constexpr int kGroup = 4;        // weight rows per group (both kernels)
constexpr int kDirectMax = 5;    // input rows up to which the register kernel runs
constexpr int kTileRows = 6;     // input rows per tile of the buffered kernel
constexpr int64_t kXTile = 96;   // input rows a thread keeps hot in L2 (buffered kernel)
// Bytes ahead to prefetch a row's codes: decode streams every weight from DRAM once per
// step, and the hardware prefetcher alone left ~40% of the bandwidth unused (2 threads).
constexpr int64_t kAheadBytes = 4096;

// Q4_0 and Q4_1 expand alike, d * q + m; Q4_0's m is -8d (gguf's d * (q - 8), exactly).
struct Nibbles {
  static constexpr int64_t kCodeBytes = 16;
  static inline void expand(const uint8_t* row, int64_t b, float d, float m, v16f& lo,
                            v16f& hi) {
    nibbles_to_float(row + b * 16, lo, hi);
    lo = lo * d + m;
    hi = hi * d + m;
  }
};

struct Q4_0 : Nibbles {
  static constexpr int64_t kBytes = 18;
  static void scales(const uint8_t* row, int64_t nb, float* d, float* m) {
    halves_to_float(row + nb * 16, nb, d);
    for (int64_t b = 0; b < nb; ++b) m[b] = -8.0f * d[b];
  }
};

struct Q4_1 : Nibbles {
  static constexpr int64_t kBytes = 20;
  static void scales(const uint8_t* row, int64_t nb, float* d, float* m) {
    halves_to_float(row + nb * 16, nb, d);
    halves_to_float(row + nb * 18, nb, m);
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34, kCodeBytes = 32;
  static void scales(const uint8_t* row, int64_t nb, float* d, float*) {
    halves_to_float(row + nb * 32, nb, d);
  }
  static inline void expand(const uint8_t* row, int64_t b, float d, float, v16f& lo,
                            v16f& hi) {
    lo = int8_to_float(row + b * 32) * d;
    hi = int8_to_float(row + b * 32 + 16) * d;
  }
};

// One group of G weight rows, its scales converted once.
template <class F, int G>
struct Group {
  const uint8_t* rows[G];
  const float* d;  // [G][nb]
  const float* m;  // [G][nb]
  int64_t nb;
};

template <int G, int NB>
inline void store_group(v16f (&acc)[G][NB], float* out, int64_t ldo, int64_t r,
                        const float* bias) {
  for (int i = 0; i < G; ++i) {
    const float add = bias ? bias[r + i] : 0.0f;
    for (int j = 0; j < NB; ++j) out[j * ldo + r + i] = hsum(acc[i][j]) + add;
  }
}

// NB input rows (x, row stride k) against a group, blocks expanded in registers.
template <class F, int G, int NB>
void group_direct(const Group<F, G>& g, const float* x, int64_t k, float* out, int64_t ldo,
                  int64_t r, const float* bias) {
  v16f acc[G][NB] = {};
  for (int64_t b = 0; b < g.nb; ++b) {
    for (int i = 0; i < G; ++i) {
      const char* row = reinterpret_cast<const char*>(g.rows[i]);
      _mm_prefetch(row + b * F::kCodeBytes + kAheadBytes, _MM_HINT_T0);
    }
    v16f lo[G], hi[G];
    for (int i = 0; i < G; ++i)
      F::expand(g.rows[i], b, g.d[i * g.nb + b], g.m[i * g.nb + b], lo[i], hi[i]);
    for (int j = 0; j < NB; ++j) {
      const v16f xv = load16(x + j * k + b * 32);
      for (int i = 0; i < G; ++i) acc[i][j] += lo[i] * xv;
    }
    for (int j = 0; j < NB; ++j) {
      const v16f xv = load16(x + j * k + b * 32 + 16);
      for (int i = 0; i < G; ++i) acc[i][j] += hi[i] * xv;
    }
  }
  store_group<G, NB>(acc, out, ldo, r, bias);
}

// NB input rows against G expanded weight rows (wbuf, row stride k).
template <int G, int NB>
void group_buffered(const float* wbuf, const float* x, int64_t k, float* out, int64_t ldo,
                    int64_t r, const float* bias) {
  v16f acc[G][NB] = {};
  for (int64_t c = 0; c < k; c += 16) {
    v16f wv[G];
    for (int i = 0; i < G; ++i) wv[i] = load16(wbuf + i * k + c);
    for (int j = 0; j < NB; ++j) {
      const v16f xv = load16(x + j * k + c);
      for (int i = 0; i < G; ++i) acc[i][j] += wv[i] * xv;
    }
  }
  store_group<G, NB>(acc, out, ldo, r, bias);
}

template <class F, int G>
void expand_group(const Group<F, G>& g, float* wbuf) {
  const int64_t k = g.nb * 32;
  for (int i = 0; i < G; ++i)
    for (int64_t b = 0; b < g.nb; ++b) {
      v16f lo, hi;
      F::expand(g.rows[i], b, g.d[i * g.nb + b], g.m[i * g.nb + b], lo, hi);
      store16(wbuf + i * k + b * 32, lo);
      store16(wbuf + i * k + b * 32 + 16, hi);
    }
}

template <class F, int G>
void run_direct(const Group<F, G>& g, const float* x, int64_t n, int64_t k, float* out,
                int64_t ldo, int64_t r, const float* bias) {
  switch (n) {
    case 1: return group_direct<F, G, 1>(g, x, k, out, ldo, r, bias);
    case 2: return group_direct<F, G, 2>(g, x, k, out, ldo, r, bias);
    case 3: return group_direct<F, G, 3>(g, x, k, out, ldo, r, bias);
    case 4: return group_direct<F, G, 4>(g, x, k, out, ldo, r, bias);
    default: return group_direct<F, G, 5>(g, x, k, out, ldo, r, bias);
  }
}

template <int G>
void run_buffered(const float* wbuf, const float* x, int64_t n0, int64_t n1, int64_t k,
                  float* out, int64_t ldo, int64_t r, const float* bias) {
  int64_t j = n0;
  for (; j + kTileRows <= n1; j += kTileRows)
    group_buffered<G, kTileRows>(wbuf, x + j * k, k, out + j * ldo, ldo, r, bias);
  for (; j < n1; ++j) group_buffered<G, 1>(wbuf, x + j * k, k, out + j * ldo, ldo, r, bias);
}

struct Scratch {
  std::vector<float> d, m, wbuf;
};

template <class F, int G>
Group<F, G> make_group(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t r,
                       Scratch& s) {
  Group<F, G> g;
  g.nb = nb;
  for (int i = 0; i < G; ++i) {
    g.rows[i] = w + (r + i) * row_bytes;
    F::scales(g.rows[i], nb, s.d.data() + i * nb, s.m.data() + i * nb);
  }
  g.d = s.d.data();
  g.m = s.m.data();
  return g;
}

// Weight rows [r0, r1) of one thread, groups of G rows.
template <class F, int G>
void rows_range(const float* x, int64_t n, int64_t k, const uint8_t* w, int64_t m,
                int64_t r0, int64_t r1, float* out, const float* bias, Scratch& s) {
  const int64_t nb = k / 32, row_bytes = nb * F::kBytes;
  if (n <= kDirectMax) {
    for (int64_t r = r0; r + G <= r1; r += G)
      run_direct<F, G>(make_group<F, G>(w, row_bytes, nb, r, s), x, n, k, out, m, r, bias);
    return;
  }
  for (int64_t t0 = 0; t0 < n; t0 += kXTile) {
    const int64_t t1 = std::min(n, t0 + kXTile);
    for (int64_t r = r0; r + G <= r1; r += G) {
      expand_group<F, G>(make_group<F, G>(w, row_bytes, nb, r, s), s.wbuf.data());
      run_buffered<G>(s.wbuf.data(), x, t0, t1, k, out, m, r, bias);
    }
  }
}

template <class F>
void linear(const float* x, int64_t n, int64_t k, const uint8_t* w, int64_t m, float* out,
            const float* bias) {
  const int64_t groups = m / kGroup, tail = groups * kGroup;
#pragma omp parallel if (n * k * m >= kParallelWork)
  {
    const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
    Scratch s;
    s.d.resize(kGroup * (k / 32));
    s.m.resize(kGroup * (k / 32));
    if (n > kDirectMax) s.wbuf.resize(kGroup * k);
    const int64_t r0 = groups * id / threads * kGroup, r1 = groups * (id + 1) / threads * kGroup;
    rows_range<F, kGroup>(x, n, k, w, m, r0, r1, out, bias, s);
    if (id == threads - 1)  // the m % kGroup rows left over, one at a time
      rows_range<F, 1>(x, n, k, w, m, tail, m, out, bias, s);
  }
}

template <class F>
void dequantize_rows(const uint8_t* w, int64_t k, const int64_t* rows, int64_t count,
                     float* out) {
  const int64_t nb = k / 32, row_bytes = nb * F::kBytes;
#pragma omp parallel if (count * k > (1 << 16))
  {
    Scratch s;
    s.d.resize(nb);
    s.m.resize(nb);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; ++i) {
      const int64_t r = rows ? rows[i] : i;
      expand_group<F, 1>(make_group<F, 1>(w, row_bytes, nb, r, s), out + i * k);
    }
  }
}

enum Format : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

}  // namespace

// out[n, m] = x[n, k] @ W[m, k]^T (+ bias[m]); W in `format`'s packed rows; k % 32 == 0.
HR_EXPORT void hr_quant_linear(int64_t format, const float* x, int64_t n, int64_t k,
                               const uint8_t* w, int64_t m, float* out, const float* bias) {
  if (format == kQ4_0) return linear<Q4_0>(x, n, k, w, m, out, bias);
  if (format == kQ4_1) return linear<Q4_1>(x, n, k, w, m, out, bias);
  return linear<Q8_0>(x, n, k, w, m, out, bias);
}

// out[i, :] = W[rows[i], :] in fp32 (rows == nullptr: rows 0..count-1), bit-exact.
HR_EXPORT void hr_dequantize_rows(int64_t format, const uint8_t* w, int64_t k,
                                  const int64_t* rows, int64_t count, float* out) {
  if (format == kQ4_0) return dequantize_rows<Q4_0>(w, k, rows, count, out);
  if (format == kQ4_1) return dequantize_rows<Q4_1>(w, k, rows, count, out);
  return dequantize_rows<Q8_0>(w, k, rows, count, out);
}
