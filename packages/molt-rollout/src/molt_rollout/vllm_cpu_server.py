"""`python -m molt_rollout.vllm_cpu_server ARGS`: vLLM's OpenAI server
(`python -m vllm.entrypoints.openai.api_server ARGS`) as a CPU engine runs it, its engine core
forked rather than spawned (molt_rollout.vllm_compat.fork_cpu_engine_core says why)."""

import runpy

from molt_rollout.vllm_compat import fork_cpu_engine_core

if __name__ == "__main__":
    fork_cpu_engine_core()
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
