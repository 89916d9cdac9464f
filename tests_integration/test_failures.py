"""A run meeting failures, end to end on CPU: the driver killed and the run resumed, an engine
killed and restarted (or, with restarts off, the run ended within seconds), then SIGTERM or
SIGINT. Each test checks that nothing of the run is left behind.
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
from test_train import ADAPTER, FAST, LORA, metrics, molt_train

from molt_rollout.engines.engine import CPU_SERVER


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
