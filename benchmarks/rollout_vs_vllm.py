"""Rollout on one GPU: Molt against bare vLLM on the same prompts, and k bare engines sharing the
GPU against one.

    python benchmarks/rollout_vs_vllm.py --write /tmp/q3r     # random Qwen3-1.7B shape, prompts
    python benchmarks/rollout_vs_vllm.py --model /tmp/q3r --steps 3 --out DIR
    python benchmarks/rollout_vs_vllm.py --model /tmp/q3r --engines 1 2 --out DIR

The second command runs, one after the other on the same GPU:
  bare: vLLM's OpenAI server (with the engine flags Molt passes too: dtype, memory share,
        context), every prompt x sample sent at once to /v1/completions as token ids, once
        without log-probs and once asking each sampled token's log-prob, as Molt does;
  molt: `molt-train` colocated (--train.colocate, refit over CUDA IPC), synchronous
        (--train.force_on_policy, so each step's generation has the GPU alone), with this
        file's Env (reward: the share of even token ids in the reply), the same prompts and
        sampling;
and prints generated tokens/s of both and their ratio (Molt / bare), Molt's refit phases and
step breakdown (medians over the steps after the first) and `is/vllm_kl`.

The third starts k bare servers at once on the GPU for each k of --engines, sharing the memory
one engine gets (each with an explicit KV cache size), sends the same prompts x samples
round-robin over them, with and without the log-prob, and prints the total generated tokens/s
for each k and its ratio to the first k. Asked for each sampled token's log-prob, one engine can
be bound by its processes' CPU rather than by the GPU; each engine brings its own processes.

Both sides send with aiohttp, the runners' client library. The model: Qwen3-1.7B's shape (28
layers, hidden 2048, 151,936 vocabulary; 2.03 B parameters, 4.06 GB in bf16) with random
weights, and Molt's tiny tokenizer widened to the same vocabulary (ids past its own are plain
tokens `w<id>`, reachable by sampling only). `--write DIR --tiny` writes a 2-layer model to
check the script on CPU. Raw results and every server's log go to --out.
"""

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from molt_rollout import Env, EnvRunner, EnvState, Result

VOCAB = 151936
MEMORY = "0.45"  # the engine's share beside the trainer (--train.colocate's default)
MAX_LEN = "2048"  # the engines' context
# The bare server's flags: what Molt's engines are also given.
BARE_FLAGS = ["--dtype", "bfloat16", "--gpu-memory-utilization", MEMORY, "--max-model-len", MAX_LEN]
GIB = 1 << 30
# One engine's memory besides its KV cache for this 1.7B model (vLLM's log on an H200: weights
# 3.79, peak activation 0.64, non-torch 0.22, CUDA graphs 0.52 GiB).
ENGINE_BYTES = int(5.2 * GIB)


class EvenTokens(Env):
    """Molt's side's task: any random model earns about 0.5 and can learn more."""

    async def step(self, state: EnvState) -> Result:
        ids = state.token_ids
        value = sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1)
        return Result(reward=value, score=value)


class AgentRunner(EnvRunner):  # `--train.agent_path` is this file
    env_class = EvenTokens


