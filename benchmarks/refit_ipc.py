"""Colocated refit on one GPU: vLLM's own CUDA-IPC transfer against Molt's staging buffer.

    python benchmarks/gpu_rollout.py --write /tmp/q3r            # random Qwen3-1.7B shape
    python benchmarks/refit_ipc.py --model /tmp/q3r --out $OUT

One engine (Molt's server flags, `--weight-transfer-config {"backend": "molt_ipc"}`, whose
engine also accepts vLLM's own per-tensor IPC updates) and this process as the trainer, holding
the checkpoint on the same GPU in bf16. Each round refits with every variant in turn, through
the same `Refitter` (pause, start, buckets, finish, resume):
  vllm      vLLM 0.26's IPC message: a fresh handle per tensor, pickled into the HTTP call (what
            Molt sent before), `--buckets-mb` per call;
  molt      Molt's (ipc_transport.py): each bucket copied into one of two staging buffers, each
            shared once, packed while the engine loads the bucket before, loaded in place where
            the model allows it (a dense unquantized one does), else by vLLM's layerwise reload
            as the vllm variant always is;
  serial    Molt's before the pipeline: one staging buffer, each bucket packed after the
            engine answered the one before.
Each variant refits twice in a row per round and the second is timed (the engine keeps its
staging buffers mapped, as in a run). It prints each variant's median phases over the rounds
after the first and the ratios of pause->resume times, then checks that every variant leaves
the engine serving the same weights (greedy log-probs equal bit for bit after each one's refit
of the same perturbed checkpoint), and times the parts of a molt refit alone (`breakdown`).
"""

import argparse
import base64
import dataclasses
import json
import os
import pickle
import statistics
import time
from pathlib import Path

import httpx
import torch

PROMPT = list(range(10, 74))


