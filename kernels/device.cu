// plow native kernel — the CUDA build: one persistent step on an NVIDIA GPU.
//
// The same interpreter and tile sources as the host build (kernels/interp.h, tiles.h), compiled
// for the device with PLOW_HD = PLOW_SIMD = __host__ __device__. One launch per decode step,
// one CTA per plan worker (the plan's workers are the GPU's SMs, as the target says): CTA w
// walks worker w's queue — the record indices of the plan file whose `worker` field is w, in
// file order, precomputed by the loader (plow/runtime/cuda/) — and for each record:
//
//   thread 0 waits until the record's counter reaches per_step[c] * (step - 1) + threshold
//            (an acquire load at the counter's scope: the scope its signalling records carry —
//            wire v1's `scope` byte is the scope of the record's signal — 0 cta -> block
//            scope, 1 device -> device scope, 2 system -> system scope; cuda::atomic_ref);
//   the CTA runs the record's units (kernels/interp.h's unit walk; see run_record_cta);
//   thread 0 increments the record's signal counter (a release fetch-add at the same scope)
//            after a __syncthreads(), so every thread's writes are ordered before it.
//
// Counters are 64-bit words in global memory and only grow, exactly as host.cpp's: nothing is
// reset between steps. A wait that does not open within `timeout_ns` (only an uncertified plan
// can do that) stops the step: the first CTA to time out records where it was blocked in the
// status word, every other CTA leaves at its next wait, and the loader restores the counters to
// their end-of-step values before raising.
//
// Arithmetic: no FMA contraction (nvcc --fmad=false); the fused multiply-adds are the explicit
// fmaf calls, as in tiles.h (fmaf is exactly rounded on both). The linear / lm_head tile is
// CTA-parallel: warp w of the CTA computes four output columns at a time (n0 = a + 4w,
// a + 4w + 4 * warps, ...); lane l of the warp accumulates elements l, l + 32, ... of a row in
// order (acc = fmaf(x, w, acc)) and the warp reduces with shuffles in the same fixed tree as
// tiles.h's lanes_sum (s = 16, 8, 4, 2, 1: acc[l] += acc[l + s]) — so every output element has
// exactly dot_f32 / dot_bf16's operations in their order, and the host build's bits. rmsnorm's
// sums of squares are the same warp dot. Element-wise tiles (embedding, rope, gated MLP,
// residual add) and merges of linear ops split their independent elements over the CTA's
// threads; attention splits a tile's rows over up to PLOW_ATTN_THREADS threads (each
// with its own scratch); everything else runs on thread 0 with the others idle (correctness
// first). Transcendentals (expf, tanhf, sinf, cosf) are CUDA's, not glibc's: within CUDA's
// documented ulp bounds of the host's, not bitwise equal to them.
#define PLOW_HD __host__ __device__
#define PLOW_SIMD __host__ __device__

// The same source compiles with hipcc for AMD GPUs (kernels/Makefile.device, `make hip`): the
// few CUDA-only spellings (scoped atomics, shuffles, sleep, the nanosecond timer) go through
// the small layer below. AMD's wavefront is 64 lanes; the dot products use 32-lane groups
// (shuffles of width 32), so the reduction tree is the same on both.
//
// A third build, PLOW_EMULATE (a C++20 host compiler, x86-64, tests only), runs the kernel on
// CPU threads — one OS thread per CTA, its GPU threads fibers switched at barriers (so
// __syncthreads and the shuffles are real barriers), std::atomic_ref for the counters —
// through plow_emu_launch at the end of this file, so the kernel's own queue walk, waits,
// signals and CTA-parallel tiles run where no GPU is (tests/runtime/test_cuda.py).
#if defined(PLOW_EMULATE)
#if !defined(__x86_64__)
#error "the emulation build switches fibers with x86-64 code"
#endif
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>
#undef PLOW_HD
#undef PLOW_SIMD
#define PLOW_HD
#define PLOW_SIMD
#define __host__
#define __device__
#define __global__
#define __launch_bounds__(a, b)
// One OS thread per CTA; its GPU threads are fibers switched at barriers only (a dozen
// instructions: the callee-saved registers and the stack pointer), so a __syncthreads or a
// shuffle costs a few nanoseconds, not a futex. A barrier that some thread of the CTA never
// reaches (a divergent __syncthreads or shuffle) is reported and fails the launch.
extern "C" void plow_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl plow_emu_switch
  .hidden plow_emu_switch
  .type plow_emu_switch, @function
