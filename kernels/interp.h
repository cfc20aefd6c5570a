// plow native kernel — the packet interpreter: decode one 64-byte wire-v1 record and run its
// units. Shared by the host build (kernels/host.cpp); the wait/signal side lives with the
// atomics of each build.
#ifndef PLOW_INTERP_H
#define PLOW_INTERP_H

#include "tiles.h"
#include "moe.h"
#include "gemma4.h"
#include "ssm.h"
#include "deepseek.h"
#include "fused.h"
#include "kda.h"
#include "collective.h"

namespace plow {

struct Record {
  uint32_t opcode, flags, scope, worker, op_index, wait_counter, wait_threshold, signal_counter;
  uint32_t row_start, rows;
};

PLOW_HD static inline uint32_t rd32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

PLOW_HD static inline Record decode_record(const uint8_t* p) {
  Record r;
  r.opcode = p[0];
  r.flags = p[1];
  r.scope = p[2];
  r.worker = static_cast<uint32_t>(p[4]) | static_cast<uint32_t>(p[5]) << 8;
  r.op_index = rd32(p + 8);
  r.wait_counter = rd32(p + 12);
  r.wait_threshold = rd32(p + 16);
  r.signal_counter = rd32(p + 20);
  r.row_start = rd32(p + 24);
  r.rows = rd32(p + 32);
  return r;
}

// Tile `j` of `op`: row-major over the op's axes, last axis fastest; `*step` its index along the
// split reduction axis (-1 when the op is not split).
PLOW_HD static inline void tile_ranges(const PlowOp& op, int64_t j, Range* r, int64_t* step) {
  *step = -1;
  for (int ax = op.naxes - 1; ax >= 0; --ax) {
    const int64_t i = j % op.steps[ax];
    j /= op.steps[ax];
    const int64_t a = i * op.tile[ax], b = a + op.tile[ax];
    r[ax].a = a;
    r[ax].b = b < op.ext[ax] ? b : op.ext[ax];
    if (ax == op.red_axis) *step = i;
  }
  for (int ax = op.naxes; ax < 3; ++ax) r[ax].a = 0, r[ax].b = 1;
}

// Returns the tile's counted work (attention: query-key pairs scored; others 0).
PLOW_HD static int64_t run_tile(const Ctx& c, const PlowOp& op, const Range* r, int64_t step,
                                float* scratch) {
  switch (op.kind) {
    case PLOW_EMBEDDING: tile_embedding(c, op, r); break;
    case PLOW_RMSNORM: tile_rmsnorm(c, op, r, step); break;
    case PLOW_ROPE: tile_rope(c, op, r); break;
    case PLOW_LINEAR:
    case PLOW_LM_HEAD: tile_linear(c, op, r, step); break;
    case PLOW_ATTENTION: return tile_attention(c, op, r, step, scratch);
    case PLOW_GATED_MLP: tile_elementwise(c, op, r); break;
    case PLOW_RESIDUAL_ADD:  // with a scale (Gemma 4's layer_scalar): kernels/gemma4.h
      if (op.w0 != nullptr) tile_residual_scaled(c, op, r); else tile_elementwise(c, op, r);
      break;
    case PLOW_SAMPLE: tile_sample(c, op, r, step); break;
    case PLOW_ROUTER: tile_router(c, op, r); break;
    case PLOW_ROUTER_GROUPED: tile_router_grouped(c, op, r); break;  // kernels/deepseek.h
    case PLOW_EXPERT_LINEAR: return tile_expert(c, op, r, step);
    case PLOW_SSM_CONV:
    case PLOW_SSM_SCAN:
    case PLOW_SSM_NORM: ssm_tile(c, op, r); break;  // kernels/ssm.h (Mamba-2)
    case PLOW_KDA: tile_kda(c, op, r); break;  // kernels/kda.h (Kimi-Linear)
    case PLOW_ADD_RMSNORM: tile_add_rmsnorm(c, op, r, step); break;  // kernels/fused.h (R1)
    case PLOW_LINEAR_GLU: tile_linear_glu(c, op, r, step); break;  // kernels/fused.h (R2+R3+R13)
    case PLOW_LINEAR_QKV: tile_linear_qkv(c, op, r, step); break;  // kernels/fused.h (R4)
    case PLOW_RMSNORM_LM_HEAD: tile_rmsnorm_lm_head(c, op, r, step); break;  // fused_lm.h (R19)
    case PLOW_EMBEDDING_RMSNORM: tile_embedding_rmsnorm(c, op, r); break;    // fused_lm.h (R18)
    case PLOW_ALLREDUCE: tile_allreduce(c, op, r); break;      // kernels/collective.h (tp)
    default: break;  // the loader refuses other kinds
  }
  return 0;
}

PLOW_HD static void run_merge(const Ctx& c, const PlowOp& op, const int64_t* u, float* scratch) {
  switch (op.kind) {
    case PLOW_RMSNORM: merge_rmsnorm(c, op, u); break;
    case PLOW_LINEAR:
    case PLOW_LM_HEAD: merge_linear(c, op, u); break;
    case PLOW_ATTENTION: merge_attention(c, op, u, scratch); break;
    case PLOW_SAMPLE: merge_sample(c, op, u); break;
    case PLOW_EXPERT_LINEAR: merge_linear(c, op, u); break;  // the sum over experts
    case PLOW_ADD_RMSNORM: merge_add_rmsnorm(c, op, u); break;  // kernels/fused.h (R1)
    case PLOW_LINEAR_GLU: merge_linear_glu(c, op, u); break;    // kernels/fused.h (R2+R3+R13)
    case PLOW_LINEAR_QKV: merge_linear_qkv(c, op, u); break;    // kernels/fused.h (R4)
    case PLOW_RMSNORM_LM_HEAD: merge_linear(c, op, u); break;   // kernels/fused_lm.h (R19)
    default: break;
  }
}

// The work of one task packet (a nop or a load does none); returns its counted work.
PLOW_HD static int64_t run_record(const Ctx& c, const Record& rec, float* scratch) {
  if (rec.opcode == PLOW_OP_NOP || rec.opcode == PLOW_OP_LOAD) return 0;
  const PlowOp& op = c.plan->ops[rec.op_index];
  if (rec.flags & PLOW_FLAG_ACCUMULATE) {
    for (uint32_t k = 0; k < rec.rows; ++k)
      run_merge(c, op, op.merge + 8 * (rec.row_start + k), scratch);
    return 0;
  }
  Range r[3];
  int64_t step, work = 0;
  for (uint32_t k = 0; k < rec.rows; ++k) {
    tile_ranges(op, rec.row_start + k, r, &step);
    work += run_tile(c, op, r, step, scratch);
  }
  return work;
}

}  // namespace plow
#endif
