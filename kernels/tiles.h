// plow native kernel — tile kernels: what one task packet computes.
//
// Each function computes exactly the output region of one unit (a tile, or a merge unit of a
// split reduction) from the words it reads, in a fixed order: a result never depends on which
// worker or thread ran it, or on what ran before it, so a step is bitwise identical for every
// thread count and every interleaving the counters allow. The semantics are the numpy CPU
// executor's (plow/runtime/cpu/kernels.py, itself HF-faithful); the layout conventions are
// restated there (attention rows ordered ((b*kv_heads + kv)*T + t)*group + g; split
// reductions write fp32 partials at their step; merges reduce steps in ascending order).
//
// Reductions use 32 explicit lanes, an explicit fused multiply-add per element and a fixed
// tree; nothing else is contracted (-ffp-contract=off), so the AVX-512, AVX2+FMA and portable
// builds of the same source give the same bits (fmaf is exactly rounded everywhere).
#ifndef PLOW_TILES_H
#define PLOW_TILES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "plow_abi.h"

#ifndef PLOW_HD
#define PLOW_HD
#endif
#ifndef PLOW_SIMD
#define PLOW_SIMD PLOW_HD  // a device build defines PLOW_HD only: the SIMD helpers follow it
#endif
#ifndef PLOW_INLINE
// Helpers of a PLOW_SIMD function: inlined, so they are compiled for each of its clones.
#define PLOW_INLINE inline __attribute__((always_inline))
#endif

namespace plow {

struct Ctx {
  float* A;             // the arena (4-byte words)
  const PlowPlan* plan;
};

struct Range { int64_t a, b; };

PLOW_HD static inline int32_t* I32(float* A, int64_t off) {
  return reinterpret_cast<int32_t*>(A + off);
}

PLOW_HD static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// 32 lanes (two AVX-512 / four AVX2 registers in flight), summed by a fixed tree.
#define PLOW_LANES 32
static_assert(PLOW_LANES == 32, "a quantization block (32 weights) is one pass of the lanes");

PLOW_HD static inline float lanes_sum(float* acc) {
  for (int s = PLOW_LANES / 2; s > 0; s >>= 1)
    for (int l = 0; l < s; ++l) acc[l] += acc[l + s];
  return acc[0];
}

}  // namespace plow
#include "blocks.h"
namespace plow {

PLOW_HD static inline float weight_at(const void* w, int32_t dt, int64_t i) {
  if (dt == PLOW_BF16) return bf16_to_f32(static_cast<const uint16_t*>(w)[i]);
  if (is_blocked(dt)) return block_weight(static_cast<const uint8_t*>(w), dt, i);
  return static_cast<const float*>(w)[i];
}

PLOW_HD static inline float bf16_lane(const uint16_t* w, int64_t i) {
  uint32_t u = static_cast<uint32_t>(w[i]) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// dot(x, w) over n elements; lane l sums elements l, l + 32, ... in order.
PLOW_SIMD static float dot_f32(const float* x, const float* w, int64_t n) {
  float acc[PLOW_LANES] = {0};
  int64_t k = 0;
  for (; k + PLOW_LANES <= n; k += PLOW_LANES)
    for (int l = 0; l < PLOW_LANES; ++l) acc[l] = fmaf(x[k + l], w[k + l], acc[l]);
  for (int l = 0; k + l < n; ++l) acc[l] = fmaf(x[k + l], w[k + l], acc[l]);
  return lanes_sum(acc);
}

PLOW_SIMD static float dot_bf16(const float* x, const uint16_t* w, int64_t n) {
  float acc[PLOW_LANES] = {0};
  int64_t k = 0;
  for (; k + PLOW_LANES <= n; k += PLOW_LANES)
    for (int l = 0; l < PLOW_LANES; ++l) acc[l] = fmaf(x[k + l], bf16_lane(w, k + l), acc[l]);
  for (int l = 0; k + l < n; ++l) acc[l] = fmaf(x[k + l], bf16_lane(w, k + l), acc[l]);
  return lanes_sum(acc);
}

// Four rows of x against one weight row: each result has exactly dot_f32's order (a row's bits
// do not depend on which rows share its tile); the weight row is loaded once for all four.
// The 32 lanes go in two passes of 16 (lanes 0-15 over the whole row, then 16-31): each lane
// still sums its elements in order, so the bits are dot_f32's, but four rows of 16 lanes fit
// the 16 AVX2 registers where four of 32 spilled every accumulator on every element. Each
// pass reads its own half of every 128-byte run of the weights: a line is fetched once.
#define PLOW_HALF (PLOW_LANES / 2)
struct F32Row {
  const float* w;
  PLOW_HD float operator()(int64_t e) const { return w[e]; }
};
struct Bf16Row {
  const uint16_t* w;
  PLOW_HD float operator()(int64_t e) const { return bf16_lane(w, e); }
};

template <class Row>
PLOW_HD PLOW_INLINE void dot4_halves(const float* x, int64_t ldx, Row w, int64_t n, float* y) {
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
  float a0[PLOW_LANES], a1[PLOW_LANES], a2[PLOW_LANES], a3[PLOW_LANES];
  for (int h = 0; h < PLOW_LANES; h += PLOW_HALF) {
    float b0[PLOW_HALF] = {0}, b1[PLOW_HALF] = {0}, b2[PLOW_HALF] = {0}, b3[PLOW_HALF] = {0};
    int64_t k = 0;
    for (; k + PLOW_LANES <= n; k += PLOW_LANES)
      for (int l = 0; l < PLOW_HALF; ++l) {
        const int64_t e = k + h + l;
        const float wv = w(e);
        b0[l] = fmaf(x0[e], wv, b0[l]);
        b1[l] = fmaf(x1[e], wv, b1[l]);
        b2[l] = fmaf(x2[e], wv, b2[l]);
        b3[l] = fmaf(x3[e], wv, b3[l]);
      }
    for (int l = 0; l < PLOW_HALF && k + h + l < n; ++l) {
      const int64_t e = k + h + l;
      const float wv = w(e);
      b0[l] = fmaf(x0[e], wv, b0[l]);
      b1[l] = fmaf(x1[e], wv, b1[l]);
      b2[l] = fmaf(x2[e], wv, b2[l]);
      b3[l] = fmaf(x3[e], wv, b3[l]);
    }
    for (int l = 0; l < PLOW_HALF; ++l) {
      a0[h + l] = b0[l];
      a1[h + l] = b1[l];
      a2[h + l] = b2[l];
      a3[h + l] = b3[l];
    }
  }
  y[0] = lanes_sum(a0);
  y[1] = lanes_sum(a1);
  y[2] = lanes_sum(a2);
  y[3] = lanes_sum(a3);
}

PLOW_SIMD static void dot4_f32(const float* x, int64_t ldx, const float* w, int64_t n,
                               float* y) {
  dot4_halves(x, ldx, F32Row{w}, n, y);
}

PLOW_SIMD static void dot4_bf16(const float* x, int64_t ldx, const uint16_t* w, int64_t n,
                                float* y) {
  dot4_halves(x, ldx, Bf16Row{w}, n, y);
}

#if defined(PLOW_X86_BLOCKS)
// Four rows of x against three weight rows (fp32 or bf16, n a multiple of 32): y[r * 3 + o],
// each with exactly dot_f32's order and tree. The 32 lanes go in four groups of 8 (one AVX2
// register): group g of all twelve (row, output) pairs is accumulated in one pass, so the
// twelve accumulators stay in registers and a weight load feeds four fmas, an x load three
// (dot4's 16-lane passes: one x load per fma). The groups are then folded as lanes_sum's first
// two levels fold them — lane l + 16 into l, then l + 8 into l: (g0 + g2) + (g1 + g3) — and
// the last three levels run inside the group. Each pass reads its quarter of every 128-byte
// run of a row, so a line is fetched from memory once. Host AVX2 builds only; the portable
// path is dot4 (same bits).
__attribute__((target("avx2,fma"))) static inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma"))) static inline __m256 load8(const uint16_t* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));  // bf16_lane, eight at once
}

template <class W>
__attribute__((target("avx2,fma"))) static void dot4x3_avx2(const float* x, int64_t ldx,
                                                             const W* w, int64_t ldw, int64_t n,
                                                             float* y, const W* next = nullptr) {
  __m256 fold[2][12];
  for (int g = 0; g < 4; ++g) {
    __m256 a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm256_setzero_ps();
    const W *w0 = w + g * 8, *w1 = w0 + ldw, *w2 = w1 + ldw;
    const float* xg = x + g * 8;
    for (int64_t k = 0; k < n; k += 32) {
      if (next != nullptr && g == 0)  // the next three rows' lines, while these compute
        for (int o = 0; o < 3; ++o) {
          _mm_prefetch(reinterpret_cast<const char*>(w + o * ldw + k + 16), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(next + o * ldw + k), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(next + o * ldw + k + 16), _MM_HINT_T0);
        }
      const __m256 v0 = load8(w0 + k), v1 = load8(w1 + k), v2 = load8(w2 + k);
      for (int r = 0; r < 4; ++r) {
        const __m256 xr = _mm256_loadu_ps(xg + r * ldx + k);
        a[r * 3 + 0] = _mm256_fmadd_ps(xr, v0, a[r * 3 + 0]);
        a[r * 3 + 1] = _mm256_fmadd_ps(xr, v1, a[r * 3 + 1]);
        a[r * 3 + 2] = _mm256_fmadd_ps(xr, v2, a[r * 3 + 2]);
      }
    }
    for (int i = 0; i < 12; ++i)
      fold[g & 1][i] = g < 2 ? a[i] : _mm256_add_ps(fold[g & 1][i], a[i]);
  }
  for (int i = 0; i < 12; ++i) {  // lanes_sum's last three levels, inside the group
    const __m256 t = _mm256_add_ps(fold[0][i], fold[1][i]);
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
    y[i] = _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
  }
}

// AVX-512 spellings of the same dots (fp32 or bf16 weights, n a multiple of 32), for hosts
// that have it. A 32-lane accumulator is two registers: lanes 0-15 and 16-31. Each lane sums
// its elements in order with one fma each, and the fold below is lanes_sum's tree level by
// level (l + 16 into l, then l + 8, 4, 2, 1), so every y has exactly dot_f32's bits.
// (GCC 12 warns, wrongly, that the intrinsics' own _mm512_undefined_* values are uninitialised
// once they are inlined: the pragmas cover these helpers.)
static const bool plow_has_avx512 = __builtin_cpu_supports("avx512f");
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

__attribute__((target("avx512f"))) static inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
__attribute__((target("avx512f"))) static inline __m512 load16(const uint16_t* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));  // bf16_lane, sixteen at once
}
// lanes_sum of the 32 lanes (a0: lanes 0-15, a1: lanes 16-31)
__attribute__((target("avx512f"))) static inline float fold32(__m512 a0, __m512 a1) {
  const __m512 t = _mm512_add_ps(a0, a1);
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}

