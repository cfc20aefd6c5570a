// plow native kernel — Kimi-Linear's Kimi Delta Attention (issue 18): the `kda` op.
//
// The op table's kind of plow/graph/kda.py; the arithmetic is plow.runtime.numpy_ops.kda_row's
// (transformers' recurrent_kimi_delta_attention and KimiLinearRMSNormGated torch paths) in
// fp32. A tile holds whole batch rows (every token: the recurrence runs through them in order)
// and a range of heads (plow/tiles/tiler.py). Each head's state S [D, D] (key rows, value
// columns) lives in the arena's state region [slots, H, D, D]; row b uses slot state_slot[b],
// read and rewritten by the one tile covering its heads. A row whose first valid position is
// 0 starts from zeros; padded tokens (position -1) output 0 and leave the state alone.
// Prefill (a row of more than one token) runs the chunked form on the host builds
// (kda_chunked_head), the recurrence on the device builds and for decode. Mamba-2's
// ssm_conv (kernels/ssm.h) runs the short conv before this op.
// Shared by the host and device builds (only PLOW_HD helpers of tiles.h are used).
#ifndef PLOW_KDA_H
#define PLOW_KDA_H

#include "ssm.h"  // ssm_first: a row's first valid token (and tiles.h)

#if !defined(__CUDACC__) && !defined(__HIPCC__)
#include <vector>
#endif

