"""molt-rollout: generation for Molt.

Engines (vLLM servers owned by Ray actors), the session-affine router, the token client that
implements molt-capture's generator contract, refit with pause/resume (docs/rollout.md), and
the agent contract with its two runner forms (docs/agents.md), runner actors, the streaming
prompt-group pool (docs/pool.md), the prompt data path and evaluation (docs/data.md).
"""

from molt_capture.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "molt_rollout.agent": [
        "ChatAgent",
        "ChatContext",
        "Dropped",
        "Env",
        "EnvState",
        "Result",
        "RolloutDropped",
    ],
    "molt_rollout.chat_runner": ["ChatRunner"],
    "molt_rollout.config": [
        "RefitConfig",
        "RolloutConfig",
        "RouterConfig",
        "VLLMConfig",
        "validate_rollout_config",
    ],
    "molt_rollout.data": ["DataConfig", "PromptSource", "load_rows"],
    "molt_rollout.env_runner": ["EnvRunner"],
    "molt_rollout.eval": ["EvalConfig", "eval_metrics", "run_eval"],
    "molt_rollout.loader": ["AgentLoadError", "load_agent"],
    "molt_rollout.pool": ["Batch", "GroupResult", "PromptTask", "RolloutPool"],
}
# Loaded on first use, so importing one submodule pays for that one alone (molt_capture.lazy).
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
