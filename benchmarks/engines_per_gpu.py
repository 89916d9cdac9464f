"""Rollout tokens/s of one vLLM engine on a GPU against several engines sharing it.

    python benchmarks/gpu_rollout.py --write /tmp/q3r          # the model and prompts
    python benchmarks/engines_per_gpu.py --model /tmp/q3r --engines 1 2 --out $OUT

Why: with each sampled token's log-prob asked (as Molt asks), one vLLM 0.26 engine on an H200 is
bound by its two processes' CPU (the API server busy 90-95% of the batch, the engine core 67-78%;
docs/benchmarks.md, H200 run4), not by the GPU, which decodes 1.7x faster when no log-prob is
asked. Several engines on one GPU each bring their own two processes. This starts k servers at once
on the same GPU sharing the memory one engine gets (`gpu_rollout.MEMORY`, the colocated default;
each gets an explicit KV cache size), sends the same prompts x samples round-robin over them all at
once (aiohttp, as the runners), with and without the log-prob, and prints the total generated
tokens/s for each k and its ratio to k = 1, all in one run.
"""

import argparse
import contextlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from gpu_rollout import MEMORY, send, server

GIB = 1 << 30
# One engine's memory besides its KV cache for gpu_rollout.py's 1.7B model (vLLM 0.26's log on
# an H200: weights 3.79, peak activation 0.64, non-torch 0.22, CUDA graphs 0.52 GiB).
ENGINE_BYTES = int(5.2 * GIB)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/engines_per_gpu")))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 64 * GIB
    results = {}
    for k in args.engines:
        # vLLM sizes the KV cache from the free memory it sees at start-up, which another engine
        # starting beside it changes: give each its cache explicitly (the KV cache of one engine
        # at MEMORY, less each other engine's own use, split k ways).
        kv = int((float(MEMORY) * total - k * ENGINE_BYTES) / k)
        share = ["--kv-cache-memory", str(kv)]
        with contextlib.ExitStack() as stack, ThreadPoolExecutor(k) as pool:
            # started side by side: each server's start-up waits in a thread of its own
            names = [f"k{k}_{i}" for i in range(k)]
            launch = [server(args.model, args.out, share, name=name) for name in names]
            servers = list(pool.map(stack.enter_context, launch))
            urls = [url for url, _ in servers]
            row = {}
            for logprobs in (False, True):
                tokens, seconds = send(urls, args.model, args.samples, args.max_tokens, logprobs)
                row["logprobs" if logprobs else "plain"] = tokens / seconds
        results[k] = row
        base = results[args.engines[0]]
        ratio = {key: row[key] / base[key] for key in row}
        print(f"{k} engine(s): {row['plain']:8.0f} tokens/s plain ({ratio['plain']:.2f}x), "
              f"{row['logprobs']:8.0f} with the log-prob ({ratio['logprobs']:.2f}x)",
              flush=True)  # fmt: skip
        (args.out / "engines_per_gpu.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
