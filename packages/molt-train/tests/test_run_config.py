"""Run configuration: defaults are valid, bad combinations fail naming their flags before
anything starts (the CLI itself: test_cli.py)."""

import dataclasses
from pathlib import Path

import pytest

from molt_train.cli import parse
from molt_train.config import RunConfig, adapter_serving
from molt_train.validate import validate_run_config

ROOT = Path(__file__).resolve().parents[3]


def test_defaults_are_valid_and_async():
    cfg = RunConfig()
    validate_run_config(cfg)
    assert cfg.train.async_queue_size == 1 and not cfg.train.force_on_policy


def _cfg(argv: list[str]) -> RunConfig:
    return parse(argv)


@pytest.mark.parametrize(
    "argv, flags",
    [
        (
            ["--rollout.n_samples_per_prompt", "1"],
            ["--algo.advantage.estimator", "--rollout.n_samples_per_prompt"],
        ),
        (
            ["--algo.advantage.is_correction_level", "off"],
            ["--algo.advantage.is_correction_level", "--train.force_on_policy"],
        ),
        (["--rollout.top_p", "0.9"], ["--algo.advantage.is_correction_level", "--rollout.top_p"]),
        (
            ["--train.force_on_policy", "True", "--train.epochs_per_batch", "2"],
            ["--train.force_on_policy", "--train.epochs_per_batch"],
        ),
        (
            ["--train.force_on_policy", "True", "--train.mini_batches", "2"],
            ["--train.force_on_policy", "--train.mini_batches"],
        ),
        (
            [
                "--vllm.enable_return_routed_experts",
                "True",
                "--vllm.mtp_num_speculative_tokens",
                "2",
            ],
            ["--vllm.enable_return_routed_experts", "--vllm.mtp_num_speculative_tokens"],
        ),
        (["--eval.n_samples", "0"], ["--eval.n_samples"]),
        (
            ["--train.routing_replay", "True"],
            ["--train.routing_replay", "--vllm.enable_return_routed_experts"],
        ),
        (
            [
                "--train.routing_replay",
                "True",
                "--vllm.enable_return_routed_experts",
                "True",
                "--vllm.mtp_num_speculative_tokens",
                "2",
            ],
            ["--vllm.enable_return_routed_experts", "--vllm.mtp_num_speculative_tokens"],
        ),
        (
            ["--rollout.groups_per_batch", "6", "--train.mini_batches", "4"],
            ["--rollout.groups_per_batch", "--train.mini_batches"],
        ),
        (["--algo.kl.loss_coef", "0.1"], ["--ref.enable"]),
        (["--train.async_queue_size", "-1"], ["--train.async_queue_size"]),
        (["--train.max_staleness", "-1"], ["--train.max_staleness"]),
        (["--algo.advantage.is_correction_threshold", "1.0"], ["threshold"]),
        (["--algo.advantage.is_correction_gating", "tv"], ["gating", "level 'seq'"]),
        (
            ["--reward.overlong_buffer_len", "4"],
            ["--reward.overlong_buffer_len", "--reward.max_response_len", "--rollout.max_tokens"],
        ),
        (
            ["--reward.overlong_buffer_len", "4", "--rollout.max_tokens", "2"],
            ["--reward.", "overlong_buffer_len=4", "max_response_len=2"],
        ),
        (["--reward.stop_properly_penalty_coef", "1.5"], ["--reward.", "stop_properly"]),
        (["--ckpt.best_metric", "rollout/reward_mean"], ["--ckpt.best_metric", "eval/"]),
        (["--algo.score_centering"], ["--algo.score_centering", "--rollout.top_logprobs"]),
        (
            [
                "--algo.score_centering",
                "--rollout.top_logprobs",
                "4",
                "--algo.advantage.is_correction_level",
                "seq",
                "--algo.advantage.is_correction_mode",
                "mask",
            ],
            ["--algo.score_centering", "--algo.advantage.is_correction_level"],
        ),
        (
            ["--algo.score_centering", "--rollout.top_logprobs", "4", "--fsdp.tp_size", "2"],
            ["--algo.score_centering", "--fsdp.tp_size"],
        ),
        (
            [
                "--algo.score_centering",
                "--rollout.top_logprobs",
                "4",
                "--actor.num_workers",
                "2",
                "--fsdp.cp_size",
                "2",
            ],
            ["--algo.score_centering", "--fsdp.cp_size"],
        ),
        (
            [
                "--train.routing_replay",
                "True",
                "--vllm.enable_return_routed_experts",
                "True",
                "--actor.num_workers",
                "2",
                "--fsdp.cp_size",
                "2",
            ],
            ["--train.routing_replay", "--fsdp.cp_size"],
        ),
        (["--rollout.top_logprobs", "21"], ["--rollout.top_logprobs"]),
        (
            ["--actor.num_workers", "2", "--fsdp.cp_size", "2", "--ref.enable"],
            ["--ref.num_workers 1", "--fsdp.cp_size 2"],
        ),
        (
            [
                "--algo.advantage.estimator",
                "gae",
                "--actor.num_workers",
                "2",
                "--fsdp.cp_size",
                "2",
                "--critic.num_workers",
                "3",
            ],
            ["--critic.num_workers 3"],
        ),
        (["--ckpt.best_metric", "eval/pass@1"], ["--ckpt.best_metric", "--eval.every_steps"]),
        (
            [
                "--algo.advantage.is_correction_level",
                "seq",
                "--algo.advantage.is_correction_mode",
                "mask",
                "--algo.advantage.is_correction_gating",
                "tv",
            ],
            ["threshold", "(0, 1)"],
        ),
        (["--data.train_files"], ["--data.train_files"]),
        (["--refit.backend", "molt_ipc"], ["--refit.backend molt_ipc", "--train.colocate"]),
        (["--vllm.enable_sleep_mode"], ["--vllm.enable_sleep_mode", "--train.colocate"]),
        (["--train.colocate", "--refit.backend", "nccl"], ["--train.colocate", "--refit.backend"]),
        (
            ["--train.colocate", "--vllm.enable_sleep_mode"],
            ["--vllm.enable_sleep_mode", "--train.partial_rollout_enable False"],
        ),
        (
            ["--train.colocate", "--vllm.num_engines", "2"],
            [
                "--train.colocate",
                "--vllm.num_engines equal to",
                "--vllm.engines_per_gpu",
                "--vllm.tensor_parallel_size 1",
            ],
        ),
        (
            ["--train.colocate", "--vllm.num_engines", "4", "--vllm.engines_per_gpu", "2"],
            ["--train.colocate", "--vllm.num_engines equal to", "--vllm.engines_per_gpu"],
        ),
        (
            ["--train.colocate", "--vllm.tensor_parallel_size", "2"],
            ["--train.colocate", "--vllm.tensor_parallel_size 1"],
        ),
        (["--vllm.max_restarts", "0"], ["--vllm.max_restarts"]),
        (["--vllm.ray_resources", "engine_node", "0"], ["--vllm.ray_resources"]),
        (["--actor.ray_resources", "trainer_node", "-1"], ["--actor.ray_resources"]),
        (
            ["--train.colocate", "--vllm.ray_resources", "engine_node", "1"],
            ["--train.colocate", "--vllm.ray_resources"],
        ),
        (["--actor.lora.rank", "-1"], ["--actor.lora.rank"]),
        (
            ["--actor.lora.rank", "8", "--actor.lora.target_modules", "*.q_proj", "lm_head"],
            ["--actor.lora.target_modules", "lm_head"],
        ),
        (["--actor.lora.refit", "adapter"], ["--actor.lora.refit adapter", "--actor.lora.rank"]),
        (
            ["--actor.lora.rank", "1024", "--actor.lora.refit", "adapter"],
            ["--actor.lora.refit adapter", "--actor.lora.rank 1024", "512"],
        ),
        (
            [
                "--actor.lora.rank",
                "8",
                "--actor.lora.refit",
                "adapter",
                "--train.max_staleness",
                "None",
            ],
            ["--actor.lora.refit adapter", "--train.max_staleness"],
        ),
        (
            ["--actor.lora.rank", "8", "--actor.lora.refit", "adapter", "--refit.report_unupdated"],
            ["--refit.report_unupdated", "--actor.lora.refit"],
        ),
        (
            [
                "--actor.lora.rank",
                "8",
                "--actor.lora.refit",
                "adapter",
                "--train.colocate",
                "--vllm.enable_sleep_mode",
                "--train.partial_rollout_enable",
                "False",
            ],
            ["--vllm.enable_sleep_mode", "--actor.lora.refit adapter"],
        ),
    ],
)
def test_bad_combinations_name_their_flags(argv, flags):
    with pytest.raises(ValueError) as error:
        validate_run_config(_cfg(argv))
    for flag in flags:
        assert flag in str(error.value), (flag, str(error.value))


