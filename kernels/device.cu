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
// threads; attention splits a tile's rows over the CTA's warps (each with its own scratch;
// the lanes split a row's keys, then its output elements); everything else runs on thread 0
// with the others idle (correctness first). Transcendentals (expf, tanhf, sinf, cosf) are CUDA's, not glibc's: within CUDA's
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
#include <cmath>
#include <cstdint>
#include <cstring>
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
  uint32_t mma_a[32][4], mma_b[32][2];  // an emulated mma.sync's fragments (two barriers)
};
struct Block {
  Barrier bar;
  std::vector<Warp> warps;
  std::vector<Fiber> fibers;
  void* sched = nullptr;
  Fiber* cur = nullptr;
  int s_abort = 0;
  std::unique_ptr<unsigned char[]> smem;  // the launch's dynamic shared memory
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
#define PLOW_SYNCWARP() plow_emu::arrive(plow_emu::block->warps[threadIdx.x / 32].bar)
#define PLOW_SLEEP() std::this_thread::sleep_for(std::chrono::microseconds(50))
#define PLOW_SHARED_ABORT int& s_abort = plow_emu::block->s_abort
#define PLOW_DYN_SMEM(name) unsigned char* name = plow_emu::block->smem.get()
namespace plow_emu {
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 on the emulated warp: every lane posts
// its A (4 x b32) and B (2 x b32) fragments, then computes its four D elements from the whole
// 16 x 16 A and 16 x 8 B in PTX's fragment layout (groupID g = lane / 4, t = lane % 4:
// a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..];
// b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; d0, d1 = D[g][2t, 2t+1], d2, d3 = D[g+8][2t, 2t+1]),
// k ascending with fmaf (a bf16 product is exact in fp32). The hardware's accumulation order
// inside one mma is its own: the tests compare the tensor-core path with a tolerance.
inline float bf16_half(uint32_t v, int hi) {
  const uint32_t u = hi ? v & 0xffff0000u : v << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void mma_bf16(float* d, const uint32_t* a, const uint32_t* b) {
  Warp& w = block->warps[threadIdx.x / 32];
  const int lane = static_cast<int>(threadIdx.x & 31);
  for (int i = 0; i < 4; ++i) w.mma_a[lane][i] = a[i];
  for (int i = 0; i < 2; ++i) w.mma_b[lane][i] = b[i];
  arrive(w.bar);
  auto A = [&](int row, int k) {
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0), kk = k & 7;
    return bf16_half(w.mma_a[(row & 7) * 4 + kk / 2][reg], kk & 1);
  };
  auto B = [&](int k, int col) {
    const int kk = k & 7;
    return bf16_half(w.mma_b[col * 4 + kk / 2][k >= 8 ? 1 : 0], kk & 1);
  };
  const int g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc = fmaf(A(row, k), B(k, col), acc);
    d[i] = acc;
  }
  arrive(w.bar);  // every lane has read the fragments before the next mma posts its own
}
}  // namespace plow_emu
#elif defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define PLOW_SHFL_DOWN(v, s) __shfl_down((v), (s), 32)
#define PLOW_SHFL0(v) __shfl((v), 0, 32)
// a wavefront's lanes run in lockstep: its memory operations only need ordering
#define PLOW_SYNCWARP() (__threadfence_block(), __builtin_amdgcn_wave_barrier())
#define PLOW_SLEEP() __builtin_amdgcn_s_sleep(1)
#define PLOW_SHARED_ABORT __shared__ int s_abort
#define PLOW_DYN_SMEM(name) extern __shared__ __attribute__((aligned(16))) unsigned char name[]
#else
#include <cuda/atomic>
#define PLOW_SHFL_DOWN(v, s) __shfl_down_sync(0xffffffffu, (v), (s))
#define PLOW_SHFL0(v) __shfl_sync(0xffffffffu, (v), 0)
#define PLOW_SYNCWARP() __syncwarp()
#define PLOW_SLEEP() __nanosleep(64)
#define PLOW_SHARED_ABORT __shared__ int s_abort
#define PLOW_DYN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
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
#include "device_sampler.h"
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
#define PLOW_DEVICE_ABI 3
#ifndef PLOW_BLOCK_THREADS
#define PLOW_BLOCK_THREADS 256  // the emulation build may run fewer (-DPLOW_BLOCK_THREADS=64)
#endif
#define PLOW_ATTN_THREADS 32
#define PLOW_WARPS (PLOW_BLOCK_THREADS / 32)

