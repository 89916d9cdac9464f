"""The agent contract: loading a user module names exactly what is wrong; small helpers."""

from __future__ import annotations

import asyncio
import re
import textwrap
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from molt_capture.testing import ADD_TOOL, FakeGenerator, assert_token_exact, tool_call_text
from molt_capture.tiny_tokenizer import build_tiny_tokenizer
from molt_rollout.agents.agent import (
    ChatContext,
    Dropped,
    Result,
    RolloutDropped,
    canonical_tools,
    check_result,
    numeric_info,
    row_messages,
    within_deadline,
)
from molt_rollout.agents.chat_runner import ChatRunner
from molt_rollout.agents.env_runner import EnvRunner
from molt_rollout.agents.loader import AgentLoadError, load_agent
from molt_rollout.config import RolloutConfig

ENV_AGENT = """
from molt_rollout.agents.agent import Env, Result
from molt_rollout.agents.env_runner import EnvRunner

class MyEnv(Env):
    async def step(self, state):
        return Result(reward=1.0)

class AgentRunner(EnvRunner):
    env_class = MyEnv
"""

CHAT_AGENT = """
from molt_rollout.agents.agent import ChatAgent, Result
from molt_rollout.agents.chat_runner import ChatRunner

class MyAgent(ChatAgent):
    async def run(self, ctx):
        return Result(reward=1.0)

class AgentRunner(ChatRunner):
    agent_class = MyAgent
"""


