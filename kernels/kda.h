// plow native kernel — Kimi-Linear's Kimi Delta Attention (issue 18): the `kda` op.
//
// The op table's kind of plow/graph/kda.py; the arithmetic is plow.runtime.numpy_ops.kda_row's
// (transformers' recurrent_kimi_delta_attention and KimiLinearRMSNormGated torch paths) in
// fp32. A tile holds whole batch rows (every token: the recurrence runs through them in order)
// and a range of heads (plow/tiles/tiler.py). Each head's state S [D, D] (key rows, value
// columns) lives in the arena's state region [slots, H, D, D]; row b uses slot state_slot[b],
// read and rewritten by the one tile covering its heads. A row whose first valid position is
// 0 starts from zeros; padded tokens (position -1) output 0 and leave the state alone.
// Prefill runs the recurrence token by token (the chunked form is not here). Mamba-2's
// ssm_conv (kernels/ssm.h) runs the short conv before this op.
// Shared by the host and device builds (only PLOW_HD helpers of tiles.h are used).
#ifndef PLOW_KDA_H
#define PLOW_KDA_H

#include "ssm.h"  // ssm_first: a row's first valid token (and tiles.h)

namespace plow {

// Op kind of the op table (plow/runtime/native/lower.py KDA_KINDS) and its wire-v1 opcode.
enum PlowKdaKind { PLOW_KDA = 60 };
enum PlowKdaOpcode { PLOW_OP_KDA = 19 };

// The largest head_dim the tile's stack vectors hold (Kimi-Linear: 128).
constexpr int64_t PLOW_KDA_MAX_DIM = 256;

PLOW_HD static inline float kda_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// -- kda: rows [b0, b1) x heads [h0, h1) --------------------------------------------------------
// t0 conv output [B, T, 3C] (q | k | v), t1 f [B, T, C], t2 beta [B, T, H], t3 gate [B, T, C],
// t4 state [slots, H, D, D], t5 positions [B, T], t6 state_slot [B], t7 out [B, T, C];
// d0 B, d1 T, d2 H, d3 D; f0 eps; table [C + H + D] fp32: dt_bias, A_log, o_norm weight.
PLOW_HD static void tile_kda(const Ctx& c, const PlowOp& op, const Range* r) {
  const int64_t T = op.d[1], H = op.d[2], D = op.d[3], C = H * D;
  const int32_t* pos_all = I32(c.A, op.t[5]);
  const int32_t* slots = I32(c.A, op.t[6]);
  const float* dt_bias = op.table;
  const float* a_log = op.table + C;
  const float* nw = op.table + C + H;
  const float scale = 1.0f / sqrtf(static_cast<float>(D));
  const int64_t h1 = r[1].b < H ? r[1].b : H;
  for (int64_t b = r[0].a; b < r[0].b; ++b) {
    const int32_t* pos = pos_all + b * T;
    float* out = c.A + op.t[7] + b * T * C;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = r[1].a * D; j < h1 * D; ++j) out[t * C + j] = 0.0f;
    bool fresh = false;
    if (ssm_first(pos, T, &fresh) == T) continue;
    float* st_row = c.A + op.t[4] + static_cast<int64_t>(slots[b]) * H * D * D;
    for (int64_t h = r[1].a; h < h1; ++h) {
      float* s = st_row + h * D * D;
      if (fresh)
        for (int64_t i = 0; i < D * D; ++i) s[i] = 0.0f;
      const float decay = expf(a_log[h]);
      for (int64_t t = 0; t < T; ++t) {
        if (pos[t] < 0) continue;
        const int64_t row = b * T + t;
        const float* x = c.A + op.t[0] + row * 3 * C;
        const float* qr = x + h * D;
        const float* kr = x + C + h * D;
        const float* vr = x + 2 * C + h * D;
        const float* f = c.A + op.t[1] + row * C + h * D;
        const float* gt = c.A + op.t[3] + row * C + h * D;
        const float beta = kda_sigmoid(c.A[op.t[2] + row * H + h]);
        float q[PLOW_KDA_MAX_DIM], k[PLOW_KDA_MAX_DIM], y[PLOW_KDA_MAX_DIM];
        float qq = 0.0f, kk = 0.0f;
        for (int64_t i = 0; i < D; ++i) {
          qq += qr[i] * qr[i];
          kk += kr[i] * kr[i];
        }
        const float qn = sqrtf(qq + 1e-6f), kn = sqrtf(kk + 1e-6f);
        for (int64_t i = 0; i < D; ++i) {
          q[i] = qr[i] / qn * scale;
          k[i] = kr[i] / kn;
        }
        // S = S * exp(g) by key row; y = S^T k (the memory's value for k)
        for (int64_t j = 0; j < D; ++j) y[j] = 0.0f;
        for (int64_t i = 0; i < D; ++i) {
          float g = f[i] + dt_bias[h * D + i];
          g = g > 20.0f ? g : log1pf(expf(g));  // torch's softplus
          const float e = expf(-decay * g);
          float* si = s + i * D;
          for (int64_t j = 0; j < D; ++j) {
            si[j] = si[j] * e;
            y[j] += si[j] * k[i];
          }
        }
        for (int64_t j = 0; j < D; ++j) y[j] = (vr[j] - y[j]) * beta;  // delta
        // S += k delta^T; out = S^T q
        float o[PLOW_KDA_MAX_DIM];
        for (int64_t j = 0; j < D; ++j) o[j] = 0.0f;
        for (int64_t i = 0; i < D; ++i) {
          float* si = s + i * D;
          for (int64_t j = 0; j < D; ++j) {
            si[j] = si[j] + k[i] * y[j];
            o[j] += si[j] * q[i];
          }
        }
        float ss = 0.0f;
        for (int64_t j = 0; j < D; ++j) ss += o[j] * o[j];
        const float rms = sqrtf(ss / static_cast<float>(D) + op.f[0]);
        float* dst = out + t * C + h * D;
        for (int64_t j = 0; j < D; ++j) dst[j] = o[j] / rms * nw[j] * kda_sigmoid(gt[j]);
      }
    }
  }
}

}  // namespace plow

#endif
