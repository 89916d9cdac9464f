"""Agent-runner processes: Ray actors running many prompt groups concurrently, each importing the
agent module as it is created (overlapping the engines' start-up); `launch` feeds the pool."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from molt_rollout.agents.agent import Dropped
from molt_rollout.agents.loader import load_agent
from molt_rollout.agents.pool import GroupResult, PromptTask
from molt_rollout.config import RolloutConfig
from molt_rollout.engines.client import TokenClient
from molt_rollout.network import check_reachable


class RunnerActor:
    """The body of one runner actor (a plain class, testable without Ray)."""

    def __init__(self, agent: str, text: tuple, settings: tuple, client: dict) -> None:
        """`text`: the tokenizer and image encoder (None: text only), loaded by the driver;
        `settings`: the rollout config, the eval's (or None) and apply_chat_template; `client`:
        the TokenClient's keyword arguments."""
        self.runner_class = load_agent(agent)
        self.text, self.client_args = text, client
        self.rollout, self.eval_rollout, self.apply_chat_template = settings

    def connect(self, router_url: str) -> None:
        check_reachable(router_url, "an agent runner dialling the router")
        self.client = TokenClient(router_url, **self.client_args)
        tokenizer, image_encoder = self.text
        # A multimodal model's processor, passed only then: text-only runners are unchanged.
        extra = {} if image_encoder is None else {"image_encoder": image_encoder}
        args = (self.client, tokenizer, self.rollout, self.apply_chat_template)
        self.runner = self.runner_class(*args, **extra)
        # Eval tasks sample with their own parameters: the same runner with the eval's config.
        self.eval_runner = self.runner.with_sampling(self.eval_rollout or self.rollout)

    async def run_group(self, task: PromptTask) -> GroupResult:
        """All n rollouts of one prompt at once; failures come back as `Dropped`, not raised."""
        runner = self.eval_runner if task.for_eval else self.runner
        ids = [(f"{task.group_id}-{i}", task.group_id) for i in range(task.n)]
        results = await asyncio.gather(*(runner.run(task.row, *pair) for pair in ids))
        dropped = [r for r in results if isinstance(r, Dropped)]
        return GroupResult(task, [r for r in results if not isinstance(r, Dropped)], dropped)

    def tell_version(self, version: int) -> None:
        self.client.tell_version(version)

    def close(self) -> None:
        self.runner.close()  # the eval runner shares its resources


class RunnerActors:
    """The runner actors of a run; `launch` hands groups out round-robin. Creating them returns
    at once (they build while the engines start); `connect` waits for them."""

    def __init__(
        self,
        cfg: RolloutConfig,
        agent: str,
        model: str,
        apply_chat_template: bool,
        request_timeout_s: float,
        max_retries: int,
        eval_rollout: RolloutConfig | None = None,
        adapter: str | None = None,
        token: str | None = None,
    ) -> None:
        """`adapter`: the engines serve each version as a LoRA adapter of that prefix."""
        # On the driver's node, the router's: it listens on loopback there (engines/router.py).
        node = ray.get_runtime_context().get_node_id()
        placement = NodeAffinitySchedulingStrategy(node, soft=False)
        options = {"num_cpus": cfg.cpus_per_runner, "max_concurrency": cfg.max_concurrent_groups}
        actor = ray.remote(**options, scheduling_strategy=placement)(RunnerActor)
        # Loaded here once, not in each actor: AutoTokenizer's imports cost a runner process
        # seconds of CPU, more than unpickling its result (docs/performance.md, start-up).
        from transformers import AutoTokenizer

        from molt_capture.media import load_image_encoder

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        text = ray.put((self.tokenizer, load_image_encoder(model)))
        settings = (cfg, eval_rollout, apply_chat_template)
        client = {"model": model, "timeout_s": request_timeout_s, "max_retries": max_retries}
        client |= {"top_logprobs": cfg.top_logprobs, "adapter": adapter, "token": token}
        self.cfg = cfg
        self.actors = [actor.remote(agent, text, settings, client) for _ in range(cfg.num_runners)]
        self._next = itertools.cycle(self.actors)

    def connect(self, router_url: str) -> RunnerActors:
        """Every runner's client to the router; returns self. A bad agent module surfaces here."""
        cfg = self.cfg
        connected = [a.connect.remote(router_url) for a in self.actors]
        try:
            ray.get(connected, timeout=cfg.startup_timeout_s)
        # Unschedulable: the driver's node has fewer CPUs in all than they ask for.
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnschedulableError):
            for a in self.actors:
                ray.kill(a)
            raise RuntimeError(
                f"{cfg.num_runners} agent-runner actors could not be placed or did not start "
                f"within {cfg.startup_timeout_s} s: does the driver's Ray node have "
                f"--rollout.num_runners x --rollout.cpus_per_runner = "
                f"{cfg.num_runners * cfg.cpus_per_runner} CPUs free?"
            ) from None
        return self

    def tell_version(self, version: int) -> None:
        """Every engine serves `version` now; not waited for (the client's race rule covers it)."""
        for actor in self.actors:
            actor.tell_version.remote(version)

    def launch(self, task: PromptTask) -> concurrent.futures.Future:
        return next(self._next).run_group.remote(task).future()

    def shutdown(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):  # a dead actor has nothing left to close
                ray.get(actor.close.remote(), timeout=10)
            ray.kill(actor)
