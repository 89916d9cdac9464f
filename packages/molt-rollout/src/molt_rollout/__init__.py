"""molt-rollout: generation for Molt.

Engines (vLLM servers owned by Ray actors), the session-affine router, the token client that
implements molt-capture's generator contract, refit with pause/resume (docs/rollout.md), and
the agent contract with its two runner forms (docs/agents.md), runner actors, the streaming
prompt-group pool (docs/pool.md), the prompt data path and evaluation (docs/data.md).
"""

from molt_rollout.agent import (
    ChatAgent,
    ChatContext,
    Dropped,
    Env,
    EnvState,
    Result,
    RolloutDropped,
)
from molt_rollout.chat_runner import ChatRunner
from molt_rollout.config import (
    RefitConfig,
    RolloutConfig,
    RouterConfig,
    VLLMConfig,
    validate_rollout_config,
)
from molt_rollout.data import DataConfig, PromptSource, load_rows
from molt_rollout.env_runner import EnvRunner
from molt_rollout.eval import EvalConfig, eval_metrics, run_eval
from molt_rollout.loader import AgentLoadError, load_agent
from molt_rollout.pool import Batch, GroupResult, PromptTask, RolloutPool

__version__ = "0.1.0"

__all__ = [
    "AgentLoadError",
    "Batch",
    "DataConfig",
    "EvalConfig",
    "GroupResult",
    "PromptSource",
    "PromptTask",
    "RolloutPool",
    "eval_metrics",
    "load_rows",
    "run_eval",
    "ChatAgent",
    "ChatContext",
    "ChatRunner",
    "Dropped",
    "Env",
    "EnvRunner",
    "EnvState",
    "RefitConfig",
    "Result",
    "RolloutDropped",
    "RouterConfig",
    "RolloutConfig",
    "VLLMConfig",
    "load_agent",
    "validate_rollout_config",
]