plow_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size plow_emu_switch, .-plow_emu_switch
)");
namespace plow_emu {
struct Dim { unsigned x = 0, y = 0, z = 0; };
struct Barrier {
  int n = 0, count = 0;
  unsigned gen = 0;
};
struct Fiber {
  void* sp = nullptr;
  std::unique_ptr<char[]> stack;
  unsigned tid = 0;
  bool done = false;
  Barrier* wait = nullptr;
  unsigned wait_gen = 0;
};
struct Warp {
  Barrier bar;
  float slot[2][32];
  int parity = 0;  // shuffles alternate slot buffers: one barrier per shuffle
};
struct Block {
  Barrier bar;
  std::vector<Warp> warps;
  std::vector<Fiber> fibers;
  void* sched = nullptr;
  Fiber* cur = nullptr;
  int s_abort = 0;
};
inline thread_local Dim threadIdx, blockIdx;
inline Dim blockDim;
inline thread_local Block* block = nullptr;
inline void arrive(Barrier& b) {
  const unsigned g = b.gen;
  if (++b.count == b.n) {
    b.count = 0;
    ++b.gen;
    return;
  }
  Fiber* f = block->cur;
  f->wait = &b;
  f->wait_gen = g;
  plow_emu_switch(&f->sp, block->sched);
}
inline float shfl(float v, int from) {  // lane l gets lane `from`'s v (its own if out of range)
  Warp& w = block->warps[threadIdx.x / 32];
  const int p = w.parity;
  w.slot[p][threadIdx.x & 31] = v;
  if (w.bar.count + 1 == w.bar.n) w.parity ^= 1;  // the next shuffle writes the other buffer
  arrive(w.bar);
  return from >= 0 && from < 32 ? w.slot[p][from] : v;
}
inline thread_local void** args = nullptr;  // the launch's kernelParams
}  // namespace plow_emu
using plow_emu::blockDim;
using plow_emu::blockIdx;
using plow_emu::threadIdx;
inline void __syncthreads() { plow_emu::arrive(plow_emu::block->bar); }
inline float __fadd_rn(float a, float b) { return a + b; }
template <class T>
inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
inline unsigned atomicCAS(unsigned* p, unsigned want, unsigned put) {
  std::atomic_ref<unsigned>(*p).compare_exchange_strong(want, put);
  return want;
}
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
#define PLOW_SHFL_DOWN(v, s) plow_emu::shfl((v), static_cast<int>(threadIdx.x & 31) + (s))
#define PLOW_SHFL0(v) plow_emu::shfl((v), 0)
#define PLOW_SLEEP() std::this_thread::sleep_for(std::chrono::microseconds(50))
#define PLOW_SHARED_ABORT int& s_abort = plow_emu::block->s_abort
#elif defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define PLOW_SHFL_DOWN(v, s) __shfl_down((v), (s), 32)
#define PLOW_SHFL0(v) __shfl((v), 0, 32)
#define PLOW_SLEEP() __builtin_amdgcn_s_sleep(1)
#define PLOW_SHARED_ABORT __shared__ int s_abort
#else
#include <cuda/atomic>
#define PLOW_SHFL_DOWN(v, s) __shfl_down_sync(0xffffffffu, (v), (s))
#define PLOW_SHFL0(v) __shfl_sync(0xffffffffu, (v), 0)
#define PLOW_SLEEP() __nanosleep(64)
#define PLOW_SHARED_ABORT __shared__ int s_abort
#endif

#if defined(__clang__) || defined(PLOW_EMULATE)
// run_record (the host build's unit walk) is not used here: run_record_cta replaces it.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#endif
// one query row per attention thread (the CTA splits a tile's rows over its threads; the
// loader sizes each thread's scratch for one row: plow/runtime/cuda/image.py)
#define PLOW_ATTN_ROWS 1
#include "interp.h"
#if defined(__clang__) || defined(PLOW_EMULATE)
#pragma GCC diagnostic pop
#endif

#if defined(PLOW_EMULATE)
#define PLOW_UNROLL(n)
#else
#define PLOW_UNROLL(n) _Pragma(#n)
#endif

// The device ABI beyond plow_abi.h: the loader checks plow_device_config against its own
// constants when it loads the module (plow/runtime/cuda/model.py, through plow_config below),
// and the host-side test reads it from the compiled PTX.
#define PLOW_DEVICE_ABI 1
#ifndef PLOW_BLOCK_THREADS
#define PLOW_BLOCK_THREADS 256  // the emulation build may run fewer (-DPLOW_BLOCK_THREADS=64)
#endif
#define PLOW_ATTN_THREADS 32
#define PLOW_WARPS (PLOW_BLOCK_THREADS / 32)

// Written by the kernel, read by the loader after each step.
struct PlowDeviceStatus {
  unsigned int abort;          // 0: the step finished; 1: a wait timed out
  unsigned int worker;         // where the first timeout was seen
  long long packet;            //   (record index in the plan file)
  unsigned int counter;
  unsigned int scope;
  unsigned long long value;    //   the counter's value then
  unsigned long long want;     //   and what the record waited for
  unsigned long long tasks;    // task records run by the step
  unsigned long long nops;     // nop records run by the step
};

