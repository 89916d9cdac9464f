"""recipes/ray_cluster.sh, the Slurm recipe's bootstrap: a head on 127.0.0.3 and a worker node
on 127.0.0.2 (two raylets on one machine, as two hosts would run them) form one cluster that a
driver joins; ending the two node processes ends the nodes. Not 127.0.0.1 for the head: Ray
replaces that one address with the host's own (`resolve_ip_for_localhost`), which would put the
head's servers outside the loopback range."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from molt_rollout.network import free_port

SCRIPT = Path(__file__).resolve().parents[1] / "recipes" / "ray_cluster.sh"
HEAD, WORKER = "127.0.0.3", "127.0.0.2"
pytestmark = pytest.mark.slow


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
    engine on them) ended, Ray's address file naming them gone, and no GCS of theirs left."""
    port = str(free_port())
    nodes = [node("head", HEAD, port, *head)]
    try:
        nodes.append(node("worker", HEAD, port, WORKER, *worker))
        ready = subprocess.run(["bash", str(SCRIPT), "wait", HEAD, port, "2", "180"],
                               env=env(), capture_output=True, text=True, timeout=240)  # fmt: skip
        assert ready.returncode == 0, ready.stdout + ready.stderr
        yield f"{HEAD}:{port}"
    finally:
        for process in reversed(nodes):
            os.killpg(process.pid, signal.SIGTERM)
        for process in reversed(nodes):
            process.wait(60)
        # `ray start` records the head's address for plain `ray.init()` calls on this machine
        # (Molt's own pass address="local"); a file naming the ended test cluster must not stay.
        address_file = Path("/tmp/ray/ray_current_cluster")
        if address_file.exists() and address_file.read_text().strip().endswith(f":{port}"):
            address_file.unlink()
    time.sleep(1)
    leftover = subprocess.run(["pgrep", "-f", f"gcs_server.*--gcs_server_port={port}"],
                              capture_output=True, text=True)  # fmt: skip
    assert not leftover.stdout.strip(), "the head's GCS outlived its node process"


def test_head_and_worker_form_one_cluster():
    with cluster(["--num-cpus", "1", "--resources", '{"head": 1}'],
                 ["--num-cpus", "1", "--resources", '{"engine_node": 1}']) as address:  # fmt: skip
        probe = (
            "import json, ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
            "print(json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))"
        )
        out = subprocess.run([sys.executable, "-c", probe, address], env=env(),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        addresses = json.loads(out.stdout.strip().splitlines()[-1])
        assert addresses == sorted([HEAD, WORKER]), out.stderr