def test_adapter_refit_sets_the_engines_lora_serving():
    """One owner: the engines' LoRA settings follow --actor.lora.* and the staleness bound."""
    assert adapter_serving(_cfg(["--actor.lora.rank", "8"])) is None  # merged: plain engines
    serving = adapter_serving(
        _cfg(
            [
                "--actor.lora.rank",
                "12",
                "--actor.lora.refit",
                "adapter",
                "--train.max_staleness",
                "3",
            ]
        )
    )
    assert (serving.rank, serving.keep) == (12, 4)  # versions t-3 .. t can still be trained
    args = serving.server_args()
    assert args[args.index("--max-lora-rank") + 1] == "16"  # vLLM's next allowed rank
    assert args[args.index("--max-loras") + 1] == "4"
    forced = _cfg(
        [
            "--actor.lora.rank",
            "8",
            "--actor.lora.refit",
            "adapter",
            "--train.force_on_policy",
            "--train.max_staleness",
            "None",
        ]
    )
    validate_run_config(forced)  # on-policy: the bound is 0 whatever max_staleness says
    assert adapter_serving(forced).keep == 1
    cfg = _cfg(["--actor.lora.rank", "8", "--actor.lora.refit", "adapter"])
    own = dataclasses.replace(cfg.vllm, extra_args=["--max-loras=8"])
    with pytest.raises(ValueError, match="--vllm.extra_args --max-loras=8 with --actor.lora.refit"):
        validate_run_config(dataclasses.replace(cfg, vllm=own))