// (A whole-program cubin keeps device variables as LOCAL symbols; the driver finds them by
// name all the same — the runtime's cudaMemcpyToSymbol relies on that.)
extern "C" __device__ const long long plow_device_config[8] = {
    PLOW_DEVICE_ABI,
    PLOW_ABI_VERSION,
    PLOW_BLOCK_THREADS,
    PLOW_ATTN_THREADS,
    static_cast<long long>(sizeof(PlowPlan)),
    static_cast<long long>(sizeof(PlowOp)),
    static_cast<long long>(sizeof(PlowDeviceStatus)),
    PLOW_LANES,
};

// The loader reads plow_device_config through this kernel (one CTA of 8 threads): a kernel is
// an exported function of the module whatever the compilation mode.
extern "C" __global__ void plow_config(long long* out) {
  if (threadIdx.x < 8) out[threadIdx.x] = plow_device_config[threadIdx.x];
}

namespace plow_dev {

using plow::Ctx;
using plow::Range;

// -- counters ------------------------------------------------------------------------------
#if defined(PLOW_EMULATE)
__device__ inline unsigned long long counter_load(unsigned long long* p, uint32_t) {
  return std::atomic_ref<unsigned long long>(*p).load(std::memory_order_acquire);
}

__device__ inline void counter_signal(unsigned long long* p, uint32_t) {
  std::atomic_ref<unsigned long long>(*p).fetch_add(1ull, std::memory_order_release);
}

__device__ inline unsigned long long global_ns() {
  return static_cast<unsigned long long>(std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count());
}

__device__ inline unsigned int abort_seen(unsigned int* p) {
  return std::atomic_ref<unsigned int>(*p).load(std::memory_order_relaxed);
}
#elif defined(__HIPCC__)
__device__ inline unsigned long long counter_load(unsigned long long* p, uint32_t scope) {
  if (scope == 0) return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_WORKGROUP);
  if (scope == 2) return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}