// One row of x against R weight rows (batch 1: weight bandwidth). The R rows stream at once,
// 2R accumulators in registers, each x load feeding R fmas; the R folds overlap, where one
// row at a time serialised each row's tree behind its loads. Each step prefetches the same
// lines of the next R rows, so the next call's loads find them in L1 (measured on this
// machine's 2 cores: 20-25% less time per batch-1 pass over the weights, fp32 and bf16).
template <int R, class W>
__attribute__((target("avx512f"))) static void dot1xr_avx512(const float* x, const W* w,
                                                             int64_t ldw, int64_t n, float* y) {
  __m512 a[R][2];
  for (int o = 0; o < R; ++o) a[o][0] = a[o][1] = _mm512_setzero_ps();
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(w) + R * ldw * sizeof(W);
  for (int64_t k = 0; k < n; k += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
    for (int o = 0; o < R; ++o)  // the same lines of the next R rows (integer addresses: a
      for (int64_t b = 0; b < 32 * static_cast<int64_t>(sizeof(W)); b += 64)  // hint may
        _mm_prefetch(reinterpret_cast<const char*>(ahead + ((o * ldw + k) * sizeof(W) + b)),
                     _MM_HINT_T0);  // point past the tensor; it never faults)
    for (int o = 0; o < R; ++o) {
      a[o][0] = _mm512_fmadd_ps(x0, load16(w + o * ldw + k), a[o][0]);
      a[o][1] = _mm512_fmadd_ps(x1, load16(w + o * ldw + k + 16), a[o][1]);
    }
  }
  for (int o = 0; o < R; ++o) y[o] = fold32(a[o][0], a[o][1]);
}

#pragma GCC diagnostic pop
#endif

PLOW_HD static inline float dot_w(const float* x, const void* w, int32_t dt, int64_t off,
                                  int64_t n) {
  if (dt == PLOW_BF16) return dot_bf16(x, static_cast<const uint16_t*>(w) + off, n);
  if (is_blocked(dt)) return dot_blocks(x, static_cast<const uint8_t*>(w), dt, off, n);
  return dot_f32(x, static_cast<const float*>(w) + off, n);
}

PLOW_HD static inline void dot4_w(const float* x, int64_t ldx, const void* w, int32_t dt,
                                  int64_t off, int64_t n, float* y) {
  if (dt == PLOW_BF16) return dot4_bf16(x, ldx, static_cast<const uint16_t*>(w) + off, n, y);
  if (is_blocked(dt)) return dot4_blocks(x, ldx, static_cast<const uint8_t*>(w), dt, off, n, y);
  dot4_f32(x, ldx, static_cast<const float*>(w) + off, n, y);
}

PLOW_SIMD static float sumsq(const float* x, int64_t n) { return dot_f32(x, x, n); }

// -- embedding: rows [a, b) of the flat ids x hidden columns [c0, c1) --------------------------
// d0 hidden (columns of the table and of the output); f0 scale
PLOW_HD static void tile_embedding(const Ctx& c, const PlowOp& op, const Range* r) {
  const int32_t* ids = I32(c.A, op.t[0]);
  float* out = c.A + op.t[1];
  const int64_t H = op.d[0];
  const float scale = op.f[0];
  for (int64_t i = r[0].a; i < r[0].b; ++i) {
    const int64_t id = ids[i];
    for (int64_t j = r[1].a; j < r[1].b; ++j)
      out[i * H + j] = weight_at(op.w0, op.w0_dtype, id * H + j) * scale;
  }
}