def test_the_overlong_budget_comes_from_the_rollout_limits():
    from molt_train.config import resolved_reward

    cfg = _cfg(["--reward.overlong_buffer_len", "2", "--rollout.max_tokens", "8"])
    validate_run_config(cfg)
    assert resolved_reward(cfg).max_response_len == 8
    cfg = _cfg(
        [
            "--reward.overlong_buffer_len",
            "2",
            "--rollout.max_tokens",
            "8",
            "--rollout.max_response_tokens",
            "6",
        ]
    )
    assert resolved_reward(cfg).max_response_len == 6
    cfg = _cfg(["--reward.overlong_buffer_len", "2", "--reward.max_response_len", "5"])
    assert resolved_reward(cfg).max_response_len == 5
    assert resolved_reward(RunConfig()) == RunConfig().reward


def test_aggregation_is_selectable_per_loss():
    cfg = _cfg(
        [
            "--algo.aggregation",
            "prompt-mean-token-mean",
            "--algo.kl_aggregation",
            "seq-mean-token-sum",
        ]
    )
    algo = cfg.algo
    assert [algo.aggregation_of(x) for x in ("policy", "entropy", "kl", "value")] == [
        "prompt-mean-token-mean",
        "prompt-mean-token-mean",
        "seq-mean-token-sum",
        "prompt-mean-token-mean",
    ]
    assert algo.aggregations() == {"prompt-mean-token-mean", "seq-mean-token-sum"}
    with pytest.raises(SystemExit):
        _cfg(["--algo.entropy_aggregation", "mean"])


