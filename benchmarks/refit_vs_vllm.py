"""Colocated refit on one GPU: Molt's CUDA-IPC transfer against vLLM's own, into one engine.

    python benchmarks/rollout_vs_vllm.py --write /tmp/q3r        # random Qwen3-1.7B shape
    python benchmarks/refit_vs_vllm.py --model /tmp/q3r --out DIR

One engine (Molt's server flags, `--weight-transfer-config {"backend": "molt_ipc"}`, whose engine
also accepts vLLM's own per-tensor IPC updates) and this process as the trainer, holding the
checkpoint on the same GPU. Each round refits with every variant in turn, through the same
`Refitter` (pause, start, buckets, finish, resume), at each of --buckets-mb:
  vllm  vLLM's IPC message: a fresh handle per tensor, pickled into the HTTP call;
  molt  Molt's (molt_rollout.refit.ipc_transport): each bucket copied into one of two staging
        buffers, each shared once, packed while the engine loads the bucket before, loaded in
        place where the model allows it (a dense unquantized one does), else by vLLM's
        layerwise reload as the vllm variant always is.
Each variant refits twice in a row per round and the second is timed (the engine keeps its
staging buffers mapped, as in a run). Printed: each variant's median phases over the rounds
after the first, the ratio of pause->resume times (vLLM's over Molt's), and a check that every
variant leaves the engine serving the same weights (greedy log-probs after each one's refit of
the same perturbed checkpoint are equal bit for bit, and the original weights come back).
"""

import argparse
import base64
import json
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

PROMPT = list(range(10, 74))


class VllmIpcTransport:
    """vLLM's own IPC update message: every tensor shared by its own handle, the handles
    pickled (the engine needs VLLM_ALLOW_INSECURE_SERIALIZATION=1)."""

    backend = "ipc"
    address = port = None

    def __init__(self) -> None:
        self.held: list[torch.Tensor] = []

    def worker_init_info(self, rank_offset: int) -> dict:
        return {}

    def connect(self) -> None:
        pass

    def bucket_fields(self, tensors: list[torch.Tensor], index: int, dtype) -> dict:
        from torch.multiprocessing.reductions import reduce_tensor

        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        # The bucket before's tensors, freed once the engine released them (its reply came).
        self.held = []
        torch.cuda.ipc_collect()
        self.held = [t.detach().to(dtype or t.dtype).contiguous() for t in tensors]
        torch.cuda.current_stream().synchronize()
        handles = [{uuid: reduce_tensor(t)[1]} for t in self.held]
        pickled = base64.b64encode(pickle.dumps(handles)).decode()
        return {"packed": False, "ipc_handles_pickled": pickled}

    def send(self, tensors: list[torch.Tensor], dtype) -> None:
        pass


def greedy_logprobs(url: str, model: str) -> list[float]:
    from molt_rollout.engines.client import GENERATE_PATH

    sampling = {"max_tokens": 16, "temperature": 0.0, "logprobs": 0}
    body = {"model": model, "token_ids": PROMPT, "sampling_params": sampling}
    reply = httpx.post(url + GENERATE_PATH, json=body, timeout=120)
    reply.raise_for_status()
    return [e["logprob"] for e in reply.json()["choices"][0]["logprobs"]["content"]]


def measure(url: str, args, original: dict, perturbed: dict) -> dict:
    """Every variant's refit phases over the rounds, then the same-weights check."""
    from molt_rollout.config import RefitConfig
    from molt_rollout.refit.control import Refitter

    wire = torch.bfloat16
    variants: dict[str, Refitter] = {}
    for mb in args.buckets_mb:
        for kind in ("vllm", "molt"):
            refitter = Refitter([url], 1, RefitConfig(bucket_mb=mb), on_gpu=True, colocated=True)
            if kind == "vllm":
                refitter.transport = VllmIpcTransport()
            refitter.init_transfer()
            variants[f"{kind}-{mb}MB"] = refitter
    times: dict[str, list[dict]] = {name: [] for name in variants}
    version = 0
    for _ in range(args.rounds):
        for name, refitter in variants.items():
            # The untimed refit maps this variant's staging buffers, as a run's stay mapped
            # from its first refit on.
            refitter.refit(iter(original.items()), version := version + 1, dtype=wire)
            metrics = refitter.refit(iter(original.items()), version := version + 1, dtype=wire)
            times[name].append(metrics)
    base = greedy_logprobs(url, str(args.model))
    result = {}
    for name, refitter in variants.items():
        refitter.refit(iter(perturbed.items()), version := version + 1, dtype=wire)
        after = greedy_logprobs(url, str(args.model))
        refitter.refit(iter(original.items()), version := version + 1, dtype=wire)
        later = times[name][1:] or times[name]
        phases = {
            k.removeprefix("timing/refit_"): statistics.median(r[k] for r in later)
            for k in later[0]
            if k.startswith("timing/")
        }
        phases.update(buckets=later[0]["refit/buckets"], perturbed=after)
        phases["all_totals"] = [r["timing/refit_total"] for r in times[name]]
        phases["restored_equal"] = greedy_logprobs(url, str(args.model)) == base
        phases["changed_weights"] = after != base
        result[name] = phases
    reference = next(iter(result.values()))["perturbed"]
    for name, phases in result.items():
        phases["same_weights_as_first"] = phases.pop("perturbed") == reference
        print(name, json.dumps(phases), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--buckets-mb", type=int, nargs="*", default=[512, 2048])
    p.add_argument("--out", type=Path, help="logs and results (default: a new temporary dir)")
    p.add_argument(
        "--fp32-masters",
        action="store_true",
        help="hold the weights in fp32, as the trainer does, and send them in bf16: the cast "
        "in the packing, as in a run",
    )
    args = p.parse_args()
    args.out = args.out or Path(tempfile.mkdtemp(prefix="refit_vs_vllm-"))
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"logs and results in {args.out}", flush=True)
    from safetensors.torch import load_file

    from molt_rollout.config import VLLMConfig
    from molt_rollout.engines.engine import EngineServer

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the vllm variant's pickled handles
    cfg = VLLMConfig(
        dtype="bfloat16",
        gpu_memory_utilization=0.45,
        max_model_len=2048,
        enforce_eager=True,
        startup_timeout_s=600,
    )
    server = EngineServer(0, cfg, str(args.model), "molt_ipc", str(args.out), on_gpu=True)
    start = time.monotonic()
    url = server.start()
    print(f"engine ready in {time.monotonic() - start:.0f} s", flush=True)
    try:
        held = torch.float32 if args.fp32_masters else torch.bfloat16
        files = sorted(args.model.glob("*.safetensors"))
        original = {k: v.cuda().to(held) for f in files for k, v in load_file(str(f)).items()}
        perturbed = {
            k: v + 0.01 * torch.randn_like(v) if "lm_head" in k else v for k, v in original.items()
        }
        nbytes = sum(t.numel() * torch.bfloat16.itemsize for t in original.values())
        variants = measure(url, args, original, perturbed)
        for mb in args.buckets_mb:
            ours, theirs = variants[f"molt-{mb}MB"]["total"], variants[f"vllm-{mb}MB"]["total"]
            print(
                f"refit ratio {theirs / ours:.2f} at {mb} MB buckets (vLLM IPC / Molt IPC, "
                f"pause->resume {theirs * 1e3:.1f} -> {ours * 1e3:.1f} ms, {nbytes / 1e9:.2f} GB)"
            )
        result = {"bytes": nbytes, "tensors": len(original), "variants": variants}
        (args.out / "refit_vs_vllm.json").write_text(json.dumps(result, indent=2))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