// -- rmsnorm over groups of g columns ----------------------------------------------------------
// d0 g (group), d1 norm rows, d2 output columns (its 2-D view), d3 steps; f0 eps, f1 offset
PLOW_HD static inline float norm_apply(const PlowOp& op, float x, float inv_rms, int64_t j) {
  const float w = weight_at(op.w0, op.w0_dtype, j);
  return (x / inv_rms) * (op.f[1] + w);
}

PLOW_HD static void tile_rmsnorm(const Ctx& c, const PlowOp& op, const Range* r, int64_t step) {
  const float* x = c.A + op.t[0];
  const int64_t g = op.d[0];
  if (step >= 0) {  // partial: this column slice's sum of squares per row
    float* part = c.A + op.t[2];
    const int64_t R = op.d[1];
    for (int64_t i = r[0].a; i < r[0].b; ++i)
      part[step * R + i] = sumsq(x + i * g + r[1].a, r[1].b - r[1].a);
    return;
  }
  float* out = c.A + op.t[1];
  for (int64_t i = r[0].a; i < r[0].b; ++i) {
    const float var = sumsq(x + i * g, g) / static_cast<float>(g);
    const float den = sqrtf(var + op.f[0]);
    for (int64_t j = r[1].a; j < r[1].b; ++j) out[i * g + j] = norm_apply(op, x[i * g + j], den, j);
  }
}

PLOW_HD static void merge_rmsnorm(const Ctx& c, const PlowOp& op, const int64_t* u) {
  const float* x = c.A + op.t[0];
  const float* part = c.A + op.t[2];
  float* out = c.A + op.t[1];
  const int64_t g = op.d[0], R = op.d[1], ncols = op.d[2], steps = op.d[3];
  const int64_t c0 = u[6], c1 = u[7];
  for (int64_t i = u[0]; i < u[1]; ++i) {
    float total = part[i];
    for (int64_t k = 1; k < steps; ++k) total = total + part[k * R + i];
    const float den = sqrtf(total / static_cast<float>(g) + op.f[0]);
    for (int64_t j = 0; j < g; ++j) {
      const int64_t col = (i * g + j) % ncols;
      if (col >= c0 && col < c1) out[i * g + j] = norm_apply(op, x[i * g + j], den, j);
    }
  }
}

// -- rope: rows x columns of [rows, heads * head_dim] ------------------------------------------
// d0 columns, d1 head_dim; table: inverse frequencies
PLOW_HD static void tile_rope(const Ctx& c, const PlowOp& op, const Range* r) {
  const float* x = c.A + op.t[0];
  const int32_t* pos = I32(c.A, op.t[1]);
  float* out = c.A + op.t[2];
  const int64_t C = op.d[0], hd = op.d[1], half = hd / 2;
  for (int64_t i = r[0].a; i < r[0].b; ++i) {
    const float p = static_cast<float>(pos[i] > 0 ? pos[i] : 0);
    for (int64_t j = r[1].a; j < r[1].b; ++j) {
      const int64_t h0 = (j / hd) * hd, e = j - h0, fi = e % half;
      const float ang = p * op.table[fi];
      const float cs = cosf(ang), sn = sinf(ang);
      const float* xh = x + i * C + h0;
      const float rot = e < half ? -xh[e + half] : xh[e - half];
      out[i * C + j] = xh[e] * cs + rot * sn;
    }
  }
}

// -- element-wise: gated_mlp (act(gate) * up) and residual_add ---------------------------------
// d0 columns; d1 activation (0 silu, 1 gelu_tanh)
PLOW_HD static inline float act_fn(float x, int64_t kind) {
  if (kind == 1) {
    const float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(k0 * (x + 0.044715f * (x * x * x))));
  }
  return x / (1.0f + expf(-x));
}

PLOW_HD static void tile_elementwise(const Ctx& c, const PlowOp& op, const Range* r) {
  const float* x = c.A + op.t[0];
  const float* y = c.A + op.t[1];
  float* out = c.A + op.t[2];
  const int64_t C = op.d[0];
  const bool mlp = op.kind == PLOW_GATED_MLP;
  for (int64_t i = r[0].a; i < r[0].b; ++i)
    for (int64_t j = r[1].a; j < r[1].b; ++j) {
      const int64_t e = i * C + j;
      out[e] = mlp ? act_fn(x[e], op.d[1]) * y[e] : x[e] + y[e];
    }
}

// -- linear / lm_head: y[m, n] = x[m, k] . w[n, k] ---------------------------------------------
// d0 M, d1 N, d2 K, d3 steps; f0 softcap (lm_head; 0: none)
PLOW_HD static inline float epilogue(const PlowOp& op, float y, int64_t n) {
  if (op.w1 != nullptr) y = y + weight_at(op.w1, op.w1_dtype, n);
  if (op.kind == PLOW_LM_HEAD && op.f[0] != 0.0f) y = tanhf(y / op.f[0]) * op.f[0];
  return y;
}

// Fused greedy: per chunk of the columns [n0, n1) this unit wrote, the chunk's (max, lowest
// argmax) per row (the chunks are whole inside a unit: the loader cut them at unit bounds).
PLOW_HD static void argmax_chunks(const Ctx& c, const PlowOp& op, int64_t m0, int64_t m1,
                                  int64_t n0, int64_t n1) {
  const PlowPlan* p = c.plan;
  const float* y = c.A + op.t[1];
  float* vals = c.A + p->fused_values;
  int32_t* idx = I32(c.A, p->fused_index);
  const int64_t M = op.d[0], N = op.d[1];
  int64_t lo = 0;
  while (lo < p->n_chunks && p->bounds[lo] < n0) ++lo;
  for (int64_t ch = lo; ch < p->n_chunks && p->bounds[ch + 1] <= n1; ++ch) {
    const int64_t b0 = p->bounds[ch], b1 = p->bounds[ch + 1];
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = y + m * N;
      int64_t best = b0;
      for (int64_t n = b0 + 1; n < b1; ++n)
        if (row[n] > row[best]) best = n;
      vals[ch * M + m] = row[best];
      idx[ch * M + m] = static_cast<int32_t>(best);
    }
  }
}

