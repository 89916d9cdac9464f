"""The chat runner: the agent owns its LLM loop through a stock SDK; a capture server (one per
runner process, on loopback, started on first use) records each session as token-exact segments."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from typing import Any

from molt_capture import CaptureServer, Session
from molt_capture.errors import ParamRejected
from molt_capture.media import MediaError, openai_image_parts
from molt_capture.types import Rollout, Segment, derive_seed
from molt_rollout.agents.agent import (
    ChatAgent,
    ChatContext,
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

# How long closing a session may wait for a model call the agent left running.
CLOSE_GRACE_S = 5.0
API_KEY = "molt"  # any value works: the server on loopback checks none, the SDKs want one


class ChatRunner(Runner):
    """Runs rollouts of `agent_class`. Subclass it as `AgentRunner` and set `agent_class`.
    `generator` runs on the capture server's event loop (its own thread), not the caller's."""

    agent_class: type[ChatAgent] | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._server: CaptureServer | None = None
        # A with_sampling() copy keeps this: one capture server per runner process, the owner's.
        self._owner = self
        # Sessions whose engine call failed (a dead engine): their rollouts drop as
        # `engine_error`, whatever the agent's SDK made of the 502. Shared with siblings.
        self._engine_failed: set[str] = set()

    @property
    def server(self) -> CaptureServer:
        """Started lazily, so runners that are never used hold no port or thread."""
        owner = self._owner
        if owner._server is None:
            cfg = owner.config
            owner._server = CaptureServer(
                owner.tokenizer,
                owner._generate,
                parser=cfg.parser,
                chat_template_kwargs=cfg.chat_template_kwargs,
                model_name=cfg.model_name,
                generator_timeout_s=cfg.generator_timeout_s,
                max_request_bytes=cfg.max_request_bytes,
                image_encoder=owner.image_encoder,
            ).start()
        return owner._server

    async def _generate(self, ids: list[int], params, session_id: str, **images):
        try:
            return await self.generator(ids, params, session_id, **images)
        except ParamRejected:
            raise  # the agent's request, not the engine: the agent gets a 400
        except Exception:
            self._engine_failed.add(session_id)
            raise

    def make_agent(self) -> ChatAgent:
        """One agent per rollout; override to pass constructor arguments."""
        assert self.agent_class is not None, "set AgentRunner.agent_class"
        return self.agent_class()

    def close(self) -> None:
        if self._owner is self and self._server is not None:
            self._server.stop()
            self._server = None

    async def _rollout(self, row: dict, rollout_id: str, group_id: str, t0: float):
        session: Session | None = None
        try:  # a RolloutDropped raised here becomes the rollout's Dropped (Runner.run)
            messages = row_messages(row)
            if self.image_encoder is not None:  # the row's images as the SDKs send them
                try:
                    messages = openai_image_parts(messages, row.get("images"))
                except MediaError as e:
                    raise RolloutDropped("bad_row", str(e)) from e
            cfg = self.config
            seed = None if cfg.seed is None else derive_seed(cfg.seed, rollout_id)
            session = self.server.open_session(
                row, max_len=cfg.max_len, seed=seed, **self._sampling()
            )
            ctx = self._context(row, messages, session, rollout_id, group_id)
            result = await within_deadline(self._run_agent(ctx, session), self.config.deadline_s)
            agent_s = time.monotonic() - t0
            segments = await self._close(session)
        finally:
            if session is not None:
                self._engine_failed.discard(session.id)
                # A failed rollout's session, forgotten without waiting (later requests get
                # 404); a closed one is gone already (KeyError).
                with contextlib.suppress(TimeoutError, concurrent.futures.TimeoutError, KeyError):
                    self.server.close_session(session.id, timeout_s=0)
        if not segments:
            raise RolloutDropped("empty", "the agent never called the model")
        if result.truncated:
            segments[-1].truncated = True
        turns = float(sum(len(s.turns) for s in segments))
        info = numeric_info(result.info) | {"turns": turns, "segments": float(len(segments))}
        timings = {"agent": agent_s, "total": time.monotonic() - t0}
        reward, ids = float(result.reward), (rollout_id, group_id)
        return Rollout(segments, reward, *ids, score=result.score, info=info, timings=timings)

    def _sampling(self) -> dict[str, Any]:
        cfg = self.config
        return {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens}

    def _context(
        self, row: dict, messages: list[dict], session: Session, rollout_id: str, group_id: str
    ) -> ChatContext:
        cfg = self.config
        return ChatContext(
            messages=messages,
            tools=canonical_tools(row.get("tools")),
            label=row.get("label"),
            row=row,
            # The OpenAI SDK appends /chat/completions or /responses, the Anthropic SDK
            # /v1/messages: the server serves all three under the session URL.
            base_url=session.base_url,
            anthropic_base_url=session.base_url,
            model=cfg.model_name,
            api_key=API_KEY,
            max_len=cfg.max_len,
            rollout_id=rollout_id,
            group_id=group_id,
            deadline_s=cfg.deadline_s,
            **self._sampling(),
        )

    async def _run_agent(self, ctx: ChatContext, session: Session) -> Result:
        try:
            result = await self.make_agent().run(ctx)
        except RolloutDropped:
            raise  # the agent drops the rollout on purpose, with its own reason
        except Exception as e:
            reason = "engine_error" if session.id in self._engine_failed else "agent_error"
            raise RolloutDropped(reason, describe(e)) from e
        return check_result(result)

    async def _close(self, session: Session) -> list[Segment]:
        """On a worker thread: it blocks while a model call still commits; the loop serves on."""
        try:
            return await asyncio.to_thread(self.server.close_session, session.id, CLOSE_GRACE_S)
        except (TimeoutError, concurrent.futures.TimeoutError) as e:
            raise RolloutDropped(
                "session_busy", f"a model call was still running {CLOSE_GRACE_S} s after run()"
            ) from e
