"""A new session's prompt prefill runs in slices: the other sessions' frames go on meanwhile."""

from __future__ import annotations

import asyncio

import numpy as np
from tool_support import WEATHER

from mlx_voicechat_plugin.runtime.options import ConversationOptions
from mlx_voicechat_plugin.server.engine import Engine
from mlx_voicechat_plugin.server.engine.channel import Reply


def test_frames_of_open_sessions_run_while_a_new_session_prefills(tiny_ckpt):
    engine = Engine(str(tiny_ckpt), max_sessions=2)
    engine.start()
    engine.loaded.wait(120)

    class Sink:  # the session's hand-offs, dropped
        def __init__(self):
            self.event_loop = asyncio.get_running_loop()

        def on_handoff(self, handoff):
            for entry in handoff.entries:
                if isinstance(entry, Reply):
                    entry.resolve()

    async def scenario() -> tuple[int, int]:
        await engine.open("a", ConversationOptions(), Sink())
        frame = np.zeros(engine.config.frame_samples, np.float32)
        # The rendered tool block is hundreds of prefill positions.
        opening = engine.open("b", ConversationOptions(tools=[WEATHER]), Sink())
        during = 0
        while not opening.done():
            await engine.push("a", frame)
            during += 1
        details = await opening
        after = await engine.push("b", frame)
        return during, details.frame_samples, after is None

    try:
        during, frame_samples, _ = asyncio.run(scenario())
    finally:
        engine.stop()
    assert frame_samples == engine.config.frame_samples
    # Unsliced, "a"'s first push would wait for the whole prefill (during == 1).
    assert during >= 5
