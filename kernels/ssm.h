// plow native kernel — Mamba-2's state-space ops (issue 18): ssm_conv, ssm_scan, ssm_norm.
//
// The op table's kinds of plow/graph/ops.py; the arithmetic is plow.runtime.numpy_ops's
// (transformers' Mamba2Mixer torch path) in fp32. A conv / scan tile holds whole batch rows
// (every token: the recurrence runs through them in order) and a range of conv channels /
// heads (plow/tiles/tiler.py). The recurrent state lives in the arena's state region
// [slots, ...] (plow.runtime.cpu.arena.StateShape); row b uses slot state_slot[b], read and
// rewritten by the one tile covering its channels / heads. A row whose first valid position
// is 0 starts from zeros (a new sequence); padded tokens (position -1) output 0 and leave the
// state alone. Prefill (a row of more than one token) runs the chunked scan on the host builds
// (ssm_chunked_head), the recurrence on the device builds and for decode.
// Shared by the host and device builds (only PLOW_HD helpers of tiles.h are used).
#ifndef PLOW_SSM_H
#define PLOW_SSM_H

#include "tiles.h"

#if !defined(__CUDACC__) && !defined(__HIPCC__)
#include <vector>
#endif

namespace plow {

// Op kinds of the op table (PlowKind continues here; plow/runtime/native/lower.py).
enum PlowSsmKind { PLOW_SSM_CONV = 20, PLOW_SSM_SCAN = 21, PLOW_SSM_NORM = 22 };
// Wire-v1 opcodes of the three kinds (docs/wire.md).
enum PlowSsmOpcode { PLOW_OP_SSM_CONV = 16, PLOW_OP_SSM_SCAN = 17, PLOW_OP_SSM_NORM = 18 };

PLOW_HD static inline float ssm_silu(float x) { return x / (1.0f + expf(-x)); }

// The first valid token of row b (T if none) and whether the row starts a sequence.
PLOW_HD static inline int64_t ssm_first(const int32_t* pos, int64_t T, bool* fresh) {
  for (int64_t t = 0; t < T; ++t)
    if (pos[t] >= 0) {
      *fresh = pos[t] == 0;
      return t;
    }
  *fresh = false;
  return T;
}

// -- ssm_conv: rows [b0, b1) x channels [c0, c1) ------------------------------------------------
// t0 proj [B, T, P], t1 out [B, T, C], t2 conv state [slots, C, K-1], t3 positions [B, T],
// t4 state_slot [B]; d0 B, d1 T, d2 P, d3 C, d4 K, d5 offset of xBC in proj; w0 conv weight
// [C, 1, K], w1 conv bias [C] (none: 0).
PLOW_HD static void tile_ssm_conv(const Ctx& c, const PlowOp& op, const Range* r) {
  const int64_t T = op.d[1], P = op.d[2], C = op.d[3], K = op.d[4], off = op.d[5];
  const int32_t* pos_all = I32(c.A, op.t[3]);
  const int32_t* slots = I32(c.A, op.t[4]);
  const int64_t c1 = r[1].b < C ? r[1].b : C;
  for (int64_t b = r[0].a; b < r[0].b; ++b) {
    const int32_t* pos = pos_all + b * T;
    float* out = c.A + op.t[1] + b * T * C;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t ch = r[1].a; ch < c1; ++ch) out[t * C + ch] = 0.0f;
    bool fresh = false;
    if (ssm_first(pos, T, &fresh) == T) continue;
    float* st_row = c.A + op.t[2] + static_cast<int64_t>(slots[b]) * C * (K - 1);
    const float* x = c.A + op.t[0] + b * T * P + off;
    for (int64_t ch = r[1].a; ch < c1; ++ch) {
      float* st = st_row + ch * (K - 1);
      float win[64];  // the K-1 previous inputs, then the current one (K <= 64: the family)
      for (int64_t k = 0; k + 1 < K; ++k) win[k] = fresh ? 0.0f : st[k];
      const float bias = op.w1 != nullptr ? weight_at(op.w1, op.w1_dtype, ch) : 0.0f;
      for (int64_t t = 0; t < T; ++t) {
        if (pos[t] < 0) continue;
        win[K - 1] = x[t * P + ch];
        float acc = 0.0f;
        for (int64_t k = 0; k < K; ++k)
          acc = acc + weight_at(op.w0, op.w0_dtype, ch * K + k) * win[k];
        out[t * C + ch] = ssm_silu(acc + bias);
        for (int64_t k = 0; k + 1 < K; ++k) win[k] = win[k + 1];
      }
      for (int64_t k = 0; k + 1 < K; ++k) st[k] = win[k];
    }
  }
}