// Written by the kernel, read by the loader after each step.
struct PlowDeviceStatus {
  unsigned int abort;          // 0: the step finished; 1: a wait timed out; 2: an op kind with
                               //   no tile in this build (counter: the kind)
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

// -- linear / lm_head / linear_qkv: tiles.h's tile_linear, CTA-parallel over the columns ----
// Where weight row n's dot with x row m goes: a linear / lm_head output (or its split-k
// partial at `step`), or for linear_qkv (kernels/fused.h) q, k or v by where n falls.
enum class Fuse { none, qkv, glu };  // glu: tile_linear_glu_cta / tile_linear_tc's pairs

template <Fuse F>
__device__ inline void store_row_dot(const Ctx& c, const PlowOp& op, int64_t step, int64_t m,
                                     int64_t n, float v) {
  const int64_t M = op.d[0], N = op.d[1];
  if constexpr (F == Fuse::none) {
    if (step >= 0) c.A[op.t[2] + step * M * N + m * N + n] = v;
    else c.A[op.t[1] + m * N + n] = plow::epilogue(op, v, n);
  } else if (step >= 0) {  // linear_qkv split k: t4 its partial [steps, M, N]
    c.A[op.t[4] + step * M * N + m * N + n] = v;
  } else {  // linear_qkv: t1 q, t2 k, t3 v; d4 nq, d5 nk, d6 nv
    const int64_t nq = op.d[4], nk = op.d[5];
    const int part = n < nq ? 0 : n < nq + nk ? 1 : 2;
    const int64_t col = n - (part == 0 ? 0 : part == 1 ? nq : nq + nk);
    c.A[op.t[1 + part] + m * op.d[4 + part] + col] = v;
  }
}

// Where a tile's weights are read: element (row, k0 + j) of weight row `row` is element
// at(row) + j of `w` (dtype op.w0_dtype). In global memory: op.w0, ld K, row0 0, k0 the tile's
// first k (at(row) = row * K + k0); in the task's weight pages (fill_weight_tile): the tile's
// rows row0 .. copied back to back, ld = the tile's k extent, k0 0.
struct WView {
  const void* w;
  int64_t ld, row0, k0;
  __device__ int64_t at(int64_t row) const { return (row - row0) * ld + k0; }
};

__device__ inline WView weights_of(const PlowOp& op, const Range* r, const WView* ws) {
  return ws != nullptr ? *ws : WView{op.w0, op.d[2], 0, r[2].a};
}

// `xs`: the tile's input rows r[0] x columns r[2], row stride `ldx` — in the arena (nullptr:
// x + r[0].a * K + r[2].a, stride K) or staged in the task's shared-memory pages. `ws`: the
// tile's weights in its weight pages, or nullptr (global memory).
template <Fuse F>
__device__ void warp_linear_cta(const Ctx& c, const PlowOp& op, const Range* r, int64_t step,
                                const float* xs, int64_t ldx, const WView* ws = nullptr) {
#if PLOW_LANES == 32
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t K = op.d[2];
  const int64_t k0 = r[2].a, kn = r[2].b - r[2].a;
  const WView wv = weights_of(op, r, ws);
  if (xs == nullptr) xs = c.A + op.t[0] + r[0].a * K + k0, ldx = K;
  // warp w takes columns [n0, n0 + 4) for n0 = a + 4w, a + 4w + 4 * warps, ...: four weight
  // rows streamed at once (more loads in flight); each element keeps warp_dot's order
  for (int64_t n0 = r[1].a + 4 * warp; n0 < r[1].b; n0 += 4 * PLOW_WARPS) {
    const int nc = r[1].b - n0 < 4 ? static_cast<int>(r[1].b - n0) : 4;
    int64_t m = r[0].a;
    float y4[4];
    for (; m + 4 <= r[0].b; m += 4)
      for (int j = 0; j < nc; ++j) {
        const int64_t n = n0 + j;
        warp_dot4(xs + (m - r[0].a) * ldx, ldx, wv.w, op.w0_dtype, wv.at(n), kn, lane, y4);
        if (lane < 4) store_row_dot<F>(c, op, step, m + lane, n, y4[lane]);
      }
    for (; m < r[0].b; ++m) {
      warp_dot_rows4(xs + (m - r[0].a) * ldx, wv.w, op.w0_dtype, wv.at(n0), wv.ld, nc, kn, lane,
                     y4);
      if (lane < nc) store_row_dot<F>(c, op, step, m, n0 + lane, y4[lane]);
    }
  }
#else
  (void)xs;
  (void)ldx;
  (void)ws;
  if (threadIdx.x == 0) {
    if constexpr (F == Fuse::none) plow::tile_linear(c, op, r, step);
    else plow::tile_linear_qkv(c, op, r, step);
  }
#endif
}

__device__ void tile_linear_cta(const Ctx& c, const PlowOp& op, const Range* r, int64_t step,
                                const float* xs = nullptr, int64_t ldx = 0,
                                const WView* ws = nullptr) {
  warp_linear_cta<Fuse::none>(c, op, r, step, xs, ldx, ws);
#if PLOW_LANES == 32
  if (step < 0 && is_fused_lm(c, op)) {
    __syncthreads();
    if (threadIdx.x == 0) plow::argmax_chunks(c, op, r[0].a, r[0].b, r[1].a, r[1].b);
  }
#endif
}

// linear_glu (kernels/fused.h): output column n = act(row 2n . x) * (row 2n + 1 . x) over the
// interleaved weight; warp w takes columns [n0, n0 + 2) — weight rows 2 n0 .. 2 n0 + 3, four
// rows streamed at once — and each dot keeps warp_dot's order (fused.h's bits). Split k
// (`step` >= 0): both dots into the step's partial [M, 2N] (gate at 2n, up at 2n + 1).
__device__ void tile_linear_glu_cta(const Ctx& c, const PlowOp& op, const Range* r,
                                    int64_t step, const float* xs = nullptr, int64_t ldx = 0,
                                    const WView* ws = nullptr) {
#if PLOW_LANES == 32
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t N = op.d[1], K = op.d[2];
  const int64_t k0 = r[2].a, kn = r[2].b - r[2].a;
  const WView wv = weights_of(op, r, ws);
  if (xs == nullptr) xs = c.A + op.t[0] + r[0].a * K + k0, ldx = K;
  float* out = c.A + op.t[1];
  float* part = step >= 0 ? c.A + op.t[2] + step * op.d[0] * 2 * N : nullptr;
  for (int64_t n0 = r[1].a + 2 * warp; n0 < r[1].b; n0 += 2 * PLOW_WARPS) {
    const int nc = r[1].b - n0 < 2 ? 1 : 2;
    int64_t m = r[0].a;
    float g4[4], u4[4];
    for (; m + 4 <= r[0].b; m += 4)
      for (int j = 0; j < nc; ++j) {
        const int64_t n = n0 + j;
        const float* xm = xs + (m - r[0].a) * ldx;
        warp_dot4(xm, ldx, wv.w, op.w0_dtype, wv.at(2 * n), kn, lane, g4);
        warp_dot4(xm, ldx, wv.w, op.w0_dtype, wv.at(2 * n + 1), kn, lane, u4);
        if (lane < 4 && part != nullptr) {
          part[(m + lane) * 2 * N + 2 * n] = g4[lane];
          part[(m + lane) * 2 * N + 2 * n + 1] = u4[lane];
        } else if (lane < 4) {
          out[(m + lane) * N + n] = plow::act_fn(g4[lane], op.d[3]) * u4[lane];
        }
      }
    for (; m < r[0].b; ++m) {
      warp_dot_rows4(xs + (m - r[0].a) * ldx, wv.w, op.w0_dtype, wv.at(2 * n0), wv.ld, 2 * nc,
                     kn, lane, g4);
      if (lane == 0 && part != nullptr) {
        for (int j = 0; j < 2 * nc; ++j) part[m * 2 * N + 2 * n0 + j] = g4[j];
      } else if (lane == 0) {
        out[m * N + n0] = plow::act_fn(g4[0], op.d[3]) * g4[1];
        if (nc == 2) out[m * N + n0 + 1] = plow::act_fn(g4[2], op.d[3]) * g4[3];
      }
    }
  }
#else
  (void)xs;
  (void)ldx;
  (void)ws;
  if (threadIdx.x == 0) plow::tile_linear_glu(c, op, r, step);
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

// add_rmsnorm (kernels/fused.h): one warp per row, as tile_rmsnorm_cta. Lane l forms the sums
// s = a + b of columns l, l + 32, ... and accumulates their squares in that order — warp_dot's
// order over the written row, so the sums of squares are fused.h's sumsq bits — then writes
// the norm of the values it formed (recomputed: a + b rounds the same way twice).
__device__ void tile_add_rmsnorm_cta(const Ctx& c, const PlowOp& op, const Range* r,
                                     int64_t step) {
#if PLOW_LANES == 32
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* a = c.A + op.t[0];
  const float* b = c.A + op.t[1];
  float* s = c.A + op.t[2];
  const int64_t C = op.d[0];
  for (int64_t i = r[0].a + warp; i < r[0].b; i += PLOW_WARPS) {
    const int64_t o = i * C;
    float acc = 0.0f;
    for (int64_t j = r[1].a + lane; j < r[1].b; j += 32) {
      const float v = a[o + j] + b[o + j];
      s[o + j] = v;
      acc = fmaf(v, v, acc);
    }
    const float total = PLOW_SHFL0(warp_tree(acc));
    if (step >= 0) {  // partial: this column slice's sum of squares
      if (lane == 0) c.A[op.t[4] + step * op.d[1] + i] = total;
      continue;
    }
    const float den = sqrtf(total / static_cast<float>(C) + op.f[0]);
    float* out = c.A + op.t[3];
    for (int64_t j = r[1].a + lane; j < r[1].b; j += 32)
      out[o + j] = plow::norm_apply(op, a[o + j] + b[o + j], den, j);
  }
#else
  if (threadIdx.x == 0) plow::tile_add_rmsnorm(c, op, r, step);
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
      case plow::PLOW_ALLREDUCE: plow::tile_allreduce(c, op, s); break;  // kernels/collective.h
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

// -- attention: the tile's rows split over the CTA's warps, each with its scratch ---------------
// tiles.h's tile_attention on the 32 lanes of a warp (WarpAttend): the scores of keys j = lane,
// lane + 32, ... (qk_dot's order each); per row the scale / soft-cap and max over the lanes, the
// weights, and their sum l with attend_rows' 8 lanes (lane k < 8 adds the weights k, k + 8, ...
// in order; qk_tree by shuffles); then lane l owns output elements d = l, l + 32, ... and adds
// w * v key by key in key order, as attend_rows does (its four-key passes are the same adds in
// the same order). So every word is the host's bits (up to CUDA's tanhf under a soft-cap).
// Rows are independent (each writes its own output or partial); the key / value cache write of
// a token happens in the warp whose rows hold the token's first query head, so exactly once.
#if PLOW_LANES == 32
struct WarpAttend {
  int lane;
  static constexpr int width = 32;
  __device__ void sync() const { PLOW_SYNCWARP(); }
  __device__ void rows(plow::KvWalk& kw, plow::KvWalk& vw, const float* const* qv, int64_t R,
                       int64_t D, int64_t n, float scale, float softcap, float* sc, float* acc,
                       float* m, float* l) const {
    plow::KvWalk k = kw;  // this lane's own walk (keys out of order: one table lookup each)
    const int64_t lo = kw.kp;
    for (int64_t j = lane; j < n; j += 32) {
      k.seek_to(lo + j);
      for (int64_t i = 0; i < R; ++i) sc[i * n + j] = k.dot(qv[i], D);
    }
    for (int64_t i = 0; i < R; ++i) {
      float* s = sc + i * n;
      float mx = -INFINITY;
      for (int64_t j = lane; j < n; j += 32) {
        const float v = softcap != 0.0f ? tanhf(s[j] * scale / softcap) * softcap : s[j] * scale;
        s[j] = v;
        mx = v > mx ? v : mx;
      }
      for (int o = 16; o > 0; o >>= 1) {  // a max: the same value in any order
        const float y = PLOW_SHFL_DOWN(mx, o);
        mx = y > mx ? y : mx;
      }
      const float big = PLOW_SHFL0(mx);
      m[i] = big;
      if (big == -INFINITY) {  // warp-uniform: no weight, acc stays 0
        l[i] = 0.0f;
        for (int64_t j = lane; j < n; j += 32) s[j] = 0.0f;
        continue;
      }
      for (int64_t j = lane; j < n; j += 32) s[j] = plow::exp_nonpos(s[j] - big);
      sync();
      float ls = 0.0f;
      if (lane < PLOW_QK_LANES)
        for (int64_t j = lane; j < n; j += PLOW_QK_LANES) ls += s[j];
      for (int o = PLOW_QK_LANES / 2; o > 0; o >>= 1) ls = ls + PLOW_SHFL_DOWN(ls, o);
      l[i] = PLOW_SHFL0(ls);
    }
    sync();
    plow::KvWalk v = vw;  // every lane walks the values in key order
    for (int64_t j = 0; j < n; ++j, v.next())
      for (int64_t i = 0; i < R; ++i) {
        const float w = sc[i * n + j];
        float* a = acc + i * D;
        for (int64_t d = lane; d < D; d += 32) a[d] = a[d] + w * v.at(d);
      }
  }
};
#endif

__device__ int64_t tile_attention_cta(const Ctx& c, const PlowOp& op, const Range* r,
                                      int64_t step, float* scratch, int64_t scratch_floats) {
#if PLOW_LANES == 32
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t rows = r[0].b - r[0].a;
  const int64_t parts = rows < PLOW_WARPS ? rows : PLOW_WARPS;
  if (warp >= parts) return 0;
  const int64_t per = (rows + parts - 1) / parts;
  const int64_t a = r[0].a + warp * per;
  const int64_t b = a + per < r[0].b ? a + per : r[0].b;
  if (a >= b) return 0;
  const Range s[3] = {{a, b}, r[1], r[2]};
  const int64_t work =
      plow::tile_attention(c, op, s, step, scratch + warp * scratch_floats, WarpAttend{lane});
  return lane == 0 ? work : 0;  // counted once per warp
#else
  (void)scratch_floats;
  return threadIdx.x == 0 ? plow::tile_attention(c, op, r, step, scratch) : 0;
#endif
}

// run_record_cta's answer for a record whose op kind has no tile in this build: the step stops
// and reports it (status abort 2) rather than leave the op's words unwritten.
#define PLOW_NO_TILE INT64_MIN

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
      case plow::PLOW_RMSNORM_LM_HEAD:  // R19 (kernels/fused_lm.h): one thread per tile
        if (threadIdx.x == 0) plow::tile_rmsnorm_lm_head(c, op, r, step);
        break;
      case plow::PLOW_EMBEDDING_RMSNORM:  // R18 (kernels/fused_lm.h): one thread per tile
        if (threadIdx.x == 0) plow::tile_embedding_rmsnorm(c, op, r);
        break;
      case PLOW_RMSNORM: tile_rmsnorm_cta(c, op, r, step); break;
      case PLOW_EMBEDDING:
      case PLOW_ROPE:
      case PLOW_GATED_MLP:
      case PLOW_RESIDUAL_ADD:
      case plow::PLOW_ALLREDUCE: tile_elements_cta(c, op, r); break;  // allreduce: tensor parallel
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
      // Kimi-Linear (kernels/kda.h): one thread runs the tile's recurrence (correct, not fast)
      case plow::PLOW_KDA:
        if (threadIdx.x == 0) plow::tile_kda(c, op, r);
        break;
      // fused ops (kernels/fused.h): add_rmsnorm, one warp per row
      case plow::PLOW_ADD_RMSNORM: tile_add_rmsnorm_cta(c, op, r, step); break;
      // the fused linears (kernels/fused.h): the linear's warp dots, then the fused store
      case plow::PLOW_LINEAR_QKV: warp_linear_cta<Fuse::qkv>(c, op, r, step, nullptr, 0); break;
      case plow::PLOW_LINEAR_GLU: tile_linear_glu_cta(c, op, r, step); break;
      default: return PLOW_NO_TILE;  // a kind this build has no tile for: the step stops
    }
  }
  return work;
}