// The dots of a linear-shaped tile: x rows [ma, mb) (row stride K, columns k0 .. k0 + kn)
// against weight rows [ra, rb) of w0 (row stride K); `store(m, n, y)` takes each one, for a
// given m in ascending n. linear / lm_head store outputs or partials; the fused linears
// (fused.h) store into q / k / v, or pair gate and up rows. Every y has dot_f32's order
// whichever path computes it.
template <class Store>
PLOW_HD static void linear_rows(const float* x, int64_t K, int64_t k0, int64_t kn,
                                const void* w0, int32_t dt, int64_t ma, int64_t mb, int64_t ra,
                                int64_t rb, Store store) {
#if !defined(__CUDACC__) && !defined(__HIPCC__)
  // Several rows against GGML blocks: decode each weight row once into fp32 and run the fp32
  // dots on it (dot_blocks is dot_f32 over the decoded values, so the bits are the same).
  if (is_blocked(dt) && mb - ma >= 4 && kn <= 8192) {
    float wrow[3 * 8192];
    const uint8_t* wb = static_cast<const uint8_t*>(w0);
    const auto decode_row = [&](int64_t n, float* out) {
      const int64_t off = n * K + k0;
      int64_t k = 0;
#if defined(PLOW_X86_BLOCKS)
      if (plow_has_avx2 && off % 32 == 0 && dt != PLOW_Q4_0) {
        decode_blocks_avx2(wb + off / 32 * block_bytes(dt), dt, kn / 32, out);
        k = kn / 32 * 32;
      }
#endif
      if (off % 32 == 0)
        for (; k + 32 <= kn; k += 32) decode_block(wb, dt, (off + k) / 32, out + k);
      for (; k < kn; ++k) out[k] = block_weight(wb, dt, off + k);
    };
    int64_t n_done = ra;
#if defined(PLOW_X86_BLOCKS)
    if (plow_has_avx2 && kn % 32 == 0) {  // three decoded rows at a time through dot4x3
      const int64_t mq = ma + (mb - ma) / 4 * 4;
      for (; n_done + 3 <= rb; n_done += 3) {
        const int64_t n = n_done;
        for (int o = 0; o < 3; ++o) decode_row(n + o, wrow + o * kn);
        float y12[12];
        for (int64_t m = ma; m < mq; m += 4) {
          dot4x3_avx2(x + m * K + k0, K, wrow, kn, kn, y12);
          for (int i = 0; i < 4; ++i)
            for (int o = 0; o < 3; ++o)
              store(m + i, n + o, y12[i * 3 + o]);
        }
        for (int64_t m = mq; m < mb; ++m)
          for (int o = 0; o < 3; ++o) {
            const float y = dot_f32(x + m * K + k0, wrow + o * kn, kn);
            store(m, n + o, y);
          }
      }
    }
#endif
    for (int64_t n = n_done; n < rb; ++n) {
      decode_row(n, wrow);
      int64_t m = ma;
      float y4[4];
      for (; m + 4 <= mb; m += 4) {
        dot4_f32(x + m * K + k0, K, wrow, kn, y4);
        for (int i = 0; i < 4; ++i)
          store(m + i, n, y4[i]);
      }
      for (; m < mb; ++m) {
        const float y = dot_f32(x + m * K + k0, wrow, kn);
        store(m, n, y);
      }
    }
    return;
  }
#endif
  int64_t n_done = ra;  // outputs below it are written
#if defined(PLOW_X86_BLOCKS)
  if (plow_has_avx512 && kn % 32 == 0 && mb - ma < 4 && (dt == PLOW_F32 || dt == PLOW_BF16)) {
    // a few x rows (decode batches 1-3): four weight rows at a time, read once, kept in L1
    const auto run = [&](auto* w) {  // w: the weights at row 0, column k0
      for (; n_done + 4 <= rb; n_done += 4) {
        const auto* wn = w + n_done * K;
        for (int64_t m = ma; m < mb; ++m) {
          float y4[4];
          dot1xr_avx512<4>(x + m * K + k0, wn, K, kn, y4);
          for (int o = 0; o < 4; ++o) store(m, n_done + o, y4[o]);
        }
      }
    };
    if (dt == PLOW_F32) run(static_cast<const float*>(w0) + k0);
    else run(static_cast<const uint16_t*>(w0) + k0);
  }
  if (plow_has_avx2 && kn % 32 == 0 && mb - ma >= 4 && (dt == PLOW_F32 || dt == PLOW_BF16)) {
    const int64_t mq = ma + (mb - ma) / 4 * 4;
    for (; n_done + 3 <= rb; n_done += 3) {
      const int64_t n = n_done, off = n * K + k0;
      float y12[12];
      const bool ahead = n + 6 <= rb;  // the first row block prefetches the next three rows
      for (int64_t m = ma; m < mq; m += 4) {
        const bool pf = ahead && m == ma;
        if (dt == PLOW_F32) {
          const float* w = static_cast<const float*>(w0) + off;
          dot4x3_avx2(x + m * K + k0, K, w, K, kn, y12, pf ? w + 3 * K : nullptr);
        } else {
          const uint16_t* w = static_cast<const uint16_t*>(w0) + off;
          dot4x3_avx2(x + m * K + k0, K, w, K, kn, y12, pf ? w + 3 * K : nullptr);
        }
        for (int i = 0; i < 4; ++i)
          for (int o = 0; o < 3; ++o)
            store(m + i, n + o, y12[i * 3 + o]);
      }
      for (int64_t m = mq; m < mb; ++m)
        for (int64_t o = 0; o < 3; ++o) {
          const float y = dot_w(x + m * K + k0, w0, dt, off + o * K, kn);
          store(m, n + o, y);
        }
    }
  }
#endif
  // weight row n is read once from memory and reused from cache for every row m
  for (int64_t n = n_done; n < rb; ++n) {
    int64_t m = ma;
    float y4[4];
    for (; m + 4 <= mb; m += 4) {
      dot4_w(x + m * K + k0, K, w0, dt, n * K + k0, kn, y4);
      for (int i = 0; i < 4; ++i)
        store(m + i, n, y4[i]);
    }
    for (; m < mb; ++m) {
      const float y = dot_w(x + m * K + k0, w0, dt, n * K + k0, kn);
      store(m, n, y);
    }
  }
}

PLOW_HD static void tile_linear(const Ctx& c, const PlowOp& op, const Range* r, int64_t step) {
  const int64_t M = op.d[0], N = op.d[1], K = op.d[2];
  float* dst = step >= 0 ? c.A + op.t[2] + step * M * N : c.A + op.t[1];
  linear_rows(c.A + op.t[0], K, r[2].a, r[2].b - r[2].a, op.w0, op.w0_dtype, r[0].a, r[0].b,
              r[1].a, r[1].b, [&](int64_t m, int64_t n, float y) {
                dst[m * N + n] = step >= 0 ? y : epilogue(op, y, n);
              });
  if (step < 0 && c.plan->fused_lm >= 0 && &op == &c.plan->ops[c.plan->fused_lm])
    argmax_chunks(c, op, r[0].a, r[0].b, r[1].a, r[1].b);
}

PLOW_HD static void merge_linear(const Ctx& c, const PlowOp& op, const int64_t* u) {
  const int64_t M = op.d[0], N = op.d[1], steps = op.d[3];
  const int64_t n0 = u[2] > u[6] ? u[2] : u[6], n1 = u[3] < u[7] ? u[3] : u[7];
  const float* part = c.A + op.t[2];
  float* out = c.A + op.t[1];
  for (int64_t m = u[0]; m < u[1]; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float y = part[m * N + n];
      for (int64_t k = 1; k < steps; ++k) y = y + part[(k * M + m) * N + n];
      out[m * N + n] = epilogue(op, y, n);
    }
  if (n1 > n0 && c.plan->fused_lm >= 0 && &op == &c.plan->ops[c.plan->fused_lm])
    argmax_chunks(c, op, u[0], u[1], n0, n1);
}

// -- attention over the paged head-major pool ---------------------------------------------------
// d0 B, d1 T, d2 heads, d3 kv_heads, d4 head_dim, d5 layer, d6 window (0: none), d7 key steps;
// f0 scale, f1 softcap (0: none)
// Query rows an attention tile scores together (scratch: attention_scratch_floats per thread).
#ifndef PLOW_ATTN_ROWS
#define PLOW_ATTN_ROWS 4
#endif
// scores and outputs of the rows, then a bf16 pool's widened key and value rows (4 each)
PLOW_HD static inline int64_t attention_scratch_floats(int64_t keys, int64_t head_dim) {
  return PLOW_ATTN_ROWS * (keys + head_dim) + 8 * head_dim;
}