#if !defined(__CUDACC__) && !defined(__HIPCC__)
// Prefill on the host: a row of more than one token runs the chunked (SSD) scan of
// plow.runtime.numpy_ops._ssm_chunk (transformers' mamba2_chunk_scan), PLOW_SSM_CHUNK tokens
// at a time; the device builds run the recurrence (one thread per tile, no scratch).
constexpr int64_t PLOW_SSM_CHUNK = 16;

// Head h of batch row b over its valid tokens idx[0 .. nv): state s [hd, N] updated in place;
// y [T, H * hd] the row's output. G the running sum of dt * a over the chunk:
// y_l = exp(G_l) S c_l + sum_{s <= l} (c_l . b_s) exp(G_l - G_s) dt_s x_s + D x_l;
// S' = exp(G_last) S + sum_s exp(G_last - G_s) dt_s x_s b_s^T.
static void ssm_chunked_head(const Ctx& c, const PlowOp& op, int64_t b, int64_t h,
                             const int64_t* idx, int64_t nv, float* s, float* y) {
  const int64_t T = op.d[1], C = op.d[2], Pw = op.d[3], H = op.d[4], hd = op.d[5], N = op.d[6];
  const int64_t G = op.d[7], inner = H * hd, dt_off = inner + C, g = h / (H / G);
  const int64_t L = PLOW_SSM_CHUNK;
  const float a = -expf(op.table[H + h]);
  std::vector<float> buf(static_cast<size_t>(2 * L + L * L));
  float* dt = buf.data();
  float* gc = dt + L;
  float* cb = gc + L;  // [L, L]: (c_l . b_s) exp(G_l - G_s) dt_s, s <= l
  for (int64_t c0 = 0; c0 < nv; c0 += L) {
    const int64_t m = nv - c0 < L ? nv - c0 : L;
    for (int64_t i = 0; i < m; ++i) {
      float v = c.A[op.t[1] + (b * T + idx[c0 + i]) * Pw + dt_off + h] + op.table[h];
      v = v > 20.0f ? v : log1pf(expf(v));  // torch's softplus
      dt[i] = v < op.f[0] ? op.f[0] : (v > op.f[1] ? op.f[1] : v);
      gc[i] = (i ? gc[i - 1] : 0.0f) + dt[i] * a;
    }
    for (int64_t l = 0; l < m; ++l) {
      const float* cm = c.A + op.t[0] + (b * T + idx[c0 + l]) * C + inner + G * N + g * N;
      for (int64_t j = 0; j <= l; ++j) {
        const float* bm = c.A + op.t[0] + (b * T + idx[c0 + j]) * C + inner + g * N;
        float acc = 0.0f;
        for (int64_t n = 0; n < N; ++n) acc += cm[n] * bm[n];
        cb[l * L + j] = acc * expf(gc[l] - gc[j]) * dt[j];
      }
    }
    for (int64_t l = 0; l < m; ++l) {
      const float* row = c.A + op.t[0] + (b * T + idx[c0 + l]) * C;
      const float* cm = row + inner + G * N + g * N;
      const float e = expf(gc[l]);
      float* yl = y + idx[c0 + l] * inner + h * hd;
      for (int64_t p = 0; p < hd; ++p) {
        float acc = 0.0f;
        for (int64_t n = 0; n < N; ++n) acc += s[p * N + n] * cm[n];
        float intra = 0.0f;
        for (int64_t j = 0; j <= l; ++j)
          intra += cb[l * L + j] * c.A[op.t[0] + (b * T + idx[c0 + j]) * C + h * hd + p];
        yl[p] = acc * e + intra + op.table[2 * H + h] * row[h * hd + p];
      }
    }
    const float last = gc[m - 1];
    const float el = expf(last);
    for (int64_t i = 0; i < hd * N; ++i) s[i] *= el;
    for (int64_t j = 0; j < m; ++j) {
      const float* row = c.A + op.t[0] + (b * T + idx[c0 + j]) * C;
      const float* bm = row + inner + g * N;
      const float wgt = expf(last - gc[j]) * dt[j];
      for (int64_t p = 0; p < hd; ++p) {
        const float xd = wgt * row[h * hd + p];
        for (int64_t n = 0; n < N; ++n) s[p * N + n] += xd * bm[n];
      }
    }
  }
}
#endif

