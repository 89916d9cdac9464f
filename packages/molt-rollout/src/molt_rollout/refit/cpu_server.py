"""`python -m molt_rollout.refit.cpu_server ARGS`: vLLM's OpenAI server as a CPU engine runs it,
its engine core forked rather than spawned (vllm_compat.fork_cpu_engine_core says why)."""

import runpy
import sys

from molt_rollout.refit.vllm_compat import fork_cpu_engine_core

if __name__ == "__main__":
    fork_cpu_engine_core()
    # Whole prompts in one prefill: after a partial one vLLM rewinds a seeded request's
    # generator (--rollout.seed), which a CPU generator cannot. Flags given later win.
    sys.argv.insert(1, "--no-enable-chunked-prefill")
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
