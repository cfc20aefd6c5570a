// plow native kernel — the fused ops the e-graph stage chooses (plow/egraph/apply.py, issue 15).
//
// Each fused tile does the arithmetic of the canonical ops it replaces, in their order, so its
// words are the canonical tiles' bits wherever the canonical tiling reduces in the same order:
//
//   add_rmsnorm (R1)  s = a + b (tiles.h's residual add) of the tile's box, written; then, as
//                     tiles.h's rmsnorm: unsplit, the row's norm (sumsq over its 32 lanes, sqrtf,
//                     norm_apply); split (column tiles), the box's sums of squares per row into
//                     the partial, and a merge (merge_add_rmsnorm, merge_rmsnorm's arithmetic)
//                     that reads the partials in step order and the sums, and writes the norm.
//   linear_glu (R2+R3+R13)  one linear over the interleaved gate/up weight (row 2n gate row n,
//                     row 2n + 1 up row n; re-laid-out in the bundle), then the gated MLP's
//                     act(g) * u: g and u are tiles.h's linear_rows dots (the linear's
//                     order), the product tiles.h's act_fn as tile_elementwise computes it.
//                     Split k (the tiler prices it as a linear's): a k tile writes both dots
//                     of its columns to the fp32 partial [step, M, 2N] (gate at 2n, up at
//                     2n + 1: the weight's row order), and merge_linear_glu sums each in step
//                     order (merge_linear's adds) and only then applies act(gate) * up — the
//                     unfused split gate and up linears' merges followed by the gated MLP.
//   linear_qkv (R4)   one linear over cat3(Wq, Wk, Wv) (rows stacked; the bundle's weight):
//                     output column n is row n's dot (linear_rows, the linear's order),
//                     written to q, k or v by where n falls in their widths. Split k: k tiles
//                     write the partial [step, M, nq + nk + nv] as a linear's, and
//                     merge_linear_qkv's plain ordered sums go to q, k or v.
//
// Packets of a fused op carry the opcode of its main canonical op (add_rmsnorm: RMSNORM); the
// op table's kind tells which. Shared by the host and device builds (PLOW_HD helpers only).
#ifndef PLOW_FUSED_H
#define PLOW_FUSED_H

#include "tiles.h"

