// plow native kernel — the C ABI between the Python loader and the persistent kernel.
//
// The loader (plow/runtime/native/lower.py) fills one PlowPlan per bucket from a certified
// bundle: the plan file's 64-byte wire-v1 records as they are, plus the op table lowered to
// flat descriptors (which tensor sits at which arena word, which weight pointer, the tile
// geometry). The kernel reads the records itself: opcode, flags, worker, wait / signal
// counters, threshold, op_index, row_start, rows. Nothing here is specific to the host or a
// GPU; kernels/host.cpp runs it on CPU threads.
#ifndef PLOW_ABI_H
#define PLOW_ABI_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PLOW_ABI_VERSION 3  // 3: op kind allreduce (kernels/collective.h)
#define PLOW_RECORD_SIZE 64

// Op kinds (the op table's `kind`), not wire opcodes.
enum PlowKind {
  PLOW_EMBEDDING = 1,
  PLOW_RMSNORM = 2,
  PLOW_ROPE = 3,
  PLOW_LINEAR = 4,
  PLOW_LM_HEAD = 5,
  PLOW_ATTENTION = 6,
  PLOW_GATED_MLP = 7,
  PLOW_RESIDUAL_ADD = 8,
  PLOW_SAMPLE = 9,
};

// Weight storage dtypes: weights run in their stored precision.
// weights: fp32, bf16, or GGML blocks of 32 (kernels/blocks.h; plow/checkpoint/quant.py)
enum PlowDType { PLOW_NONE = 0, PLOW_F32 = 1, PLOW_BF16 = 2, PLOW_Q4_0 = 3, PLOW_Q4_1 = 4, PLOW_Q8_0 = 5 };

// Wire-v1 opcodes and flags the interpreter reads (docs/wire.md).
enum PlowOpcode {
  PLOW_OP_NOP = 0, PLOW_OP_LOAD = 1, PLOW_OP_EMBED = 2, PLOW_OP_RMSNORM = 3,
  PLOW_OP_LINEAR = 4, PLOW_OP_ROPE = 5, PLOW_OP_ATTENTION = 6, PLOW_OP_ATTENTION_MERGE = 7,
  PLOW_OP_MLP_GATE_UP = 8, PLOW_OP_MLP_DOWN = 9, PLOW_OP_RESIDUAL_ADD = 10,
  PLOW_OP_LM_HEAD = 11, PLOW_OP_SAMPLE = 12,
};
#define PLOW_FLAG_ACCUMULATE 16u
#define PLOW_NO_COUNTER 0xFFFFFFFFu

// One op of the op table. `t[]` are absolute arena word offsets (-1: none), meaning per kind:
//   embedding   t0 ids, t1 out
//   rmsnorm     t0 x, t1 out, t2 partial (sums of squares)
//   rope        t0 x, t1 positions, t2 out
//   linear      t0 x, t1 out, t2 partial; lm_head the same
//   attention   t0 q, t1 k, t2 v, t3 positions, t4 out, t5 partial o, t6 partial (m, l)
//   gated_mlp   t0 gate, t1 up, t2 out; residual_add t0 x, t1 y, t2 out
//   sample      t0 logits, t1 sample_index, t2 out (ids), t3 partial value, t4 partial index
// `d[]` / `f[]` are per-kind integers / floats (kernels/tiles.h names them).
typedef struct {
  int32_t kind;
  int32_t opcode;      // the op table's opcode: every task packet of the op must carry it
  int32_t red_axis;    // split reduction axis, -1 when the op's reduction is not split
  int32_t naxes;
  int64_t ext[3], tile[3], steps[3];
  int64_t t[8];
  int64_t d[8];
  float f[8];
  const void* w0;      // the op's weight (embedding table, norm weight, linear weight)
  const void* w1;      // linear bias
  int32_t w0_dtype, w1_dtype;
  const float* table;  // rope: inverse frequencies [head_dim / 2]
  const int64_t* merge;  // split ops: merge units, 8 per unit: r0 r0' r1 r1' r2 r2' c0 c1
  int64_t n_merge;
} PlowOp;

typedef struct {
  int32_t abi;                 // PLOW_ABI_VERSION
  int32_t n_workers;
  int64_t n_records;
  const uint8_t* records;      // the plan file after its 32-byte header
  int64_t n_ops;
  const PlowOp* ops;
  int64_t n_counters;
  // the paged key-value pool: [layers, 2, blocks, kv_heads, block_size, head_dim] (kv_dtype)
  int64_t kv_off, kv_layers, kv_blocks, kv_heads, kv_block, kv_dim;
  int64_t page_table, page_cols;  // int32 [batch, page_cols]
  // greedy fused into lm_head (-1: not fused): per-chunk (max, argmax) partials [chunks, M]
  int32_t fused_lm, fused_sample;
  int64_t n_chunks;
  const int64_t* bounds;       // n_chunks + 1 column bounds
  int64_t fused_values, fused_index;
  int32_t kv_dtype;            // the pool's storage: PLOW_F32, or PLOW_BF16 (opt-in, lossy)
  int32_t kv_halves;           // 2: keys then values; 1: values are keys (one row per token)
} PlowPlan;

// One batch row of a multi-step quantum (the step epilogue, kernels/sampler.h).
typedef struct {
  int32_t active;        // 0: padding (no request in this row)
  int32_t greedy;        // 1: the packets' argmax; 0: sampled with the filters below
  float temperature, top_p, min_p;
  int32_t top_k;
  int32_t n_stop;
  const int32_t* stop;   // stop token ids
  const double* uniforms;  // one per step of the quantum (stochastic rows), from its generator
} PlowRow;

// Where the epilogue reads and writes (absolute arena words), and the bucket's shape.
typedef struct {
  int64_t out, positions, sample_index, ring, remaining, logits;
  int64_t batch, tokens, vocab, context;
} PlowQuantum;

// Lifecycle. Errors: NULL / non-zero return and a one-line message in `err`.
void* plow_plan_new(const PlowPlan* plan, char* err, int64_t errlen);
void plow_plan_free(void* handle);
// One step: every worker queue of the plan run to its end by `threads` host threads.
// Returns 0, or -1 with a message in `err` (a stuck step: no counter moved for `timeout_ms`).
int32_t plow_plan_dispatch(void* handle, float* arena, int64_t arena_words, int32_t threads,
                           int64_t timeout_ms, char* err, int64_t errlen);
// `steps` dispatches back to back, each followed by the epilogue (sample stochastic rows, append
// every row's token to ring[step, row], shrink its budget, advance or retire its position).
int32_t plow_plan_quantum(void* handle, float* arena, int64_t arena_words, int32_t threads,
                          int64_t timeout_ms, int32_t steps, const PlowQuantum* q,
                          const PlowRow* rows, char* err, int64_t errlen);
// Records run by the last dispatch (task packets, nops) — for stats and tests.
void plow_plan_last_counts(void* handle, int64_t* out3);
// Per-op nanoseconds spent in task packets since the last call (summed over threads; `out_ns`
// has one slot per op, may be NULL), then profiling switched on or off for later steps.
void plow_plan_profile(void* handle, int32_t enable, int64_t* out_ns);
// Counted work per op in the last dispatch (attention: query-key pairs scored), one slot per op.
void plow_plan_work(void* handle, int64_t* out);
const char* plow_build_info(void);

#ifdef __cplusplus
}
#endif
#endif