__device__ inline void counter_signal(unsigned long long* p, uint32_t scope) {
  if (scope == 0) {
    __hip_atomic_fetch_add(p, 1ull, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_WORKGROUP);
  } else if (scope == 2) {
    __hip_atomic_fetch_add(p, 1ull, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
  } else {
    __hip_atomic_fetch_add(p, 1ull, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
  }
}

__device__ inline unsigned long long global_ns() {
  return __builtin_amdgcn_s_memrealtime() * 10ull;  // the 100 MHz real-time counter
}

__device__ inline unsigned int abort_seen(unsigned int* p) {
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
#else
template <cuda::thread_scope S>
__device__ inline unsigned long long load_acquire(unsigned long long* p) {
  return cuda::atomic_ref<unsigned long long, S>(*p).load(cuda::memory_order_acquire);
}

template <cuda::thread_scope S>
__device__ inline void add_release(unsigned long long* p) {
  cuda::atomic_ref<unsigned long long, S>(*p).fetch_add(1ull, cuda::memory_order_release);
}

__device__ inline unsigned long long counter_load(unsigned long long* p, uint32_t scope) {
  if (scope == 0) return load_acquire<cuda::thread_scope_block>(p);
  if (scope == 2) return load_acquire<cuda::thread_scope_system>(p);
  return load_acquire<cuda::thread_scope_device>(p);
}

__device__ inline void counter_signal(unsigned long long* p, uint32_t scope) {
  if (scope == 0) return add_release<cuda::thread_scope_block>(p);
  if (scope == 2) return add_release<cuda::thread_scope_system>(p);
  add_release<cuda::thread_scope_device>(p);
}

__device__ inline unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ inline unsigned int abort_seen(unsigned int* p) {
  return cuda::atomic_ref<unsigned int, cuda::thread_scope_device>(*p).load(
      cuda::memory_order_relaxed);
}
#endif

// -- warp dot products with dot_f32's order ------------------------------------------------
#if PLOW_LANES == 32
__device__ inline float warp_tree(float acc) {
  // lanes_sum: for s = 16 .. 1, acc[l] += acc[l + s] (l < s); lane 0 ends with the total
  for (int s = PLOW_LANES / 2; s > 0; s >>= 1)
    acc = __fadd_rn(acc, PLOW_SHFL_DOWN(acc, s));
  return acc;
}

__device__ inline float wload(const void* w, int32_t dt, int64_t i) {
  if (dt == PLOW_BF16) return plow::bf16_to_f32(static_cast<const uint16_t*>(w)[i]);
  // GGML blocks: lane l of an aligned warp pass decodes element l of one block (blocks.h's
  // float operations, so the device's quantized dots are its fp32 dots of the de-quantized
  // weights, as on the host)
  if (plow::is_blocked(dt)) return plow::block_weight(static_cast<const uint8_t*>(w), dt, i);
  return static_cast<const float*>(w)[i];
}

// dot(x, w[off ..]) over n, on one warp; the result on every lane.
__device__ inline float warp_dot(const float* x, const void* w, int32_t dt, int64_t off, int64_t n,
                                 int lane) {
  float acc = 0.0f;
  int64_t k = 0;
PLOW_UNROLL(unroll 4)
  for (; k + PLOW_LANES <= n; k += PLOW_LANES)
    acc = fmaf(x[k + lane], wload(w, dt, off + k + lane), acc);
  if (k + lane < n) acc = fmaf(x[k + lane], wload(w, dt, off + k + lane), acc);
  return PLOW_SHFL0(warp_tree(acc));
}

// Four rows of x (stride ldx) against one weight row: each result is warp_dot's.
__device__ inline void warp_dot4(const float* x, int64_t ldx, const void* w, int32_t dt,
                                 int64_t off, int64_t n, int lane, float* y) {
  float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
  int64_t k = 0;
PLOW_UNROLL(unroll 2)
  for (; k + PLOW_LANES <= n; k += PLOW_LANES) {
    const float wv = wload(w, dt, off + k + lane);
    a0 = fmaf(x0[k + lane], wv, a0);
    a1 = fmaf(x1[k + lane], wv, a1);
    a2 = fmaf(x2[k + lane], wv, a2);
    a3 = fmaf(x3[k + lane], wv, a3);
  }
  if (k + lane < n) {
    const float wv = wload(w, dt, off + k + lane);
    a0 = fmaf(x0[k + lane], wv, a0);
    a1 = fmaf(x1[k + lane], wv, a1);
    a2 = fmaf(x2[k + lane], wv, a2);
    a3 = fmaf(x3[k + lane], wv, a3);
  }
  y[0] = PLOW_SHFL0(warp_tree(a0));
  y[1] = PLOW_SHFL0(warp_tree(a1));
  y[2] = PLOW_SHFL0(warp_tree(a2));
  y[3] = PLOW_SHFL0(warp_tree(a3));
}

// One row of x against `nc` <= 4 weight rows (offsets off + j * ldw): each result is
// warp_dot's, the four rows' loads interleaved so more of them are in flight.
__device__ inline void warp_dot_rows4(const float* x, const void* w, int32_t dt, int64_t off,
                                      int64_t ldw, int nc, int64_t n, int lane, float* y) {
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int64_t k = 0;
  PLOW_UNROLL(unroll 4)
  for (; k + PLOW_LANES <= n; k += PLOW_LANES) {
    const float xv = x[k + lane];
    PLOW_UNROLL(unroll)
    for (int j = 0; j < 4; ++j)
      if (j < nc) a[j] = fmaf(xv, wload(w, dt, off + j * ldw + k + lane), a[j]);
  }
  if (k + lane < n) {
    const float xv = x[k + lane];
    for (int j = 0; j < 4; ++j)
      if (j < nc) a[j] = fmaf(xv, wload(w, dt, off + j * ldw + k + lane), a[j]);
  }
  for (int j = 0; j < 4; ++j) y[j] = PLOW_SHFL0(warp_tree(a[j]));  // every lane: uniform
}
#endif

__device__ inline bool is_fused_lm(const Ctx& c, const PlowOp& op) {
  return c.plan->fused_lm >= 0 && &op == &c.plan->ops[c.plan->fused_lm];
}

// -- linear / lm_head: tiles.h's tile_linear, CTA-parallel over the columns -----------------
__device__ void tile_linear_cta(const Ctx& c, const PlowOp& op, const Range* r, int64_t step) {
#if PLOW_LANES == 32
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* x = c.A + op.t[0];
  const int64_t M = op.d[0], N = op.d[1], K = op.d[2];
  const int64_t k0 = r[2].a, kn = r[2].b - r[2].a;
  float* dst = step >= 0 ? c.A + op.t[2] + step * M * N : c.A + op.t[1];
  // warp w takes columns [n0, n0 + 4) for n0 = a + 4w, a + 4w + 4 * warps, ...: four weight
  // rows streamed at once (more loads in flight); each element keeps warp_dot's order
  for (int64_t n0 = r[1].a + 4 * warp; n0 < r[1].b; n0 += 4 * PLOW_WARPS) {
    const int nc = r[1].b - n0 < 4 ? static_cast<int>(r[1].b - n0) : 4;
    int64_t m = r[0].a;
    float y4[4];
    for (; m + 4 <= r[0].b; m += 4)
      for (int j = 0; j < nc; ++j) {
        const int64_t n = n0 + j;
        warp_dot4(x + m * K + k0, K, op.w0, op.w0_dtype, n * K + k0, kn, lane, y4);
        if (lane < 4)
          dst[(m + lane) * N + n] = step >= 0 ? y4[lane] : plow::epilogue(op, y4[lane], n);
      }
    for (; m < r[0].b; ++m) {
      warp_dot_rows4(x + m * K + k0, op.w0, op.w0_dtype, n0 * K + k0, K, nc, kn, lane, y4);
      if (lane < nc) {
        const int64_t n = n0 + lane;
        dst[m * N + n] = step >= 0 ? y4[lane] : plow::epilogue(op, y4[lane], n);
      }
    }
  }
  if (step < 0 && is_fused_lm(c, op)) {
    __syncthreads();
    if (threadIdx.x == 0) plow::argmax_chunks(c, op, r[0].a, r[0].b, r[1].a, r[1].b);
  }
#else
  if (threadIdx.x == 0) plow::tile_linear(c, op, r, step);
#endif
}

// merge_linear: each output element is independent (steps summed in ascending order).
__device__ void merge_linear_cta(const Ctx& c, const PlowOp& op, const int64_t* u) {
  const int64_t M = op.d[0], N = op.d[1], steps = op.d[3];
  const int64_t n0 = u[2] > u[6] ? u[2] : u[6], n1 = u[3] < u[7] ? u[3] : u[7];
  const float* part = c.A + op.t[2];
  float* out = c.A + op.t[1];
  const int64_t cols = n1 > n0 ? n1 - n0 : 0, count = (u[1] - u[0]) * cols;
  for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
    const int64_t m = u[0] + e / cols, n = n0 + e % cols;
    float y = part[m * N + n];
    for (int64_t k = 1; k < steps; ++k) y = __fadd_rn(y, part[(k * M + m) * N + n]);
    out[m * N + n] = plow::epilogue(op, y, n);
  }
  if (n1 > n0 && is_fused_lm(c, op)) {
    __syncthreads();
    if (threadIdx.x == 0) plow::argmax_chunks(c, op, u[0], u[1], n0, n1);
  }
}

// -- rmsnorm: one warp per row, the sum of squares as tiles.h's sumsq (= dot_f32(x, x)) -------
__device__ void tile_rmsnorm_cta(const Ctx& c, const PlowOp& op, const Range* r, int64_t step) {
#if PLOW_LANES == 32
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* x = c.A + op.t[0];
  const int64_t g = op.d[0];
  if (step >= 0) {
    float* part = c.A + op.t[2];
    const int64_t R = op.d[1];
    for (int64_t i = r[0].a + warp; i < r[0].b; i += PLOW_WARPS) {
      const float* xi = x + i * g + r[1].a;
      const float s = warp_dot(xi, xi, PLOW_F32, 0, r[1].b - r[1].a, lane);
      if (lane == 0) part[step * R + i] = s;
    }
    return;
  }
  float* out = c.A + op.t[1];
  for (int64_t i = r[0].a + warp; i < r[0].b; i += PLOW_WARPS) {
    const float* xi = x + i * g;
    const float var = warp_dot(xi, xi, PLOW_F32, 0, g, lane) / static_cast<float>(g);
    const float den = sqrtf(var + op.f[0]);
    for (int64_t j = r[1].a + lane; j < r[1].b; j += 32)
      out[i * g + j] = plow::norm_apply(op, xi[j], den, j);
  }
#else
  if (threadIdx.x == 0) plow::tile_rmsnorm(c, op, r, step);
#endif
}

// -- element-wise tiles: every output element on its own (a 1 x 1 sub-range of the tile) ----
__device__ void tile_elements_cta(const Ctx& c, const PlowOp& op, const Range* r) {
  const int64_t cols = r[1].b - r[1].a, count = (r[0].b - r[0].a) * cols;
  for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
    const int64_t i = r[0].a + e / cols, j = r[1].a + e % cols;
    const Range s[3] = {{i, i + 1}, {j, j + 1}, r[2]};
    switch (op.kind) {
      case PLOW_EMBEDDING: plow::tile_embedding(c, op, s); break;
      case PLOW_ROPE: plow::tile_rope(c, op, s); break;
      case PLOW_RESIDUAL_ADD:  // with a scale (Gemma 4's layer_scalar): kernels/gemma4.h
        if (op.w0 != nullptr) plow::tile_residual_scaled(c, op, s);
        else plow::tile_elementwise(c, op, s);
        break;
      default: plow::tile_elementwise(c, op, s); break;
    }
  }
}

// -- routed experts: moe.h's tiles on one-element (expert_linear) or one-row (router) sub-ranges,
// strided over the CTA's threads; each value is moe.h's arithmetic, so the host build's bits.
// Returns this thread's share of the rows computed (counted at each row's first column).
__device__ int64_t tile_moe_cta(const Ctx& c, const PlowOp& op, const Range* r, int64_t step) {
  if (op.kind == plow::PLOW_ROUTER || op.kind == plow::PLOW_ROUTER_GROUPED) {
    for (int64_t i = r[0].a + threadIdx.x; i < r[0].b; i += blockDim.x) {
      const Range s[3] = {{i, i + 1}, r[1], r[2]};
      if (op.kind == plow::PLOW_ROUTER) plow::tile_router(c, op, s);
      else plow::tile_router_grouped(c, op, s);  // kernels/deepseek.h
    }
    return 0;
  }
  int64_t work = 0;
  const int64_t cols = r[1].b - r[1].a, count = (r[0].b - r[0].a) * cols;
  for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
    const int64_t i = r[0].a + e / cols, j = r[1].a + e % cols;
    const Range s[3] = {{i, i + 1}, {j, j + 1}, r[2]};
    const int64_t rows = plow::tile_expert(c, op, s, step);
    if (j == r[1].a) work += rows;
  }
  return work;
}