class VllmIpcTransport:
    """vLLM 0.26's own IPC update message: every tensor shared by its own handle, the handles
    pickled (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the engine)."""

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
        return {"packed": False,
                "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}  # fmt: skip

    def send(self, tensors: list[torch.Tensor], dtype) -> None:
        pass


def serial_refitter(*args, **kwargs):
    """Molt's refit before the pipeline (the baseline of `molt`): one staging buffer, and each
    bucket's replies awaited before the next bucket is packed."""
    from molt_rollout.refit import IpcTransport, Refitter

    class OneBuffer(IpcTransport):
        SLOTS = 1

    class Serial(Refitter):
        def _send(self, update, tensors, dtype):
            replies, seconds = super()._send(update, tensors, dtype)
            return [], seconds + self._wait(replies)

    refitter = Serial(*args, **kwargs)
    refitter.transport = OneBuffer()
    return refitter


def greedy_logprobs(url: str, model: str) -> list[float]:
    body = {"model": model, "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 16, "temperature": 0.0, "logprobs": 0}}  # fmt: skip
    reply = httpx.post(url + "/inference/v1/generate", json=body, timeout=120)
    reply.raise_for_status()
    return [e["logprob"] for e in reply.json()["choices"][0]["logprobs"]["content"]]


def breakdown(refitter, named: dict[str, torch.Tensor], mb: int, dtype: torch.dtype,
              repeats: int = 10) -> dict:  # fmt: skip
    """Where a molt refit's time goes, each part timed alone (medians, ms): the pause and the
    resume with nothing between; the trainer packing every bucket (copy and synchronize); an
    update naming the staging buffer with no tensors (HTTP, the engine core, the worker's RPC
    and its synchronize, per bucket); the rest of the transfer is the engine loading."""
    from molt_rollout.buckets import BucketMeta, iter_buckets
    from molt_rollout.refit import IpcTransport

    def ms(call) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            call()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    result = {"pause_ms": [], "resume_ms": []}
    for _ in range(repeats):
        t = time.perf_counter()
        refitter.pause("keep")
        result["pause_ms"].append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        refitter.resume()
        result["resume_ms"].append((time.perf_counter() - t) * 1e3)
    result = {k: statistics.median(v) for k, v in result.items()}
    packer = IpcTransport()
    buckets = [tensors for _, tensors in iter_buckets(iter(named.items()), mb << 20, dtype)]
    result["pack_all_ms"] = ms(
        lambda: [packer.bucket_fields(b, i, dtype) for i, b in enumerate(buckets)]
    )
    packer.staging = [None] * packer.SLOTS  # freed before the engine is timed
    buffer = refitter.transport.shared[0]
    empty = {"update_info": {**dataclasses.asdict(BucketMeta()), "buffer": buffer}}
    refitter.pause("keep")
    refitter._on_all(lambda e: e.post("/start_weight_update"))
    try:
        result["empty_update_ms"] = ms(lambda: refitter._on_all(
            lambda e: e.post("/update_weights", empty)))  # fmt: skip
    finally:
        refitter._on_all(lambda e: e.post("/finish_weight_update"))
        refitter.resume()
    result["buckets"] = len(buckets)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--buckets-mb", type=int, nargs="*", default=[512, 2048])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/refit_ipc")))
    p.add_argument("--fp32-masters", action="store_true",
                   help="hold the weights in fp32, as the trainer does, and send them in bf16: "
                        "the cast in the packing, as in a run")  # fmt: skip
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import load_file

    from molt_rollout.config import RefitConfig, VLLMConfig
    from molt_rollout.engine import EngineServer
    from molt_rollout.refit import Refitter

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the vllm variant's pickled handles
    cfg = VLLMConfig(dtype="bfloat16", gpu_memory_utilization=0.45, max_model_len=2048,
                     enforce_eager=True, startup_timeout_s=600)  # fmt: skip
    server = EngineServer(0, cfg, str(args.model), "molt_ipc", str(args.out), on_gpu=True)
    t0 = time.monotonic()
    url = server.start()
    print(f"engine ready in {time.monotonic() - t0:.0f} s", flush=True)
    try:
        files = sorted(args.model.glob("*.safetensors"))
        held = torch.float32 if args.fp32_masters else torch.bfloat16
        original = {k: v.cuda().to(held) for f in files for k, v in load_file(str(f)).items()}
        wire = torch.bfloat16
        nbytes = sum(t.numel() * wire.itemsize for t in original.values())
        perturbed = {k: v + 0.01 * torch.randn_like(v) if "lm_head" in k else v
                     for k, v in original.items()}  # fmt: skip
        variants: dict[str, Refitter] = {}
        for mb in args.buckets_mb:
            for kind in ("vllm", "serial", "molt"):
                make = serial_refitter if kind == "serial" else Refitter
                refitter = make([url], 1, RefitConfig(bucket_mb=mb), on_gpu=True, colocated=True)
                if kind == "vllm":
                    refitter.transport = VllmIpcTransport()
                refitter.init_transfer()
                variants[f"{kind}-{mb}MB"] = refitter
        times: dict[str, list[dict]] = {name: [] for name in variants}
        version = 0
        for _ in range(args.rounds):
            for name, refitter in variants.items():
                # The engine keeps two staging buffers mapped: the untimed refit maps this
                # variant's, as the buffers of a run stay mapped from its first refit on.
                refitter.refit(iter(original.items()), version := version + 1, dtype=wire)
                times[name].append(
                    refitter.refit(iter(original.items()), version := version + 1, dtype=wire)
                )
        base = greedy_logprobs(url, str(args.model))
        checks = {}
        for name, refitter in variants.items():
            refitter.refit(iter(perturbed.items()), version := version + 1, dtype=wire)
            after = greedy_logprobs(url, str(args.model))
            refitter.refit(iter(original.items()), version := version + 1, dtype=wire)
            checks[name] = {"perturbed": after, "restored_equal": greedy_logprobs(
                url, str(args.model)) == base}  # fmt: skip
        reference = checks[next(iter(checks))]["perturbed"]
        result = {"bytes": nbytes, "tensors": len(original), "variants": {}}
        for name, rows in times.items():
            later = rows[1:] or rows
            phases = {k.removeprefix("timing/refit_"): statistics.median(r[k] for r in later)
                      for k in later[0] if k.startswith("timing/")}  # fmt: skip
            phases["buckets"] = later[0]["refit/buckets"]
            phases["all_totals"] = [r["timing/refit_total"] for r in rows]
            phases["same_weights_as_first"] = checks[name]["perturbed"] == reference
            phases["changed_weights"] = checks[name]["perturbed"] != base
            phases["restored_equal"] = checks[name]["restored_equal"]
            result["variants"][name] = phases
            print(name, json.dumps(phases), flush=True)
        for mb in args.buckets_mb:
            parts = breakdown(variants[f"molt-{mb}MB"], original, mb, wire)
            result["variants"][f"molt-{mb}MB"]["breakdown"] = parts
            print(f"molt-{mb}MB breakdown", json.dumps(parts), flush=True)
        for mb in args.buckets_mb:
            new = result["variants"][f"molt-{mb}MB"]["total"]
            for kind, what in (("vllm", "vLLM IPC"), ("serial", "Molt IPC serial")):
                old = result["variants"][f"{kind}-{mb}MB"]["total"]
                print(f"refit ratio {old / new:.2f} at {mb} MB buckets ({what} / Molt IPC, "
                      f"pause->resume {old * 1e3:.1f} -> {new * 1e3:.1f} ms, "
                      f"{nbytes / 1e9:.2f} GB)")  # fmt: skip
        (args.out / "refit_ipc.json").write_text(json.dumps(result, indent=2))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