namespace plow {

// Op kind of the op table (plow/runtime/native/lower.py KDA_KINDS) and its wire-v1 opcode.
enum PlowKdaKind { PLOW_KDA = 60 };
enum PlowKdaOpcode { PLOW_OP_KDA = 19 };

// The largest head_dim the tile's stack vectors hold (Kimi-Linear: 128).
constexpr int64_t PLOW_KDA_MAX_DIM = 256;

PLOW_HD static inline float kda_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// One token of head h: q (l2-normed, times D^-1/2), k (l2-normed) and the log decays
// g = -exp(A_log) softplus(f + dt_bias) from the conv output row x [3C] and f row [C].
PLOW_HD static inline void kda_prep(const float* x, const float* f, const float* dt_bias,
                                    float decay, int64_t C, int64_t h, int64_t D, float scale,
                                    float* q, float* k, float* g) {
  const float* qr = x + h * D;
  const float* kr = x + C + h * D;
  float qq = 0.0f, kk = 0.0f;
  for (int64_t i = 0; i < D; ++i) {
    qq += qr[i] * qr[i];
    kk += kr[i] * kr[i];
  }
  const float qn = sqrtf(qq + 1e-6f), kn = sqrtf(kk + 1e-6f);
  for (int64_t i = 0; i < D; ++i) {
    q[i] = qr[i] / qn * scale;
    k[i] = kr[i] / kn;
    float gi = f[h * D + i] + dt_bias[h * D + i];
    gi = gi > 20.0f ? gi : log1pf(expf(gi));  // torch's softplus
    g[i] = -decay * gi;
  }
}

// The output of one token: rmsnorm(o) * o_norm weight * sigmoid(gate).
PLOW_HD static inline void kda_emit(const float* o, const float* gt, const float* nw, float eps,
                                    int64_t D, float* dst) {
  float ss = 0.0f;
  for (int64_t j = 0; j < D; ++j) ss += o[j] * o[j];
  const float rms = sqrtf(ss / static_cast<float>(D) + eps);
  for (int64_t j = 0; j < D; ++j) dst[j] = o[j] / rms * nw[j] * kda_sigmoid(gt[j]);
}

#if !defined(__CUDACC__) && !defined(__HIPCC__)
// Prefill on the host: a row of more than one token runs the chunked (WY) form of
// plow.runtime.numpy_ops._kda_chunk (transformers' chunk_kimi_delta_attention), PLOW_KDA_CHUNK
// tokens at a time; the device builds run the recurrence (one thread per tile, no scratch).
constexpr int64_t PLOW_KDA_CHUNK = 16;

// Head h of batch row b over its valid tokens idx[0 .. nv): state s [D, D] updated in place.
// The decay products exp(G_i - G_j) (j <= i, G the running sum of the log decays over the
// chunk) are the running products E[i][j] = E[i-1][j] exp(g_i), E[j][j] = 1, and exp(G_i) is
// E's chain from the chunk's start: one expf per token and column, as the recurrence, and
// every factor at most 1 (no overflow however strong the decay).
static void kda_chunked_head(const Ctx& c, const PlowOp& op, int64_t b, int64_t h,
                             const int64_t* idx, int64_t nv, float* s) {
  const int64_t T = op.d[1], H = op.d[2], D = op.d[3], C = H * D, L = PLOW_KDA_CHUNK;
  const float* dt_bias = op.table;
  const float decay = expf(op.table[C + h]);
  const float* nw = op.table + C + H;
  const float scale = 1.0f / sqrtf(static_cast<float>(D));
  std::vector<float> buf(static_cast<size_t>(5 * L * D + L * L * D + L * L + L + D));
  float* q = buf.data();
  float* k = q + L * D;
  float* eg = k + L * D;  // exp(g_i), then exp(G_i)
  float* u = eg + L * D;  // beta v, then T beta v, then the new values v'
  float* w = u + L * D;   // T (beta k exp(G))
  float* E = w + L * D;   // [L, L, D]: exp(G_i - G_j), j <= i
  float* A = E + L * L * D;  // [L, L] strictly lower, then T = (I + A)^-1's rows
  float* beta = A + L * L;
  float* o = beta + L;
  float* out = c.A + op.t[7] + b * T * C;
  for (int64_t c0 = 0; c0 < nv; c0 += L) {
    const int64_t m = nv - c0 < L ? nv - c0 : L;
    for (int64_t i = 0; i < m; ++i) {
      const int64_t row = b * T + idx[c0 + i];
      const float* x = c.A + op.t[0] + row * 3 * C;
      float* ei = eg + i * D;
      kda_prep(x, c.A + op.t[1] + row * C, dt_bias, decay, C, h, D, scale, q + i * D, k + i * D,
               ei);
      for (int64_t d = 0; d < D; ++d) ei[d] = expf(ei[d]);
      float* eii = E + (i * L + i) * D;
      for (int64_t d = 0; d < D; ++d) eii[d] = 1.0f;
      for (int64_t j = 0; j < i; ++j) {
        const float* prev = E + ((i - 1) * L + j) * D;
        float* cur = E + (i * L + j) * D;
        for (int64_t d = 0; d < D; ++d) cur[d] = prev[d] * ei[d];
      }
      if (i > 0)
        for (int64_t d = 0; d < D; ++d) ei[d] *= eg[(i - 1) * D + d];  // exp(G_i)
      beta[i] = kda_sigmoid(c.A[op.t[2] + row * H + h]);
      const float* vr = x + 2 * C + h * D;
      for (int64_t d = 0; d < D; ++d) {
        u[i * D + d] = vr[d] * beta[i];
        w[i * D + d] = beta[i] * k[i * D + d] * ei[d];
      }
    }
    // A[i, j] = -beta_i k_i . (k_j exp(G_i - G_j)), j < i; rows solved in order (row i
    // reads the rows before it already solved): T = I + A
    for (int64_t i = 0; i < m; ++i) {
      float* ai = A + i * L;
      for (int64_t j = 0; j < i; ++j) {
        const float* eij = E + (i * L + j) * D;
        float acc = 0.0f;
        for (int64_t d = 0; d < D; ++d) acc += k[i * D + d] * k[j * D + d] * eij[d];
        ai[j] = -beta[i] * acc;
      }
      for (int64_t j = 0; j < i; ++j) {
        float acc = ai[j];
        for (int64_t r = j + 1; r < i; ++r) acc += ai[r] * A[r * L + j];
        ai[j] = acc;  // later j read ai[r] for r > j only: still A's own entries
      }
    }
    // u = T (beta v), w = T (beta k exp(G)), from the last row up (T is unit lower)
    for (int64_t i = m - 1; i >= 0; --i) {
      for (int64_t j = 0; j < i; ++j) {
        const float t = A[i * L + j];
        for (int64_t d = 0; d < D; ++d) {
          u[i * D + d] += t * u[j * D + d];
          w[i * D + d] += t * w[j * D + d];
        }
      }
    }
    // v' = u - w S
    for (int64_t i = 0; i < m; ++i)
      for (int64_t kk = 0; kk < D; ++kk) {
        const float wk = w[i * D + kk];
        const float* sk = s + kk * D;
        for (int64_t j = 0; j < D; ++j) u[i * D + j] -= wk * sk[j];
      }
    // y_i = (q_i exp(G_i)) S + sum_{j <= i} (q_i . k_j exp(G_i - G_j)) v'_j
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < D; ++j) o[j] = 0.0f;
      for (int64_t kk = 0; kk < D; ++kk) {
        const float qe = q[i * D + kk] * eg[i * D + kk];
        const float* sk = s + kk * D;
        for (int64_t j = 0; j < D; ++j) o[j] += qe * sk[j];
      }
      for (int64_t j = 0; j <= i; ++j) {
        const float* eij = E + (i * L + j) * D;
        float acc = 0.0f;
        for (int64_t d = 0; d < D; ++d) acc += q[i * D + d] * k[j * D + d] * eij[d];
        for (int64_t e = 0; e < D; ++e) o[e] += acc * u[j * D + e];
      }
      const int64_t row = b * T + idx[c0 + i];
      kda_emit(o, c.A + op.t[3] + row * C + h * D, nw, op.f[0], D, out + idx[c0 + i] * C + h * D);
    }
    // S' = exp(G_last) S + sum_j (k_j exp(G_last - G_j)) v'_j^T
    const float* last = eg + (m - 1) * D;
    for (int64_t kk = 0; kk < D; ++kk) {
      float* sk = s + kk * D;
      for (int64_t j = 0; j < D; ++j) sk[j] *= last[kk];
      for (int64_t i = 0; i < m; ++i) {
        const float kd = k[i * D + kk] * E[((m - 1) * L + i) * D + kk];
        for (int64_t j = 0; j < D; ++j) sk[j] += kd * u[i * D + j];
      }
    }
  }
}
#endif

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
#if !defined(__CUDACC__) && !defined(__HIPCC__)
    std::vector<int64_t> idx;
    for (int64_t t = 0; t < T; ++t)
      if (pos[t] >= 0) idx.push_back(t);