struct AttnGeom {
  int64_t B, T, H, KVH, D, grp, block, rows;
  PLOW_HD explicit AttnGeom(const PlowOp& op)
      : B(op.d[0]), T(op.d[1]), H(op.d[2]), KVH(op.d[3]), D(op.d[4]) {
    grp = H / KVH;
    block = T * grp;
    rows = B * KVH * block;
  }
};

// The pool holds fp32 rows, or (opt-in, lossy) bf16 rows packed two to a word: the same
// [layers, halves, blocks, kv_heads, block_size, head_dim] order in the storage type. A pool
// of one half (kv_halves 1: latent attention, whose values are its keys) holds each token's
// row once; tile_attention then reads values from the key rows (kind 0) and writes no value.
PLOW_HD static inline int64_t kv_halves(const PlowPlan* p) { return p->kv_halves == 1 ? 1 : 2; }
PLOW_HD static inline int64_t kv_index(const PlowPlan* p, int64_t layer, int64_t kind,
                                       int64_t block, int64_t head, int64_t slot) {
  return (((layer * kv_halves(p) + kind) * p->kv_blocks + block) * p->kv_heads + head) * p->kv_block + slot;
}

PLOW_HD static inline float* kv_row(const Ctx& c, int64_t layer, int64_t kind, int64_t block,
                                    int64_t head, int64_t slot) {
  return c.A + c.plan->kv_off + kv_index(c.plan, layer, kind, block, head, slot) * c.plan->kv_dim;
}

PLOW_HD static inline uint16_t* kv_row16(const Ctx& c, int64_t layer, int64_t kind, int64_t block,
                                         int64_t head, int64_t slot) {
  return reinterpret_cast<uint16_t*>(c.A + c.plan->kv_off) +
         kv_index(c.plan, layer, kind, block, head, slot) * c.plan->kv_dim;
}

// fp32 -> bf16, round to nearest even (what numpy's astype to ml_dtypes.bfloat16 does); a NaN
// stays a NaN (quiet, its sign kept).
PLOW_HD static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// This step's key or value row of a token into the pool, in the pool's storage type.
PLOW_HD static inline void kv_put(const Ctx& c, int64_t layer, int64_t kind, int64_t block,
                                  int64_t head, int64_t slot, const float* src) {
  const int64_t D = c.plan->kv_dim;
  if (c.plan->kv_dtype == PLOW_BF16) {
    uint16_t* dst = kv_row16(c, layer, kind, block, head, slot);
    for (int64_t d = 0; d < D; ++d) dst[d] = f32_to_bf16(src[d]);
  } else {
    memcpy(kv_row(c, layer, kind, block, head, slot), src, D * 4);
  }
}

// Keys ahead of a pool walk that take4 asks memory for: a head's rows lie in pages of a few
// KiB (the pool is head-major within a block), where the hardware prefetchers stop, so a long
// walk otherwise waits on memory at every page (a 1,024-key step: 7.9 -> 3.6 ms of one
// thread in a microbenchmark). A hint only: no result depends on it; host builds.
#ifndef PLOW_KV_AHEAD
#define PLOW_KV_AHEAD 32
#endif

// q . k with 8 lanes (lane l sums elements l, l + 8, ... in order) and a fixed tree. Attention
// dots are short (head_dim), so fewer lanes than dot_f32's 32 keep the tree cheap; each score's
// order depends only on head_dim, never on which keys or rows share its tile.
#define PLOW_QK_LANES 8
PLOW_HD static inline float qk_tree(float* a) {
  for (int s = PLOW_QK_LANES / 2; s > 0; s >>= 1)
    for (int l = 0; l < s; ++l) a[l] += a[l + s];
  return a[0];
}

// `k`: a key row as F32Row / Bf16Row (a bf16 pool's row widened element by element: the
// values KvWalk::row's staging gives)
template <class Row>
PLOW_HD PLOW_INLINE float qk_dot_row(const float* q, Row k, int64_t n) {
  float a[PLOW_QK_LANES] = {0};
  int64_t d = 0;
  for (; d + PLOW_QK_LANES <= n; d += PLOW_QK_LANES)
    for (int l = 0; l < PLOW_QK_LANES; ++l) a[l] = fmaf(q[d + l], k(d + l), a[l]);
  for (int l = 0; d + l < n; ++l) a[l] = fmaf(q[d + l], k(d + l), a[l]);
  return qk_tree(a);
}

PLOW_HD PLOW_INLINE float qk_dot(const float* q, const float* k, int64_t n) {
  return qk_dot_row(q, F32Row{k}, n);
}

// One (sequence, kv head)'s keys or values in key order: the pool's pages through the page
// table, then this step's fresh rows (positions >= p_min are the step's own tokens, contiguous
// in the input, fp32 as the op computed them). Advancing is an add within a page and one
// table lookup per page, so a key costs its dot product, not its address. A bf16 pool's rows
// are widened (exactly) into `stage` (four rows) as they are taken.
struct KvWalk {
  const Ctx& c;
  const int32_t* table;  // this sequence's page-table row
  int64_t layer, kind, kv, p_min;
  const float* fresh;  // the step's key/value input at position p_min
  int64_t fresh_ld, kp, slot;
  const float* ptr;      // the current row: fp32 pool or fresh
  const uint16_t* ptr16;  // the current row of a bf16 pool (when ptr is null)
  float* stage;
  PLOW_HD KvWalk(const Ctx& c_, const int32_t* table_, int64_t layer_, int64_t kind_,
                 int64_t kv_, int64_t p_min_, const float* fresh_, int64_t fresh_ld_,
                 int64_t kp0, float* stage_)
      : c(c_), table(table_), layer(layer_), kind(kind_), kv(kv_), p_min(p_min_),
        fresh(fresh_), fresh_ld(fresh_ld_), kp(kp0), slot(0), ptr(nullptr), ptr16(nullptr),
        stage(stage_) {
    seek();
  }
  PLOW_HD void seek() {
    const int64_t bs = c.plan->kv_block;
    if (kp >= p_min) {
      ptr = fresh + (kp - p_min) * fresh_ld;
      return;
    }
    slot = kp % bs;
    if (c.plan->kv_dtype == PLOW_BF16) {
      ptr = nullptr;
      ptr16 = kv_row16(c, layer, kind, table[kp / bs], kv, slot);
    } else {
      ptr = kv_row(c, layer, kind, table[kp / bs], kv, slot);
    }
  }
  // key `kp_` of the walk (any order: one table lookup), for walks that are not sequential
  PLOW_HD void seek_to(int64_t kp_) {
    kp = kp_;
    seek();
  }
  // element d of the current row as fp32 (a bf16 row's element widened, exactly as row())
  PLOW_HD float at(int64_t d) const { return ptr != nullptr ? ptr[d] : bf16_to_f32(ptr16[d]); }
  // q . the current row, with qk_dot's order
  PLOW_HD float dot(const float* q, int64_t n) const {
    return ptr != nullptr ? qk_dot_row(q, F32Row{ptr}, n) : qk_dot_row(q, Bf16Row{ptr16}, n);
  }
  // the current row as fp32 (a bf16 row widened into stage row i)
  PLOW_HD const float* row(int i) {
    if (ptr != nullptr) return ptr;
    const int64_t D = c.plan->kv_dim;
    float* __restrict out = stage + i * D;  // the pool and the stage never overlap
    const uint16_t* __restrict in = ptr16;
    for (int64_t d = 0; d < D; ++d) out[d] = bf16_to_f32(in[d]);
    return out;
  }
  // the next four rows (keys or values) in key order
  PLOW_HD void take4(const float** p) {
#if !defined(__CUDACC__) && !defined(__HIPCC__)
    const int64_t far = kp + PLOW_KV_AHEAD;  // the four rows this far ahead, through the table
    if (far + 4 <= p_min) {
      const int64_t bs = c.plan->kv_block, D = c.plan->kv_dim;
      const bool narrow = c.plan->kv_dtype == PLOW_BF16;
      const char* at =
          narrow ? reinterpret_cast<const char*>(kv_row16(c, layer, kind, table[far / bs], kv, far % bs))
                 : reinterpret_cast<const char*>(kv_row(c, layer, kind, table[far / bs], kv, far % bs));
      const int64_t n = (bs - far % bs < 4 ? bs - far % bs : 4) * D * (narrow ? 2 : 4);
      for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(at + o, 0, 3);
    }
#endif
    for (int i = 0; i < 4; ++i, next()) p[i] = row(i);
  }
  PLOW_HD void next() {
    ++kp;
    if (kp >= p_min) {
      ptr = fresh + (kp - p_min) * fresh_ld;
    } else if (++slot == c.plan->kv_block) {
      seek();
    } else if (ptr != nullptr) {
      ptr += c.plan->kv_dim;
    } else {
      ptr16 += c.plan->kv_dim;
    }
  }
};


