"""Runs inside vLLM's own virtualenv (benchmarks/decode_peers.py): vLLM's CPU build, offline
`LLM.generate` with greedy sampling and `ignore_eos`. A decode step's time is taken from two
generations of the same prompts: (t(1 + steps tokens) - t(1 token)) / steps, which removes the
prefill and the first token. Prints {"<batch>,<context>": [per-token seconds, ...]}."""

import json
import sys
import time

from vllm import LLM, SamplingParams


def main() -> None:  # vLLM's engine core is a spawned process: the module must import cleanly
    cfg = json.loads(sys.argv[1])
    llm = LLM(
        model=cfg["model"],
        dtype=cfg["dtype"],
        max_model_len=cfg["n_ctx"],
        max_num_seqs=max(cfg["batches"]),
        enforce_eager=True,
        seed=0,
        # the CPU backend reserves this share of the node's memory for its key-value cache
        gpu_memory_utilization=cfg.get("memory_share", 0.2),
    )
    out = {}
    for b in cfg["batches"]:
        for ctx in cfg["contexts"]:
            prompts = [
                {"prompt_token_ids": [100 + (i * 7 + 3 + r) % 1000 for i in range(ctx)]}
                for r in range(b)
            ]

            def run(n: int, prompts: list = prompts) -> float:
                sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                t = time.perf_counter()
                llm.generate(prompts, sp, use_tqdm=False)
                return time.perf_counter() - t

            run(2)  # warm-up
            per = []
            for _ in range(cfg["repeats"]):
                short, long = run(1), run(1 + cfg["steps"])
                per.append((long - short) / cfg["steps"])
            out[f"{b},{ctx}"] = per
    print(json.dumps(out))


if __name__ == "__main__":
    main()