// -- tensor-core linear tiles (bf16 weights; the loader sets PLOW_MODE_TC per op) -----------
// mma.sync m16n8k16 (bf16 inputs, fp32 accumulate) with A = 16 weight rows (output columns) by
// 16 k and B = 16 k by 8 rows of x. Lane (g = lane / 4, t = lane % 4) loads 8 consecutive
// weights of rows n0 + g and n0 + g + 8 (16-byte loads) and 8 consecutive x values of row
// m0 + g: the fragments' k index is a fixed permutation of the physical k (the same on A and
// B, so the sum is the dot product). x is fp32: each value goes in as bf16 hi + bf16 lo
// (x - hi rounded again), two mma per fragment, so x keeps about 16 bits of mantissa; the
// weights are bf16 already. The accumulation order differs from the scalar path's, so the
// bits do too (tests compare with a tolerance).
#define PLOW_MODE_TC 1u

#if defined(PLOW_EMULATE)
struct alignas(16) PlowU4 { uint32_t x, y, z, w; };
struct alignas(16) PlowF4 { float x, y, z, w; };
template <class T> inline T plow_ld16(const T* p) { return *p; }
#else
typedef uint4 PlowU4;  // 16-byte vector loads
typedef float4 PlowF4;
#if defined(__HIPCC__)
template <class T> __device__ inline T plow_ld16(const T* p) { return *p; }
#else
template <class T> __device__ inline T plow_ld16(const T* p) { return __ldg(p); }
#endif
#endif

