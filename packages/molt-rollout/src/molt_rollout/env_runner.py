"""The Env runner: the framework owns the LLM loop, the Env only judges and observes.

Per rollout: render the prompt once, then repeat: generate from the exact trace, let the Env
step, append its observation (tokenized on its own, masked from the loss). Generated tokens are
appended as sampled and never re-tokenized. The loop ends when the Env terminates or truncates,
after `max_turns`, when the token budgets run out, or at the wall-clock deadline (dropped).
"""

from __future__ import annotations

import copy
import time
from typing import Any

from molt_capture import CaptureError, ChatRenderer, Generator, Reply
from molt_capture.media import IMAGES_REFUSED, ImageEncoder, ImagePrompt, MediaError, message_images
from molt_capture.types import Generation, Rollout, SamplingParams, Segment

from .agent import (
    Dropped,
    Env,
    EnvState,
    Result,
    RolloutDropped,
    canonical_tools,
    check_result,
    describe,
    numeric_info,
    row_messages,
    within_deadline,
)
from .config import RolloutConfig

# Any harmless two-turn history: observations are rendered as the template's text after it.
_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]


class EnvRunner:
    """Runs rollouts of `env_class`. Subclass it as `AgentRunner` and set `env_class`."""

    env_class: type[Env] | None = None

    def __init__(
        self,
        generator: Generator,
        tokenizer,
        config: RolloutConfig | None = None,
        apply_chat_template: bool = True,
        image_encoder: ImageEncoder | None = None,
    ):
        """`image_encoder`: a multimodal model's processor (molt_capture.media); None: text only,
        and a prompt or observation holding an image is dropped."""
        self.generator = generator
        self.tokenizer = tokenizer
        self.image_encoder = image_encoder
        self.config = cfg = config or RolloutConfig()
        # The same renderer the capture server uses, so both forms present identical prompts.
        self.renderer = (
            ChatRenderer(tokenizer, cfg.parser, cfg.chat_template_kwargs)
            if apply_chat_template  # --data.apply_chat_template
            else None
        )

    def make_env(self) -> Env:
        """One Env per rollout; override to pass constructor arguments."""
        assert self.env_class is not None, "set AgentRunner.env_class"
        return self.env_class()

    def combine_rewards(self, rewards: list[float]) -> float:
        """The rollout's reward from the per-turn rewards; override for e.g. the last one."""
        return float(sum(rewards))

    def close(self) -> None:
        """Nothing to release (the chat runner stops its capture server here)."""

    def with_sampling(self, config: RolloutConfig) -> EnvRunner:
        """This runner with other sampling and limits (the eval's), sharing everything else."""
        sibling = copy.copy(self)
        sibling.config = config
        return sibling

    async def run(self, row: dict[str, Any], rollout_id: str, group_id: str) -> Rollout | Dropped:
        """One rollout; never raises for an agent's or engine's failure, returns `Dropped`."""
        t0 = time.monotonic()
        try:
            episode = self._episode(row, rollout_id, group_id, t0)
            return await within_deadline(episode, self.config.deadline_s)
        except RolloutDropped as d:
            return Dropped(d.reason, d.detail, rollout_id, group_id, time.monotonic() - t0)

    async def _episode(
        self, row: dict[str, Any], rollout_id: str, group_id: str, t0: float
    ) -> Rollout:
        cfg = self.config
        messages = row_messages(row)
        tools = canonical_tools(row.get("tools"))
        prompt = self._render_prompt(row, messages, tools)
        if len(prompt.token_ids) >= cfg.max_len:
            raise RolloutDropped(
                "prompt_too_long", f"{len(prompt.token_ids)} prompt tokens, max_len {cfg.max_len}"
            )
        seg = Segment(temperature=cfg.temperature, top_p=cfg.top_p)
        seg.append_context(prompt.token_ids, prompt.images)
        segments = [seg]
        state = EnvState(row=row, messages=messages, tools=tools, label=row.get("label"),
                         rollout_id=rollout_id, group_id=group_id)  # fmt: skip
        timings = {"generate": 0.0, "env": 0.0}
        env = await self._env_call(self._new_env(), timings)
        await self._env_call(env.reset(state), timings)

        rewards: list[float] = []
        score: float | None = None
        info: dict[str, Any] = {}
        generated = 0
        truncated = False
        last = Result(reward=0.0)  # the previous step's sampling overrides
        for turn in range(cfg.max_turns):
            room = cfg.max_len - len(seg)
            if cfg.max_response_tokens is not None:
                room = min(room, cfg.max_response_tokens - generated)
            if room <= 0:
                truncated = True  # a budget is spent and the Env has not finished
                break
            temperature = cfg.temperature if last.temperature is None else last.temperature
            if temperature != seg.temperature:
                # One sampling temperature per segment (the trainer recomputes log-probs with
                # it): continue in a new segment whose context is the exact trace so far.
                seg = Segment(temperature=temperature, top_p=cfg.top_p)
                seg.append_context(segments[-1].token_ids, segments[-1].images)
                segments.append(seg)
            want = last.max_tokens or cfg.max_tokens or room
            params = SamplingParams(min(want, room), temperature, cfg.top_p,
                                    list(last.stop or []), seg.routing_known)  # fmt: skip
            gen = await self._generate(seg, params, rollout_id, timings)
            prefix_len = len(seg)
            seg.append_generation(gen, params.max_tokens)
            generated += len(gen.token_ids)
            self._observe_reply(state, turn, gen, seg, prefix_len)

            last = check_result(await self._env_call(env.step(state), timings))
            rewards.append(float(last.reward))
            score = last.score if last.score is not None else score
            info.update(last.info)
            if last.terminated or last.truncated:
                truncated = last.truncated
                break
            if turn + 1 == cfg.max_turns:
                truncated = True  # out of turns, the Env wanted more
                break
            obs = self._observation(gen, last.observation, tools)
            obs_ids = obs.token_ids
            if len(seg) + len(obs_ids) >= cfg.max_len:
                truncated = True  # no room for the observation and a reply after it
                break
            seg.append_context(obs_ids, obs.images)
            if isinstance(last.observation, list):
                state.messages += last.observation
            state.transcript += self.tokenizer.decode(obs_ids)

        seg.truncated = truncated
        per_turn = {f"reward_turn_{i}": r for i, r in enumerate(rewards)}
        timings["total"] = time.monotonic() - t0
        return Rollout(
            segments=segments,
            reward=self.combine_rewards(rewards),
            rollout_id=rollout_id,
            group_id=group_id,
            score=score,
            info={
                **numeric_info(info),
                **per_turn,
                "turns": float(len(rewards)),
                "truncated": float(truncated),
            },
            timings=timings,
        )

    def _render_prompt(
        self, row: dict[str, Any], messages: list[dict], tools: list[dict] | None
    ) -> ImagePrompt:
        if self.renderer is None:  # a base-model prompt: the text as the dataset wrote it
            if not isinstance(row["prompt"], str):
                raise RolloutDropped(
                    "bad_row", "apply_chat_template is off but the prompt is not a string"
                )
            return ImagePrompt(self.tokenizer.encode(row["prompt"]))
        try:
            text = self.renderer.render(messages, tools, True)
            images = message_images(messages, row.get("images"))
            return self._encode(text, images, "prompt")
        except CaptureError as e:
            raise RolloutDropped("bad_row", e.message) from e
        except MediaError as e:
            raise RolloutDropped("bad_row", str(e)) from e

    def _encode(self, text: str, images: list, where: str) -> ImagePrompt:
        """Rendered text -> ids; with images, through the processor (placeholders expanded)."""
        if not images:  # the text path: as it was, no processor
            return ImagePrompt(self.renderer.encode(text))
        if self.image_encoder is None:
            raise MediaError(f"{where}: {IMAGES_REFUSED}")
        return self.image_encoder.encode(text, images, where)

    async def _new_env(self) -> Env:
        return self.make_env()  # a constructor that raises is the agent's failure

    async def _generate(
        self, seg: Segment, params: SamplingParams, session_id: str, timings: dict
    ) -> Generation:
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
            raise RolloutDropped(
                "engine_error",
                f"{len(gen.token_ids)} tokens generated for max_tokens={params.max_tokens}",
            )
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

    def _observe_reply(
        self, state: EnvState, turn: int, gen: Generation, seg: Segment, prefix_len: int
    ) -> None:
        """Show the Env the reply: ids as sampled, text decoded for reading only."""
        state.turn = turn
        state.token_ids = list(gen.token_ids)
        state.finish_reason = gen.finish_reason
        state.text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        if self.renderer is not None:
            stop = gen.stop_reason if isinstance(gen.stop_reason, str) else None
            prefix = self.renderer.decode(seg.token_ids[:prefix_len])
            try:
                state.reply = self.renderer.parse(gen.token_ids, prefix, state.tools, stop)
            except Exception:  # unparseable output is the model's answer, not a runner failure
                state.reply = Reply(content=state.text)
            state.messages.append(state.reply.as_message())
        else:
            state.reply = Reply(content=state.text)
            state.messages.append({"role": "assistant", "content": state.text})
        state.transcript += self.tokenizer.decode(gen.token_ids)

    def _observation(
        self, gen: Generation, observation: str | list[dict], tools: list[dict] | None
    ) -> ImagePrompt:
        """A string is appended verbatim. Messages are rendered with the chat template as the
        turns that follow a reply: the end-of-turn tokens the engine stopped before, the new
        turns, and the generation prompt for the next reply; their image parts go through the
        processor with that text."""
        if isinstance(observation, str):
            return ImagePrompt(self.tokenizer.encode(observation, add_special_tokens=False))
        if self.renderer is None:
            raise RolloutDropped(
                "bad_result", "observation messages need apply_chat_template; return a string"
            )
        try:
            before = self.renderer.render(_PROBE, tools, False)
            after = self.renderer.render(_PROBE + list(observation), tools, True)
        except CaptureError as e:
            raise RolloutDropped("bad_result", f"observation messages: {e.message}") from e
        if not after.startswith(before):
            raise RolloutDropped(
                "bad_result", "the chat template re-renders earlier turns after the observation"
            )
        closing = self.renderer.missing_closing(gen.token_ids)
        try:
            obs = self._encode(after[len(before) :], message_images(observation), "observation")
        except MediaError as e:
            raise RolloutDropped("bad_result", str(e)) from e
        return ImagePrompt(closing + obs.token_ids, [i.shifted(len(closing)) for i in obs.images])
