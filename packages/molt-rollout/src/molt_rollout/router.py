"""The router: vllm-router as its own process in front of the engines.

Inference traffic only (refit talks to each engine directly). It listens on loopback on the
driver's node, where its only clients, the agent runners, are placed (RunnerActors): vllm-router
0.1.17 checks no token, so across nodes it must not be reachable from other nodes. The engines
get the run's token from the client's own header, which it passes on, and from `--api-key` on
the requests it makes itself. The default policy, sticky least-loaded on the `x-session-id`
header, keeps every request of one rollout on the engine that holds its prefix cache and places
new sessions on the least-loaded engine.
"""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from molt_rollout import lifeline
from molt_rollout.config import RouterConfig
from molt_rollout.engine import EngineError, log_tail
from molt_rollout.network import LOOPBACK, SINGLE_NODE, Network, check_reachable, free_port


class Router:
    def __init__(self, cfg: RouterConfig, engine_urls: list[str], log_dir: str,
                 network: Network = SINGLE_NODE) -> None:  # fmt: skip
        self.cfg, self.engine_urls, self.network = cfg, engine_urls, network
        self.log_path = Path(log_dir) / "router.log"
        self.process: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> str:
        # The interpreter's own bin directory first: a venv used without activating it.
        executable = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or (
            shutil.which("vllm-router")
        )
        if executable is None:
            raise EngineError("vllm-router is not installed (pip install vllm-router)")
        for i, url in enumerate(self.engine_urls):  # a clear error, not a router that waits
            check_reachable(url, f"the router (this node) dialling engine {i}")
        port = free_port(LOOPBACK)
        self.url = f"http://{LOOPBACK}:{port}"
        command = [
            executable, "--host", LOOPBACK, "--port", str(port),
            "--policy", self.cfg.policy,
            "--worker-urls", *self.engine_urls,
            # Its metrics exporter defaults to a fixed port (29000): two routers on one host
            # (two runs, or a run beside a test's engines) would collide. Nothing dials it.
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(free_port()),
        ]  # fmt: skip
        if self.network.token:  # vllm-router 0.1.17 takes it on the command line only
            # One argument: a token starting with "-" (token_urlsafe: 1 in 64) would otherwise
            # read as an option and stop the router.
            command.append(f"--api-key={self.network.token}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:
            # Tied to the driver's process: a killed driver leaves no router.
            self.process = lifeline.spawn(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        with httpx.Client(timeout=2.0) as http:  # one TLS context, not one per poll
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise EngineError(f"router exited with {self.process.returncode}:\n"
                                      f"{log_tail(self.log_path)}")  # fmt: skip
                try:
                    if http.get(f"{self.url}/health").status_code == 200:
                        return self.url
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        self.stop()
        raise EngineError(
            f"router not ready after {self.cfg.startup_timeout_s} s:\n{log_tail(self.log_path)}"
        )

    def add_worker(self, url: str) -> None:
        """Route to engine `url` from now on (a restarted engine, once it holds the weights)."""
        self._manage("/add_worker", url)

    def remove_worker(self, url: str) -> None:
        """Route nothing more to `url` (a dead engine); its sessions move to the others."""
        self._manage("/remove_worker", url)

    def _manage(self, path: str, url: str) -> None:
        try:
            response = httpx.post(f"{self.url}{path}", params={"url": url}, timeout=30.0,
                                  headers=self.network.headers())  # fmt: skip
        except httpx.HTTPError as error:
            raise EngineError(f"router {path} {url} failed: {error!r}") from error
        if response.status_code >= 400:
            raise EngineError(f"router {path} {url} answered {response.status_code}: "
                              f"{response.text[:500]}")  # fmt: skip

    def stop(self) -> None:
        if self.process is not None:
            lifeline.stop(self.process)