__device__ inline uint32_t bf16_bits_rn(float f) {  // round to nearest even
  uint32_t u;
  memcpy(&u, &f, 4);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

__device__ inline void split_pair(float a, float b, uint32_t* hi, uint32_t* lo) {
  const uint32_t ha = bf16_bits_rn(a), hb = bf16_bits_rn(b);
  *hi = ha | hb << 16;
  *lo = bf16_bits_rn(a - plow::bf16_to_f32(static_cast<uint16_t>(ha))) |
        bf16_bits_rn(b - plow::bf16_to_f32(static_cast<uint16_t>(hb))) << 16;
}

#if !defined(__HIPCC__)
__device__ inline void mma_bf16_16816(float* d, const uint32_t* a, const uint32_t* b) {
#if defined(PLOW_EMULATE)
  plow_emu::mma_bf16(d, a, b);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// 32 physical k: weights P (row n0 + g), Q (row n0 + g + 8), x values xv[0..8) of row m0 + g.
__device__ inline void mma_block32(float* d, const PlowU4& P, const PlowU4& Q, const float* xv) {
  uint32_t hi[4], lo[4];
  for (int j = 0; j < 4; ++j) split_pair(xv[2 * j], xv[2 * j + 1], &hi[j], &lo[j]);
  const uint32_t a0[4] = {P.x, Q.x, P.y, Q.y}, a1[4] = {P.z, Q.z, P.w, Q.w};
  const uint32_t bh0[2] = {hi[0], hi[1]}, bl0[2] = {lo[0], lo[1]};
  const uint32_t bh1[2] = {hi[2], hi[3]}, bl1[2] = {lo[2], lo[3]};
  mma_bf16_16816(d, a0, bh0);
  mma_bf16_16816(d, a0, bl0);
  mma_bf16_16816(d, a1, bh1);
  mma_bf16_16816(d, a1, bl1);
}
#endif

// The tile on tensor cores; false (nothing written) when its shape or alignment does not suit
// the 16-byte fragment loads, and the scalar path runs it instead. linear_qkv stores row n's
// dot as store_row_dot does; linear_glu's weight rows 2n (gate) and 2n + 1 (up) land in lanes
// g and g + 1 of a fragment (lanes 4 apart): the up value moves down to the gate's lane, which
// writes act(gate) * up to output column n.
template <Fuse F>
__device__ bool tile_linear_tc(const Ctx& c, const PlowOp& op, const Range* r, int64_t step,
                               const float* xs, int64_t ldx, const WView* ws = nullptr) {
#if defined(__HIPCC__) || PLOW_LANES != 32
  (void)c, (void)op, (void)r, (void)step, (void)xs, (void)ldx, (void)ws;
  return false;  // the HIP loader marks no op for tensor cores
#else
  const int64_t N = op.d[1], K = op.d[2];
  (void)N;  // linear_glu's output width (its partial's rows: 2N)
  const int64_t k0 = r[2].a, kn = r[2].b - r[2].a;
  const WView wv = weights_of(op, r, ws);
  if (xs == nullptr) xs = c.A + op.t[0] + r[0].a * K + k0, ldx = K;
  if (op.w0_dtype != PLOW_BF16 || K % 8 != 0 || k0 % 8 != 0 || ldx % 4 != 0 ||
      wv.ld % 8 != 0 || wv.k0 % 8 != 0 || (reinterpret_cast<uintptr_t>(wv.w) & 15u) != 0 ||
      (reinterpret_cast<uintptr_t>(xs) & 15u) != 0)
    return false;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const uint16_t* W = static_cast<const uint16_t*>(wv.w);
  const bool paged = ws != nullptr;
  const int64_t kfull = kn - kn % 32;
  const PlowU4 zero{0u, 0u, 0u, 0u};
  const int64_t ra = F == Fuse::glu ? 2 * r[1].a : r[1].a, rb = F == Fuse::glu ? 2 * r[1].b : r[1].b;
  for (int64_t n0 = ra + 16 * warp; n0 < rb; n0 += 16 * PLOW_WARPS) {
    const int64_t na = n0 + g, nb = n0 + g + 8;
    const bool va = na < rb, vb = nb < rb;
    const uint16_t* wa = va ? W + wv.at(na) + 8 * t : W;
    const uint16_t* wb = vb ? W + wv.at(nb) + 8 * t : W;
    for (int64_t m0 = r[0].a; m0 < r[0].b; m0 += 8) {
      const bool vm = m0 + g < r[0].b;
      const float* xr = xs + (vm ? (m0 + g - r[0].a) * ldx : 0) + 8 * t;
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      PLOW_UNROLL(unroll 2)
      for (int64_t kb = 0; kb < kfull; kb += 32) {
        // from the weight pages: plain shared loads (ld.global.nc is for global memory only)
        const PlowU4* pa4 = reinterpret_cast<const PlowU4*>(wa + kb);
        const PlowU4* qb4 = reinterpret_cast<const PlowU4*>(wb + kb);
        const PlowU4 P = va ? (paged ? *pa4 : plow_ld16(pa4)) : zero;
        const PlowU4 Q = vb ? (paged ? *qb4 : plow_ld16(qb4)) : zero;
        float xv[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (vm) {
          const PlowF4 x0 = *reinterpret_cast<const PlowF4*>(xr + kb);
          const PlowF4 x1 = *reinterpret_cast<const PlowF4*>(xr + kb + 4);
          xv[0] = x0.x, xv[1] = x0.y, xv[2] = x0.z, xv[3] = x0.w;
          xv[4] = x1.x, xv[5] = x1.y, xv[6] = x1.z, xv[7] = x1.w;
        }
        mma_block32(d, P, Q, xv);
      }
      if (kfull < kn) {  // the tail: element loads, zeros past the end
        uint16_t pa[8], qa[8];
        float xv[8];
        for (int e = 0; e < 8; ++e) {
          const int64_t k = kfull + 8 * t + e;
          const bool in = k < kn;
          pa[e] = in && va ? wa[kfull + e] : 0;
          qa[e] = in && vb ? wb[kfull + e] : 0;
          xv[e] = in && vm ? xr[kfull + e] : 0.0f;
        }
        PlowU4 P, Q;
        memcpy(&P, pa, 16);
        memcpy(&Q, qa, 16);
        mma_block32(d, P, Q, xv);
      }
      if (F == Fuse::glu && step >= 0) {  // split k: gate and up rows into the partial
        for (int i = 0; i < 4; ++i) {
          const int64_t n = n0 + g + (i >= 2 ? 8 : 0), m = m0 + 2 * t + (i & 1);
          if (n < rb && m < r[0].b) c.A[op.t[2] + (step * op.d[0] + m) * 2 * N + n] = d[i];
        }
      } else if constexpr (F == Fuse::glu) {
        float up[4];
        for (int i = 0; i < 4; ++i) up[i] = PLOW_SHFL_DOWN(d[i], 4);  // every lane: uniform
        for (int i = 0; i < 4; ++i) {
          const int64_t n = n0 + g + (i >= 2 ? 8 : 0), m = m0 + 2 * t + (i & 1);
          if ((g & 1) == 0 && n < rb && m < r[0].b)
            c.A[op.t[1] + m * N + n / 2] = plow::act_fn(d[i], op.d[3]) * up[i];
        }
      } else {
        for (int i = 0; i < 4; ++i) {
          const int64_t n = n0 + g + (i >= 2 ? 8 : 0), m = m0 + 2 * t + (i & 1);
          if (n < rb && m < r[0].b) store_row_dot<F>(c, op, step, m, n, d[i]);
        }
      }
    }
  }
  if (F == Fuse::none && step < 0 && is_fused_lm(c, op)) {
    __syncthreads();
    if (threadIdx.x == 0) plow::argmax_chunks(c, op, r[0].a, r[0].b, r[1].a, r[1].b);
  }
  return true;
#endif
}

// -- on-chip pages: each task's activation window in the CTA's dynamic shared memory --------
// The loader assigns every task record its pages from the plan's page timeline (the schedule
// file's `pages`: act_pages over [start, finish), weight_pages over [load, finish); windows
// live at once on one worker get disjoint pages) and passes (byte offset, bytes) of the
// activation window per record. A linear tile's input rows are staged there when they fit
// (every warp then reads x from shared memory), attention's per-thread scratch lives there
// when it fits; otherwise the arena path runs. The weight window (the slab) holds the tile's
// weights when they fit it (fill_weight_tile below); LOAD records stay no-ops.
struct StageKey { int64_t a = -1, b = -1, k0 = -1, kn = -1; };

__device__ const float* stage_x(const Ctx& c, const PlowOp& op, const Range* r, float* act,
                                int64_t act_floats, StageKey* key) {
  const int64_t K = op.d[2], k0 = r[2].a, kn = r[2].b - r[2].a, rows = r[0].b - r[0].a;
  if (rows * kn > act_floats || kn % 4 != 0) return nullptr;
  if (key->a == r[0].a && key->b == r[0].b && key->k0 == k0 && key->kn == kn) return act;
  __syncthreads();  // the previous unit's readers are done with the pages
  const float* x = c.A + op.t[0];
  for (int64_t e = threadIdx.x; e < rows * kn; e += blockDim.x)
    act[e] = x[(r[0].a + e / kn) * K + k0 + e % kn];
  __syncthreads();
  *key = StageKey{r[0].a, r[0].b, k0, kn};
  return act;
}

// -- weight pages: each linear tile's weights copied into its task's weight window ---------
// The page table's words per record (plow/runtime/cuda/image.py PageTable.device_table).
#define PLOW_PAGE_WORDS 8
// 0 activation window offset, 1 its bytes, 2 the record whose first weight tile this record
// loads ahead (its hoisted load; -1: none), 3 nonzero: the record before this one loaded this
// record's first weight tile, 4 weight window offset, 5 its bytes.

// The weight tile of linear-kind tile `r`: weight rows row0 .. row0 + rows (linear_glu: both
// interleaved rows of each output column), k r[2]; false where the window (`wbytes`) does not
// hold it, or the op has no weights the fill copies (GGML blocks, other kinds).
struct WTile { int64_t row0, rows, k0, kn, eb; };

__device__ inline bool weight_tile(const PlowOp& op, const Range* r, int64_t wbytes, WTile* t) {
  const bool glu = op.kind == plow::PLOW_LINEAR_GLU;
  if ((op.kind != PLOW_LINEAR && op.kind != PLOW_LM_HEAD && op.kind != plow::PLOW_LINEAR_QKV &&
       !glu) ||
      op.w0 == nullptr)
    return false;
  const int64_t eb = op.w0_dtype == PLOW_BF16 ? 2 : op.w0_dtype == PLOW_F32 ? 4 : 0;
  t->row0 = glu ? 2 * r[1].a : r[1].a;
  t->rows = (glu ? 2 : 1) * (r[1].b - r[1].a);
  t->k0 = r[2].a;
  t->kn = r[2].b - r[2].a;
  t->eb = eb;
  return eb != 0 && t->rows > 0 && t->kn > 0 && t->rows * t->kn * eb <= wbytes;
}

#if !defined(PLOW_EMULATE) && !defined(__HIPCC__) && defined(__CUDA_ARCH__) && \
    __CUDA_ARCH__ >= 800
#define PLOW_CP_ASYNC 1
#endif

// Copies weight tile `t` to `dst` (its rows back to back, kn elements each), spread over the
// CTA (every thread calls it). `async`: cp.async (sm_80+, 16-byte pieces, one commit group;
// the reader runs weight_fill_wait before its barrier), else plain loads; 16-byte pieces where
// the rows' bytes and the addresses allow, else element by element.
__device__ void copy_weight_tile(const PlowOp& op, const WTile& t, unsigned char* dst,
                                 bool async) {
  const int64_t K = op.d[2], rb = t.kn * t.eb;
  const unsigned char* src = static_cast<const unsigned char*>(op.w0);
#if !defined(PLOW_CP_ASYNC)
  (void)async;  // plain loads only (emulation, HIP, before sm_80)
#endif
  const bool v16 = (K * t.eb) % 16 == 0 && (t.k0 * t.eb) % 16 == 0 && rb % 16 == 0 &&
                   (reinterpret_cast<uintptr_t>(src) & 15u) == 0 &&
                   (reinterpret_cast<uintptr_t>(dst) & 15u) == 0;
  if (v16) {
    const int64_t per = rb / 16, n = t.rows * per;
    for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
      const int64_t row = e / per, piece = e % per;
      const unsigned char* s = src + ((t.row0 + row) * K + t.k0) * t.eb + 16 * piece;
      unsigned char* d = dst + row * rb + 16 * piece;
#if defined(PLOW_CP_ASYNC)
      if (async) {
        const unsigned sd = static_cast<unsigned>(__cvta_generic_to_shared(d));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sd), "l"(s) : "memory");
        continue;
      }
#endif
      *reinterpret_cast<PlowU4*>(d) = plow_ld16(reinterpret_cast<const PlowU4*>(s));
    }
#if defined(PLOW_CP_ASYNC)
    if (async) asm volatile("cp.async.commit_group;" ::: "memory");
#endif
    return;
  }
  const int64_t n = t.rows * t.kn;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    const int64_t row = e / t.kn, j = e % t.kn, from = (t.row0 + row) * K + t.k0 + j;
    if (t.eb == 2)
      reinterpret_cast<uint16_t*>(dst)[e] = static_cast<const uint16_t*>(op.w0)[from];
    else
      reinterpret_cast<float*>(dst)[e] = static_cast<const float*>(op.w0)[from];
  }
}

