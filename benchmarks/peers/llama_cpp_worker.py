"""Runs inside the peers' virtualenv (benchmarks/decode_peers.py): llama.cpp through
llama-cpp-python on one GGUF file. Batch 1: `eval` one token per step after a prompt of the
context length (logits of the last token; no sampling). Prints one JSON object:
{"<context>": [step seconds, ...]}."""

import json
import sys
import time

from llama_cpp import Llama

cfg = json.loads(sys.argv[1])
llm = Llama(
    model_path=cfg["gguf"],
    n_ctx=cfg["n_ctx"],
    n_threads=cfg["threads"],
    n_threads_batch=cfg["threads"],
    n_batch=512,
    verbose=False,
)
out = {}
for ctx in cfg["contexts"]:
    llm.reset()
    llm.eval([100 + (i * 7 + 3) % 1000 for i in range(ctx)])
    ts = []
    for s in range(cfg["warmup"] + cfg["steps"]):
        t = time.perf_counter()
        llm.eval([200 + s])
        if s >= cfg["warmup"]:
            ts.append(time.perf_counter() - t)
    out[str(ctx)] = ts
print(json.dumps(out))