namespace plow {

// Op kinds of the op table (PlowKind continues here; plow/runtime/native/lower.py).
enum PlowFusedKind { PLOW_ADD_RMSNORM = 30, PLOW_LINEAR_GLU = 31, PLOW_LINEAR_QKV = 32 };

// add_rmsnorm: t0 a, t1 b, t2 sum (out), t3 norm (out), t4 partial (sums of squares); d0
// columns, d1 rows, d2 merge columns (the output's 2-D view), d3 steps; f0 eps, f1 offset;
// w0 the norm weight [d0]
PLOW_HD static void tile_add_rmsnorm(const Ctx& c, const PlowOp& op, const Range* r,
                                     int64_t step) {
  const float* a = c.A + op.t[0];
  const float* b = c.A + op.t[1];
  float* s = c.A + op.t[2];
  float* out = c.A + op.t[3];
  const int64_t C = op.d[0];
  for (int64_t i = r[0].a; i < r[0].b; ++i) {
    float* si = s + i * C;
    for (int64_t j = r[1].a; j < r[1].b; ++j) si[j] = a[i * C + j] + b[i * C + j];
    if (step >= 0) {  // partial: this column slice's sum of squares
      c.A[op.t[4] + step * op.d[1] + i] = sumsq(si + r[1].a, r[1].b - r[1].a);
      continue;
    }
    const float var = sumsq(si, C) / static_cast<float>(C);
    const float den = sqrtf(var + op.f[0]);
    for (int64_t j = 0; j < C; ++j) out[i * C + j] = norm_apply(op, si[j], den, j);
  }
}

// A merge unit of a split add_rmsnorm (u: rows u0..u1, output columns u6..u7): merge_rmsnorm's
// arithmetic over the sums, into the norm.
PLOW_HD static void merge_add_rmsnorm(const Ctx& c, const PlowOp& op, const int64_t* u) {
  const float* s = c.A + op.t[2];
  const float* part = c.A + op.t[4];
  float* out = c.A + op.t[3];
  const int64_t C = op.d[0], R = op.d[1], steps = op.d[3];
  for (int64_t i = u[0]; i < u[1]; ++i) {
    float total = part[i];
    for (int64_t k = 1; k < steps; ++k) total = total + part[k * R + i];
    const float den = sqrtf(total / static_cast<float>(C) + op.f[0]);
    for (int64_t j = u[6]; j < u[7]; ++j) out[i * C + j] = norm_apply(op, s[i * C + j], den, j);
  }
}

// linear_glu: t0 x, t1 out, t2 partial [d4 steps, M, 2N]; d0 M, d1 N (outputs), d2 K; d3
// activation (0 silu, 1 gelu_tanh); w0 the interleaved weight [2N, K]
PLOW_HD static void tile_linear_glu(const Ctx& c, const PlowOp& op, const Range* r,
                                    int64_t step) {
  float* out = c.A + op.t[1];
  const int64_t N = op.d[1], act = op.d[3];
  if (step >= 0) {  // split k: both dots of the tile's columns into this step's partial
    float* part = c.A + op.t[2] + step * op.d[0] * 2 * N;
    linear_rows(c.A + op.t[0], op.d[2], r[2].a, r[2].b - r[2].a, op.w0, op.w0_dtype, r[0].a,
                r[0].b, 2 * r[1].a, 2 * r[1].b,
                [&](int64_t m, int64_t row, float y) { part[m * 2 * N + row] = y; });
    return;
  }
  // weight rows 2n (gate) and 2n + 1 (up) of the tile's output columns n, through tiles.h's
  // linear_rows (its 4 x 3 blocks, prefetch and block decoding): a row's gate comes before its
  // up, so act(gate) waits in the output word until up multiplies it (the same two roundings)
  linear_rows(c.A + op.t[0], op.d[2], r[2].a, r[2].b - r[2].a, op.w0, op.w0_dtype, r[0].a,
              r[0].b, 2 * r[1].a, 2 * r[1].b, [&](int64_t m, int64_t row, float y) {
                float* o = out + m * N + row / 2;
                *o = (row & 1) == 0 ? act_fn(y, act) : *o * y;
              });
}
// A merge unit of a split linear_glu (u: rows u0..u1, output columns max(u2, u6)..min(u3, u7)):
// gate and up each summed in step order as merge_linear sums, then act(gate) * up.
PLOW_HD static void merge_linear_glu(const Ctx& c, const PlowOp& op, const int64_t* u) {
  const int64_t M = op.d[0], N = op.d[1], act = op.d[3], steps = op.d[4];
  const int64_t n0 = u[2] > u[6] ? u[2] : u[6], n1 = u[3] < u[7] ? u[3] : u[7];
  const float* part = c.A + op.t[2];
  float* out = c.A + op.t[1];
  for (int64_t m = u[0]; m < u[1]; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float g = part[m * 2 * N + 2 * n], v = part[m * 2 * N + 2 * n + 1];
      for (int64_t k = 1; k < steps; ++k) {
        g = g + part[(k * M + m) * 2 * N + 2 * n];
        v = v + part[(k * M + m) * 2 * N + 2 * n + 1];
      }
      out[m * N + n] = act_fn(g, act) * v;
    }
}

// linear_qkv's output column n (of q | k | v side by side) in its tensor.
PLOW_HD static inline float* qkv_word(const Ctx& c, const PlowOp& op, int64_t m, int64_t n) {
  const int64_t nq = op.d[4], nk = op.d[5];
  const int part = n < nq ? 0 : n < nq + nk ? 1 : 2;
  const int64_t col = n - (part == 0 ? 0 : part == 1 ? nq : nq + nk);
  return c.A + op.t[1 + part] + m * op.d[4 + part] + col;
}

// linear_qkv: t0 x, t1 q, t2 k, t3 v (outputs), t4 partial [d3 steps, M, N]; d0 M, d1 N
// (= nq + nk + nv), d2 K; d4 nq, d5 nk, d6 nv; w0 the concatenated weight [N, K]
PLOW_HD static void tile_linear_qkv(const Ctx& c, const PlowOp& op, const Range* r,
                                    int64_t step) {
  float* part = step >= 0 ? c.A + op.t[4] + step * op.d[0] * op.d[1] : nullptr;
  linear_rows(c.A + op.t[0], op.d[2], r[2].a, r[2].b - r[2].a, op.w0, op.w0_dtype, r[0].a,
              r[0].b, r[1].a, r[1].b, [&](int64_t m, int64_t n, float y) {
                if (part != nullptr) part[m * op.d[1] + n] = y;
                else *qkv_word(c, op, m, n) = y;
              });
}

// A merge unit of a split linear_qkv: merge_linear's ordered sums, to q, k or v.
PLOW_HD static void merge_linear_qkv(const Ctx& c, const PlowOp& op, const int64_t* u) {
  const int64_t M = op.d[0], N = op.d[1], steps = op.d[3];
  const int64_t n0 = u[2] > u[6] ? u[2] : u[6], n1 = u[3] < u[7] ? u[3] : u[7];
  const float* part = c.A + op.t[4];
  for (int64_t m = u[0]; m < u[1]; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float y = part[m * N + n];
      for (int64_t k = 1; k < steps; ++k) y = y + part[(k * M + m) * N + n];
      *qkv_word(c, op, m, n) = y;
    }
}
}  // namespace plow
#include "fused_lm.h"  // R19: the final norm in the lm_head's prologue
#endif