// This thread's cp.async copies have landed (the barrier after it makes every thread's seen).
__device__ inline void weight_fill_wait() {
#if defined(PLOW_CP_ASYNC)
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// The hoisted load of record `idx` (the next task on this CTA's queue): its first tile's
// weights into its weight window, issued as the record before it starts (cp.async on sm_80+,
// so the copy overlaps this record's work; the window is disjoint from every window live
// meanwhile, image.assign_pages). The record's run waits for it (page word 3) instead of
// copying; the conditions here and there are the same, so a tile is filled exactly once.
__device__ void fill_hoisted(const Ctx& c, int64_t idx, const int32_t* pages,
                             unsigned char* smem) {
  const int32_t* hp = pages + PLOW_PAGE_WORDS * idx;
  if (hp[3] == 0 || hp[5] <= 0) return;
  const plow::Record rec = plow::decode_record(c.plan->records + idx * PLOW_RECORD_SIZE);
  if (rec.opcode == PLOW_OP_NOP || rec.opcode == PLOW_OP_LOAD ||
      (rec.flags & PLOW_FLAG_ACCUMULATE) != 0 || rec.rows == 0)
    return;
  const PlowOp& op = c.plan->ops[rec.op_index];
  Range r[3];
  int64_t step;
  plow::tile_ranges(op, rec.row_start, r, &step);
  WTile t;
  if (weight_tile(op, r, hp[5], &t)) copy_weight_tile(op, t, smem + hp[4], true);
}

// Tile k of a record with a weight window: its weights in the window (the hoisted copy for
// tile 0 where page word 3 says so, else copied now), and the view the tile reads them by;
// false (nothing done) where the window does not hold the tile.
__device__ bool fill_weight_tile(const PlowOp& op, const Range* r, uint32_t k,
                                 unsigned char* smem, const int32_t* page, WView* wv) {
  WTile t;
  if (page == nullptr || page[5] <= 0 || !weight_tile(op, r, page[5], &t)) return false;
  unsigned char* dst = smem + page[4];
  if (k == 0 && page[3] != 0) {  // loaded ahead by the record before (weight_fill_wait done)
    __syncthreads();
  } else {
    __syncthreads();  // the previous tile's readers are done with the window
    copy_weight_tile(op, t, dst, false);
    __syncthreads();
  }
  *wv = WView{dst, t.kn, t.row0, 0};
  return true;
}

// A hoisted weight load (the plan's page timeline opens a task's weight window at the start of
// the task before it on the queue): while this record runs, the next one's weight rows are
// prefetched into L2 (`prefetch.global.L2`, one per 128-byte line, spread over the CTA), so
// its loads find them there. Weights of linear / lm_head / linear_qkv / linear_glu in fp32 or
// bf16; nothing elsewhere, and nothing on HIP or in the emulation (a prefetch changes no value).
__device__ void prefetch_weights(const Ctx& c, int64_t idx) {
#if defined(PLOW_EMULATE) || defined(__HIPCC__)
  (void)c, (void)idx;
#else
  const plow::Record rec = plow::decode_record(c.plan->records + idx * PLOW_RECORD_SIZE);
  if (rec.opcode == PLOW_OP_NOP || rec.opcode == PLOW_OP_LOAD ||
      (rec.flags & PLOW_FLAG_ACCUMULATE) != 0)
    return;
  const PlowOp& op = c.plan->ops[rec.op_index];
  const bool glu = op.kind == plow::PLOW_LINEAR_GLU;  // two weight rows per output column
  if ((op.kind != PLOW_LINEAR && op.kind != PLOW_LM_HEAD && op.kind != plow::PLOW_LINEAR_QKV &&
       !glu) ||
      op.w0 == nullptr)
    return;
  const int64_t eb = op.w0_dtype == PLOW_BF16 ? 2 : op.w0_dtype == PLOW_F32 ? 4 : 0;
  if (eb == 0) return;
  const int64_t K = op.d[2];
  const char* w = static_cast<const char*>(op.w0);
  Range r[3];
  int64_t step;
  for (uint32_t k = 0; k < rec.rows; ++k) {
    plow::tile_ranges(op, rec.row_start + k, r, &step);
    const int64_t first = r[2].a * eb, bytes = (r[2].b - r[2].a) * eb;
    const int64_t row0 = glu ? 2 * r[1].a : r[1].a, rows = (glu ? 2 : 1) * (r[1].b - r[1].a);
    const int64_t lines = (bytes + 127) / 128, n = rows * lines;
    for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
      const char* at = w + (row0 + e / lines) * K * eb + first + (e % lines) * 128;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
    }
  }
#endif
}

