"""Runs inside the peers' virtualenv (benchmarks/decode_peers.py): llama.cpp at batch > 1
through llama-cpp-python's low-level API (the high-level `Llama.eval` runs one sequence).
One prompt of the context length is prefilled as sequence 0 and its cache cells are shared
with sequences 1..B-1 (`llama_memory_seq_cp`, as plow's rows share the prompt's cached
blocks); a step is one `llama_decode` of B tokens, one per sequence, each with logits.
Prints one JSON object: {"<batch>,<context>": [step seconds, ...]}."""

import json
import sys
import time

import llama_cpp as L

cfg = json.loads(sys.argv[1])
L.llama_backend_init()
model = L.llama_model_load_from_file(cfg["gguf"].encode(), L.llama_model_default_params())
if not model:
    raise SystemExit(f"{cfg['gguf']}: llama.cpp could not load the model")


def decode(lctx, batch, items):
    """One llama_decode of `items` (token, position, sequence, wants logits)."""
    batch.n_tokens = 0
    for tok, pos, seq, want in items:
        i = batch.n_tokens
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, want
        batch.n_tokens += 1
    rc = L.llama_decode(lctx, batch)
    if rc != 0:
        raise SystemExit(f"llama_decode returned {rc}")


out = {}
steps = cfg["warmup"] + cfg["steps"]
for B in cfg["batches"]:
    for ctx in cfg["contexts"]:
        cp = L.llama_context_default_params()
        cp.n_ctx = ctx + B * (steps + 2) + 64
        cp.n_batch = cp.n_ubatch = 512
        cp.n_seq_max = B
        cp.kv_unified = True  # sequences share the prompt's cells
        cp.n_threads = cp.n_threads_batch = cfg["threads"]
        lctx = L.llama_init_from_model(model, cp)
        batch = L.llama_batch_init(512, 0, B)

        prompt = [100 + (i * 7 + 3) % 1000 for i in range(ctx)]
        for s in range(0, ctx, 512):
            chunk = prompt[s : s + 512]
            decode(lctx, batch, [(t, s + j, 0, s + j == ctx - 1) for j, t in enumerate(chunk)])
        mem = L.llama_get_memory(lctx)
        for seq in range(1, B):
            L.llama_memory_seq_cp(mem, 0, seq, -1, -1)
        ts = []
        for s in range(steps):
            t = time.perf_counter()
            decode(lctx, batch, [(200 + s, ctx + s, seq, True) for seq in range(B)])
            if s >= cfg["warmup"]:
                ts.append(time.perf_counter() - t)
        out[f"{B},{ctx}"] = ts
        L.llama_batch_free(batch)
        L.llama_free(lctx)
print(json.dumps(out))
