"""What every example's whole-run test shares. The test file is itself the run's agent module: its
`AgentRunner` is the example's runner with each engine call recorded (`Recorded`), and writes per
rollout what the test then checks (`trace`) to the row's `trace_dir`."""

import json
import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

from molt_capture.testing import RecordingGenerator, assert_token_exact
from molt_capture.types import Rollout

EXAMPLES = Path(__file__).resolve().parents[1]


class Recorded:
    """Put before an example's runner class: records every engine call of a rollout, and writes
    its trace. `session_of` maps a rollout id to its capture session (the Env runner's is the
    rollout id; a ChatAgent's is the last part of its `ctx.base_url`)."""

    def __init__(self, generator, *args, **kwargs):
        self.recorder = RecordingGenerator(lambda: generator)
        super().__init__(self.recorder, *args, **kwargs)

    def session_of(self, rollout_id: str) -> str:
        return rollout_id

    def traced(self, row: dict) -> dict:
        """The row's fields the test reads beside the trace."""
        return {}

    async def run(self, row, rollout_id, group_id):
        result = await super().run(row, rollout_id, group_id)
        calls = self.recorder.calls_for(self.session_of(rollout_id))
        write_trace(row["trace_dir"], trace(result, calls, self.tokenizer) | self.traced(row))
        return result


# A ChatAgent's rollouts: rollout id -> capture session id (the last part of `ctx.base_url`).
SESSIONS: dict[str, str] = {}


def note_session(ctx) -> None:
    """Called by a recorded ChatAgent's `run`: where its engine calls are recorded."""
    SESSIONS[ctx.rollout_id] = ctx.base_url.rsplit("/", 1)[-1]


class RecordedChat(Recorded):
    def session_of(self, rollout_id: str) -> str:
        return SESSIONS.pop(rollout_id, "")


def trace(result, calls, tokenizer) -> dict:
    """A rollout as the tests read it: dropped or not, token-exact or not, the prompt, each trained
    turn and the context between turns decoded, and the generated ids beside the trained."""
    if not isinstance(result, Rollout):
        return {"dropped": f"{result.reason}: {result.detail}"}
    try:
        assert_token_exact(result.segments, calls)
        exact = True
    except AssertionError as e:
        exact = str(e)
    turns = [(s, t) for s in result.segments for t in s.turns]
    between = [(s, a.end, b.start) for s in result.segments for a, b in pairwise(s.turns)]
    images = [(s, i.offset, i.offset + i.length) for s in result.segments for i in s.images]
    return {
        "dropped": None,
        "exact": exact,
        "reward": result.reward,
        "info": result.info,
        "prompt": tokenizer.decode(calls[0].token_ids),
        "replies": [tokenizer.decode(s.token_ids[t.start : t.end], True) for s, t in turns],
        "between": [tokenizer.decode(s.token_ids[start:end]) for s, start, end in between],
        "masked_between": not any(any(s.trainable[start:end]) for s, start, end in between),
        "images": [len(s.images) for s in result.segments],
        "images_masked": not any(any(s.trainable[start:end]) for s, start, end in images),
        "generated": [list(c.generation.token_ids) for c in calls],
        "trained": [list(s.token_ids[t.start : t.end]) for s, t in turns],
    }


def write_trace(directory: str, record: dict) -> None:
    with open(Path(directory) / f"trace-{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def read_traces(directory: Path) -> list[dict]:
    lines = [line for f in directory.glob("trace-*.jsonl") for line in f.read_text().splitlines()]
    return [json.loads(line) for line in lines]


def molt_train(run_dir: Path, *flags: str) -> None:
    """`molt-train` in a process of its own, writing to `run_dir`; fails with its output."""
    # Eager, as the quickstart runs: compiling the tiny model costs each start 5 s for nothing.
    cmd = [sys.executable, "-m", "molt_train.cli", *flags, "--vllm.enforce_eager", "True",
           "--train.output_dir", str(run_dir.parent), "--logger.run_name", run_dir.name]  # fmt: skip
    # The runner actors import the examples by name (installed or not) and load the test file as
    # the agent, which imports this module.
    paths = (str(EXAMPLES), str(EXAMPLES / "tests"), os.environ.get("PYTHONPATH"))
    env = dict(
        os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=os.pathsep.join(filter(None, paths))
    )
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
