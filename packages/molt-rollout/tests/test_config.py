"""Start-up validation of the rollout config, and the vLLM server command line it produces."""

import json
import typing

import pytest

from molt_capture import PARSERS
from molt_rollout.config import (
    ParserName,
    RefitConfig,
    RolloutConfig,
    RouterConfig,
    VLLMConfig,
    validate_engine_devices,
    validate_rollout_config,
)
from molt_rollout.engines.engine import server_args
from molt_rollout.refit.adapters import AdapterServing, engine_lora_rank

ROUTER_POLICIES = typing.get_args(typing.get_type_hints(RouterConfig)["policy"])
WEIGHT_TRANSFER_BACKENDS = typing.get_args(typing.get_type_hints(RefitConfig)["backend"])


def validate(vllm=None, router=None, refit=None, rollout=None) -> None:
    validate_rollout_config(
        rollout or RolloutConfig(),
        vllm or VLLMConfig(),
        router or RouterConfig(),
        refit or RefitConfig(),
    )


def test_parser_names_are_molt_captures():
    assert list(typing.get_args(ParserName)) == list(PARSERS)


def flag_value(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} appears {args.count(flag)} times in {args}"
    return args[args.index(flag) + 1]


# --- validate_rollout_config -----------------------------------------------------------------


def test_defaults_are_valid():
    validate()


@pytest.mark.parametrize("policy", ROUTER_POLICIES)
@pytest.mark.parametrize("backend", WEIGHT_TRANSFER_BACKENDS)
def test_every_listed_policy_and_backend_is_accepted(policy, backend):
    validate(router=RouterConfig(policy=policy), refit=RefitConfig(backend=backend))


def test_edges_that_are_valid():
    validate(
        VLLMConfig(gpu_memory_utilization=1.0, mtp_num_speculative_tokens=3),
        refit=RefitConfig(bucket_mb=1),
    )
    # Routing capture alone, and speculative decoding alone, are both fine.
    validate(VLLMConfig(enable_return_routed_experts=True))
    validate(VLLMConfig(enable_return_routed_experts=True, mtp_num_speculative_tokens=0))
    validate_engine_devices(VLLMConfig(enable_return_routed_experts=True), on_gpu=True)


def test_routed_experts_need_gpu_engines():
    with pytest.raises(ValueError, match="--vllm.enable_return_routed_experts needs GPU engines"):
        validate_engine_devices(VLLMConfig(enable_return_routed_experts=True), on_gpu=False)


def test_engines_per_gpu_need_gpu_engines():
    validate_engine_devices(VLLMConfig(num_engines=2, engines_per_gpu=2), on_gpu=True)
    with pytest.raises(ValueError, match="--vllm.engines_per_gpu 2 places engines on GPUs"):
        validate_engine_devices(VLLMConfig(num_engines=2, engines_per_gpu=2), on_gpu=False)


@pytest.mark.parametrize(
    ("vllm", "router", "refit", "flags"),
    [
        (
            VLLMConfig(enable_return_routed_experts=True, mtp_num_speculative_tokens=1),
            None,
            None,
            ["--vllm.enable_return_routed_experts", "--vllm.mtp_num_speculative_tokens"],
        ),
        (VLLMConfig(num_engines=0), None, None, ["--vllm.num_engines"]),
        (VLLMConfig(engines_per_gpu=0), None, None, ["--vllm.engines_per_gpu"]),
        (
            VLLMConfig(num_engines=2, engines_per_gpu=2, tensor_parallel_size=2),
            None,
            None,
            ["--vllm.engines_per_gpu 2", "--vllm.tensor_parallel_size 1"],
        ),
        (
            VLLMConfig(num_engines=3, engines_per_gpu=2),
            None,
            None,
            ["--vllm.num_engines 3", "--vllm.engines_per_gpu 2"],
        ),
        (VLLMConfig(tensor_parallel_size=0), None, None, ["--vllm.tensor_parallel_size"]),
        (VLLMConfig(data_parallel_size=-1), None, None, ["--vllm.data_parallel_size"]),
        (
            VLLMConfig(mtp_num_speculative_tokens=-1),
            None,
            None,
            ["--vllm.mtp_num_speculative_tokens"],
        ),
        (VLLMConfig(gpu_memory_utilization=0.0), None, None, ["--vllm.gpu_memory_utilization"]),
        (VLLMConfig(gpu_memory_utilization=-0.5), None, None, ["--vllm.gpu_memory_utilization"]),
        (VLLMConfig(gpu_memory_utilization=1.01), None, None, ["--vllm.gpu_memory_utilization"]),
        (None, None, RefitConfig(bucket_mb=0), ["--refit.bucket_mb"]),
        (None, None, RefitConfig(bucket_mb=-512), ["--refit.bucket_mb"]),
        (
            VLLMConfig(max_restarts=0),
            None,
            None,
            ["--vllm.max_restarts", "--vllm.restart_on_failure False"],
        ),
    ],
    ids=[
        "routed-experts-with-mtp",
        "num_engines-0",
        "engines_per_gpu-0",
        "engines_per_gpu-with-tp",
        "engines_per_gpu-not-dividing",
        "tp-0",
        "dp-negative",
        "mtp-negative",
        "gpu-mem-0",
        "gpu-mem-negative",
        "gpu-mem-above-1",
        "bucket-0",
        "bucket-negative",
        "max-restarts-0",
    ],
)
def test_rejects_with_message_naming_the_flags(vllm, router, refit, flags):
    with pytest.raises(ValueError) as info:
        validate(vllm, router, refit)
    for flag in flags:
        assert flag in str(info.value)