// Four keys against one query: four independent chains in flight, each with qk_dot's order.
// Inlined into attend_rows' clones (a call per four keys through the clone dispatch cost as
// much as the dots at head_dim 64).
PLOW_HD PLOW_INLINE void qk_dot4(const float* q, const float* k0, const float* k1,
                                 const float* k2, const float* k3, int64_t n, float* s) {
  float a0[PLOW_QK_LANES] = {0}, a1[PLOW_QK_LANES] = {0}, a2[PLOW_QK_LANES] = {0},
        a3[PLOW_QK_LANES] = {0};
  int64_t d = 0;
  for (; d + PLOW_QK_LANES <= n; d += PLOW_QK_LANES)
    for (int l = 0; l < PLOW_QK_LANES; ++l) {
      const float qv = q[d + l];
      a0[l] = fmaf(qv, k0[d + l], a0[l]);
      a1[l] = fmaf(qv, k1[d + l], a1[l]);
      a2[l] = fmaf(qv, k2[d + l], a2[l]);
      a3[l] = fmaf(qv, k3[d + l], a3[l]);
    }
  for (int l = 0; d + l < n; ++l) {
    const float qv = q[d + l];
    a0[l] = fmaf(qv, k0[d + l], a0[l]);
    a1[l] = fmaf(qv, k1[d + l], a1[l]);
    a2[l] = fmaf(qv, k2[d + l], a2[l]);
    a3[l] = fmaf(qv, k3[d + l], a3[l]);
  }
  s[0] = qk_tree(a0);
  s[1] = qk_tree(a1);
  s[2] = qk_tree(a2);
  s[3] = qk_tree(a3);
}

// exp(x) for the softmax's x = score - max <= 0: Cephes' single-precision range reduction and
// polynomial (about 1 ulp), in fmaf and integer steps only, so it vectorises over keys and
// every build (AVX-512, AVX2, portable, CUDA) gives the same bits. Below -87 (weights under
// 1e-38 of the row's largest) the weight is 0.
PLOW_HD PLOW_INLINE float exp_nonpos(float x) {
  const float xc = x > -87.0f ? x : -87.0f;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds x * log2(e) to an integer
  const float t = fmaf(xc, 1.44269504088896341f, magic);
  const float n = t - magic;
  float r = fmaf(n, -0.693359375f, xc);  // x - n ln 2, ln 2 in two parts
  r = fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  const float y = fmaf(p, r * r, r) + 1.0f;
  int32_t ti;
  memcpy(&ti, &t, 4);
  const int32_t bits = ((ti - 0x4B400000) + 127) * (1 << 23);  // 2^n, n in [-126, 0]
  float two_n;
  memcpy(&two_n, &bits, 4);
  return x > -87.0f ? y * two_n : 0.0f;
}

// R (<= PLOW_ATTN_ROWS) query rows of one token against the n visible keys / values their
// walks start at: scores into sc (row i at sc + i * n), then each row's max m, weights
// exp(s - m) in place, their sum l (8 lanes, fixed tree) and acc += w * v in key order, four
// keys per pass over acc (the same adds in the same order as one key at a time). Each key and
// value is read once for the R rows.
PLOW_SIMD static void attend_rows(KvWalk& kw, KvWalk& vw, const float* const* qv, int64_t R,
                                  int64_t D, int64_t n, float scale, float softcap, float* sc,
                                  float* acc, float* m, float* l) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* k[4];
    kw.take4(k);
    for (int64_t i = 0; i < R; ++i) qk_dot4(qv[i], k[0], k[1], k[2], k[3], D, sc + i * n + j);
  }
  for (; j < n; ++j, kw.next()) {
    const float* k = kw.row(0);
    for (int64_t i = 0; i < R; ++i) sc[i * n + j] = qk_dot(qv[i], k, D);
  }
  for (int64_t i = 0; i < R; ++i) {
    float* s = sc + i * n;
    if (softcap != 0.0f) {
      for (j = 0; j < n; ++j) s[j] = tanhf(s[j] * scale / softcap) * softcap;
    } else {
      for (j = 0; j < n; ++j) s[j] = s[j] * scale;
    }
    float mx[PLOW_QK_LANES];
    for (int k = 0; k < PLOW_QK_LANES; ++k) mx[k] = -INFINITY;
    for (j = 0; j + PLOW_QK_LANES <= n; j += PLOW_QK_LANES)
      for (int k = 0; k < PLOW_QK_LANES; ++k) mx[k] = s[j + k] > mx[k] ? s[j + k] : mx[k];
    for (int k = 0; j + k < n; ++k) mx[k] = s[j + k] > mx[k] ? s[j + k] : mx[k];
    float big = mx[0];  // a max: the same value in any order
    for (int k = 1; k < PLOW_QK_LANES; ++k) big = mx[k] > big ? mx[k] : big;
    m[i] = big;
    if (big == -INFINITY) {
      l[i] = 0.0f;
      for (j = 0; j < n; ++j) s[j] = 0.0f;  // no weight: acc stays 0
      continue;
    }
    for (j = 0; j < n; ++j) s[j] = exp_nonpos(s[j] - big);
    float ls[PLOW_QK_LANES] = {0};
    for (j = 0; j + PLOW_QK_LANES <= n; j += PLOW_QK_LANES)
      for (int k = 0; k < PLOW_QK_LANES; ++k) ls[k] += s[j + k];
    for (int k = 0; j + k < n; ++k) ls[k] += s[j + k];
    l[i] = qk_tree(ls);
  }
  for (j = 0; j + 4 <= n; j += 4) {
    const float* v[4];
    vw.take4(v);
    const float *v0 = v[0], *v1 = v[1], *v2 = v[2], *v3 = v[3];
    for (int64_t i = 0; i < R; ++i) {
      const float* w = sc + i * n + j;
      const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
      float* a = acc + i * D;
      for (int64_t d = 0; d < D; ++d)
        a[d] = (((a[d] + w0 * v0[d]) + w1 * v1[d]) + w2 * v2[d]) + w3 * v3[d];
    }
  }
  for (; j < n; ++j, vw.next()) {
    const float* v = vw.row(0);
    for (int64_t i = 0; i < R; ++i) {
      const float w0 = sc[i * n + j];
      float* a = acc + i * D;
      for (int64_t d = 0; d < D; ++d) a[d] = a[d] + w0 * v[d];
    }
  }
}