// -- ssm_scan: rows [b0, b1) x heads [h0, h1) ---------------------------------------------------
// t0 xBC [B, T, C], t1 proj [B, T, Pw], t2 ssm state [slots, H, hd, N], t3 positions,
// t4 state_slot, t5 out [B, T, H * hd]; d0 B, d1 T, d2 C, d3 Pw, d4 H, d5 hd, d6 N, d7 G;
// f0 dt_min, f1 dt_max; table [3, H]: dt_bias, A_log, D (fp32). dt is proj's column
// H * hd + C + h (in_proj's [z | xBC | dt]).
PLOW_HD static void tile_ssm_scan(const Ctx& c, const PlowOp& op, const Range* r) {
  const int64_t T = op.d[1], C = op.d[2], Pw = op.d[3], H = op.d[4], hd = op.d[5], N = op.d[6];
  const int64_t G = op.d[7], inner = H * hd, dt_off = inner + C, per_group = H / G;
  const int32_t* pos_all = I32(c.A, op.t[3]);
  const int32_t* slots = I32(c.A, op.t[4]);
  const float* dt_bias = op.table;
  const float* a_log = op.table + H;
  const float* dskip = op.table + 2 * H;
  const int64_t h1 = r[1].b < H ? r[1].b : H;
  for (int64_t b = r[0].a; b < r[0].b; ++b) {
    const int32_t* pos = pos_all + b * T;
    float* out = c.A + op.t[5] + b * T * inner;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = r[1].a * hd; j < h1 * hd; ++j) out[t * inner + j] = 0.0f;
    bool fresh = false;
    if (ssm_first(pos, T, &fresh) == T) continue;
    float* st_row = c.A + op.t[2] + static_cast<int64_t>(slots[b]) * H * hd * N;
#if !defined(__CUDACC__) && !defined(__HIPCC__)
    std::vector<int64_t> idx;
    for (int64_t t = 0; t < T; ++t)
      if (pos[t] >= 0) idx.push_back(t);
#endif
    for (int64_t h = r[1].a; h < h1; ++h) {
      float* s = st_row + h * hd * N;
      if (fresh)
        for (int64_t i = 0; i < hd * N; ++i) s[i] = 0.0f;
#if !defined(__CUDACC__) && !defined(__HIPCC__)
      if (idx.size() > 1) {
        ssm_chunked_head(c, op, b, h, idx.data(), static_cast<int64_t>(idx.size()), s, out);
        continue;
      }
#endif
      const int64_t g = h / per_group;
      const float a = -expf(a_log[h]);
      for (int64_t t = 0; t < T; ++t) {
        if (pos[t] < 0) continue;
        const float* row = c.A + op.t[0] + (b * T + t) * C;
        const float* x = row + h * hd;
        const float* bm = row + inner + g * N;
        const float* cm = row + inner + G * N + g * N;
        float dt = c.A[op.t[1] + (b * T + t) * Pw + dt_off + h] + dt_bias[h];
        dt = dt > 20.0f ? dt : log1pf(expf(dt));  // torch's softplus
        dt = dt < op.f[0] ? op.f[0] : (dt > op.f[1] ? op.f[1] : dt);
        const float da = expf(dt * a);
        float* y = out + t * inner + h * hd;
        for (int64_t p = 0; p < hd; ++p) {
          const float dx = dt * x[p];
          float acc = 0.0f;
          for (int64_t n = 0; n < N; ++n) {
            s[p * N + n] = s[p * N + n] * da + dx * bm[n];
            acc += s[p * N + n] * cm[n];
          }
          y[p] = acc + dskip[h] * x[p];
        }
      }
    }
  }
}

// -- ssm_norm: token rows [a, b) x norm groups [g0, g1) -----------------------------------------
// t0 y [M, inner], t1 proj [M, Pw] (the gate z: its first inner columns), t2 out; d0 inner,
// d1 Pw, d2 group; f0 eps; w0 weight [inner]. MambaRMSNormGated: (y * silu(z)) normalised per
// group, times the weight.
PLOW_HD static void tile_ssm_norm(const Ctx& c, const PlowOp& op, const Range* r) {
  const int64_t inner = op.d[0], Pw = op.d[1], gs = op.d[2];
  const int64_t g1 = r[1].b * gs < inner ? r[1].b : inner / gs;
  for (int64_t i = r[0].a; i < r[0].b; ++i) {
    const float* y = c.A + op.t[0] + i * inner;
    const float* z = c.A + op.t[1] + i * Pw;
    float* out = c.A + op.t[2] + i * inner;
    for (int64_t g = r[1].a; g < g1; ++g) {
      float ss = 0.0f;
      for (int64_t j = g * gs; j < (g + 1) * gs; ++j) {
        const float h = y[j] * ssm_silu(z[j]);
        out[j] = h;
        ss += h * h;
      }
      const float rms = sqrtf(ss / static_cast<float>(gs) + op.f[0]);
      for (int64_t j = g * gs; j < (g + 1) * gs; ++j)
        out[j] = weight_at(op.w0, op.w0_dtype, j) * (out[j] / rms);
    }
  }
}

PLOW_HD static inline bool ssm_tile(const Ctx& c, const PlowOp& op, const Range* r) {
  switch (op.kind) {
    case PLOW_SSM_CONV: tile_ssm_conv(c, op, r); return true;
    case PLOW_SSM_SCAN: tile_ssm_scan(c, op, r); return true;
    case PLOW_SSM_NORM: tile_ssm_norm(c, op, r); return true;
    default: return false;
  }
}

}  // namespace plow

#endif
