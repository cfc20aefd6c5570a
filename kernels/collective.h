// plow native kernel — the tensor-parallel collective (plow/graph/shard.py, docs/parallel.md).
//
// allreduce: one op per device d; its tiles read the box of every device's partial (the
// row-parallel o_proj / down_proj of each device writes one into its part of the arena) and
// write the box of device d's sum, p_0 + p_1 + ... + p_{n-1} in device order, so every
// device's copy of the residual stream is the same bits. A one-shot collective (each device
// reads all n partials: a tree of depth one); the partials' producers signal system-scope
// counters (checkpoint D), the only counters of the plan that cross devices. The partials and
// the sums live in the arena like any activation (kernels/host.cpp runs every device's workers
// over one arena; plow/memory keeps every live buffer disjoint, checkpoint F).
// Shared by the host and device builds (PLOW_HD helpers only).
#ifndef PLOW_COLLECTIVE_H
#define PLOW_COLLECTIVE_H

#include "tiles.h"

namespace plow {

// Op kinds of the op table (PlowKind continues here; plow/runtime/native/lower.py).
enum PlowCollectiveKind { PLOW_ALLREDUCE = 50 };
// Its packets' wire opcode (docs/wire.md; also a tensor-parallel merge's).
enum PlowCollectiveOpcode { PLOW_OP_ALLREDUCE = 15 };

// allreduce: t0 .. t(d1 - 1) the partials (device order), t7 the sum; d0 columns, d1 devices
PLOW_HD static void tile_allreduce(const Ctx& c, const PlowOp& op, const Range* r) {
  float* out = c.A + op.t[7];
  const int64_t C = op.d[0];
  const int64_t n = op.d[1];
  for (int64_t i = r[0].a; i < r[0].b; ++i)
    for (int64_t j = r[1].a; j < r[1].b; ++j) {
      const int64_t e = i * C + j;
      float s = c.A[op.t[0] + e];
      for (int64_t k = 1; k < n; ++k) s = s + c.A[op.t[k] + e];
      out[e] = s;
    }
}

}  // namespace plow
#endif
