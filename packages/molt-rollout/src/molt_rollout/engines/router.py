"""The router: vllm-router in its own process, for inference only (refit calls each engine),
sticky on the rollout's session. It checks no token, so it listens on the driver's loopback,
beside its only clients, the agent runners."""

import shutil
import subprocess
import sys
from pathlib import Path

from molt_rollout.config import RouterConfig
from molt_rollout.engines import lifeline
from molt_rollout.engines.engine import EngineError, ServerProcess
from molt_rollout.network import LOOPBACK, SINGLE_NODE, Network, check_reachable, free_port
from molt_rollout.refit.control import EngineControl, RefitError


class Router(ServerProcess):
    def __init__(
        self,
        cfg: RouterConfig,
        engine_urls: list[str],
        log_dir: str,
        network: Network = SINGLE_NODE,
    ) -> None:
        self.cfg, self.engine_urls, self.network = cfg, engine_urls, network
        self.name, self.log_path = "router", Path(log_dir) / "router.log"

    def start(self) -> str:
        # The interpreter's own bin directory first: a venv used without activating it.
        here = str(Path(sys.executable).parent)
        executable = shutil.which("vllm-router", path=here) or shutil.which("vllm-router")
        if executable is None:
            raise EngineError("vllm-router is not installed (pip install vllm-router)")
        for i, url in enumerate(self.engine_urls):  # a clear error, not a router that waits
            check_reachable(url, f"the router (this node) dialling engine {i}")
        port = free_port(LOOPBACK)
        self.url = f"http://{LOOPBACK}:{port}"
        command = [executable, "--host", LOOPBACK, "--port", str(port), "--policy", self.cfg.policy]
        command += ["--worker-urls", *self.engine_urls]
        # Its metrics exporter's default port is fixed: two routers on one host would collide.
        command += ["--prometheus-host", LOOPBACK, "--prometheus-port", str(free_port())]
        if self.network.token:  # vllm-router takes it on the command line only
            # One argument: a token starting with "-" would read as an option.
            command.append(f"--api-key={self.network.token}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:
            # Tied to the driver's process: a killed driver leaves no router.
            self.process = lifeline.spawn(command, stdout=log, stderr=subprocess.STDOUT)
        self.wait_ready(self.cfg.startup_timeout_s, "--router.startup_timeout_s")
        return self.url

    def add_worker(self, url: str) -> None:
        """Route to engine `url` from now on (a restarted engine, once it holds the weights)."""
        self._manage("/add_worker", url)

    def remove_worker(self, url: str) -> None:
        """Route nothing more to `url` (a dead engine); its sessions move to the others."""
        self._manage("/remove_worker", url)

    def _manage(self, path: str, url: str) -> None:
        try:
            EngineControl(self.url, 30.0, self.network.token).post(path, url=url)
        except RefitError as error:
            raise EngineError(f"router {path} {url}: {error}") from error