// -- attention: the tile's rows split over PLOW_ATTN_THREADS threads, each with its scratch --
// Rows are independent (each writes its own output or partial); the key / value cache write of
// a token happens in the call whose rows hold the token's first query head, so exactly once.
__device__ int64_t tile_attention_cta(const Ctx& c, const PlowOp& op, const Range* r,
                                      int64_t step, float* scratch, int64_t scratch_floats) {
  const int64_t rows = r[0].b - r[0].a;
  const int64_t parts = rows < PLOW_ATTN_THREADS ? rows : PLOW_ATTN_THREADS;
  if (static_cast<int64_t>(threadIdx.x) >= parts) return 0;
  const int64_t per = (rows + parts - 1) / parts;
  const int64_t a = r[0].a + threadIdx.x * per;
  const int64_t b = a + per < r[0].b ? a + per : r[0].b;
  if (a >= b) return 0;
  const Range s[3] = {{a, b}, r[1], r[2]};
  return plow::tile_attention(c, op, s, step, scratch + threadIdx.x * scratch_floats);
}

// The work of one task record on the whole CTA (every thread calls it); returns this thread's
// share of the counted work. Units of one record write disjoint words (the plan's tiles
// partition each op), so they need no barrier between them.
__device__ int64_t run_record_cta(const Ctx& c, const plow::Record& rec, float* scratch,
                                  int64_t scratch_floats) {
  if (rec.opcode == PLOW_OP_NOP || rec.opcode == PLOW_OP_LOAD) return 0;
  const PlowOp& op = c.plan->ops[rec.op_index];
  if (rec.flags & PLOW_FLAG_ACCUMULATE) {
    for (uint32_t k = 0; k < rec.rows; ++k) {
      const int64_t* u = op.merge + 8 * (rec.row_start + k);
      if (op.kind == PLOW_LINEAR || op.kind == PLOW_LM_HEAD ||
          op.kind == plow::PLOW_EXPERT_LINEAR)  // expert_linear: the sum over experts
        merge_linear_cta(c, op, u);
      else if (threadIdx.x == 0)
        plow::run_merge(c, op, u, scratch);
    }
    return 0;
  }
  Range r[3];
  int64_t step, work = 0;
  for (uint32_t k = 0; k < rec.rows; ++k) {
    plow::tile_ranges(op, rec.row_start + k, r, &step);
    switch (op.kind) {
      case PLOW_LINEAR:
      case PLOW_LM_HEAD: tile_linear_cta(c, op, r, step); break;
      case PLOW_RMSNORM: tile_rmsnorm_cta(c, op, r, step); break;
      case PLOW_EMBEDDING:
      case PLOW_ROPE:
      case PLOW_GATED_MLP:
      case PLOW_RESIDUAL_ADD: tile_elements_cta(c, op, r); break;
      case PLOW_ATTENTION:
        work += tile_attention_cta(c, op, r, step, scratch, scratch_floats);
        break;
      case PLOW_SAMPLE:
        if (threadIdx.x == 0) plow::tile_sample(c, op, r, step);
        break;
      // routed experts (kernels/moe.h), the tile's elements spread over the CTA
      case plow::PLOW_ROUTER:
      case plow::PLOW_ROUTER_GROUPED:
      case plow::PLOW_EXPERT_LINEAR: work += tile_moe_cta(c, op, r, step); break;
      // Mamba-2 (kernels/ssm.h): one thread runs the tile's recurrence (correct, not fast)
      case plow::PLOW_SSM_CONV:
      case plow::PLOW_SSM_SCAN:
      case plow::PLOW_SSM_NORM:
        if (threadIdx.x == 0) plow::ssm_tile(c, op, r);
        break;
      default: break;  // the loader refuses other kinds
    }
  }
  return work;
}

}  // namespace plow_dev

