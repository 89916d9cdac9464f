"""Agent-runner processes: Ray actors that run the n rollouts of a prompt group concurrently.

Each actor imports the researcher's module by path (`load_agent` inside the actor: a module
loaded from a file does not pickle by reference) as it is created, so that work overlaps the
engines' start-up; the tokenizer (and a multimodal model's image encoder) it gets from the
driver, which loads them once. `connect` then builds its token client (one per event loop)
against the router. It serves `run_group` on its event loop, so many groups interleave in
one process. `RunnerActors.launch` is the pool's launcher: it returns a
`concurrent.futures.Future`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from molt_rollout.agent import Dropped
from molt_rollout.client import TokenClient
from molt_rollout.config import RolloutConfig
from molt_rollout.loader import load_agent
from molt_rollout.network import check_reachable
from molt_rollout.pool import GroupResult, PromptTask

if TYPE_CHECKING:
    from molt_capture.media import ImageEncoder


class RunnerActor:
    """The body of one runner actor (plain class, so it is testable without Ray)."""

    def __init__(self, agent: str, model: str, tokenizer, image_encoder: ImageEncoder | None,
                 rollout: RolloutConfig, apply_chat_template: bool, request_timeout_s: float,
                 max_retries: int, eval_rollout: RolloutConfig | None = None,
                 adapter: str | None = None, token: str | None = None) -> None:  # fmt: skip
        """Everything that needs no engine. `tokenizer` and `image_encoder` (None: a text-only
        model) are `model`'s, loaded by the driver (RunnerActors). `adapter`: the engines serve
        each version as a LoRA adapter of that prefix (TokenClient), for both agent forms: the
        capture server generates through this client. `token`: the run's token
        (molt_rollout.network)."""
        self.runner_class = load_agent(agent)
        self.tokenizer = tokenizer
        self.model, self.rollout, self.eval_rollout = model, rollout, eval_rollout
        self.apply_chat_template = apply_chat_template
        self.client_args = (request_timeout_s, max_retries, adapter, token)
        # A multimodal model's processor, passed only then: text-only runners are unchanged.
        self.extra = {} if image_encoder is None else {"image_encoder": image_encoder}

    def connect(self, router_url: str) -> None:
        """The token client to the router and the agent runner on it."""
        check_reachable(router_url, "an agent runner dialling the router")
        request_timeout_s, max_retries, adapter, token = self.client_args
        self.client = TokenClient(router_url, self.model, request_timeout_s, max_retries,
                                  top_logprobs=self.rollout.top_logprobs, adapter=adapter,
                                  token=token)  # fmt: skip
        self.runner = self.runner_class(self.client, self.tokenizer, self.rollout,
                                        self.apply_chat_template, **self.extra)  # fmt: skip
        # Eval tasks sample with their own parameters: the same runner with the eval's config.
        eval_rollout = self.eval_rollout
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

    def tell_version(self, version: int) -> None:
        """Every engine serves `version` now (TokenClient.tell_version)."""
        self.client.tell_version(version)

    def close(self) -> None:
        self.runner.close()  # the eval runner shares its resources


class RunnerActors:
    """The runner actors of a run; `launch` hands groups out round-robin. Creating them returns
    at once (they build while the engines start); `connect` waits for them."""

    def __init__(self, cfg: RolloutConfig, agent: str, model: str, apply_chat_template: bool,
                 request_timeout_s: float, max_retries: int,
                 eval_rollout: RolloutConfig | None = None,
                 adapter: str | None = None, token: str | None = None) -> None:  # fmt: skip
        # On the driver's node, the router's: it listens on loopback there, so across nodes no
        # port without a token is open (vllm-router 0.1.17 checks none; molt_rollout.router).
        driver_node = NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        )
        actor = ray.remote(num_cpus=cfg.cpus_per_runner, max_concurrency=cfg.max_concurrent_groups,
                           scheduling_strategy=driver_node)(RunnerActor)  # fmt: skip
        # Loaded here once, not in each actor: AutoTokenizer's imports (torch and its compiler)
        # cost a runner process about 7 s of CPU, unpickling its result 1.5 s
        # (docs/benchmarks.md, start-up).
        from transformers import AutoTokenizer

        from molt_capture.media import load_image_encoder

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        text_side = ray.put(self.tokenizer), ray.put(load_image_encoder(model))
        args = (agent, model, *text_side, cfg, apply_chat_template, request_timeout_s,
                max_retries, eval_rollout, adapter, token)  # fmt: skip
        self.cfg = cfg
        self.actors = [actor.remote(*args) for _ in range(cfg.num_runners)]
        self._next = itertools.cycle(self.actors)

    def connect(self, router_url: str) -> RunnerActors:
        """Every runner's client to the router; returns self. A bad agent module or model path
        surfaces here, not at the first group. Actors the driver's node cannot place fail
        naming the flags: at once when it has too few CPUs in all, else after
        --rollout.startup_timeout_s."""
        cfg = self.cfg
        try:
            ray.get([a.connect.remote(router_url) for a in self.actors],
                    timeout=cfg.startup_timeout_s)  # fmt: skip
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
        """After a refit (or the first version) reached every engine: the runners' token
        clients salt and check requests with it instead of reading it per request. Not waited
        for: an actor runs its calls in order, and a request that goes out before it is
        checked by the race rule (TokenClient)."""
        for actor in self.actors:
            actor.tell_version.remote(version)

    def launch(self, task: PromptTask) -> concurrent.futures.Future:
        return next(self._next).run_group.remote(task).future()

    def shutdown(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):  # a dead actor has nothing left to close
                ray.get(actor.close.remote(), timeout=10)
            ray.kill(actor)