def write(path: Path, prompts: int, tiny: bool = False) -> None:
    """The random model (`tiny`: 2 narrow layers), the widened tokenizer and `prompts.jsonl`."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from molt_capture.tiny_tokenizer import build_tiny_tokenizer

    build_tiny_tokenizer(path)
    own = len(PreTrainedTokenizerFast.from_pretrained(str(path)))
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["model"]["vocab"].update({f"w{i}": i for i in range(own, VOCAB)})
    (path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    shape = (2, 64, 128, 2, 1, 32) if tiny else (28, 2048, 6144, 16, 8, 128)
    layers, hidden, intermediate, heads, kv_heads, head_dim = shape
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path))
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "river",
        "stone",
        "cloud",
        "seven",
        "orange",
        "quiet",
    ]
    rng = random.Random(0)
    with (path / "prompts.jsonl").open("w") as f:
        for i in range(prompts):
            text = " ".join(rng.choice(words) for _ in range(12))
            row = {"prompt": [{"role": "user", "content": f"{i}: {text}"}], "label": ""}
            f.write(json.dumps(row) + "\n")
    print(f"wrote {path}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")


@functools.cache  # send() runs several times over the same prompts
def prompt_ids(path: Path) -> list[list[int]]:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    rows = [json.loads(line) for line in (path / "prompts.jsonl").open()]
    render = tokenizer.apply_chat_template
    return [render(r["prompt"], add_generation_prompt=True, return_dict=False) for r in rows]


@contextlib.contextmanager
def server(path: Path, out: Path, extra: list[str] = (), name: str = "bare_server"):
    """vLLM's OpenAI server alone (BARE_FLAGS, then `extra`); yields (url, start-up seconds)
    once it answers /health; its log in out/name.log."""
    import httpx

    from molt_rollout.network import free_port

    port = free_port()
    module = "vllm.entrypoints.openai.api_server"
    command = [sys.executable, "-m", module, "--model", str(path), "--port", str(port)]
    log = (out / f"{name}.log").open("w")
    process = subprocess.Popen(
        [*command, *BARE_FLAGS, *extra], stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        start = time.monotonic()
        while time.monotonic() - start < 600:
            if process.poll() is not None:
                raise RuntimeError(f"bare vLLM exited: see {out / name}.log")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        yield url, time.monotonic() - start
    finally:
        process.terminate()
        process.wait(60)


def send(urls: list[str], path: Path, samples: int, max_tokens: int, logprobs: bool):
    """Every prompt x sample at once to /v1/completions, request i to urls[i % len(urls)]:
    (generated tokens, seconds). `logprobs`: each sampled token's log-prob, as Molt asks."""
    import aiohttp

    prompts = prompt_ids(path)

    async def run() -> tuple[int, float]:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:

            async def one(url, ids):
                body = {"model": str(path), "prompt": ids, "max_tokens": max_tokens}
                body.update(temperature=1.0, top_p=1.0, **({"logprobs": 0} if logprobs else {}))
                async with http.post(url + "/v1/completions", json=body) as reply:
                    reply.raise_for_status()
                    return (await reply.json())["usage"]["completion_tokens"]

            await asyncio.gather(*(one(url, prompts[0]) for url in urls))  # warm
            work = [p for p in prompts for _ in range(samples)]
            start = time.perf_counter()
            counts = await asyncio.gather(
                *(one(urls[i % len(urls)], p) for i, p in enumerate(work))
            )
            return sum(counts), time.perf_counter() - start

    return asyncio.run(run())


def bare(args) -> dict:
    """vLLM's server alone: generated tokens/s without log-probs and asking the sampled one's."""
    with server(args.model, args.out) as (url, startup):
        tokens, seconds = send([url], args.model, args.samples, args.max_tokens, logprobs=False)
        asked, asked_s = send([url], args.model, args.samples, args.max_tokens, logprobs=True)
    return dict(
        startup_s=startup,
        tokens=tokens,
        seconds=seconds,
        tokens_per_s=tokens / seconds,
        logprobs_tokens_per_s=asked / asked_s,
    )


def molt(args) -> dict:
    """`molt-train`, colocated and synchronous, on the same prompts: the median over the steps
    after the first (which also pays CUDA-graph and allocator warm-up)."""
    path, out = args.model, args.out
    prompts = sum(1 for _ in (path / "prompts.jsonl").open())
    flags = {
        "--actor.model_path": path,
        "--data.train_files": path / "prompts.jsonl",
        "--train.agent_path": Path(__file__).resolve(),
        "--actor.num_workers": 1,
        "--train.num_steps": args.steps,
        "--rollout.groups_per_batch": prompts,
        "--rollout.n_samples_per_prompt": args.samples,
        "--rollout.max_tokens": args.max_tokens,
        "--rollout.num_runners": 4,
        "--vllm.dtype": "bfloat16",
        "--vllm.max_model_len": MAX_LEN,
        "--vllm.gpu_memory_utilization": MEMORY,
        "--logger.wandb_mode": "disabled",
        "--logger.tensorboard": False,
        "--train.output_dir": out,
        "--logger.run_name": "molt",
        "--ckpt.every_steps": 0,
    }
    command = [
        sys.executable,
        "-m",
        "molt_train.cli",
        "--train.colocate",
        "--train.force_on_policy",
    ]
    command += [str(x) for pair in flags.items() for x in pair] + args.molt_args
    start = time.monotonic()
    with (out / "molt.log").open("w") as log:
        env = dict(os.environ, RAY_AUTH_MODE="disabled")
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if code:
        raise RuntimeError(f"molt-train exited {code}: see {out / 'molt.log'}")
    rows = [json.loads(line) for line in (out / "molt" / "metrics.jsonl").open()]
    later = rows[1:] or rows
    tokens = [r["rollout/response_length_mean"] * r["rollout/count"] for r in later]
    per_s = [t / r["timing/generation"] for t, r in zip(tokens, later, strict=True)]
    keys = sorted(k for k in rows[-1] if k.startswith(("timing/", "is/")))
    medians = {k: statistics.median(r[k] for r in later if r.get(k) is not None) for k in keys}
    return dict(
        wall_s=time.monotonic() - start,
        tokens_per_s=statistics.median(per_s),
        per_step_tokens_per_s=per_s,
        rewards=[r["rollout/reward_mean"] for r in rows],
        **medians,
    )