#endif
    for (int64_t h = r[1].a; h < h1; ++h) {
      float* s = st_row + h * D * D;
      if (fresh)
        for (int64_t i = 0; i < D * D; ++i) s[i] = 0.0f;
#if !defined(__CUDACC__) && !defined(__HIPCC__)
      if (idx.size() > 1) {
        kda_chunked_head(c, op, b, h, idx.data(), static_cast<int64_t>(idx.size()), s);
        continue;
      }
#endif
      const float decay = expf(a_log[h]);
      for (int64_t t = 0; t < T; ++t) {
        if (pos[t] < 0) continue;
        const int64_t row = b * T + t;
        const float* x = c.A + op.t[0] + row * 3 * C;
        const float* vr = x + 2 * C + h * D;
        const float* gt = c.A + op.t[3] + row * C + h * D;
        const float beta = kda_sigmoid(c.A[op.t[2] + row * H + h]);
        float q[PLOW_KDA_MAX_DIM], k[PLOW_KDA_MAX_DIM], g[PLOW_KDA_MAX_DIM], y[PLOW_KDA_MAX_DIM];
        kda_prep(x, c.A + op.t[1] + row * C, dt_bias, decay, C, h, D, scale, q, k, g);
        // S = S * exp(g) by key row; y = S^T k (the memory's value for k)
        for (int64_t j = 0; j < D; ++j) y[j] = 0.0f;
        for (int64_t i = 0; i < D; ++i) {
          const float e = expf(g[i]);
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
        kda_emit(o, gt, nw, op.f[0], D, out + t * C + h * D);
      }
    }
  }
}

}  // namespace plow

#endif