def write(tmp_path, source: str, name: str = "my_agent.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def load_error(tmp_path, source: str) -> str:
    with pytest.raises(AgentLoadError) as e:
        load_agent(write(tmp_path, source))
    return str(e.value)


def test_loads_both_forms_by_path(tmp_path):
    env_runner = load_agent(write(tmp_path, ENV_AGENT, "env_agent.py"))
    assert issubclass(env_runner, EnvRunner) and env_runner.env_class.__name__ == "MyEnv"
    chat_runner = load_agent(write(tmp_path, CHAT_AGENT, "chat_agent.py"))
    assert issubclass(chat_runner, ChatRunner) and chat_runner.agent_class.__name__ == "MyAgent"


def test_loads_by_dotted_name(tmp_path, monkeypatch):
    pkg = tmp_path / "agents_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "math_env.py").write_text(ENV_AGENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert issubclass(load_agent("agents_pkg.math_env"), EnvRunner)


def test_missing_file_and_module(tmp_path):
    with pytest.raises(AgentLoadError, match="agent file .*nope.py does not exist"):
        load_agent(str(tmp_path / "nope.py"))
    with pytest.raises(AgentLoadError, match="no module named 'no_such_agent_module'"):
        load_agent("no_such_agent_module")
    with pytest.raises(AgentLoadError, match="is a directory: give the .py file"):
        load_agent(str(tmp_path))


def test_import_failure_is_named(tmp_path):
    message = load_error(tmp_path, "import json\nraise RuntimeError('no API key set')\n")
    assert "importing" in message and "RuntimeError: no API key set" in message


def test_no_agent_runner(tmp_path):
    message = load_error(tmp_path, "class Runner: pass\n")
    assert "does not define AgentRunner" in message


def test_agent_runner_of_the_wrong_kind(tmp_path):
    message = load_error(tmp_path, "class AgentRunner: pass\n")
    assert "AgentRunner must be a subclass of EnvRunner or ChatRunner" in message
    message = load_error(tmp_path, "AgentRunner = 3\n")
    assert "got 3" in message


def test_env_class_missing(tmp_path):
    source = (
        "from molt_rollout.agents.env_runner import EnvRunner\nclass AgentRunner(EnvRunner): pass\n"
    )
    message = load_error(tmp_path, source)
    assert "AgentRunner.env_class must be set to your Env class, got None" in message


def test_env_without_step_and_with_sync_reset(tmp_path):
    source = """
    from molt_rollout.agents.env_runner import EnvRunner

    class MyEnv:
        def reset(self, state):
            pass

    class AgentRunner(EnvRunner):
        env_class = MyEnv
    """
    message = load_error(tmp_path, source)
    assert "MyEnv.reset must be async (async def reset(...))" in message
    assert "MyEnv does not define step()" in message


def test_env_subclass_not_overriding_step(tmp_path):
    source = """
    from molt_rollout.agents.agent import Env
    from molt_rollout.agents.env_runner import EnvRunner

    class MyEnv(Env):
        pass

    class AgentRunner(EnvRunner):
        env_class = MyEnv
    """
    message = load_error(tmp_path, source)
    assert message.endswith("MyEnv does not define step()")  # reset is inherited, fine


def test_chat_agent_with_sync_run(tmp_path):
    source = """
    from molt_rollout.agents.agent import ChatAgent
    from molt_rollout.agents.chat_runner import ChatRunner

    class MyAgent(ChatAgent):
        def run(self, ctx):
            pass

    class AgentRunner(ChatRunner):
        agent_class = MyAgent
    """
    assert "MyAgent.run must be async (async def run(...))" in load_error(tmp_path, source)


def test_chat_agent_class_missing(tmp_path):
    source = "from molt_rollout.agents.chat_runner import ChatRunner\nclass AgentRunner(ChatRunner): pass\n"
    message = load_error(tmp_path, source)
    assert "AgentRunner.agent_class must be set to your ChatAgent class" in message


def test_result_defaults_and_checks():
    r = Result(reward=1)
    assert (r.score, r.info, r.observation, r.terminated, r.truncated) == (
        None,
        {},
        "",
        True,
        False,
    )
    assert (r.max_tokens, r.temperature, r.stop) == (None, None, None)
    assert check_result(r) is r
    for bad in (
        None,
        Result(reward=True),
        Result(reward=float("inf")),
        Result(reward="1"),
        Result(1, score="A"),
    ):
        with pytest.raises(RolloutDropped) as e:
            check_result(bad)
        assert e.value.reason == "bad_result"
    assert numeric_info({"a": 1, "b": True, "c": "x", "d": 0.5}) == {"a": 1.0, "b": 1.0, "d": 0.5}


def test_row_messages():
    assert row_messages({"prompt": "Hi"}) == [{"role": "user", "content": "Hi"}]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert row_messages({"prompt": msgs}) == msgs
    with pytest.raises(RolloutDropped, match="row has no 'prompt'"):
        row_messages({"question": "Hi"})


def test_anthropic_args_and_canonical_tools():
    tool = {
        "type": "function",
        "function": {"parameters": {"type": "object"}, "name": "f", "strict": True},
    }
    (canon,) = canonical_tools([tool])
    assert list(canon["function"]) == ["name", "parameters"]  # wire order; unknown keys dropped
    assert canonical_tools(None) is None and canonical_tools([]) is None
    ctx = ChatContext(
        messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        tools=[canon],
        label=None,
        row={},
        base_url="u",
        anthropic_base_url="u",
        model="m",
        api_key="k",
        temperature=1.0,
        top_p=1.0,
        max_tokens=None,
        max_len=100,
    )
    assert ctx.anthropic_args() == {
        "max_tokens": 100,
        "system": "S",
        "messages": [{"role": "user", "content": "U"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    }
    assert len(ctx.messages) == 2  # not modified


def test_within_deadline():
    async def value():
        return 7

    async def hang():
        await asyncio.sleep(60)

    assert asyncio.run(within_deadline(value(), 1.0)) == 7
    assert asyncio.run(within_deadline(value(), None)) == 7
    with pytest.raises(RolloutDropped) as e:
        asyncio.run(within_deadline(hang(), 0.05))
    assert e.value.reason == "deadline"


# ---- docs/concepts/agents.md: every example file loads and earns its reward ----------------------

DOCS = Path(__file__).resolve().parents[3] / "docs" / "concepts" / "agents.md"


def doc_blocks() -> list[str]:
    if not DOCS.exists():  # the package tested on its own, outside the repository
        pytest.skip("docs/concepts/agents.md is not next to this package")
    return re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)


def doc_files() -> dict[str, str]:
    """The examples that are whole files: their first line is `# name.py`."""
    blocks = doc_blocks()
    return {b.split("\n", 1)[0][2:]: b for b in blocks if re.match(r"# \w+\.py\n", b)}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return PreTrainedTokenizerFast.from_pretrained(
        build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    )


DOC_ROW = {
    "prompt": [
        {"role": "system", "content": "Use the add tool."},
        {"role": "user", "content": "What is 17+25?"},
    ],
    "tools": [ADD_TOOL],
    "label": "42",
}


@pytest.mark.parametrize(
    "name", ["calculator_env.py", "openai_agent.py", "responses_agent.py", "anthropic_agent.py"]
)
def test_docs_examples_run(name, tmp_path, tokenizer):
    files = doc_files()
    assert name in files, f"docs/concepts/agents.md has no example {name}"
    runner_class = load_agent(write(tmp_path, files[name], name))
    replies = [tool_call_text("add", {"a": 17, "b": 25}), "The answer is 42."]
    gen = FakeGenerator(tokenizer, replies)
    runner = runner_class(gen, tokenizer, RolloutConfig(deadline_s=20))
    try:
        rollout = asyncio.run(runner.run(DOC_ROW, rollout_id="r0", group_id="g0"))
    finally:
        runner.close()
    assert not isinstance(rollout, Dropped), rollout
    assert rollout.reward == 1.0 and len(gen.calls) == 2
    assert_token_exact(rollout.segments, gen.calls)


def test_docs_by_hand_snippet_runs(tmp_path, monkeypatch, capsys):
    files = doc_files()
    (snippet,) = [b for b in doc_blocks() if "load_agent(" in b]
    write(tmp_path, files["calculator_env.py"], "calculator_env.py")
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "agents.md", "exec"), {})
    assert capsys.readouterr().out.startswith("1.0 ")