// A task record with the device's extras (tensor cores, shared-memory pages), else
// run_record_cta. `page`: the record's activation window {byte offset, bytes}, or nullptr.
// The records with the device's extras; false (nothing done) for every other record.
__device__ bool run_record_extras(const Ctx& c, const plow::Record& rec, int64_t scratch_floats,
                                  unsigned mode, unsigned char* smem, const int32_t* page,
                                  int64_t* work) {
  if (rec.opcode == PLOW_OP_NOP || rec.opcode == PLOW_OP_LOAD ||
      (rec.flags & PLOW_FLAG_ACCUMULATE) != 0)
    return false;
  const PlowOp& op = c.plan->ops[rec.op_index];
  float* act = page != nullptr && page[1] > 0 ? reinterpret_cast<float*>(smem + page[0])
                                              : nullptr;
  const int64_t act_floats = act != nullptr ? page[1] / 4 : 0;
  const bool tc = (mode & PLOW_MODE_TC) != 0;
  Range r[3];
  int64_t step;
  const bool linear = op.kind == PLOW_LINEAR || op.kind == PLOW_LM_HEAD;
  const bool qkv = op.kind == plow::PLOW_LINEAR_QKV, glu = op.kind == plow::PLOW_LINEAR_GLU;
  const bool wpages = page != nullptr && page[5] > 0;
  if ((linear || qkv || glu) && (act != nullptr || tc || wpages)) {
    StageKey key;
    for (uint32_t k = 0; k < rec.rows; ++k) {
      plow::tile_ranges(op, rec.row_start + k, r, &step);
      const float* xs = act != nullptr ? stage_x(c, op, r, act, act_floats, &key) : nullptr;
      const int64_t ldx = xs != nullptr ? r[2].b - r[2].a : 0;
      WView wv;
      const WView* ws = wpages && fill_weight_tile(op, r, k, smem, page, &wv) ? &wv : nullptr;
      if (glu) {
        if (!(tc && tile_linear_tc<Fuse::glu>(c, op, r, step, xs, ldx, ws)))
          tile_linear_glu_cta(c, op, r, step, xs, ldx, ws);
      } else if (qkv) {
        if (!(tc && tile_linear_tc<Fuse::qkv>(c, op, r, step, xs, ldx, ws)))
          warp_linear_cta<Fuse::qkv>(c, op, r, step, xs, ldx, ws);
      } else if (!(tc && tile_linear_tc<Fuse::none>(c, op, r, step, xs, ldx, ws))) {
        tile_linear_cta(c, op, r, step, xs, ldx, ws);
      }
    }
    *work = 0;
    return true;
  }
  if (op.kind == PLOW_ATTENTION && act != nullptr &&
      PLOW_WARPS * scratch_floats <= act_floats) {
    *work = 0;
    for (uint32_t k = 0; k < rec.rows; ++k) {
      plow::tile_ranges(op, rec.row_start + k, r, &step);
      *work += tile_attention_cta(c, op, r, step, act, scratch_floats);
    }
    return true;
  }
  return false;
}