// One attention tile: rows [ra, rb); of a split key axis, step k of S scores the k-th S-th of
// the live run (keys relative to the window's first key), so the work follows the sequence,
// not the compiled context, and the steps share it evenly. Writes this step's keys/values
// into the pool (the tile holding the token's first query head and, in the plan's static key
// ranges [s0, s1), its key index). A row's
// visible keys (causal, windowed) are one contiguous run, scored in key order; masked keys are
// never touched.
//
// `Attend` says who runs it: ThreadAttend (one thread: the host, and any build's default), or
// a group of `width` lanes that run every line together (kernels/device.cu's warp version:
// lane `lane` writes elements d = lane, lane + width, ... of the rows, lane 0 alone the cache
// and the partials' (m, l), `sync()` orders the lanes' scratch words, and `rows` replaces
// attend_rows with the same arithmetic per word). The bits do not depend on it.
struct ThreadAttend {
  static constexpr int lane = 0, width = 1;
  PLOW_HD void sync() const {}
  PLOW_HD void rows(KvWalk& kw, KvWalk& vw, const float* const* qv, int64_t R, int64_t D,
                    int64_t n, float scale, float softcap, float* sc, float* acc, float* m,
                    float* l) const {
    attend_rows(kw, vw, qv, R, D, n, scale, softcap, sc, acc, m, l);
  }
};

template <class Attend = ThreadAttend>
PLOW_HD static int64_t tile_attention(const Ctx& c, const PlowOp& op, const Range* r,
                                      int64_t step, float* scratch, const Attend& at = {}) {
  int64_t scored = 0;  // (query row, key) pairs of the live length: the work, for the host
  const AttnGeom g(op);
  const PlowPlan* p = c.plan;
  const float* q = c.A + op.t[0];
  const float* kin = c.A + op.t[1];
  const float* vin = c.A + op.t[2];
  const int32_t* pos = I32(c.A, op.t[3]);
  const int32_t* table = I32(c.A, p->page_table);
  const int64_t layer = op.d[5], window = op.d[6], steps = op.d[7], D = g.D, bs = p->kv_block;
  const float scale = op.f[0], softcap = op.f[1];
  const int64_t vkind = kv_halves(p) - 1;  // the values' half: 0 where values are keys
  const int64_t ra = r[0].a, rb = r[0].b, s0 = r[1].a, s1 = r[1].b;
  float* o_part = step >= 0 ? c.A + op.t[5] + step * g.rows * D : nullptr;
  float* ml_part = step >= 0 ? c.A + op.t[6] + step * g.rows * 2 : nullptr;
  float* out = c.A + op.t[4];
  // scores of up to PLOW_ATTN_ROWS rows, at most a tile's keys each (a step's share of the
  // live run, at most ceil(extent / steps)); then their outputs, head_dim each
  const int64_t tile_keys = op.tile[1] > 0 ? op.tile[1] : op.ext[1];
  float* sc = scratch;
  float* acc = scratch + PLOW_ATTN_ROWS * tile_keys;
  const int64_t first = ra / g.block, last = (rb - 1) / g.block;
  const int64_t fresh_ld = g.KVH * D;  // one token's stride in the step's key/value input
  for (int64_t blk = first; blk <= last; ++blk) {
    const int64_t bi = blk / g.KVH, kv = blk % g.KVH;
    const int64_t lo_r = (ra > blk * g.block ? ra : blk * g.block) - blk * g.block;
    const int64_t hi_r = (rb < (blk + 1) * g.block ? rb : (blk + 1) * g.block) - blk * g.block;
    const int32_t* prow = pos + bi * g.T;
    const int32_t* trow = table + bi * p->page_cols;
    int64_t p_min = -1, p_max = -1;
    for (int64_t t = 0; t < g.T; ++t)
      if (prow[t] >= 0) {
        if (p_min < 0 || prow[t] < p_min) p_min = prow[t];
        if (prow[t] > p_max) p_max = prow[t];
      }
    const bool live = p_min >= 0;
    int64_t key_lo = 0, j0 = 0, j1 = 0;
    if (live) {
      key_lo = window > 0 ? (p_min - window + 1 > 0 ? p_min - window + 1 : 0) : 0;
      // The keys this tile scores: step k of S takes the k-th S-th of the live run, so the
      // split's tiles share the work at any length (a split of the compiled context would
      // leave every key to the first tile while the sequence is short).
      const int64_t n_live = p_max - key_lo + 1 < op.ext[1] ? p_max - key_lo + 1 : op.ext[1];
      if (step >= 0) {
        j0 = step * n_live / steps;
        j1 = (step + 1) * n_live / steps;
      } else {
        j1 = s1 < n_live ? s1 : n_live;
      }
      // cache write: tokens whose first query head is in the tile and key index in [s0, s1)
      for (int64_t t = 0; at.lane == 0 && t < g.T; ++t) {
        const int64_t pt = prow[t];
        if (pt < 0 || t * g.grp < lo_r || t * g.grp >= hi_r) continue;
        if (pt - key_lo < s0 || pt - key_lo >= s1) continue;
        const int64_t blockid = trow[pt / bs];
        const int64_t src = ((bi * g.T + t) * g.KVH + kv) * D;
        kv_put(c, layer, 0, blockid, kv, pt % bs, kin + src);
        if (vkind == 1) kv_put(c, layer, 1, blockid, kv, pt % bs, vin + src);
      }
    }
    const float* kfresh = live ? kin + ((bi * g.T) * g.KVH + kv) * D : nullptr;
    const float* vfresh = live ? vin + ((bi * g.T) * g.KVH + kv) * D : nullptr;
    // Rows of one token (its query heads sharing this kv head) see the same keys: they go in
    // groups of up to PLOW_ATTN_ROWS, each key and value read once for the group (from
    // memory at long contexts, where a head's keys outgrow the cache). Every row still does
    // exactly its own arithmetic in key order, so the grouping changes no bit.
    for (int64_t r0 = lo_r; r0 < hi_r;) {
      const int64_t t = r0 / g.grp;
      int64_t r1 = (t + 1) * g.grp < hi_r ? (t + 1) * g.grp : hi_r;
      if (r1 - r0 > PLOW_ATTN_ROWS) r1 = r0 + PLOW_ATTN_ROWS;
      const int64_t R = r1 - r0;
      const int64_t qpos = prow[t];
      float m[PLOW_ATTN_ROWS], l[PLOW_ATTN_ROWS];
      for (int64_t i = 0; i < R; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
      }
      for (int64_t d = at.lane; d < R * D; d += at.width) acc[d] = 0.0f;
      at.sync();
      if (live && j1 > j0 && qpos >= 0) {
        scored += R * (j1 - j0);
        // the visible run: key positions in [lo, hi] (causal and windowed), inside the tile
        int64_t lo = key_lo + j0, hi = key_lo + j1 - 1;
        if (window > 0 && qpos - window + 1 > lo) lo = qpos - window + 1;
        if (qpos < hi) hi = qpos;
        const int64_t n = hi - lo + 1;
        if (n > 0) {
          const float* qv[PLOW_ATTN_ROWS];
          for (int64_t i = 0; i < R; ++i)
            qv[i] = q + ((bi * g.T + t) * g.H + kv * g.grp + (r0 + i) % g.grp) * D;
          float* stage = acc + PLOW_ATTN_ROWS * D;  // attention_scratch_floats' last 8 rows
          KvWalk kw(c, trow, layer, 0, kv, p_min, kfresh, fresh_ld, lo, stage);
          KvWalk vw(c, trow, layer, vkind, kv, p_min, vfresh, fresh_ld, lo, stage + 4 * D);
          at.rows(kw, vw, qv, R, D, n, scale, softcap, sc, acc, m, l);
        }
      }
      at.sync();
      for (int64_t i = 0; i < R; ++i) {
        const int64_t row = blk * g.block + r0 + i;
        const int64_t head = kv * g.grp + (r0 + i) % g.grp;
        if (step >= 0) {
          for (int64_t d = at.lane; d < D; d += at.width) o_part[row * D + d] = acc[i * D + d];
          if (at.lane == 0) {
            ml_part[row * 2] = m[i];
            ml_part[row * 2 + 1] = l[i];
          }
        } else {
          float* o = out + ((bi * g.T + t) * g.H + head) * D;
          for (int64_t d = at.lane; d < D; d += at.width)
            o[d] = l[i] > 0.0f ? acc[i * D + d] / l[i] : 0.0f;
        }
      }
      at.sync();  // the next group's scores overwrite the scratch these lanes read
      r0 = r1;
    }
  }
  return scored;
}