@pytest.mark.parametrize(
    "changes",
    [
        {"groups_per_batch": 0},
        {"n_samples_per_prompt": 0},
        {"max_len": 0},
        {"max_tokens": 0},
        {"temperature": 0.0},
        {"top_p": 1.5},
        {"deadline_s": 0.0},
        {"num_runners": 0},
        {"cpus_per_runner": -1.0},
        {"startup_timeout_s": 0.0},
        {"max_request_bytes": 0},
    ],
)
def test_rollout_settings_name_their_flag(changes):
    with pytest.raises(ValueError, match=f"--rollout.{next(iter(changes))}"):
        validate(rollout=RolloutConfig(**changes))


# --- server_args ----------------------------------------------------------------------------


def test_default_command_line():
    args = server_args(VLLMConfig(), "/models/tiny", 8123, "molt_gloo")
    assert flag_value(args, "--model") == "/models/tiny"
    assert flag_value(args, "--host") == "127.0.0.1"
    assert flag_value(args, "--port") == "8123"
    assert "--enable-scale-out" in args  # the token-in/token-out endpoint
    assert flag_value(args, "--logprobs-mode") == "processed_logprobs"
    assert json.loads(flag_value(args, "--weight-transfer-config")) == {"backend": "molt_gloo"}
    assert flag_value(args, "--tensor-parallel-size") == "1"
    assert flag_value(args, "--data-parallel-size") == "1"
    assert flag_value(args, "--dtype") == "auto"
    assert float(flag_value(args, "--gpu-memory-utilization")) == 0.85
    assert "--enable-prefix-caching" in args and "--no-enable-prefix-caching" not in args
    for absent in (
        "--max-model-len",
        "--max-num-batched-tokens",
        "--speculative-config",
        "--enable-return-routed-experts",
        "--enable-expert-parallel",
        "--enforce-eager",
    ):
        assert absent not in args
    assert all(isinstance(a, str) for a in args)


@pytest.mark.parametrize("backend", ["nccl", "molt_gloo"])
def test_weight_transfer_config_names_the_backend(backend):
    args = server_args(VLLMConfig(), "m", 1, backend)
    assert json.loads(flag_value(args, "--weight-transfer-config")) == {"backend": backend}


def test_prefix_caching_off():
    args = server_args(VLLMConfig(enable_prefix_caching=False), "m", 1, "nccl")
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args


@pytest.mark.parametrize("n", [1, 3])
def test_speculative_config_when_mtp_tokens(n):
    args = server_args(VLLMConfig(mtp_num_speculative_tokens=n), "m", 1, "nccl")
    assert json.loads(flag_value(args, "--speculative-config")) == {
        "method": "mtp",
        "num_speculative_tokens": n,
    }


def test_optional_flags_when_set():
    cfg = VLLMConfig(
        tensor_parallel_size=2,
        data_parallel_size=4,
        enable_expert_parallel=True,
        max_num_batched_tokens=8192,
        max_model_len=2048,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        dtype="bfloat16",
        enable_return_routed_experts=True,
    )
    args = server_args(cfg, "m", 1, "nccl")
    assert flag_value(args, "--tensor-parallel-size") == "2"
    assert flag_value(args, "--data-parallel-size") == "4"
    assert flag_value(args, "--max-num-batched-tokens") == "8192"
    assert flag_value(args, "--max-model-len") == "2048"
    assert flag_value(args, "--dtype") == "bfloat16"
    assert float(flag_value(args, "--gpu-memory-utilization")) == 0.5
    for flag in ("--enable-expert-parallel", "--enforce-eager", "--enable-return-routed-experts"):
        assert args.count(flag) == 1