// A task record with the device's extras (tensor cores, shared-memory pages), else
// run_record_cta (one call site, so the compiler may inline it as before).
// `page`: the record's activation window {byte offset, bytes}, or nullptr.
__device__ int64_t run_record_dev(const Ctx& c, const plow::Record& rec, float* scratch,
                                  int64_t scratch_floats, unsigned mode, unsigned char* smem,
                                  const int32_t* page) {
  int64_t work = 0;
  if (run_record_extras(c, rec, scratch_floats, mode, smem, page, &work)) return work;
  return run_record_cta(c, rec, scratch, scratch_floats);
}

}  // namespace plow_dev

// A multi-step quantum in one launch (plow/runtime/cuda/abi.py DeviceQuantum): the epilogue's
// arena words and the bucket's shape (plow_abi.h's PlowQuantum, absolute arena words), each
// batch row (PlowRow: active, greedy, the sampling filters, stop ids, a stochastic row's
// uniforms: one per step), the step barrier's two counters, zeroed by the loader before the
// launch: `arrive` (CTAs done with a step) and `go` (steps whose epilogue ran), and the
// stochastic rows' sampler scratch (kernels/device_sampler.h; unused when every row is greedy).
struct PlowDeviceQuantum {
  PlowQuantum q;
  const PlowRow* rows;
  unsigned long long arrive;
  unsigned long long go;
  unsigned char* sampler;
};

#define PLOW_BARRIER_COUNTER 0xFFFFFFFEu  // status->counter of a timed-out step barrier

namespace plow_dev {

// Thread 0: wait until *ctr >= want (acquire at `scope`); false when the step must stop (this
// wait timed out — the first to do so records where in the status word — or another CTA's did).
__device__ bool wait_at_least(unsigned long long* ctr, uint32_t scope, unsigned long long want,
                              PlowDeviceStatus* status, unsigned w, long long packet,
                              uint32_t counter, unsigned long long timeout_ns) {
  unsigned long long seen = counter_load(ctr, scope);
  if (seen >= want) return true;
  const unsigned long long t0 = global_ns();
  unsigned int spins = 0;
  while ((seen = counter_load(ctr, scope)) < want) {
    if (++spins < 64) continue;
    PLOW_SLEEP();
    if ((spins & 63) != 0) continue;
    if (abort_seen(&status->abort) != 0) return false;
    if (global_ns() - t0 > timeout_ns) {
      if (atomicCAS(&status->abort, 0u, 1u) == 0u) {
        status->worker = w;
        status->packet = packet;
        status->counter = counter;
        status->scope = scope;
        status->value = seen;
        status->want = want;
        __threadfence_system();
      }
      return false;
    }
  }
  return true;
}

// The stochastic rows' draws of step i, by every thread of the CTA: each live row with
// greedy == 0 samples its logits row with its uniform for step i and writes the token into the
// ids slot, over the packets' argmax (host.cpp's plow_plan_quantum does the same on the host).
__device__ void quantum_sample(float* arena, const PlowDeviceQuantum* dq, int64_t i) {
  const PlowQuantum& q = dq->q;
  int32_t* out = plow::I32(arena, q.out);
  const int32_t* pos = plow::I32(arena, q.positions);
  const int32_t* sidx = plow::I32(arena, q.sample_index);
  const int32_t* rem = plow::I32(arena, q.remaining);
  const int64_t B = q.batch, T = q.tokens, V = q.vocab;
  SamplerScratch sc = sampler_carve(dq->sampler, V, blockDim.x);
  for (int64_t b = 0; b < B; ++b) {
    const PlowRow& r = dq->rows[b];
    if (!r.active || r.greedy || pos[b * T] < 0 || rem[b] <= 0) continue;
    const int32_t tok =
        sample_row_cta(arena + q.logits + (b * T + sidx[b]) * V, V, r, r.uniforms[i], sc);
    if (threadIdx.x == 0) out[b] = tok;
    __syncthreads();
  }
}

// The end of step i of a quantum (host.cpp's plow_plan_quantum; a stochastic row's token was
// drawn by quantum_sample just before): the token (in the ids slot, where the next step's
// embedding reads it) goes to ring[i, b], the budget shrinks, the position advances or the
// row retires at its budget, a stop id or the context end.
__device__ void quantum_epilogue(float* arena, const PlowDeviceQuantum* dq, int64_t i) {
  const PlowQuantum& q = dq->q;
  int32_t* out = plow::I32(arena, q.out);
  int32_t* pos = plow::I32(arena, q.positions);
  int32_t* ring = plow::I32(arena, q.ring);
  int32_t* rem = plow::I32(arena, q.remaining);
  const int64_t B = q.batch, T = q.tokens;
  for (int64_t b = 0; b < B; ++b) {
    const PlowRow& r = dq->rows[b];
    if (!r.active || pos[b * T] < 0 || rem[b] <= 0) {
      ring[i * B + b] = -1;
      if (T == 1) pos[b * T] = -1;
      continue;
    }
    const int32_t tok = out[b];
    ring[i * B + b] = tok;
    rem[b] -= 1;
    if (T == 1) {
      const int64_t p = pos[b * T] + 1;
      bool stop = rem[b] == 0 || p >= q.context;
      for (int32_t k = 0; k < r.n_stop && !stop; ++k) stop = r.stop[k] == tok;
      pos[b * T] = stop ? -1 : static_cast<int32_t>(p);
    }
  }
}

}  // namespace plow_dev

