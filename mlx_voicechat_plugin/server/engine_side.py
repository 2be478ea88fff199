"""A session's calls into the engine: open, audio, markers, tool results, flush, cancel.

:class:`EngineSide` is the half of :class:`~.session.Session` that talks to the
engine thread (the other half is its link and its clocks). Each failure becomes the
client's error (``session_initialization_failed``, ``server_busy``,
``inference_error``); dialects reach the engine only through these methods.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from ..runtime.options import ConversationOptions
from ..runtime.pool import PoolFull
from ..runtime.tool_failures import DEFAULT_MAX_RESULT_BYTES
from .engine.commands import OpenOptions, SessionDetails
from .engine.feed import InputFeed
from .engine.thread import Engine
from .lifecycle import Lifecycle, Stage
from .limits import ServerLimits
from .peers import Link
from .wire import ErrorCode, ProtocolError, inference_error, init_failed


def abandon(future: asyncio.Future) -> None:
    """Take ``future``'s outcome, now or when it comes, for nobody: its caller left."""
    def taken(done: asyncio.Future) -> None:
        if not done.cancelled():
            done.exception()

    if future.done():
        taken(future)
    else:
        future.add_done_callback(taken)


class EngineSide:
    """The engine half of a session; :class:`~.session.Session` holds the state it reads
    and moves (its stage in :attr:`life`) and counts it :meth:`active`."""

    engine: Engine
    limits: ServerLimits
    session_id: str
    life: Lifecycle
    link: Link | None
    details: SessionDetails | None
    feed: InputFeed | None
    halted: asyncio.Future
    tools_set: bool
    event_loop: asyncio.AbstractEventLoop
    frames_run: int
    samples_received: int
    received_at_open: int
    connected_at: float
    open: bool
    server_tools: Any  # SessionTools | None: the tools the server runs
    client_calls: Any  # ClientCalls: the calls the client runs, on their clocks

    def active(self) -> None:
        raise NotImplementedError


    async def open_session(self, options: OpenOptions) -> SessionDetails:
        """Open the engine session (closing one opened before), watching the transport
        while its prompt prefills; a failure is ``session_initialization_failed``."""
        if self.life.stage in (Stage.CLOSING, Stage.CLOSED):  # its client left meanwhile
            raise init_failed("the session is closing")
        if self.server_tools is not None:  # the server's tools beside the session's
            options = self.server_tools.offer(options)
        if self.open:  # opened before: closed, to be opened again
            self.client_calls.forget()
            self.life.move_engine(Stage.NEW)
            await self.engine.close(self.session_id)
        if self.slot_pending:  # admitted while only detached sessions held the slots
            admission = self.engine.admission
            if not await admission.reserve(self.session_id):
                raise ProtocolError(ErrorCode.SERVER_BUSY, admission.refusal)
            self.slot_pending = False
        self.event_loop, self.frames_run = asyncio.get_running_loop(), 0
        self.received_at_open = self.samples_received
        opening = self.engine.open(self.session_id, options, self)
        self.life.move_engine(Stage.OPENING)  # the engine may hold a stream: release closes it
        try:
            await (self.link.watch(opening) if self.link is not None
                   else self.wait_opening(opening))
        except BaseException:
            # The client left (or the task was cancelled) while it opened: the open's
            # outcome (a stopped prefill's PrefillCancelled) is ours to take, not the
            # garbage collector's to log as never retrieved.
            abandon(opening)
            raise
        try:
            details = opening.result()
        except PoolFull as exc:  # its reservation does not fit --max-state-bytes
            raise ProtocolError(ErrorCode.SERVER_BUSY, str(exc)) from None
        except Exception as exc:
            raise init_failed(str(exc)) from None
        if self.life.stage is not Stage.OPENING:  # let go meanwhile: its close is queued
            raise init_failed("the session was closed while it opened")
        self.life.move_engine(Stage.OPEN)
        self.tools_set = isinstance(options, ConversationOptions) and options.tools is not None
        self.details = details
        return details

    async def wait_opening(self, opening: asyncio.Future) -> None:
        """Wait for the engine to open the session with no transport: its prefill is
        stopped at the wall-clock cap."""
        remaining = self.connected_at + self.limits.max_session_wall_seconds - time.monotonic()
        done, _ = await asyncio.wait({opening}, timeout=max(remaining, 0))
        if not done:
            self.engine.abort(self.session_id)
            await asyncio.wait({opening})

    async def feed_audio(self, samples: np.ndarray, sent: int | None = None) -> None:
        """Client audio at the session's input rate, queued (not awaited: its frames run
        in batched steps with the other sessions' and their events come back in order);
        the session counts as active. ``sent``: the samples the client sent for it, at
        the rate it sends (by default ``samples`` themselves), counted here, once, in
        :attr:`samples_received` (a resume's figure, NVIDIA's ``session.end``)."""
        self.samples_received += samples.shape[0] if sent is None else sent
        if not samples.shape[0]:
            return
        self.active()
        await self.input_feed().append(samples)

    @property
    def heard_since_open(self) -> bool:
        """Whether the engine stream took input since it opened: client audio, or frames
        run (the server's silence too)."""
        return self.frames_run > 0 or self.samples_received > self.received_at_open

    def input_feed(self) -> InputFeed:
        """The session's bounded input queue (``--max-buffered-seconds``)."""
        if self.feed is None:
            bound = self.limits.buffered_samples(self.details.input_sample_rate,
                                                 self.details.frame_samples)
            self.feed = InputFeed(self.engine, self.session_id, bound, self)
            if self.halted.done():
                self.feed.halt(self.halted.result())
        return self.feed

    async def settle(self) -> None:
        """Wait until the audio queued so far has run and its events went out: what
        the client sends besides audio is answered in order, after them."""
        if self.feed is not None:
            await self.engine_call(self.engine.sync(self.session_id))

    async def tool_output(self, call_id: str, output: str) -> None:
        """A tool result: its tokens enter the timeline at the next frames. One over the
        result bound reaches the model as a ``too_large`` failure and is the client's
        ``tool_call_failed``; one after its call timed out is refused."""
        if not self.tools_set:
            raise ProtocolError(ErrorCode.TOOLS_NOT_SET,
                                "function_call_output needs tools registered in session.update")
        if self.server_tools is not None and self.server_tools.runs(call_id):
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                f"tool call {call_id} is run by the server; it takes no "
                                "function_call_output")
        max_bytes = (self.server_tools.manager.max_result_bytes if self.server_tools is not None
                     else DEFAULT_MAX_RESULT_BYTES)
        output, failure = self.client_calls.answer(call_id, output, max_bytes)
        try:
            await self.engine.tool_result(self.session_id, call_id, output)
        except ValueError as exc:  # unknown / answered call_id, non-ASCII output
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        except Exception as exc:
            raise inference_error(exc) from None
        if failure is not None:
            raise ProtocolError(ErrorCode.TOOL_CALL_FAILED, f"tool call {call_id}: {failure}")

    async def flush(self, pad_partial: bool = True) -> list:
        """Run the audio queued so far (the partial frame padded, if asked) and end the
        turn; its runtime events (an engine failure is the client's ``inference_error``)."""
        return await self.engine_call(self.engine.flush(self.session_id, pad_partial))

    async def cancel(self) -> list:
        """Drop the audio queued and cancel the response; its runtime events."""
        return await self.engine_call(self.engine.cancel(self.session_id))

    async def push(self, samples: np.ndarray) -> None:
        """One frame of server-made input (silence), queued behind the client's audio;
        waits for it to run (its events come as any frame's)."""
        await self.engine_call(self.engine.push(self.session_id, samples))

    @property
    def client_metrics(self) -> Any:
        """The engine's per-client figures (``/metrics``), or ``None``."""
        return getattr(self.engine.metrics, "clients", None)

    async def engine_call(self, call: Any) -> Any:
        """Await an engine command; its failure is the client's ``inference_error``."""
        try:
            return await call
        except Exception as exc:
            raise inference_error(exc) from None