def test_engines_sharing_a_gpu_split_its_memory_share():
    cfg = VLLMConfig(num_engines=4, engines_per_gpu=2, gpu_memory_utilization=0.45)
    assert float(flag_value(server_args(cfg, "m", 1, "nccl"), "--gpu-memory-utilization")) == 0.225


def test_extra_args_appended_verbatim_last():
    extra = ["--seed", "7", "--max-num-seqs=4", "--hf-overrides", '{"a": [1]}', "--enforce-eager"]
    cfg = VLLMConfig(max_model_len=1024, mtp_num_speculative_tokens=1, extra_args=list(extra))
    args = server_args(cfg, "m", 1, "nccl")
    assert args[-len(extra) :] == extra
    # Everything else comes before them; the caller's list is not mutated.
    assert "--max-model-len" in args[: -len(extra)]
    assert "--speculative-config" in args[: -len(extra)]
    assert cfg.extra_args == extra
    server_args(cfg, "m", 1, "nccl")
    assert cfg.extra_args == extra


def test_adapter_serving_adds_vllms_lora_flags():
    assert [engine_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match="512"):
        engine_lora_rank(513)
    serving = AdapterServing(rank=4, keep=3)
    args = server_args(VLLMConfig(extra_args=["--seed", "1"]), "m", 1, "molt_gloo", serving)
    assert args[-2:] == ["--seed", "1"]  # extra args still come last
    assert "--enable-lora" in args
    for flag, value in (("--max-lora-rank", "8"), ("--max-loras", "3"), ("--max-cpu-loras", "4")):
        assert flag_value(args, flag) == value
    assert "--enable-lora" not in server_args(VLLMConfig(), "m", 1, "molt_gloo")
    assert serving.adapter(7) == "molt-lora-v7"
    assert serving.server_env() == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


@pytest.mark.slow
def test_vllm_parses_the_command_line():
    """Every flag Molt passes exists in the installed vLLM, with the meaning Molt intends
    (imports vLLM's argument parser only; no engine starts)."""
    pytest.importorskip("vllm")
    cli_args = pytest.importorskip("vllm.entrypoints.launchers.cli_args")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parse(cfg: VLLMConfig, backend: str):
        parser = cli_args.make_arg_parser(FlexibleArgumentParser())
        return parser.parse_args(server_args(cfg, "/models/tiny", 8123, backend))

    cfg = VLLMConfig(
        max_model_len=2048,
        max_num_batched_tokens=4096,
        mtp_num_speculative_tokens=2,
        enforce_eager=True,
        extra_args=["--seed", "3"],
    )
    ns = parse(cfg, "molt_gloo")
    assert ns.model == "/models/tiny" and ns.port == 8123 and ns.host == "127.0.0.1"
    assert ns.enable_scale_out is True
    assert ns.logprobs_mode == "processed_logprobs"
    assert ns.weight_transfer_config.backend == "molt_gloo"
    assert ns.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    assert ns.enable_prefix_caching is True
    assert ns.max_model_len == 2048 and ns.max_num_batched_tokens == 4096
    assert ns.enforce_eager is True and ns.seed == 3
    assert ns.enable_return_routed_experts is False

    ns = parse(VLLMConfig(enable_prefix_caching=False, enable_return_routed_experts=True), "nccl")
    assert ns.enable_prefix_caching is False
    assert ns.enable_return_routed_experts is True
    assert ns.weight_transfer_config.backend == "nccl"

    parser = cli_args.make_arg_parser(FlexibleArgumentParser())
    ns = parser.parse_args(server_args(VLLMConfig(), "m", 1, "molt_gloo", AdapterServing(8, 3)))
    assert ns.enable_lora is True and ns.max_lora_rank == 8
    assert ns.max_loras == 3 and ns.max_cpu_loras == 4


@pytest.mark.parametrize(("num_engines", "per_gpu"), [(1, 1), (3, 1), (2, 2), (6, 2), (6, 3)])
def test_engines_sharing_a_gpu_start_in_different_waves(num_engines, per_gpu):
    from molt_rollout.engines.engine import start_waves

    waves = start_waves(num_engines, per_gpu)
    assert sorted(i for wave in waves for i in wave) == list(range(num_engines))
    assert len(waves) == per_gpu  # engines on GPUs of their own: one wave, all at once
    for wave in waves:
        gpus = [i // per_gpu for i in wave]
        assert len(gpus) == len(set(gpus)) == num_engines // per_gpu  # one engine of each GPU