// `n_steps` decode steps: CTA w runs worker w's queue, records queue[queue_start[w] ..
// queue_start[w+1]), once per step.
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
//   step            the launch's first step number (1, 2, ...): a record of step s waits for
//                   per_step[c] * (s - 1) + threshold
//   timeout_ns      a wait that does not open within this long stops the step
//   jitter_ns       0, or: thread 0 sleeps a pseudo-random 0..jitter_ns before every task record
//                   (tests: it widens the window a lowered threshold leaves open)
//   op_mode         nullptr, or one byte per op: PLOW_MODE_TC (bf16 linear on tensor cores)
//   pages           nullptr, or per record PLOW_PAGE_WORDS int32: {byte offset, bytes} of its
//                   activation window in the dynamic shared memory (bytes 0: none), the record
//                   whose first weight tile it loads ahead (its hoisted load; -1: none),
//                   whether the record before loaded this one's, {byte offset, bytes} of its
//                   weight window, 0, 0; the launch's dynamic shared memory is the plan's
//                   page budget
//   quantum         nullptr (n_steps must be 1), or the quantum's epilogue and step barrier:
//                   after each step every CTA arrives, CTA 0 runs the epilogue, the others
//                   wait for it before the next step (its embedding reads the sampled ids)
//   n_steps         steps in this launch (1 .. the plan's ring)
extern "C" __global__ void __launch_bounds__(PLOW_BLOCK_THREADS, 1)
plow_step(const PlowPlan* plan, float* arena, unsigned long long* counters,
          const unsigned long long* per_step, const unsigned char* counter_scope,
          const int32_t* queue, const int64_t* queue_start,
          float* scratch, int64_t scratch_floats, unsigned long long* op_work,
          PlowDeviceStatus* status, unsigned long long step, unsigned long long timeout_ns,
          unsigned int jitter_ns, const unsigned char* op_mode, const int32_t* pages,
          PlowDeviceQuantum* quantum, unsigned int n_steps) {
  PLOW_SHARED_ABORT;
  PLOW_DYN_SMEM(smem);
  const unsigned w = blockIdx.x;
  const plow::Ctx ctx{arena, plan};
  float* my_scratch = scratch + static_cast<int64_t>(w) * PLOW_ATTN_THREADS * scratch_floats;
  const int64_t q0 = queue_start[w], q1 = queue_start[w + 1];
  const unsigned long long n_workers = static_cast<unsigned long long>(plan->n_workers);
  unsigned long long tasks = 0, nops = 0;
  unsigned int rng = 0x9e3779b9u * (w + 1) ^ static_cast<unsigned int>(step);
  int stopped = 0;
  for (unsigned int i = 0; i < n_steps && !stopped; ++i) {
    const unsigned long long s = step + i;
    for (int64_t qi = q0; qi < q1; ++qi) {
      const int64_t idx = queue[qi];
      const plow::Record rec = plow::decode_record(plan->records + idx * PLOW_RECORD_SIZE);
      if (threadIdx.x == 0) {
        int abort = 0;
        if (rec.wait_counter != PLOW_NO_COUNTER) {
          const uint32_t c = rec.wait_counter;
          const unsigned long long want = per_step[c] * (s - 1) + rec.wait_threshold;
          abort = !plow_dev::wait_at_least(counters + c, counter_scope[c], want, status, w, idx,
                                           c, timeout_ns);
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
      if (s_abort) {
        stopped = 1;
        break;
      }
      const unsigned mode = op_mode != nullptr && rec.opcode != PLOW_OP_NOP
                                ? op_mode[rec.op_index] : 0u;  // NOP records name no op
      const int32_t* page = pages != nullptr ? pages + PLOW_PAGE_WORDS * idx : nullptr;
      // this record's first weight tile, loaded ahead by the record before, has landed (before
      // the next record's copies are issued, so waiting for all of them waits for this one)
      if (page != nullptr && page[3] != 0) plow_dev::weight_fill_wait();
      if (page != nullptr && page[2] >= 0) {
        plow_dev::prefetch_weights(ctx, page[2]);
        plow_dev::fill_hoisted(ctx, page[2], pages, smem);
      }
      const int64_t work =
          plow_dev::run_record_dev(ctx, rec, my_scratch, scratch_floats, mode, smem, page);
      if (work == PLOW_NO_TILE) {  // uniform: every thread saw the same kind
        if (threadIdx.x == 0 && atomicCAS(&status->abort, 0u, 2u) == 0u) {
          status->worker = w;
          status->packet = idx;
          status->counter = static_cast<unsigned int>(plan->ops[rec.op_index].kind);
        }
        stopped = 1;
        break;
      }
      if (work != 0) atomicAdd(op_work + rec.op_index, static_cast<unsigned long long>(work));
      __syncthreads();  // every thread's writes of this record before its signal
      if (threadIdx.x == 0) {
        if (rec.signal_counter != PLOW_NO_COUNTER)
          plow_dev::counter_signal(counters + rec.signal_counter, rec.scope);
        if (rec.opcode == PLOW_OP_NOP) ++nops; else ++tasks;
      }
    }
    if (stopped || quantum == nullptr) break;
    // the step barrier: every CTA's writes of step i, then CTA 0's epilogue (its stochastic
    // rows' draws by the whole CTA, then the bookkeeping), then step i + 1
    if (threadIdx.x == 0) {
      int abort = 0;
      plow_dev::counter_signal(&quantum->arrive, 1);
      if (w == 0) {
        abort = !plow_dev::wait_at_least(&quantum->arrive, 1, n_workers * (i + 1), status, w, -1,
                                         PLOW_BARRIER_COUNTER, timeout_ns);
      } else if (i + 1 < n_steps) {
        abort = !plow_dev::wait_at_least(&quantum->go, 1, i + 1, status, w, -1,
                                         PLOW_BARRIER_COUNTER, timeout_ns);
      }
      s_abort = abort;
    }
    __syncthreads();
    const int barrier_abort = s_abort;
    __syncthreads();  // every thread has read s_abort before thread 0 writes it again
    if (w == 0 && !barrier_abort) {
      plow_dev::quantum_sample(arena, quantum, i);
      if (threadIdx.x == 0) {
        plow_dev::quantum_epilogue(arena, quantum, i);
        plow_dev::counter_signal(&quantum->go, 1);
      }
    }
    if (barrier_abort) stopped = 1;
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
            *static_cast<unsigned long long*>(a[12]), *static_cast<unsigned int*>(a[13]),
            static_cast<const unsigned char*>(arg(14)), static_cast<const int32_t*>(arg(15)),
            static_cast<PlowDeviceQuantum*>(arg(16)), *static_cast<unsigned int*>(a[17]));
}

[[noreturn]] void fiber_entry() {
  fiber_main();
  Fiber* f = block->cur;
  f->done = true;
  plow_emu_switch(&f->sp, block->sched);
  __builtin_unreachable();
}

void run_cta(unsigned b, unsigned threads, size_t shmem, void** a, int* failed) {
  Block blk;
  blk.smem.reset(new unsigned char[shmem + 16]());
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
// fibers — with `shmem` bytes of dynamic shared memory each, running plow_step with the
// parameters of a cuLaunchKernel `void*[]` (plow/runtime/cuda/abi.py's PARAMS order). Returns
// 0; -1 when `block` is not this build's PLOW_BLOCK_THREADS; -2 on a barrier divergence
// (reported on stderr).
extern "C" int plow_emu_launch(unsigned grid, unsigned block, unsigned shmem, void** a) {
  if (block != PLOW_BLOCK_THREADS || block % 32 != 0) return -1;
  blockDim.x = block;
  std::vector<int> failed(grid, 0);
  std::vector<std::thread> threads;
  for (unsigned b = 0; b < grid; ++b)
    threads.emplace_back([&, b] { plow_emu::run_cta(b, block, shmem, a, &failed[b]); });
  for (auto& th : threads) th.join();
  for (int f : failed)
    if (f) return -2;
  return 0;
}
#endif
