// plow native kernel — Gemma 4's one addition to the element-wise tiles (docs/families.md).
//
// residual_add with a third input: the layer's `layer_scalar` [1] multiplies the sum,
// out = (x + y) * s, as transformers' Gemma4TextDecoderLayer (`hidden_states *= layer_scalar`
// after the residual add). The loader (plow/runtime/native/lower.py) passes s as the op's
// weight w0; a residual_add without it is tiles.h's tile_elementwise. Shared by the host and
// device builds (only PLOW_HD helpers of tiles.h are used).
#ifndef PLOW_GEMMA4_H
#define PLOW_GEMMA4_H

#include "tiles.h"

namespace plow {

// t0 x, t1 y, t2 out; d0 columns; w0 the scale [1]
PLOW_HD static void tile_residual_scaled(const Ctx& c, const PlowOp& op, const Range* r) {
  const float* x = c.A + op.t[0];
  const float* y = c.A + op.t[1];
  float* out = c.A + op.t[2];
  const int64_t C = op.d[0];
  const float s = weight_at(op.w0, op.w0_dtype, 0);
  for (int64_t i = r[0].a; i < r[0].b; ++i)
    for (int64_t j = r[1].a; j < r[1].b; ++j) {
      const int64_t e = i * C + j;
      out[e] = (x[e] + y[e]) * s;
    }
}

}  // namespace plow
#endif
