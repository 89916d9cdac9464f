"""Loading the agent module (file path or dotted name), checked before anything runs."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from molt_rollout.agents.agent import ChatAgent, Env
from molt_rollout.agents.chat_runner import ChatRunner
from molt_rollout.agents.env_runner import EnvRunner


class AgentLoadError(ValueError):
    """The agent module is missing, fails to import, or does not follow the contract."""


def load_agent(path_or_module: str) -> type:
    """The checked `AgentRunner` class of `my_agent.py` or `pkg.agent`: every problem in one error."""
    module = _import(path_or_module)
    runner = getattr(module, "AgentRunner", None)
    if runner is None:
        raise AgentLoadError(
            f"{path_or_module} does not define AgentRunner (a subclass of EnvRunner or ChatRunner)"
        )
    problems = agent_problems(runner)
    if problems:
        raise AgentLoadError(f"{path_or_module}: " + "; ".join(problems))
    return runner


def agent_problems(runner: Any) -> list[str]:
    """What is wrong with an AgentRunner class, one sentence each (empty when it is fine)."""
    if not isinstance(runner, type) or not issubclass(runner, EnvRunner | ChatRunner):
        return [f"AgentRunner must be a subclass of EnvRunner or ChatRunner, got {runner!r}"]
    if issubclass(runner, EnvRunner):
        attr, base, methods = "env_class", Env, ("reset", "step")
    else:
        attr, base, methods = "agent_class", ChatAgent, ("run",)
    cls = getattr(runner, attr, None)
    if not isinstance(cls, type):
        return [f"AgentRunner.{attr} must be set to your {base.__name__} class, got {cls!r}"]
    problems = []
    for name in methods:
        method = getattr(cls, name, None)
        # The base class's `step`/`run` only raises NotImplementedError: it must be overridden.
        if method is None or (name != "reset" and method is getattr(base, name)):
            problems.append(f"{cls.__name__} does not define {name}()")
        elif not inspect.iscoroutinefunction(method):
            problems.append(f"{cls.__name__}.{name} must be async (async def {name}(...))")
    return problems


def _import(path_or_module: str):
    path = Path(path_or_module)
    if path.suffix == ".py" or "/" in path_or_module:
        if path.is_dir():
            raise AgentLoadError(
                f"agent path {path} is a directory: give the .py file that defines AgentRunner, "
                "or a dotted module name"
            )
        if not path.is_file():
            raise AgentLoadError(f"agent file {path} does not exist")
        name = f"molt_agent_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise AgentLoadError(f"importing {path} failed: {type(e).__name__}: {e}") from e
        return module
    try:
        return importlib.import_module(path_or_module)
    except Exception as e:  # the module itself missing, or its import failing
        if isinstance(e, ModuleNotFoundError) and e.name and path_or_module.startswith(e.name):
            raise AgentLoadError(f"no module named {path_or_module!r}") from e
        raise AgentLoadError(f"importing {path_or_module} failed: {type(e).__name__}: {e}") from e
