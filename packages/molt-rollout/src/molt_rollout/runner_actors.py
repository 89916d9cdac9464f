"""Agent-runner processes: Ray actors that run the n rollouts of a prompt group concurrently.

Each actor imports the researcher's module by path (`load_agent` inside the actor: a module
loaded from a file does not pickle by reference), builds its own token client (one per event
loop) and tokenizer, and serves `run_group` on its event loop, so many groups interleave in one
process. `RunnerActors.launch` is the pool's launcher: it returns a `concurrent.futures.Future`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools

import ray

from molt_rollout.agent import Dropped
from molt_rollout.client import TokenClient
from molt_rollout.config import RolloutConfig
from molt_rollout.loader import load_agent
from molt_rollout.network import check_reachable
from molt_rollout.pool import GroupResult, PromptTask


class RunnerActor:
    """The body of one runner actor (plain class, so it is testable without Ray)."""

    def __init__(self, agent: str, model: str, router_url: str, rollout: RolloutConfig,
                 apply_chat_template: bool, request_timeout_s: float, max_retries: int,
                 eval_rollout: RolloutConfig | None = None,
                 adapter: str | None = None, token: str | None = None) -> None:  # fmt: skip
        """`adapter`: the engines serve each version as a LoRA adapter of that prefix
        (TokenClient), for both agent forms: the capture server generates through this client.
        `token`: the run's token (molt_rollout.network)."""
        from transformers import AutoTokenizer

        from molt_capture.media import load_image_encoder

        check_reachable(router_url, "an agent runner dialling the router")
        runner_class = load_agent(agent)
        tokenizer = AutoTokenizer.from_pretrained(model)
        client = TokenClient(router_url, model, request_timeout_s, max_retries,
                             top_logprobs=rollout.top_logprobs, adapter=adapter,
                             token=token)  # fmt: skip
        # A multimodal model's processor, passed only then: text-only runners are unchanged.
        encoder = load_image_encoder(model)
        extra = {} if encoder is None else {"image_encoder": encoder}
        self.runner = runner_class(client, tokenizer, rollout, apply_chat_template, **extra)
        # Eval tasks sample with their own parameters: the same runner with the eval's config.
        self.eval_runner = (
            self.runner if eval_rollout is None else self.runner.with_sampling(eval_rollout)
        )

    async def run_group(self, task: PromptTask) -> GroupResult:
        """All n rollouts of one prompt at once; failures come back as `Dropped`, not raised."""
        runner = self.eval_runner if task.for_eval else self.runner
        results = await asyncio.gather(
            *(runner.run(task.row, f"{task.group_id}-{i}", task.group_id) for i in range(task.n))
        )
        return GroupResult(
            task=task,
            rollouts=[r for r in results if not isinstance(r, Dropped)],
            dropped=[r for r in results if isinstance(r, Dropped)],
        )

    def ready(self) -> bool:
        return True

    def close(self) -> None:
        self.runner.close()  # the eval runner shares its resources


class RunnerActors:
    """The runner actors of a run; `launch` hands groups out round-robin."""

    def __init__(self, cfg: RolloutConfig, agent: str, model: str, router_url: str,
                 apply_chat_template: bool, request_timeout_s: float, max_retries: int,
                 eval_rollout: RolloutConfig | None = None,
                 adapter: str | None = None, token: str | None = None) -> None:  # fmt: skip
        actor = ray.remote(num_cpus=cfg.cpus_per_runner, max_concurrency=cfg.max_concurrent_groups)(
            RunnerActor
        )
        args = (agent, model, router_url, cfg, apply_chat_template, request_timeout_s,
                max_retries, eval_rollout, adapter, token)  # fmt: skip
        self.actors = [actor.remote(*args) for _ in range(cfg.num_runners)]
        self._next = itertools.cycle(self.actors)
        # Surface a bad agent module or model path now, not at the first group; and never wait
        # forever for actors the cluster has no CPUs to place.
        try:
            ray.get([a.ready.remote() for a in self.actors], timeout=cfg.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            for a in self.actors:
                ray.kill(a)
            raise RuntimeError(
                f"{cfg.num_runners} agent-runner actors did not start within "
                f"{cfg.startup_timeout_s} s: does the Ray cluster have "
                f"--rollout.num_runners x --rollout.cpus_per_runner = "
                f"{cfg.num_runners * cfg.cpus_per_runner} CPUs free?"
            ) from None

    def launch(self, task: PromptTask) -> concurrent.futures.Future:
        return next(self._next).run_group.remote(task).future()

    def shutdown(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):  # a dead actor has nothing left to close
                ray.get(actor.close.remote(), timeout=10)
            ray.kill(actor)
