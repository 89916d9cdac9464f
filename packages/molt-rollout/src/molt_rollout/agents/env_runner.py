"""The Env runner: the framework owns the LLM loop, the Env judges and observes. The prompt is
rendered once; generated tokens are appended as sampled, never re-tokenized; observations are
tokenized on their own and masked from the loss."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from molt_capture import CaptureError, ChatRenderer, Reply
from molt_capture.media import IMAGES_REFUSED, ImagePrompt, MediaError, message_images
from molt_capture.types import Generation, Rollout, SamplingParams, Segment, derive_seed
from molt_rollout.agents.agent import (
    Env,
    EnvState,
    Result,
    RolloutDropped,
    Runner,
    canonical_tools,
    check_result,
    describe,
    numeric_info,
    row_messages,
    within_deadline,
)

# Any harmless two-turn history: observations are rendered as the template's text after it.
_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]


class EnvRunner(Runner):
    """Runs rollouts of `env_class`. Subclass it as `AgentRunner` and set `env_class`."""

    env_class: type[Env] | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The same renderer the capture server uses, so both forms present identical prompts.
        cfg = self.config
        chat = ChatRenderer(self.tokenizer, cfg.parser, cfg.chat_template_kwargs)
        self.renderer = chat if self.apply_chat_template else None

    def make_env(self) -> Env:
        """One Env per rollout; override to pass constructor arguments."""
        assert self.env_class is not None, "set AgentRunner.env_class"
        return self.env_class()

    def combine_rewards(self, rewards: list[float]) -> float:
        """The rollout's reward from the per-turn rewards; override for e.g. the last one."""
        return float(sum(rewards))

    async def _rollout(self, *args: Any) -> Rollout:  # row, rollout_id, group_id, t0
        return await within_deadline(self._episode(*args), self.config.deadline_s)

    async def _episode(self, row: dict, rollout_id: str, group_id: str, t0: float) -> Rollout:
        cfg = self.config
        messages, tools = row_messages(row), canonical_tools(row.get("tools"))
        prompt = self._render_prompt(row, messages, tools)
        if len(prompt.token_ids) >= cfg.max_len:
            detail = f"{len(prompt.token_ids)} prompt tokens, max_len {cfg.max_len}"
            raise RolloutDropped("prompt_too_long", detail)
        segment = Segment(temperature=cfg.temperature, top_p=cfg.top_p)
        segment.append_context(prompt.token_ids, prompt.images)
        label, ids = row.get("label"), {"rollout_id": rollout_id, "group_id": group_id}
        state = EnvState(row=row, messages=messages, tools=tools, label=label, **ids)
        timings = {"generate": 0.0, "env": 0.0}
        env = await self._env_call(self._new_env(), timings)
        await self._env_call(env.reset(state), timings)
        segments, results = [segment], []
        truncated = await self._turns(env, state, segments, results, timings)
        segments[-1].truncated = truncated
        rewards = [float(r.reward) for r in results]
        info = numeric_info({k: v for result in results for k, v in result.info.items()})
        info |= {f"reward_turn_{i}": r for i, r in enumerate(rewards)}
        info |= {"turns": float(len(rewards)), "truncated": float(truncated)}
        score = next((r.score for r in reversed(results) if r.score is not None), None)
        timings["total"] = time.monotonic() - t0
        reward = self.combine_rewards(rewards)
        return Rollout(segments, reward, score=score, info=info, timings=timings, **ids)

    async def _turns(
        self, env: Env, state: EnvState, segments: list[Segment], results: list, timings: dict
    ) -> bool:
        """Generate, step, observe until the Env or a limit ends it; whether it was truncated."""
        cfg, seg = self.config, segments[-1]
        generated, last = 0, Result(reward=0.0)  # the previous step's sampling overrides
        for turn in range(cfg.max_turns):
            room = cfg.max_len - len(seg)
            if cfg.max_response_tokens is not None:
                room = min(room, cfg.max_response_tokens - generated)
            if room <= 0:
                return True  # a budget is spent and the Env has not finished
            temperature = cfg.temperature if last.temperature is None else last.temperature
            if temperature != seg.temperature:
                # One sampling temperature per segment (the trainer recomputes log-probs with
                # it): continue in a new segment whose context is the exact trace so far.
                seg = Segment(temperature=temperature, top_p=cfg.top_p)
                seg.append_context(segments[-1].token_ids, segments[-1].images)
                segments.append(seg)
            max_tokens = min(last.max_tokens or cfg.max_tokens or room, room)
            stop = list(last.stop or [])
            seed = None if cfg.seed is None else derive_seed(cfg.seed, state.rollout_id, turn)
            params = SamplingParams(
                max_tokens, temperature, cfg.top_p, stop, seg.routing_known, seed
            )
            gen = await self._generate(seg, params, state.rollout_id, timings)
            self._observe_reply(state, turn, gen, seg)  # before the reply joins `seg`
            seg.append_generation(gen, params.max_tokens)
            generated += len(gen.token_ids)
            last = check_result(await self._env_call(env.step(state), timings))
            results.append(last)
            if last.terminated or last.truncated:
                return last.truncated
            if turn + 1 == cfg.max_turns:
                return True  # out of turns, the Env wanted more
            obs = self._observation(gen, last.observation, state.tools)
            if len(seg) + len(obs.token_ids) >= cfg.max_len:
                return True  # no room for the observation and a reply after it
            seg.append_context(obs.token_ids, obs.images)
            if isinstance(last.observation, list):
                state.messages += last.observation
            state.transcript += self.tokenizer.decode(obs.token_ids)
        return False

    def _render_prompt(self, row: dict, messages: list, tools: list | None) -> ImagePrompt:
        # A base-model prompt: the text as the dataset wrote it (a string: load_datasets checks).
        if self.renderer is None:
            return ImagePrompt(self.tokenizer.encode(row["prompt"]))
        try:
            text = self.renderer.render(messages, tools, True)
            images = message_images(messages, row.get("images"))
            return self._encode(text, images, "prompt")
        except (CaptureError, MediaError) as e:
            raise RolloutDropped("bad_row", str(e)) from e

    def _encode(self, text: str, images: list, where: str) -> ImagePrompt:
        """Rendered text -> ids; with images, through the processor (placeholders expanded)."""
        if not images:
            return ImagePrompt(self.renderer.encode(text))
        if self.image_encoder is None:
            raise MediaError(f"{where}: {IMAGES_REFUSED}")
        return self.image_encoder.encode(text, images, where)

    async def _new_env(self) -> Env:
        return self.make_env()  # a constructor that raises is the agent's failure

    async def _generate(self, seg: Segment, params: SamplingParams, session_id: str, timings: dict):
        t = time.monotonic()
        # Images only when there are some: text-only generators take no such argument.
        extra = {"images": list(seg.images)} if seg.images else {}
        try:
            # The rollout id is the session id: the router keeps a rollout on one engine.
            gen = await self.generator(list(seg.token_ids), params, session_id, **extra)
        except Exception as e:
            raise RolloutDropped("engine_error", describe(e)) from e
        finally:
            timings["generate"] += time.monotonic() - t
        if len(gen.token_ids) > params.max_tokens:
            detail = f"{len(gen.token_ids)} tokens generated for max_tokens={params.max_tokens}"
            raise RolloutDropped("engine_error", detail)
        return gen

    async def _env_call(self, awaitable, timings: dict) -> Any:
        t = time.monotonic()
        try:
            return await awaitable
        except RolloutDropped:
            raise  # the Env drops the rollout on purpose, with its own reason
        except Exception as e:
            raise RolloutDropped("agent_error", describe(e)) from e
        finally:
            timings["env"] += time.monotonic() - t

    def _observe_reply(self, state: EnvState, turn: int, gen: Generation, seg: Segment) -> None:
        """Show the Env the reply to `seg`: ids as sampled, text decoded for reading only."""
        state.turn = turn
        state.token_ids = list(gen.token_ids)
        state.finish_reason = gen.finish_reason
        state.text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        state.reply = Reply(content=state.text)
        if self.renderer is not None:
            stop = gen.stop_reason if isinstance(gen.stop_reason, str) else None
            prefix = self.renderer.decode(seg.token_ids)
            # Unparseable output is the model's answer (as plain text), not a runner failure.
            with contextlib.suppress(Exception):
                state.reply = self.renderer.parse(gen.token_ids, prefix, state.tools, stop)
        state.messages.append(state.reply.as_message())
        state.transcript += self.tokenizer.decode(gen.token_ids)

    def _observation(
        self, gen: Generation, observation: str | list[dict], tools: list[dict] | None
    ) -> ImagePrompt:
        """A string as written; messages rendered with the chat template as the turns after a
        reply: the end-of-turn tokens the engine stopped before, the turns, the next prompt."""
        if isinstance(observation, str):
            return ImagePrompt(self.tokenizer.encode(observation, add_special_tokens=False))
        if self.renderer is None:
            raise RolloutDropped(
                "bad_result", "observation messages need apply_chat_template; return a string"
            )
        try:
            before = self.renderer.render(_PROBE, tools, False)
            after = self.renderer.render(_PROBE + list(observation), tools, True)
            obs = self._encode(after[len(before) :], message_images(observation), "observation")
        except (CaptureError, MediaError) as e:
            raise RolloutDropped("bad_result", f"observation messages: {e}") from e
        if not after.startswith(before):
            raise RolloutDropped(
                "bad_result", "the chat template re-renders earlier turns after the observation"
            )
        closing = self.renderer.missing_closing(gen.token_ids)
        return ImagePrompt(closing + obs.token_ids, [i.shifted(len(closing)) for i in obs.images])
