"""The one framer: the streaming shell and the server's channels cut frames with it (no model)."""

from __future__ import annotations

import numpy as np

from mlx_voicechat_plugin.runtime.framing import Chunk, Framer
from mlx_voicechat_plugin.server.engine.channel import StreamChannel

FRAME = 4


def test_frames_and_the_partial_frame_do_not_depend_on_chunk_sizes():
    rng = np.random.default_rng(1)
    signal = rng.standard_normal(7 * FRAME + 3).astype(np.float32)
    for cuts in ([], [1], [3, 5, 6], list(range(1, signal.shape[0]))):
        framer, frames = Framer(FRAME), []
        for piece in np.split(signal, cuts):
            framer.add_chunk(Chunk(piece))
            frames += framer.take_frames()
        np.testing.assert_array_equal(np.concatenate(frames), signal[: 7 * FRAME])
        np.testing.assert_array_equal(framer.take_partial(), signal[7 * FRAME:])
        assert framer.buffered == 0 and framer.take_partial().shape == (0,)


def test_counted_samples_are_reported_as_they_leave():
    left: list[int] = []
    framer = Framer(FRAME, left.append)
    framer.add_chunk(Chunk(np.zeros(3, np.float32), "client"))
    framer.add_chunk(Chunk(np.zeros(3, np.float32), "silence", counted=False))
    framer.take_frame()
    framer.clear()
    assert left == [3]


def test_the_server_channel_frames_with_the_framer():
    channel = StreamChannel(FRAME)
    assert isinstance(channel.framer, Framer) and channel.framer.frame_samples == FRAME
