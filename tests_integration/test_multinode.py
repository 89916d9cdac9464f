"""A run across two Ray nodes on one machine, started by recipes/ray_cluster.sh (the Slurm
recipe's bootstrap) as two hosts would run it: a head node (the driver's, with the CPUs and the
`trainer_node` resource) on 127.0.0.3 and a second node on 127.0.0.2 (no CPUs, the
`engine_node` resource). A driver that joins sees both nodes at their own addresses. The engine
is pinned to the second node, the policy rank to the head (the runners always run on the
driver's node); a short quickstart run completes, its refits cross nodes, the engine listens on
its own node's address and refuses calls without the run's token, the router (which checks no
token) listens on loopback only, and ending the two node processes ends the nodes and leaves
nothing. Only loopback-range addresses are used; not 127.0.0.1 for the head: Ray replaces that
one address with the host's own (`resolve_ip_for_localhost`), which would put the head's
servers outside the loopback range."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from molt_rollout.network import free_port

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "recipes" / "ray_cluster.sh"
HEAD, WORKER = "127.0.0.3", "127.0.0.2"


def env() -> dict[str, str]:
    return dict(os.environ, RAY_AUTH_MODE="disabled",
                PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")  # fmt: skip


def node(*args: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(SCRIPT), *args], env=env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


@contextlib.contextmanager
def cluster(head: list[str], worker: list[str]):
    """A head on HEAD and a worker node on WORKER, started by the recipe's script with
    these `ray start` options; yields the address. After: both nodes (and so every actor and
    engine on them) ended within 15 s of SIGTERM, Ray's address file naming them gone, and no
    GCS of theirs left."""
    port = str(free_port())
    nodes = [node("head", HEAD, port, *head)]
    try:
        nodes.append(node("worker", HEAD, port, WORKER, *worker))
        ready = subprocess.run(["bash", str(SCRIPT), "wait", HEAD, port, "2", "180"],
                               env=env(), capture_output=True, text=True, timeout=240)  # fmt: skip
        assert ready.returncode == 0, ready.stdout + ready.stderr
        # A driver that joins (the script's own check) sees both nodes at their own addresses.
        alive = ready.stdout.split("nodes alive: ")[-1].split()
        assert alive == sorted([HEAD, WORKER]), ready.stdout
        yield f"{HEAD}:{port}"
    finally:
        signalled = time.monotonic()
        for process in reversed(nodes):
            os.killpg(process.pid, signal.SIGTERM)
        for process in reversed(nodes):
            process.wait(60)
        ended_in = time.monotonic() - signalled
        # `ray start` records the head's address for plain `ray.init()` calls on this machine
        # (Molt's own pass address="local"); a file naming the ended test cluster must not stay.
        address_file = Path("/tmp/ray/ray_current_cluster")
        if address_file.exists() and address_file.read_text().strip().endswith(f":{port}"):
            address_file.unlink()
    assert ended_in < 15, f"{ended_in:.0f} s: Ray's drain on SIGTERM is on (the script's setting)"
    time.sleep(1)
    leftover = subprocess.run(["pgrep", "-f", f"gcs_server.*--gcs_server_port={port}"],
                              capture_output=True, text=True)  # fmt: skip
    assert not leftover.stdout.strip(), "the head's GCS outlived its node process"


def bindable(host: str) -> bool:
    try:
        with socket.socket() as sock:
            sock.bind((host, 0))
        return True
    except OSError:
        return False


def two_nodes():
    """The head (2 CPUs, the trainer's) and an engine node without CPUs: see `cluster`."""
    return cluster(["--num-cpus", "2", "--resources", '{"trainer_node": 1}'],
                   ["--num-cpus", "0", "--resources", '{"engine_node": 1}'])  # fmt: skip


def engine_address(log: Path, process: subprocess.Popen) -> tuple[str, int]:
    """(host, port) from the engine's command line, the first line of its log."""
    deadline = time.monotonic() + 300
    while not log.exists() or "--port" not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, "no engine log"
        time.sleep(0.5)
    line = log.read_text().splitlines()[0]
    return re.search(r"--host (\S+)", line)[1], int(re.search(r"--port (\d+)", line)[1])


def router_addresses() -> set[str]:
    """The addresses the run's vllm-router (and any process under it) listens on."""
    found = set()
    for p in psutil.process_iter(["name"]):
        with contextlib.suppress(psutil.Error):
            if p.info["name"] == "vllm::router":  # the process title it sets itself
                for q in [p, *p.children(recursive=True)]:
                    found |= {c.laddr.ip for c in q.net_connections("tcp")
                              if c.status == psutil.CONN_LISTEN}  # fmt: skip
    return found


def wait_until_serving(url: str, driver: subprocess.Popen) -> None:
    """Until the engine's /health answers 200 (refused or reset while it starts)."""
    deadline = time.monotonic() + 300
    while True:
        assert driver.poll() is None and time.monotonic() < deadline, "the engine never served"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return
        time.sleep(0.1)


def servers_on(port: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            line = " ".join(p.info["cmdline"] or [])
            if "vllm.entrypoints" in line and f"--port {port}" in line:
                found.append(p)
    return found


@pytest.mark.skipif(not (bindable(HEAD) and bindable(WORKER)),
                    reason=f"{HEAD} or {WORKER} is not bindable here")  # fmt: skip
def test_a_run_across_two_nodes(tmp_path):
    run = tmp_path / "multinode"
    with two_nodes() as address:
        cmd = [sys.executable, "-m", "molt_train.cli", "quickstart",
               "--logger.wandb_mode", "disabled", "--ckpt.export_hf", "False",
               "--eval.every_steps", "0", "--train.num_steps", "3",
               "--rollout.groups_per_batch", "4", "--train.ray_address", address,
               "--vllm.ray_resources", "engine_node", "1",
               "--actor.ray_resources", "trainer_node", "1",
               "--train.output_dir", str(tmp_path), "--logger.run_name", run.name]  # fmt: skip
        with open(f"{run}.out", "w") as out, open(f"{run}.err", "w") as err:
            driver = subprocess.Popen(cmd, env=env(), stdout=out, stderr=err)
        try:
            host, port = engine_address(run / "logs" / "engine_0.log", driver)
            assert host == WORKER  # its own node's address, from Ray
            # Checked as soon as the engine serves: the run needs its first refit and three
            # steps more before it stops the engine (CI saw a check after a step lose that race).
            url = f"http://{host}:{port}"
            wait_until_serving(url, driver)
            for path in ("/pause", "/inference/v1/generate"):  # control and inference
                assert httpx.post(f"{url}{path}", timeout=10).status_code == 401
            # The router starts after the engines and lives until the run's end.
            routers: set[str] = set()
            while driver.poll() is None and not routers:
                routers = router_addresses()
                time.sleep(0.2)
            assert routers == {"127.0.0.1"}, "no vllm-router listening, or not on loopback only"
            driver.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                driver.kill()
        stderr = Path(f"{run}.err").read_text()
        assert driver.returncode == 0, stderr[-4000:]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]
        # Every refit crossed the nodes: the engine samples exactly the trainer's weights.
        assert all(r["timing/refit_total"] > 0 for r in rows)
        assert all(abs(r["is/vllm_kl"]) < 1e-3 for r in rows if r["is/vllm_kl"] is not None)
        assert rows[-1]["train/weight_version"] == 3
        assert not servers_on(port), "the engine outlived the run"