// Attention merge: rows [u0, u1) of the split, output columns [c0, c1) of [B*T, H*D]; steps in
// ascending order; steps past the live length (m = -inf) contribute nothing and are skipped.
PLOW_HD static void merge_attention(const Ctx& c, const PlowOp& op, const int64_t* u,
                                    float* scratch) {
  const AttnGeom g(op);
  const int64_t D = g.D, steps = op.d[7];
  const float* o_part = c.A + op.t[5];
  const float* ml = c.A + op.t[6];
  float* out = c.A + op.t[4];
  float* acc = scratch;
  for (int64_t row = u[0]; row < u[1]; ++row) {
    const int64_t bi = row / (g.KVH * g.block), kv = (row / g.block) % g.KVH;
    const int64_t t = (row / g.grp) % g.T, head = kv * g.grp + row % g.grp;
    const int64_t d0c = head * D;
    if (d0c >= u[7] || d0c + D <= u[6]) continue;
    float big = -INFINITY;
    for (int64_t k = 0; k < steps; ++k) {
      const float mk = ml[(k * g.rows + row) * 2];
      if (mk > big) big = mk;
    }
    float l = 0.0f;
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
    if (big != -INFINITY) {
      for (int64_t k = 0; k < steps; ++k) {
        const float mk = ml[(k * g.rows + row) * 2];
        if (mk == -INFINITY) continue;
        const float w = expf(mk - big);
        const float* ok = o_part + (k * g.rows + row) * D;
        for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] + ok[d] * w;
        l = l + ml[(k * g.rows + row) * 2 + 1] * w;
      }
    }
    float* o = out + ((bi * g.T + t) * g.H + head) * D;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t col = d0c + d;
      if (col >= u[6] && col < u[7]) o[d] = l > 0.0f ? acc[d] / l : 0.0f;
    }
  }
}

// -- sample: greedy argmax of each row's sampled position ---------------------------------------
// d0 B, d1 T, d2 V, d3 steps
PLOW_HD static void fused_pick(const Ctx& c, const PlowOp& op, int64_t a, int64_t b) {
  const PlowPlan* p = c.plan;
  const int32_t* sidx = I32(c.A, op.t[1]);
  int32_t* out = I32(c.A, op.t[2]);
  const float* vals = c.A + p->fused_values;
  const int32_t* idx = I32(c.A, p->fused_index);
  const int64_t T = op.d[1], M = op.d[0] * T;
  for (int64_t i = a; i < b; ++i) {
    const int64_t m = i * T + sidx[i];
    float bv = vals[m];
    int32_t bi = idx[m];
    for (int64_t ch = 1; ch < p->n_chunks; ++ch)
      if (vals[ch * M + m] > bv) { bv = vals[ch * M + m]; bi = idx[ch * M + m]; }
    out[i] = bi;
  }
}

PLOW_HD static void tile_sample(const Ctx& c, const PlowOp& op, const Range* r, int64_t step) {
  const bool fused = c.plan->fused_sample >= 0 && &op == &c.plan->ops[c.plan->fused_sample];
  if (fused) {
    if (step < 0) fused_pick(c, op, r[0].a, r[0].b);
    return;  // partials: the lm_head tasks already reduced these columns
  }
  const float* logits = c.A + op.t[0];
  const int32_t* sidx = I32(c.A, op.t[1]);
  const int64_t B = op.d[0], T = op.d[1], V = op.d[2];
  for (int64_t i = r[0].a; i < r[0].b; ++i) {
    const float* row = logits + (i * T + sidx[i]) * V;
    int64_t best = r[1].a;
    for (int64_t n = r[1].a + 1; n < r[1].b; ++n)
      if (row[n] > row[best]) best = n;
    if (step >= 0) {
      (c.A + op.t[3])[step * B + i] = row[best];
      I32(c.A, op.t[4])[step * B + i] = static_cast<int32_t>(best);
    } else {
      I32(c.A, op.t[2])[i] = static_cast<int32_t>(best);
    }
  }
}

PLOW_HD static void merge_sample(const Ctx& c, const PlowOp& op, const int64_t* u) {
  if (c.plan->fused_sample >= 0 && &op == &c.plan->ops[c.plan->fused_sample]) {
    fused_pick(c, op, u[0], u[1]);
    return;
  }
  const int64_t B = op.d[0], steps = op.d[3];
  const float* val = c.A + op.t[3];
  const int32_t* ind = I32(c.A, op.t[4]);
  int32_t* out = I32(c.A, op.t[2]);
  for (int64_t i = u[0]; i < u[1]; ++i) {
    float bv = val[i];
    int32_t bi = ind[i];
    for (int64_t k = 1; k < steps; ++k)
      if (val[k * B + i] > bv) { bv = val[k * B + i]; bi = ind[k * B + i]; }
    out[i] = bi;
  }
}

}  // namespace plow
#endif
