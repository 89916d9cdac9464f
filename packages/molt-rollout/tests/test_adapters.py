"""The adapter refitter's protocol against scripted fakes of vLLM's LoRA and version routes:
the order of calls across engines, the window of kept adapters, engine restarts. Real engines
serving the adapters: tests_integration/test_adapter_refit.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from safetensors.torch import load_file, save_file

from molt_rollout.config import RefitConfig
from molt_rollout.refit.adapters import AdapterRefitter, AdapterServing
from molt_rollout.refit.control import RefitError


class FakeLoRAEngine:
    """vLLM's three routes the refitter calls; every call goes into the shared `log`."""

    def __init__(self, log: list, refuse: str | None = None) -> None:
        self.log, self.refuse = log, refuse
        self.adapters: dict[str, str] = {}  # name -> path, as vLLM's API server keeps them
        self.version = "default"
        self.url = ""
        app = FastAPI()

        @app.post("/v1/load_lora_adapter")
        async def load(request: Request):
            body = await request.json()
            self.log.append((self.url, "load", body["lora_name"]))
            if self.refuse:
                return JSONResponse({"error": {"message": self.refuse}}, status_code=500)
            if body["lora_name"] in self.adapters:  # vLLM refuses a second load of a name
                return JSONResponse({"error": {"message": "already loaded"}}, status_code=400)
            self.adapters[body["lora_name"]] = body["lora_path"]
            return Response("Success: LoRA adapter added successfully.")  # plain text, as vLLM

        @app.post("/v1/unload_lora_adapter")
        async def unload(request: Request):
            body = await request.json()
            self.log.append((self.url, "unload", body["lora_name"]))
            self.adapters.pop(body["lora_name"])
            return Response("Success")

        @app.post("/update_weight_version")
        async def update(request: Request):
            self.version = (await request.json())["new_version"]
            # What a client would find now: the adapter of the version this engine reports.
            self.log.append((self.url, "version", self.version))
            return JSONResponse({"weight_version": self.version})

        self.app = app


@contextlib.contextmanager
def serving(engine: FakeLoRAEngine):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(engine.app, log_level="warning", lifespan="off"))

    def serve() -> None:
        with contextlib.suppress(SystemExit):
            asyncio.run(server.serve(sockets=[sock]))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield engine
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def write(tmp_path: Path, version: int) -> str:
    """A PEFT-shaped adapter directory whose B holds `version + 1` everywhere."""
    path = tmp_path / f"v{version}"
    path.mkdir()
    tensors = {
        "base_model.model.x.lora_A.weight": torch.ones(2, 3),
        "base_model.model.x.lora_B.weight": torch.full((4, 2), version + 1.0),
    }
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text('{"r": 2}')
    return str(path)


@pytest.fixture
def engines():
    log: list = []
    with serving(FakeLoRAEngine(log)) as a, serving(FakeLoRAEngine(log)) as b:
        yield a, b, log


def test_every_engine_loads_before_any_reports_the_version(engines, tmp_path):
    a, b, log = engines
    refitter = AdapterRefitter([a.url, b.url], RefitConfig(), AdapterServing(rank=8, keep=2))
    times = refitter.refit(0, write(tmp_path, 0))
    kinds = [kind for _, kind, _ in log]
    assert sorted(kinds[:2]) == ["load", "load"] and kinds[2:] == ["version", "version"]
    assert a.adapters == b.adapters == {"molt-lora-v0": str(tmp_path / "v0")}
    assert a.version == b.version == "0"
    assert (
        times["refit/bytes"] == (tmp_path / "v0" / "adapter_model.safetensors").stat().st_size + 8
    )
    assert {"timing/refit_load", "timing/refit_finish", "timing/refit_total"} <= set(times)
    refitter.close()


def test_the_window_keeps_the_newest_adapters_and_retires_the_rest(engines, tmp_path):
    a, b, log = engines
    refitter = AdapterRefitter([a.url, b.url], RefitConfig(), AdapterServing(rank=8, keep=2))
    for version in range(4):
        refitter.refit(version, write(tmp_path, version))
        # The version just set is always among the kept ones, and at most `keep` are.
        assert f"molt-lora-v{version}" in a.adapters and len(a.adapters) <= 2
    assert set(a.adapters) == set(b.adapters) == {"molt-lora-v2", "molt-lora-v3"}
    # Retired versions keep a valid adapter at their path (an engine may still reload one for
    # a request it holds): hard links to the first adapter with B = 0, no disk of their own.
    retired = tmp_path / "retired" / "adapter_model.safetensors"
    assert torch.equal(load_file(retired)["base_model.model.x.lora_B.weight"], torch.zeros(4, 2))
    for version in (0, 1):
        files = tmp_path / f"v{version}"
        assert (files / "adapter_model.safetensors").stat().st_ino == retired.stat().st_ino
        assert (files / "adapter_config.json").read_text() == '{"r": 2}'
        assert sorted(p.name for p in files.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
    kept = load_file(tmp_path / "v3" / "adapter_model.safetensors")
    assert torch.equal(kept["base_model.model.x.lora_B.weight"], torch.full((4, 2), 4.0))
    # A version leaves only after its successor is served: v1 is unloaded after "version 3".
    on_a = [(kind, what) for url, kind, what in log if url == a.url]
    assert on_a.index(("unload", "molt-lora-v1")) > on_a.index(("version", "3"))
    refitter.close()


def test_a_restarted_engine_gets_the_current_adapter_and_the_others_keep_theirs(tmp_path):
    log: list = []
    with serving(FakeLoRAEngine(log)) as a, serving(FakeLoRAEngine(log)) as b:
        refitter = AdapterRefitter([a.url, b.url], RefitConfig(), AdapterServing(rank=8, keep=2))
        refitter.refit(0, write(tmp_path, 0))
        refitter.refit(1, write(tmp_path, 1))
        with serving(FakeLoRAEngine(log)) as fresh:  # b died; its replacement has a new URL
            refitter.set_engines([a.url, fresh.url])
            log.clear()
            refitter.refit(1, str(tmp_path / "v1"))  # the same version, again
            assert [(url, kind) for url, kind, _ in log if kind == "load"] == [(fresh.url, "load")]
            assert fresh.adapters == {"molt-lora-v1": str(tmp_path / "v1")}
            assert set(a.adapters) == {"molt-lora-v0", "molt-lora-v1"}
            refitter.refit(2, write(tmp_path, 2))
            assert set(fresh.adapters) == {"molt-lora-v1", "molt-lora-v2"}
            assert set(a.adapters) == {"molt-lora-v1", "molt-lora-v2"}
        refitter.close()


def test_an_adapter_the_engine_refuses_fails_naming_the_flag_and_sets_no_version(tmp_path):
    log: list = []
    message = "expected target modules in {'qkv_proj'} but received ['lm_head']"
    with serving(FakeLoRAEngine(log, refuse=message)) as engine:
        refitter = AdapterRefitter([engine.url], RefitConfig(), AdapterServing(rank=8, keep=2))
        with pytest.raises(RefitError, match=r"--actor.lora.refit adapter.*lm_head"):
            refitter.refit(0, write(tmp_path, 0))
        assert engine.version == "default"  # no client is pointed at an adapter that is not there
        refitter.close()
