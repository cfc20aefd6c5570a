// plow native kernel — DeepSeek-V3's grouped sigmoid router (issue 18).
//
// The op table's kind `router` with attribute scoring "sigmoid" (plow/graph/build.py); the
// loader gives it kind PLOW_ROUTER_GROUPED (plow/runtime/native/lower.py), the wire opcode
// stays the router's. Latent attention needs no kernel: it is lowered to linears, norms,
// rope and attention (plow/graph/mla.py). Shared by the host and device builds.
#ifndef PLOW_DEEPSEEK_H
#define PLOW_DEEPSEEK_H

#include "tiles.h"

namespace plow {

enum PlowDeepseekKind { PLOW_ROUTER_GROUPED = 40 };

// The choice value of expert e: its sigmoid score plus the correction bias (w0; none: 0).
PLOW_HD static inline float grouped_choice(const PlowOp& op, const float* s, int64_t e) {
  return op.w0 != nullptr ? s[e] + weight_at(op.w0, op.w0_dtype, e) : s[e];
}

// (a, i) ranks before (b, j): larger value first, ties to the lower index.
PLOW_HD static inline bool grouped_before(float a, int64_t i, float b, int64_t j) {
  return a > b || (a == b && i < j);
}

// The value of group g of `gs` experts: the sum of its two best choice values.
PLOW_HD static float grouped_value(const PlowOp& op, const float* s, int64_t g, int64_t gs) {
  float b1 = 0.0f, b2 = 0.0f;
  int64_t i1 = -1, i2 = -1;
  for (int64_t e = g * gs; e < (g + 1) * gs; ++e) {
    const float v = grouped_choice(op, s, e);
    if (i1 < 0 || grouped_before(v, e, b1, i1)) {
      b2 = b1, i2 = i1, b1 = v, i1 = e;
    } else if (i2 < 0 || grouped_before(v, e, b2, i2)) {
      b2 = v, i2 = e;
    }
  }
  return gs > 1 ? b1 + b2 : b1;
}

// Group g is eligible: fewer than topk_group groups rank before it.
PLOW_HD static bool grouped_eligible(const PlowOp& op, const float* s, int64_t g, int64_t G,
                                     int64_t gs, int64_t topk_group) {
  const float mine = grouped_value(op, s, g, gs);
  int64_t better = 0;
  for (int64_t h = 0; h < G && better < topk_group; ++h)
    if (h != g && grouped_before(grouped_value(op, s, h, gs), h, mine, g)) ++better;
  return better < topk_group;
}

// -- router (grouped): rows [a, b) of the router logits [rows, E] -> dense combine weights ---
// t0 logits, t1 out; d0 E, d1 top_k, d2 renormalise (norm_topk_prob), d3 n_group,
// d4 topk_group; f0 routed_scaling_factor; w0 e_score_correction_bias [E] (none: 0).
// Scores sigmoid(x) in fp32; the topk_group best groups (a group's value the sum of its two
// best score + bias) are eligible; the top_k best eligible experts by score + bias keep their
// scores, divided by their sum (+1e-20) when d2, times f0; every other weight is exactly 0
// (plow.runtime.numpy_ops.grouped_router). The selection keeps no marks: the j-th pick is
// the best expert ranking after the (j-1)-th, so the row's scores stay in `out` untouched.
PLOW_HD static void tile_router_grouped(const Ctx& c, const PlowOp& op, const Range* r) {
  const float* x = c.A + op.t[0];
  float* out = c.A + op.t[1];
  const int64_t E = op.d[0], k = op.d[1], G = op.d[3] > 0 ? op.d[3] : 1, tg = op.d[4];
  const int64_t gs = E / G;
  for (int64_t i = r[0].a; i < r[0].b; ++i) {
    const float* row = x + i * E;
    float* s = out + i * E;
    for (int64_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + expf(-row[e]));
    // the eligible groups (n_group <= 1024: plow.checkpoint.families.deepseek_v3)
    bool keep[1024];
    for (int64_t g = 0; g < G && g < 1024; ++g) keep[g] = grouped_eligible(op, s, g, G, gs, tg);
    // the k-th pick (last_v, last_i): walk k times to the best expert after the previous pick
    float last_v = 0.0f;
    int64_t last_i = -1;
    for (int64_t j = 0; j < k; ++j) {
      float bv = 0.0f;
      int64_t bi = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (!keep[e / gs]) continue;
        const float v = grouped_choice(op, s, e);
        if (last_i >= 0 && !grouped_before(last_v, last_i, v, e)) continue;  // picked before
        if (bi < 0 || grouped_before(v, e, bv, bi)) bv = v, bi = e;
      }
      last_v = bv, last_i = bi;
    }
    // picked: eligible and ranking no later than the k-th pick
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e)
      if (keep[e / gs] && !grouped_before(last_v, last_i, grouped_choice(op, s, e), e))
        sum += s[e];
    const float denom = op.d[2] ? sum + 1e-20f : 1.0f;
    for (int64_t e = 0; e < E; ++e) {  // each reads only its own score before writing it
      const bool picked =
          keep[e / gs] && !grouped_before(last_v, last_i, grouped_choice(op, s, e), e);
      s[e] = picked ? s[e] / denom * op.f[0] : 0.0f;
    }
  }
}

}  // namespace plow
#endif
