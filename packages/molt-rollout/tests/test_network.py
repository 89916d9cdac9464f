"""Addresses and tokens of a run (molt_rollout.network), the engines' token middleware, the
start-up reachability check: isolated logic, no Ray, no vLLM (one test starts the real
vllm-router, which is molt-rollout's own dependency)."""

import asyncio
import socket

import pytest

from molt_capture.server import is_loopback
from molt_rollout import network
from molt_rollout.config import VLLMConfig
from molt_rollout.engines.engine import server_args
from molt_rollout.network import (
    LOOPBACK,
    SINGLE_NODE,
    Network,
    UnreachableError,
    check_reachable,
)
from molt_rollout.refit.auth import TOKEN_ENV, RequireToken


def test_loopback_addresses():  # capture's rule, which the run's addresses follow too
    assert is_loopback("127.0.0.1") and is_loopback("127.0.0.2") and is_loopback("localhost")
    assert is_loopback("::1")
    assert not is_loopback("192.0.2.7") and not is_loopback("node-3.cluster")


def test_single_node_is_loopback_without_a_token():
    assert SINGLE_NODE.host() == LOOPBACK and SINGLE_NODE.headers() == {}


def test_several_nodes_need_a_token_which_no_repr_shows():
    with pytest.raises(ValueError, match="token"):
        Network(multi_node=True)
    net = Network(multi_node=True, token="s3cret")
    assert net.headers() == {"Authorization": "Bearer s3cret"}
    assert "s3cret" not in repr(net)


def test_across_nodes_a_server_listens_on_its_node_address(monkeypatch):
    monkeypatch.setattr(network, "node_address", lambda: "127.0.0.2")
    assert Network(multi_node=True, token="t").host() == "127.0.0.2"
    assert Network().host() == LOOPBACK  # one node: loopback whatever Ray calls the node


class FakeRay:
    def __init__(self, alive: list[bool]):
        self.alive = alive

    def nodes(self):
        return [{"Alive": a} for a in self.alive]


@pytest.mark.parametrize(
    ("alive", "multi"), [([True], False), ([True, False], False), ([True, True], True)]
)
def test_the_cluster_decides_once(monkeypatch, alive, multi):
    import sys

    monkeypatch.setitem(sys.modules, "ray", FakeRay(alive))
    monkeypatch.delenv(network.TOKEN_ENV, raising=False)
    net = Network.of_cluster()
    assert net.multi_node is multi and bool(net.token) is multi
    if multi:  # a fresh random token per run
        assert len(net.token) >= 32 and Network.of_cluster().token != net.token
    monkeypatch.setenv(network.TOKEN_ENV, "mine")
    assert Network.of_cluster().token == "mine"  # the user's, on one node too


def test_engine_command_line_across_nodes():
    args = server_args(VLLMConfig(), "/m", 8123, "molt_gloo", host="127.0.0.2", token_check=True)
    assert args[args.index("--host") + 1] == "127.0.0.2"
    # the token check wraps every other middleware: it is added last
    assert middlewares(args)[-1] == "molt_rollout.refit.auth.RequireToken"
    assert "--api-key" not in args  # the token travels in the environment, not in `ps`
    plain = server_args(VLLMConfig(), "/m", 8123, "molt_gloo")
    assert "molt_rollout.refit.auth.RequireToken" not in middlewares(plain)


def middlewares(args: list[str]) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args) if arg == "--middleware"]


def test_the_versions_middleware_sees_pause_before_molts_answers_it(monkeypatch):
    from molt_rollout import config

    monkeypatch.setattr(config, "vllm_version", lambda: (0, 26))
    assert middlewares(server_args(VLLMConfig(), "/m", 8123, "molt_ipc")) == [
        "molt_rollout.refit.fast_pause.Pause",  # innermost
        "molt_rollout.refit.weight_versions.WeightVersions",  # counts every /pause, then forwards it
    ]


def call(app, path: str, headers: dict[str, str]) -> tuple[int, list]:
    sent = []

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    asyncio.run(app(scope, None, send))
    return sent[0]["status"], sent


def test_the_engine_middleware_guards_every_path_but_health(monkeypatch):
    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    monkeypatch.setenv(TOKEN_ENV, "tok")
    app = RequireToken(inner)
    for path in ("/pause", "/init_weight_transfer_engine", "/inference/v1/generate"):
        assert call(app, path, {})[0] == 401
        assert call(app, path, {"Authorization": "Bearer nope"})[0] == 401
        assert call(app, path, {"Authorization": "Bearer tok"})[0] == 200
    assert call(app, "/health", {})[0] == 200


def test_an_unreachable_server_names_both_ends_and_the_port(monkeypatch):
    monkeypatch.setattr(network, "node_address", lambda: "127.0.0.1")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(
        UnreachableError, match=rf"\(127.0.0.1\) cannot connect to 127.0.0.1 port {port}"
    ):
        check_reachable(f"http://127.0.0.1:{port}", "refit dialling engine 0", timeout_s=2)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_reachable(f"http://127.0.0.1:{server.getsockname()[1]}", "x")  # no error


def test_refit_and_router_name_the_engine_they_cannot_reach(closed_port_url, tmp_path):
    from molt_rollout.config import RefitConfig, RouterConfig
    from molt_rollout.engines.router import Router
    from molt_rollout.refit.control import Refitter

    with pytest.raises(UnreachableError, match="refit .* dialling engine 0: this node"):
        Refitter([closed_port_url], 1, RefitConfig(), on_gpu=False)
    with pytest.raises(UnreachableError, match="the router .* dialling engine 0: this node"):
        Router(RouterConfig(), [closed_port_url], str(tmp_path)).start()


def test_the_router_takes_a_token_that_starts_with_a_dash(tmp_path):
    """A random run token starts with "-" one time in 64 (token_urlsafe); vllm-router's
    argument parser must still read it as --api-key's value, not as an option. The real
    router, in front of a stand-in engine that answers its health checks."""
    import http.server
    import threading

    from molt_rollout.config import RouterConfig
    from molt_rollout.engines.router import Router

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    engine = http.server.ThreadingHTTPServer((LOOPBACK, 0), Healthy)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    net = Network(multi_node=True, token="-dash-first-token")
    router = Router(
        RouterConfig(), [f"http://{LOOPBACK}:{engine.server_port}"], str(tmp_path), network=net
    )
    try:
        assert router.start().startswith(f"http://{LOOPBACK}:")
        assert router.process.poll() is None
    finally:
        router.stop()
        engine.shutdown()
