"""molt-rollout: generation for Molt. `agents` (the agent contract, runners, the prompt-group
pool, data, eval), `engines` (vLLM servers, router, token client) and `refit` (weights into the
engines); the public names below are importable from here."""

from molt_capture.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "molt_rollout.agents.agent": [
        "ChatAgent",
        "ChatContext",
        "Dropped",
        "Env",
        "EnvState",
        "Result",
        "RolloutDropped",
    ],
    "molt_rollout.agents.chat_runner": ["ChatRunner"],
    "molt_rollout.config": [
        "RefitConfig",
        "RolloutConfig",
        "RouterConfig",
        "VLLMConfig",
        "validate_rollout_config",
    ],
    "molt_rollout.agents.data": ["DataConfig", "PromptSource", "load_rows"],
    "molt_rollout.agents.env_runner": ["EnvRunner"],
    "molt_rollout.agents.eval": ["EvalConfig", "eval_metrics", "run_eval"],
    "molt_rollout.agents.loader": ["AgentLoadError", "load_agent"],
    "molt_rollout.agents.pool": ["Batch", "GroupResult", "PromptTask", "RolloutPool"],
}
# Loaded on first use, so importing one submodule pays for that one alone (molt_capture.lazy).
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