// One decode step: CTA w runs worker w's queue, records queue[queue_start[w] .. queue_start[w+1]).
//   plan            the PlowPlan in device memory (its records, ops, weights, tables: device)
//   arena           the arena (4-byte words): the key-value pool, then the activations
//   counters        n_counters 64-bit counters, monotonic across steps
//   per_step        signals per step of each counter (how many records signal it)
//   counter_scope   each counter's scope (0 cta, 1 device, 2 system): its signallers' `scope`
//   queue           record indices grouped by worker, file order inside a worker
//   queue_start     n_workers + 1 offsets into `queue`
//   scratch         per CTA: PLOW_ATTN_THREADS * scratch_floats floats
//   op_work         counted work per op (attention: query-key pairs), zeroed by the loader
//   status          PlowDeviceStatus
//   step            this step's number (1, 2, ...): a record waits for
//                   per_step[c] * (step - 1) + threshold
//   timeout_ns      a wait that does not open within this long stops the step
//   jitter_ns       0, or: thread 0 sleeps a pseudo-random 0..jitter_ns before every task record
//                   (tests: it widens the window a lowered threshold leaves open)
extern "C" __global__ void __launch_bounds__(PLOW_BLOCK_THREADS, 1)
plow_step(const PlowPlan* plan, float* arena, unsigned long long* counters,
          const unsigned long long* per_step, const unsigned char* counter_scope,
          const int32_t* queue, const int64_t* queue_start,
          float* scratch, int64_t scratch_floats, unsigned long long* op_work,
          PlowDeviceStatus* status, unsigned long long step, unsigned long long timeout_ns,
          unsigned int jitter_ns) {
  PLOW_SHARED_ABORT;
  const unsigned w = blockIdx.x;
  const plow::Ctx ctx{arena, plan};
  float* my_scratch = scratch + static_cast<int64_t>(w) * PLOW_ATTN_THREADS * scratch_floats;
  const int64_t q0 = queue_start[w], q1 = queue_start[w + 1];
  unsigned long long tasks = 0, nops = 0;
  unsigned int rng = 0x9e3779b9u * (w + 1) ^ static_cast<unsigned int>(step);
  for (int64_t qi = q0; qi < q1; ++qi) {
    const int64_t idx = queue[qi];
    const plow::Record rec = plow::decode_record(plan->records + idx * PLOW_RECORD_SIZE);
    if (threadIdx.x == 0) {
      int abort = 0;
      if (rec.wait_counter != PLOW_NO_COUNTER) {
        unsigned long long* ctr = counters + rec.wait_counter;
        const uint32_t scope = counter_scope[rec.wait_counter];
        const unsigned long long want =
            per_step[rec.wait_counter] * (step - 1) + rec.wait_threshold;
        unsigned long long seen = plow_dev::counter_load(ctr, scope);
        if (seen < want) {
          const unsigned long long t0 = plow_dev::global_ns();
          unsigned int spins = 0;
      // fused ops (kernels/fused.h): add_rmsnorm's rows strided over the CTA's threads
      case plow::PLOW_ADD_RMSNORM:
        for (int64_t i = r[0].a + threadIdx.x; i < r[0].b; i += blockDim.x) {
          const Range s[3] = {{i, i + 1}, r[1], r[2]};
          plow::tile_add_rmsnorm(c, op, s);
        }
        break;
      // linear_glu: the tile's output elements strided over the CTA's threads (fused.h's dots)
      case plow::PLOW_LINEAR_QKV:  // R4: the same one-element sub-ranges as linear_glu
      case plow::PLOW_LINEAR_GLU: {
        const int64_t cols = r[1].b - r[1].a, count = (r[0].b - r[0].a) * cols;
        for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
          const int64_t i = r[0].a + e / cols, j = r[1].a + e % cols;
          const Range s[3] = {{i, i + 1}, {j, j + 1}, r[2]};
          if (op.kind == plow::PLOW_LINEAR_GLU) plow::tile_linear_glu(c, op, s);
          else plow::tile_linear_qkv(c, op, s);
        }
        break;
      }
          while ((seen = plow_dev::counter_load(ctr, scope)) < want) {
            if (++spins < 64) continue;
            PLOW_SLEEP();
            if ((spins & 63) != 0) continue;
            if (plow_dev::abort_seen(&status->abort) != 0) {
              abort = 1;
              break;
            }
            if (plow_dev::global_ns() - t0 > timeout_ns) {
              if (atomicCAS(&status->abort, 0u, 1u) == 0u) {
                status->worker = w;
                status->packet = idx;
                status->counter = rec.wait_counter;
                status->scope = scope;
                status->value = seen;
                status->want = want;
                __threadfence_system();
              }
              abort = 1;
              break;
            }
          }
        }
      }
      if (!abort && jitter_ns != 0 && rec.opcode != PLOW_OP_NOP) {
        rng = rng * 1664525u + 1013904223u;
#if defined(__HIPCC__) || defined(PLOW_EMULATE)
        const unsigned long long until = plow_dev::global_ns() + (rng >> 8) % jitter_ns;
        while (plow_dev::global_ns() < until) PLOW_SLEEP();
#else
        __nanosleep((rng >> 8) % jitter_ns);
#endif
      }
      s_abort = abort;
    }
    __syncthreads();
    if (s_abort) break;
    const int64_t work = plow_dev::run_record_cta(ctx, rec, my_scratch, scratch_floats);
    if (work != 0) atomicAdd(op_work + rec.op_index, static_cast<unsigned long long>(work));
    __syncthreads();  // every thread's writes of this record before its signal
    if (threadIdx.x == 0) {
      if (rec.signal_counter != PLOW_NO_COUNTER)
        plow_dev::counter_signal(counters + rec.signal_counter, rec.scope);
      if (rec.opcode == PLOW_OP_NOP) ++nops; else ++tasks;
    }
  }
  if (threadIdx.x == 0) {
    atomicAdd(&status->tasks, tasks);
    atomicAdd(&status->nops, nops);
  }
}

