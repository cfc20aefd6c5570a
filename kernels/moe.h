// plow native kernel — routed experts (issue 17): the router and the expert tiles.
//
// The op table's kinds `router` and `expert_linear` (plow/graph/ops.py); the tiler cuts an
// expert_linear op so that every tile lies in one expert (plow/tiles/tiler.py), and the
// schedule puts every expert's tiles in the stream. A tile reads its expert's column of the
// router weights: rows that did not choose the expert get zeros and no arithmetic, so a tile
// whose expert no row chose does no work but is still run (and signals) like any other.
// Shared by the host and device builds (only PLOW_HD helpers of tiles.h are used).
#ifndef PLOW_MOE_H
#define PLOW_MOE_H

#include "tiles.h"

namespace plow {

// Op kinds of the op table (PlowKind continues here; plow/runtime/native/lower.py).
enum PlowMoeKind { PLOW_ROUTER = 10, PLOW_EXPERT_LINEAR = 11 };
// Wire-v1 opcodes of the two kinds (docs/wire.md).
enum PlowMoeOpcode { PLOW_OP_ROUTER = 13, PLOW_OP_EXPERT_LINEAR = 14 };

// -- router: rows [a, b) of the router logits [rows, E] -> dense combine weights ----------------
// t0 logits, t1 out; d0 E, d1 top_k, d2 renormalise (norm_topk_prob), d3 scaled (Gemma 4);
// f0 logit scale (d3), w0 per-expert scales [E] of the kept weights (none: 1)
// Softmax over the row in fp32, the top_k largest kept (ties: the lower expert index), divided
// by their sum when d2; every other weight is exactly 0 (plow.runtime.numpy_ops.router).
PLOW_HD static void tile_router(const Ctx& c, const PlowOp& op, const Range* r) {
  const float* x = c.A + op.t[0];
  float* out = c.A + op.t[1];
  const int64_t E = op.d[0], k = op.d[1];
  for (int64_t i = r[0].a; i < r[0].b; ++i) {
    const float* raw = x + i * E;
    float* o = out + i * E;
    // Gemma 4: the logits times f0 first (into o, reused below)
    const float* row = raw;
    if (op.d[3]) {
      for (int64_t e = 0; e < E; ++e) o[e] = raw[e] * op.f[0];
      row = o;
    }
    float mx = row[0];
    for (int64_t e = 1; e < E; ++e) mx = row[e] > mx ? row[e] : mx;
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      o[e] = expf(row[e] - mx);
      sum += o[e];
    }
    for (int64_t e = 0; e < E; ++e) o[e] = o[e] / sum;
    // selection: k passes of the first maximum among the unchosen; chosen weights are moved
    // to negative marks (-1 - e order) and restored below
    float top_sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (o[e] >= 0.0f && (best < 0 || o[e] > o[best])) best = e;
      top_sum += o[best];
      o[best] = -1.0f - o[best];  // chosen: keep the value, mark it
    }
    for (int64_t e = 0; e < E; ++e) {
      if (o[e] >= 0.0f) {
        o[e] = 0.0f;
      } else {
        const float p = -1.0f - o[e];
        o[e] = op.d[2] ? p / top_sum : p;
        if (op.w0 != nullptr) o[e] = o[e] * weight_at(op.w0, op.w0_dtype, e);
      }
    }
  }
}

// -- expert_linear: one tile of one expert -------------------------------------------------------
// t0 x, t1 out, t2 partial (merge_linear's slots), t3 router weights [M, E]; d0 M, d1 N (the op's n extent), d2 the
// row length of x, d3 k steps, d4 mode (0 gate_up, 1 down), d5 E, d6 per-expert width (gate_up:
// N / E output columns; down: K input columns), d7 activation (0 silu, 1 gelu_tanh).
// gate_up: w0 [E, 2h, K] (gate rows, then up rows); out[m, e*h + j] = act(g) * u.
// down: w0 [E, N, K]; the k step of expert e writes route[m, e] * (x_e[m] . w0[e, n]) to the
// partial (merged over experts in ascending order by merge_linear).
// Returns the rows computed (the work counter of plow_plan_work).
PLOW_HD static int64_t tile_expert(const Ctx& c, const PlowOp& op, const Range* r,
                                   int64_t step) {
  const float* x = c.A + op.t[0];
  const float* route = c.A + op.t[3];
  const int64_t M = op.d[0], N = op.d[1], KX = op.d[2], E = op.d[5], w = op.d[6];
  const bool gate_up = op.d[4] == 0;
  const int64_t k0 = r[2].a, kn = r[2].b - r[2].a;
  const int64_t e = gate_up ? r[1].a / w : k0 / w;
  float* dst = step >= 0 ? c.A + op.t[2] + step * M * N : c.A + op.t[1];
  int64_t rows = 0;
  for (int64_t m = r[0].a; m < r[0].b; ++m) {
    const float rw = route[m * E + e];
    float* y = dst + m * N;
    if (rw == 0.0f) {  // this row did not choose the expert
      for (int64_t n = r[1].a; n < r[1].b; ++n) y[n] = 0.0f;
      continue;
    }
    ++rows;
    const float* xr = x + m * KX + k0;
    for (int64_t n = r[1].a; n < r[1].b; ++n) {
      if (gate_up) {
        const int64_t j = n - e * w;
        const int64_t base = e * 2 * w;
        const float g = dot_w(xr, op.w0, op.w0_dtype, (base + j) * KX + k0, kn);
        const float u = dot_w(xr, op.w0, op.w0_dtype, (base + w + j) * KX + k0, kn);
        y[n] = act_fn(g, op.d[7]) * u;
      } else {
        const float p = dot_w(xr, op.w0, op.w0_dtype, (e * N + n) * w + (k0 - e * w), kn);
        y[n] = p * rw;
      }
    }
  }
  return rows;
}

}  // namespace plow
#endif
