// plow native kernel — R19 (plow/egraph/apply.py, issue 15): the final rmsnorm in the
// lm_head's prologue; and R18, the first rmsnorm beside the embedding gather (at the end). The op table has no kind of its own for it: an `lm_head` whose third
// input is the norm's weight (attributes the norm's: eps, offset); the loader
// (plow/runtime/native/lower.py) gives it the kernel kind PLOW_RMSNORM_LM_HEAD.
//
// The tile normalises each of its input rows as tiles.h's unsplit rmsnorm does (sumsq over the
// whole row, its 32 lanes; sqrtf(var + eps); (x / den) * (offset + w)) into a private row, then
// runs tiles.h's linear_rows over it (the linear's dot order), so each logit is the unfused
// norm-then-lm_head's bits wherever the unfused norm was unsplit. Every tile normalises whole
// rows, so a k split (which the tiler does not choose for it) would still be correct: its
// partials are the k slices' dots, merged by merge_linear. Logits are written, then the fused
// argmax chunks as tile_linear writes them. No softcap (R19 fuses only an lm_head without one).
//
// t0 x, t1 logits, t2 partial [d3 steps, M, N]; d0 M, d1 N, d2 K, d3 steps; f1 eps, f2 offset;
// w0 the lm_head weight [N, K]; table the norm weight [K] widened to fp32 by the loader (the
// values weight_at reads from a bf16 / fp32 weight, so the products are the unfused norm's).
#ifndef PLOW_FUSED_LM_H
#define PLOW_FUSED_LM_H

#include "tiles.h"
#if !defined(__CUDACC__) && !defined(__HIPCC__)
#include <vector>
#endif

namespace plow {

enum PlowFusedLmKind { PLOW_RMSNORM_LM_HEAD = 33, PLOW_EMBEDDING_RMSNORM = 34 };

// tile_rmsnorm's den of one full-width row, and norm_apply's value of its column j
PLOW_HD static inline float prologue_den(const PlowOp& op, const float* xi, int64_t K) {
  const float var = sumsq(xi, K) / static_cast<float>(K);
  return sqrtf(var + op.f[1]);
}
PLOW_HD static inline float prologue_norm(const PlowOp& op, float x, float den, int64_t j) {
  return (x / den) * (op.f[2] + op.table[j]);
}

#if !defined(__CUDACC__) && !defined(__HIPCC__)
// host: up to 16 rows at a time normalised into a thread's private rows (stride K, columns of
// the tile's k slice), then linear_rows as tile_linear runs it
static void tile_rmsnorm_lm_head(const Ctx& c, const PlowOp& op, const Range* r, int64_t step) {
  const int64_t M = op.d[0], N = op.d[1], K = op.d[2];
  const int64_t k0 = r[2].a, kn = r[2].b - r[2].a;
  const float* x = c.A + op.t[0];
  float* dst = step >= 0 ? c.A + op.t[2] + step * M * N : c.A + op.t[1];
  thread_local std::vector<float> buf;
  constexpr int64_t kRows = 16;
  if (static_cast<int64_t>(buf.size()) < kRows * K) buf.resize(kRows * K);
  for (int64_t m0 = r[0].a; m0 < r[0].b; m0 += kRows) {
    const int64_t m1 = m0 + kRows < r[0].b ? m0 + kRows : r[0].b;
    for (int64_t m = m0; m < m1; ++m) {
      const float* xi = x + m * K;
      const float den = prologue_den(op, xi, K);
      float* bi = buf.data() + (m - m0) * K;
      for (int64_t j = k0; j < k0 + kn; ++j) bi[j] = prologue_norm(op, xi[j], den, j);
    }
    linear_rows(buf.data(), K, k0, kn, op.w0, op.w0_dtype, 0, m1 - m0, r[1].a, r[1].b,
                [&](int64_t i, int64_t n, float y) { dst[(m0 + i) * N + n] = y; });
  }
  if (step < 0 && c.plan->fused_lm >= 0 && &op == &c.plan->ops[c.plan->fused_lm])
    argmax_chunks(c, op, r[0].a, r[0].b, r[1].a, r[1].b);
}
#else
// device: one thread per tile (correct, not fast): each dot in dot_f32's lane order over the
// normalised values
PLOW_HD static void tile_rmsnorm_lm_head(const Ctx& c, const PlowOp& op, const Range* r,
                                         int64_t step) {
  const int64_t M = op.d[0], N = op.d[1], K = op.d[2];
  const int64_t k0 = r[2].a, kn = r[2].b - r[2].a;
  const float* x = c.A + op.t[0];
  float* dst = step >= 0 ? c.A + op.t[2] + step * M * N : c.A + op.t[1];
  for (int64_t m = r[0].a; m < r[0].b; ++m) {
    const float* xi = x + m * K;
    const float den = prologue_den(op, xi, K);
    for (int64_t n = r[1].a; n < r[1].b; ++n) {
      float acc[PLOW_LANES] = {0};
      int64_t k = 0;
      for (; k + PLOW_LANES <= kn; k += PLOW_LANES)
        for (int l = 0; l < PLOW_LANES; ++l) {
          const int64_t j = k0 + k + l;
          acc[l] = fmaf(prologue_norm(op, xi[j], den, j), weight_at(op.w0, op.w0_dtype, n * K + j),
                        acc[l]);
        }
      for (int l = 0; k + l < kn; ++l) {
        const int64_t j = k0 + k + l;
        acc[l] = fmaf(prologue_norm(op, xi[j], den, j), weight_at(op.w0, op.w0_dtype, n * K + j),
                      acc[l]);
      }
      dst[m * N + n] = lanes_sum(acc);
    }
  }
  if (step < 0 && c.plan->fused_lm >= 0 && &op == &c.plan->ops[c.plan->fused_lm])
    argmax_chunks(c, op, r[0].a, r[0].b, r[1].a, r[1].b);
}
#endif

// R18: the first norm beside the embedding gather — an `embedding` whose third input is the
// norm's weight (attributes the embedding's, the norm's under "norm"). t0 ids, t1 rows, t2 their
// norm; d0 H; f0 scale, f1 eps, f2 offset; w0 the table; table the norm weight [H] in fp32.
// A tile holds whole rows (the tiler does not split its columns): tiles.h's tile_embedding
// writes them, then each row's norm as tiles.h's unsplit rmsnorm computes it.
PLOW_HD static void tile_embedding_rmsnorm(const Ctx& c, const PlowOp& op, const Range* r) {
  tile_embedding(c, op, r);
  const float* rows = c.A + op.t[1];
  float* out = c.A + op.t[2];
  const int64_t H = op.d[0];
  for (int64_t i = r[0].a; i < r[0].b; ++i) {
    const float den = prologue_den(op, rows + i * H, H);
    for (int64_t j = 0; j < H; ++j) out[i * H + j] = prologue_norm(op, rows[i * H + j], den, j);
  }
}

}  // namespace plow
#endif