def test_force_on_policy_needs_no_is_correction():
    cfg = _cfg(["--train.force_on_policy", "True", "--algo.advantage.is_correction_level", "off"])
    validate_run_config(cfg)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--algo.advantage.estimator", "nope"),
        ("--algo.policy_loss", "nope"),
        ("--rollout.stale_policy", "nope"),
        ("--fsdp.offload", "params"),
        ("--actor.optim.schedule", "step"),
        ("--actor.dtype", "fp8"),
        ("--router.policy", "x"),
        ("--refit.backend", "gloo"),
        ("--logger.wandb_mode", "on"),
        ("--rollout.parser", "x"),
    ],
)
def test_choices_are_checked_by_the_cli(flag, value, capsys):
    with pytest.raises(SystemExit):
        parse([flag, value])
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--train.force_on_policy"], True),
        (["--train.force_on_policy", "true"], True),
        (["--train.force_on_policy", "True"], True),
        (["--train.force_on_policy=false"], False),
        (["--no-train.force_on_policy"], False),
        (["--train.force_on_policy", "False"], False),
    ],
)
def test_booleans_take_every_spelling(argv, expected):
    cfg = parse([*argv, "--algo.advantage.is_correction_level", "off"])
    assert cfg.train.force_on_policy is expected
    # A bare boolean flag before another flag does not swallow it.
    assert parse(["--ckpt.resume", "--train.num_steps", "3"]).train.num_steps == 3


def test_more_gpus_than_the_cluster_has():
    cfg = _cfg(["--actor.num_workers", "4", "--vllm.num_engines", "4"])
    with pytest.raises(ValueError, match="asks for 8 GPUs.*has 2"):
        validate_run_config(cfg, cluster_gpus=2)


def test_colocation_shares_the_gpus_and_needs_them():
    cfg = _cfg(["--train.colocate", "--actor.num_workers", "1", "--ref.enable"])
    validate_run_config(cfg, cluster_gpus=1)  # engine, policy and reference on one GPU
    with pytest.raises(ValueError, match="--train.colocate shares GPUs.*has none"):
        validate_run_config(cfg, cluster_gpus=0)
    with pytest.raises(ValueError, match="asks for 2 GPUs"):
        validate_run_config(_cfg(["--train.colocate", "--actor.num_workers", "2"]), cluster_gpus=1)


def test_engines_sharing_gpus_count_each_gpu_once():
    cfg = _cfg(
        ["--actor.num_workers", "2", "--vllm.num_engines", "4", "--vllm.engines_per_gpu", "2"]
    )
    validate_run_config(cfg, cluster_gpus=4)  # 2 trainer GPUs + 4 engines on 2
    with pytest.raises(ValueError, match="asks for 4 GPUs.*engines_per_gpu.*has 3"):
        validate_run_config(cfg, cluster_gpus=3)
    two = [
        "--train.colocate",
        "--actor.num_workers",
        "1",
        "--vllm.num_engines",
        "2",
        "--vllm.engines_per_gpu",
        "2",
    ]
    validate_run_config(_cfg(two), cluster_gpus=1)  # both engines beside rank 0
    with pytest.raises(ValueError, match="--vllm.engines_per_gpu 2 places engines on GPUs"):
        validate_run_config(_cfg(two[1:]), cluster_gpus=0)