#if defined(PLOW_EMULATE)
namespace plow_emu {
void fiber_main() {
  void** a = args;
  auto arg = [&](int i) -> void* { return *static_cast<void**>(a[i]); };
  plow_step(static_cast<const PlowPlan*>(arg(0)), static_cast<float*>(arg(1)),
            static_cast<unsigned long long*>(arg(2)),
            static_cast<const unsigned long long*>(arg(3)),
            static_cast<const unsigned char*>(arg(4)), static_cast<const int32_t*>(arg(5)),
            static_cast<const int64_t*>(arg(6)), static_cast<float*>(arg(7)),
            *static_cast<int64_t*>(a[8]), static_cast<unsigned long long*>(arg(9)),
            static_cast<PlowDeviceStatus*>(arg(10)), *static_cast<unsigned long long*>(a[11]),
            *static_cast<unsigned long long*>(a[12]), *static_cast<unsigned int*>(a[13]));
}

[[noreturn]] void fiber_entry() {
  fiber_main();
  Fiber* f = block->cur;
  f->done = true;
  plow_emu_switch(&f->sp, block->sched);
  __builtin_unreachable();
}

void run_cta(unsigned b, unsigned threads, void** a, int* failed) {
  Block blk;
  blk.bar.n = static_cast<int>(threads);
  blk.warps.resize(threads / 32);
  for (auto& w : blk.warps) w.bar.n = 32;
  blk.fibers.resize(threads);
  block = &blk;
  args = a;
  blockIdx.x = b;
  constexpr size_t kStack = 256 * 1024;
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = blk.fibers[t];
    f.tid = t;
    f.stack.reset(new char[kStack]);
    // the first switch pops six zeroed registers and returns into fiber_entry with the stack
    // aligned as after a call
    auto top = reinterpret_cast<uintptr_t>(f.stack.get() + kStack) & ~uintptr_t{15};
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;  // fiber_entry's return address: it never returns
    *--sp = reinterpret_cast<void*>(&fiber_entry);
    for (int r = 0; r < 6; ++r) *--sp = nullptr;
    f.sp = sp;
  }
  for (;;) {
    bool live = false, moved = false;
    for (Fiber& f : blk.fibers) {
      if (f.done) continue;
      live = true;
      if (f.wait != nullptr && f.wait->gen == f.wait_gen) continue;  // still at its barrier
      f.wait = nullptr;
      blk.cur = &f;
      threadIdx.x = f.tid;
      plow_emu_switch(&blk.sched, f.sp);
      moved = true;
    }
    if (!live) break;
    if (!moved) {  // every live thread waits at a barrier the others never reach
      int at_block = 0;
      for (Fiber& f : blk.fibers) at_block += !f.done && f.wait == &blk.bar;
      fprintf(stderr, "plow_emu: CTA %u: barrier divergence (%d threads at __syncthreads)\n", b,
              at_block);
      *failed = 1;
      return;  // the fibers' stacks go with blk: nothing resumes them
    }
  }
}
}  // namespace plow_emu

// The emulator's launch: `grid` CTAs of `block` threads — one OS thread per CTA, its threads
// fibers — running plow_step with the parameters of a cuLaunchKernel `void*[]`
// (plow/runtime/cuda/abi.py's PARAMS order). Returns 0; -1 when `block` is not this build's
// PLOW_BLOCK_THREADS; -2 on a barrier divergence (reported on stderr).
extern "C" int plow_emu_launch(unsigned grid, unsigned block, void** a) {
  if (block != PLOW_BLOCK_THREADS || block % 32 != 0) return -1;
  blockDim.x = block;
  std::vector<int> failed(grid, 0);
  std::vector<std::thread> threads;
  for (unsigned b = 0; b < grid; ++b)
    threads.emplace_back([&, b] { plow_emu::run_cta(b, block, a, &failed[b]); });
  for (auto& th : threads) th.join();
  for (int f : failed)
    if (f) return -2;
  return 0;
}
#endif
