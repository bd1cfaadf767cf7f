// Host emulation of the CUDA features the kernels here use, so their exact
// source can run on a CPU in tests where no GPU exists (tests/kernels/test_cuda_launchers.py).
// Never part of a GPU build: it is force-included (`g++ -include`) ahead of a
// .cu file, and only there.
//
// Each thread of a thread block is a fiber (ucontext). A fiber runs until it
// reaches a barrier (__syncthreads, or a warp shuffle, which is a warp-wide
// barrier). Each block draws a random schedule (see run_block), so a missing
// barrier between a shared-memory write and a read from another warp shows up
// as a wrong result. Divergent barriers (a shuffle that not all lanes of a
// warp reach, __syncthreads after some threads returned) are reported as
// errors instead of hanging. Blocks run one after another, so shared memory
// (`__shared__` becomes `static`) is one copy, reused from block to block.
//
// Not emulated: anything the kernels here do not use (atomics, dynamic shared
// memory, partial-warp masks, cooperative groups, inline PTX), and hardware
// facts: memory alignment faults, bank conflicts, occupancy, timing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <ucontext.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

// cuda_fp16.h already maps __global__, __device__ and __forceinline__ to host
// C++; shared memory becomes function-static, one copy for the block that runs.
#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)

inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
inline float __uint_as_float(unsigned x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

namespace hr_emu {

constexpr int kWarp = 32;
constexpr size_t kStackBytes = 256 * 1024;

enum class State { kReady, kBlockBarrier, kWarpBarrier, kDone };

struct Fiber {
  ucontext_t ctx;
  State state = State::kReady;
  unsigned long long warp_syncs = 0;  // warp barriers passed: lanes must agree
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<char> stacks;
  std::vector<unsigned long long> exchange;  // [warp][2 generations][lane]
  ucontext_t scheduler;
  unsigned current = 0;
  const std::function<void()>* body = nullptr;
  const char* error = nullptr;
};

inline Block* g_block = nullptr;

inline void set_thread_index(unsigned tid) {
  threadIdx.x = tid % blockDim.x;
  threadIdx.y = tid / blockDim.x % blockDim.y;
  threadIdx.z = tid / (blockDim.x * blockDim.y);
}

inline void yield(State state) {
  Fiber& f = g_block->fibers[g_block->current];
  f.state = state;
  swapcontext(&f.ctx, &g_block->scheduler);
}

// Stops the whole launch: the fiber never resumes and its stack is dropped.
[[noreturn]] inline void fail(const char* message) {
  if (g_block->error == nullptr) g_block->error = message;
  yield(State::kDone);
  std::abort();  // unreachable: a failed fiber is never resumed
}

inline void fiber_main() {
  (*g_block->body)();
  g_block->fibers[g_block->current].state = State::kDone;  // uc_link returns to the scheduler
}

// True when every lane of `warp` waits at the same shuffle (then it may go on).
inline bool warp_complete(Block& b, unsigned warp) {
  const unsigned first = warp * kWarp;
  const unsigned last = std::min<unsigned>(first + kWarp, b.fibers.size());
  bool all = true, any = false, any_done = false;
  unsigned long long syncs = 0;
  for (unsigned i = first; i < last; ++i) {
    const Fiber& f = b.fibers[i];
    any_done = any_done || f.state == State::kDone;
    if (f.state != State::kWarpBarrier) {
      all = false;
      continue;
    }
    if (any && f.warp_syncs != syncs) b.error = "lanes of a warp at different shuffles";
    syncs = f.warp_syncs;
    any = true;
  }
  // Full-mask shuffles need every lane of the warp: one that returned never arrives.
  if (any && any_done) b.error = "shuffle in a warp where some lanes returned";
  return any && all;
}

// Appends the lanes of `warp` that can run now, first releasing its shuffle if complete.
inline void runnable_lanes(Block& b, unsigned warp, std::vector<unsigned>& out) {
  const unsigned last = std::min<unsigned>((warp + 1) * kWarp, b.fibers.size());
  const bool release = warp_complete(b, warp);
  for (unsigned i = warp * kWarp; i < last; ++i) {
    if (release && b.fibers[i].state == State::kWarpBarrier) b.fibers[i].state = State::kReady;
    if (b.fibers[i].state == State::kReady) out.push_back(i);
  }
}

// Nothing can run: every live thread must be at __syncthreads, and none may have returned.
inline void release_block(Block& b) {
  bool any_done = false, all_waiting = true;
  for (const Fiber& f : b.fibers) {
    any_done = any_done || f.state == State::kDone;
    all_waiting = all_waiting && (f.state == State::kBlockBarrier || f.state == State::kDone);
  }
  if (!all_waiting) {
    b.error = "deadlock: threads wait at different barriers";
  } else if (any_done) {
    b.error = "__syncthreads after some threads of the block returned";
  } else {
    for (Fiber& f : b.fibers) f.state = State::kReady;
  }
}

inline void start_fibers(Block& b, unsigned n) {
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f = Fiber{};
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = b.stacks.data() + i * kStackBytes;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &b.scheduler;
    makecontext(&f.ctx, fiber_main, 0);
  }
}

// Two schedules, drawn per block: "greedy" runs the warps in a random priority
// order, each as far as it can go before the next moves (warps drift apart by
// whole phases, which exposes a missing __syncthreads); "shuffled" runs every
// runnable thread each round in a random order.
inline void run_block(Block& b, std::mt19937& rng) {
  const unsigned n = blockDim.x * blockDim.y * blockDim.z;
  start_fibers(b, n);
  std::vector<unsigned> warps((n + kWarp - 1) / kWarp), order;
  for (unsigned w = 0; w < warps.size(); ++w) warps[w] = w;
  std::shuffle(warps.begin(), warps.end(), rng);
  const bool greedy = rng() % 2 == 0;
  while (b.error == nullptr) {
    bool all_done = true;
    for (unsigned i = 0; i < n; ++i) all_done = all_done && b.fibers[i].state == State::kDone;
    if (all_done) return;
    order.clear();
    for (unsigned w : warps) {
      runnable_lanes(b, w, order);
      if (greedy && !order.empty()) break;
    }
    if (b.error != nullptr) return;
    if (order.empty()) {
      release_block(b);
      continue;
    }
    std::shuffle(order.begin(), order.end(), rng);
    for (unsigned i : order) {
      b.current = i;
      set_thread_index(i);
      swapcontext(&b.scheduler, &b.fibers[i].ctx);
      if (b.error != nullptr) return;
    }
  }
}

// Runs kernel(args...) over the grid; args[i] points at the i-th argument's
// value, as in cudaLaunchKernel. Returns nullptr, or what went wrong.
template <typename... A, size_t... I>
void call_kernel(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <typename... A>
const char* launch(void (*kernel)(A...), dim3 grid, dim3 block, void** args, unsigned seed) {
  const std::function<void()> body = [&] {
    call_kernel(kernel, args, std::index_sequence_for<A...>{});
  };
  const unsigned n = block.x * block.y * block.z;
  Block b;
  b.fibers.resize(n);
  b.stacks.resize(n * kStackBytes);
  b.exchange.assign(((n + kWarp - 1) / kWarp) * 2 * kWarp, 0);
  b.body = &body;
  g_block = &b;
  gridDim = grid;
  blockDim = block;
  std::mt19937 rng(seed);
  for (unsigned z = 0; z < grid.z && b.error == nullptr; ++z) {
    for (unsigned y = 0; y < grid.y && b.error == nullptr; ++y) {
      for (unsigned x = 0; x < grid.x && b.error == nullptr; ++x) {
        blockIdx = uint3{x, y, z};
        run_block(b, rng);
      }
    }
  }
  g_block = nullptr;
  return b.error;
}

}  // namespace hr_emu

namespace hr_emu {

// A full-warp shuffle: every lane posts `value`, waits for the warp, reads lane `source(lane)`'s.
template <typename V, typename Source>
V shuffle(unsigned mask, V value, Source source) {
  static_assert(sizeof(V) <= sizeof(unsigned long long), "shuffle of a wide type");
  Block& b = *g_block;
  if (mask != 0xffffffffu) fail("only full-warp shuffles are emulated");
  if (b.fibers.size() % kWarp != 0) fail("shuffle in a block of partial warps");
  const unsigned tid = b.current, lane = tid % kWarp, warp = tid / kWarp;
  Fiber& self = b.fibers[tid];
  unsigned long long* slots = &b.exchange[(warp * 2 + self.warp_syncs % 2) * kWarp];
  ++self.warp_syncs;
  std::memcpy(&slots[lane], &value, sizeof(V));
  yield(State::kWarpBarrier);
  V out;
  std::memcpy(&out, &slots[source(lane) % kWarp], sizeof(V));
  return out;
}

}  // namespace hr_emu

template <typename V>
V __shfl_xor_sync(unsigned mask, V value, int lane_mask) {
  return hr_emu::shuffle(mask, value, [&](unsigned lane) {
    return lane ^ static_cast<unsigned>(lane_mask);
  });
}

template <typename V>
V __shfl_sync(unsigned mask, V value, int src_lane) {
  return hr_emu::shuffle(mask, value, [&](unsigned) { return static_cast<unsigned>(src_lane); });
}

inline void __syncthreads() { hr_emu::yield(hr_emu::State::kBlockBarrier); }