def test_engine_memory_share_defaults_by_placement():
    from molt_train.config import resolved

    assert resolved(_cfg([])).vllm.gpu_memory_utilization == 0.85
    assert resolved(_cfg(["--train.colocate"])).vllm.gpu_memory_utilization == 0.45
    given = ["--train.colocate", "--vllm.gpu_memory_utilization", "0.3"]
    assert resolved(_cfg(given)).vllm.gpu_memory_utilization == 0.3


def test_routing_replay_needs_gpu_engines():
    cfg = _cfg(["--train.routing_replay", "True", "--vllm.enable_return_routed_experts", "True"])
    validate_run_config(cfg)  # devices unknown yet
    validate_run_config(cfg, cluster_gpus=8)
    with pytest.raises(ValueError, match="--vllm.enable_return_routed_experts needs GPU"):
        validate_run_config(cfg, cluster_gpus=0)


def test_device_checks_wait_for_the_cluster():
    """Before Ray starts the GPU count is unknown: tensor parallelism passes the CLI's check
    and is judged once the cluster is up (refused on a CPU cluster)."""
    cfg = _cfg(["--actor.num_workers", "2", "--fsdp.tp_size", "2", "--vllm.num_engines", "2"])
    validate_run_config(cfg)
    validate_run_config(cfg, cluster_gpus=4)
    with pytest.raises(ValueError, match="--fsdp.tp_size / --fsdp.ep_size > 1 need GPUs"):
        validate_run_config(cfg, cluster_gpus=0)


def test_dynamic_filter_keeps_groups_whose_scores_differ():
    from molt_capture.types import Rollout
    from molt_rollout.agents.pool import GroupResult, PromptTask
    from molt_train.run import keep_informative_group

    def group(*scores, rewards=None):
        rewards = rewards or scores
        rollouts = [
            Rollout([], reward=r, rollout_id=f"r{i}", group_id="p0", score=s)
            for i, (r, s) in enumerate(zip(rewards, scores, strict=True))
        ]
        return GroupResult(PromptTask(0, {}, "p0", len(scores)), rollouts)

    assert keep_informative_group(group(0.0, 1.0, 1.0))
    assert not keep_informative_group(group(1.0, 1.0, 1.0))
    assert not keep_informative_group(group(0.0, 0.0))
    # The score decides when the agent gives one (a shaped reward may differ meanwhile).
    assert not keep_informative_group(group(1.0, 1.0, rewards=[0.5, 0.9]))


def test_aggregation_defaults_to_the_losss_own():
    """GSPO's objective is a mean over sequences; token-mean would weight them by length."""
    from molt_train.config import resolved

    assert resolved(parse(["--algo.policy_loss", "gspo"])).algo.aggregation == "seq-mean-token-mean"
    assert resolved(parse([])).algo.aggregation == "token-mean"
    explicit = ["--algo.policy_loss", "gspo", "--algo.aggregation", "token-mean"]
    assert resolved(parse(explicit)).algo.aggregation == "token-mean"


def test_a_worker_out_of_gpu_memory_is_named_with_the_flags_that_fit(
    ray_cluster, monkeypatch, capsys
):
    """A worker's CUDA out-of-memory error reaches the driver through Ray (which keeps its
    type); the program says so in two lines, with torch's numbers and the flags to change,
    and exits 1. Raised by hand in a real Ray task: a CPU cannot run out of CUDA memory."""
    import ray
    import torch

    from molt_train import cli, loop

    @ray.remote
    def step():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 594.00 MiB.")

    monkeypatch.setattr(loop, "train", lambda cfg: ray.get(step.remote()))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["quickstart"])
    assert exit_.value.code == 1
    said = capsys.readouterr().err.splitlines()
    assert said[0] == (
        "molt-train: a model ran out of GPU memory: "
        "CUDA out of memory. Tried to allocate 594.00 MiB."
    )
    assert said[1:] == [cli.OUT_OF_MEMORY]
    assert "--actor.gradient_checkpointing" in said[1] and "--vllm.enable_sleep_mode" in said[1]