def engines_per_gpu(args) -> dict:
    """k bare servers on the GPU for each k of --engines, sharing one engine's memory."""
    import torch

    total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 64 * GIB
    results = {}
    for k in args.engines:
        # vLLM sizes the KV cache from the free memory it sees at start-up, which another engine
        # starting beside it changes: each gets its share of one engine's cache explicitly.
        kv_cache = int((float(MEMORY) * total - k * ENGINE_BYTES) / k)
        share = ["--kv-cache-memory", str(kv_cache)]
        with contextlib.ExitStack() as stack, ThreadPoolExecutor(k) as pool:
            # started side by side: each server's start-up waits in a thread of its own
            names = [f"k{k}_{i}" for i in range(k)]
            launch = [server(args.model, args.out, share, name=name) for name in names]
            urls = [url for url, _ in pool.map(stack.enter_context, launch)]
            row = {}
            for logprobs in (False, True):
                count = send(urls, args.model, args.samples, args.max_tokens, logprobs)
                row["logprobs" if logprobs else "plain"] = count[0] / count[1]
        results[k] = row
        base = results[args.engines[0]]
        print(
            f"{k} engine(s): {row['plain']:8.0f} tokens/s plain "
            f"({row['plain'] / base['plain']:.2f}x), {row['logprobs']:8.0f} with the log-prob "
            f"({row['logprobs'] / base['logprobs']:.2f}x)",
            flush=True,
        )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--write", type=Path, help="write the model and prompts here, then exit")
    p.add_argument("--tiny", action="store_true", help="with --write: a tiny model (CPU check)")
    p.add_argument("--model", type=Path, help="a directory --write wrote")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", choices=("bare", "molt"), help="leave that side out")
    p.add_argument(
        "--molt-args",
        type=shlex.split,
        default=[],
        help='more molt-train flags, e.g. --molt-args "--refit.bucket_mb 2048"',
    )
    p.add_argument("--engines", type=int, nargs="+", help="k bare engines on the GPU, each k")
    p.add_argument("--out", type=Path, help="logs and results (default: a new temporary dir)")
    args = p.parse_args()
    if args.write:
        write(args.write, args.prompts, args.tiny)
        return
    if args.model is None:
        p.error("give --model (or --write DIR to make one)")
    args.out = args.out or Path(tempfile.mkdtemp(prefix="rollout_vs_vllm-"))
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"logs and results in {args.out}", flush=True)
    if args.engines:
        results = engines_per_gpu(args)
        (args.out / "engines_per_gpu.json").write_text(json.dumps(results, indent=2))
        return
    result = {}
    for side, run in (("bare", bare), ("molt", molt)):
        if args.skip != side:
            result[side] = run(args)
            print(f"{side}:", json.dumps(result[side]), flush=True)
    if len(result) == 2:
        molt_rate = result["molt"]["tokens_per_s"]
        result["ratio"] = molt_rate / result["bare"]["tokens_per_s"]
        result["ratio_same_ask"] = molt_rate / result["bare"]["logprobs_tokens_per_s"]
        print(
            f"rollout ratio {result['ratio']:.2f} (Molt tokens/s / bare vLLM tokens/s); "
            f"{result['ratio_same_ask']:.2f} against bare vLLM asked for the sampled log-prob too"
        )
    (args.out / "rollout_vs_vllm.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
