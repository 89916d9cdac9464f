"""Two GPUs: the NCCL refit into an engine on the other
GPU through `molt-train`, and context parallelism's log-probs against one GPU holding whole
rows. Skipped with fewer than two CUDA devices."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

ROOT = Path(__file__).resolve().parents[2]


def test_nccl_refit_into_an_engine_on_the_other_gpu(tmp_path):
    """Policy on one GPU, engine on the other: every refit goes over NCCL, in-flight requests
    carry on across it, and the engine then samples what the trainer computes."""
    cmd = [sys.executable, "-m", "molt_train.cli", "quickstart", "--actor.num_workers", "1",
           "--vllm.num_engines", "1", "--refit.backend", "nccl", "--vllm.dtype", "bfloat16",
           "--vllm.enforce_eager", "--vllm.startup_timeout_s", "400", "--train.num_steps", "6",
           "--eval.every_steps", "0", "--logger.wandb_mode", "disabled",
           "--train.output_dir", str(tmp_path), "--logger.run_name", "nccl"]  # fmt: skip
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "nccl" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    print("nccl refit s:", [round(r["timing/refit_total"], 4) for r in rows],
          "vllm_kl", [r["is/vllm_kl"] for r in rows])  # fmt: skip
    kls = [r["is/vllm_kl"] for r in rows if r["is/vllm_kl"] is not None]
    assert kls and all(abs(kl) < 1e-2 for kl in kls), rows


def smoke_logprobs(tmp_path, tiny_model: str, gpus: int, cp: int, dtype: str) -> list:
    """benchmarks/actor_gpu_smoke.py's packed check (four documents of up to 300 tokens in one
    row) under torchrun: the log-probs it computed."""
    dump = tmp_path / f"logprobs_{gpus}_{cp}_{dtype}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus),
           "--master-port", str(29600 + gpus * 10 + cp), "benchmarks/actor_gpu_smoke.py",
           "--model", tiny_model, "--cp", str(cp), "--dtype", dtype, "--steps", "1",
           "--seq-len", "512", "--tokens-per-rank", "1024", "--max-tokens-per-microbatch", "1024",
           "--dump-logprobs", str(dump)]  # fmt: skip
    path = os.pathsep.join(str(ROOT / p) for p in ("packages/molt-algos/src",
                                                   "packages/molt-train/src", "benchmarks"))  # fmt: skip
    env = dict(os.environ, PYTHONPATH=path + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    print(out.stdout.strip().splitlines()[-1][:600])
    return json.loads(dump.read_text())


@pytest.mark.parametrize(("dtype", "tolerance"), [("fp32", 1e-4), ("bf16", 0.1)])
def test_context_parallel_logprobs_equal_one_gpu(tmp_path, dtype, tolerance):
    """--cp 2 over two GPUs against one GPU holding whole rows: in fp32 (SDPA piece by piece)
    to float noise; in bf16 (varlen FlashAttention, bottom-right causal) to bf16 noise."""
    from molt_rollout.engines.tiny_model import build_tiny_model

    model = str(build_tiny_model(tmp_path / "tiny"))
    one = smoke_logprobs(tmp_path, model, 1, 1, dtype)
    two = smoke_logprobs(tmp_path, model, 2, 2, dtype)
    diff = max(abs(a - b) for p, q in zip(one, two, strict=True) for a, b in zip(p, q, strict=True))
    print(f"{dtype}: max |cp2 - cp1| log-prob {diff:.3g}")
    assert diff < tolerance
