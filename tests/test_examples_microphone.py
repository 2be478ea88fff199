"""The microphone example's non-audio logic, tested without sounddevice."""

from __future__ import annotations

import base64
import importlib.util
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

PATH = Path(__file__).resolve().parents[1] / "examples" / "microphone.py"


@pytest.fixture(scope="module")
def mic():
    spec = importlib.util.spec_from_file_location("example_microphone", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_importing_the_example_does_not_import_sounddevice(mic):
    assert "sounddevice" not in mic.__dict__
    assert mic.CHUNK_SAMPLES == mic.INPUT_RATE * 80 // 1000


def test_session_message_carries_seed_and_prompt(mic):
    assert mic.session_message("Be brief.", 7) == {
        "type": "session.update", "session": {"seed": 7, "system_prompt": "Be brief."}}


def test_session_message_omits_an_empty_prompt(mic):
    assert mic.session_message(None, 0) == {"type": "session.update", "session": {"seed": 0}}


def test_append_message_is_base64_pcm16_at_16khz(mic):
    message = mic.append_message(np.array([0.0, 0.5, -1.0, 1.0], np.float32))
    assert message["type"] == "input_audio_buffer.append"
    assert message["sample_rate"] == 16_000
    pcm = np.frombuffer(base64.b64decode(message["audio"]), "<i2")
    np.testing.assert_array_equal(pcm, [0, 16384, -32768, 32767])


def test_commit_message(mic):
    assert mic.commit_message() == {"type": "input_audio_buffer.commit"}


def test_audio_delta_decodes_to_float(mic):
    pcm = np.array([0, 16384, -32768], "<i2")
    event = {"type": "response.audio.delta", "delta": base64.b64encode(pcm.tobytes()).decode()}
    np.testing.assert_array_equal(mic.decode_audio_delta(event), [0.0, 0.5, -1.0])


def test_downmix_averages_channels_and_keeps_mono(mic):
    stereo = np.array([[1.0, 0.0], [0.5, 0.5]], np.float32)
    np.testing.assert_array_equal(mic.downmix(stereo), [0.5, 0.5])
    np.testing.assert_array_equal(mic.downmix(np.array([0.25], np.float32)), [0.25])


def test_resampler_is_identity_at_equal_rates(mic):
    block = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(mic.StreamResampler(16_000, 16_000)(block), block)


@pytest.mark.parametrize("source", [48_000, 44_100, 8_000])
def test_resampler_output_length_follows_the_rate_ratio(mic, source):
    out = mic.StreamResampler(source, 16_000)(np.zeros(source, np.float32))
    assert abs(out.shape[0] - 16_000) <= 1


@pytest.mark.parametrize("source,target", [(48_000, 16_000), (44_100, 16_000), (16_000, 22_050)])
def test_resampler_in_blocks_matches_resampling_at_once(mic, source, target):
    signal = np.sin(np.arange(source // 4) * 0.01).astype(np.float32)
    whole = mic.StreamResampler(source, target)(signal)
    stream = mic.StreamResampler(source, target)
    sizes = [1, 7, 480, 441, 1000, 3]
    pieces, start, index = [], 0, 0
    while start < signal.shape[0]:
        size = sizes[index % len(sizes)]
        pieces.append(stream(signal[start : start + size]))
        start, index = start + size, index + 1
    np.testing.assert_allclose(np.concatenate(pieces), whole, atol=1e-6)


def test_resampler_preserves_a_low_tone(mic):
    rate = 48_000
    times = np.arange(rate) / rate
    out = mic.StreamResampler(rate, 16_000)(np.sin(2 * np.pi * 440 * times).astype(np.float32))
    expected = np.sin(2 * np.pi * 440 * np.arange(out.shape[0]) / 16_000)
    assert np.max(np.abs(out - expected)) < 1e-3


def test_chunker_emits_80ms_chunks_and_keeps_the_rest(mic):
    chunker = mic.Chunker()
    chunks = list(chunker.push(np.arange(3000, dtype=np.float32)))
    assert [c.shape[0] for c in chunks] == [1280, 1280]
    np.testing.assert_array_equal(chunks[1][:2], [1280, 1281])
    rest = chunker.flush()
    np.testing.assert_array_equal(rest, np.arange(2560, 3000))
    assert chunker.flush().shape[0] == 0


def test_ring_buffer_reads_in_write_order_and_pads_with_silence(mic):
    ring = mic.RingBuffer(8)
    ring.write(np.array([1, 2, 3], np.float32))
    np.testing.assert_array_equal(ring.read(2), [1, 2])
    np.testing.assert_array_equal(ring.read(3), [3, 0, 0])
    assert len(ring) == 0


def test_ring_buffer_wraps_around(mic):
    ring = mic.RingBuffer(4)
    ring.write(np.array([1, 2, 3], np.float32))
    ring.read(2)
    ring.write(np.array([4, 5, 6], np.float32))
    np.testing.assert_array_equal(ring.read(4), [3, 4, 5, 6])


def test_ring_buffer_overflow_drops_the_oldest(mic):
    ring = mic.RingBuffer(4)
    assert ring.write(np.array([1, 2, 3], np.float32)) == 0
    assert ring.write(np.array([4, 5, 6], np.float32)) == 2
    np.testing.assert_array_equal(ring.read(4), [3, 4, 5, 6])
    ring.write(np.arange(10, dtype=np.float32))
    np.testing.assert_array_equal(ring.read(4), [6, 7, 8, 9])


def test_event_text_prints_deltas_and_errors(mic):
    assert mic.event_text({"type": "response.text.delta", "delta": "Hi"}) == "Hi"
    user = {"type": "conversation.item.input_audio_transcription.delta", "delta": "hello"}
    assert mic.event_text(user) == "[user] hello"
    error = {"type": "error", "error": {"code": "server_busy", "message": "busy"}}
    assert "server_busy: busy" in mic.event_text(error)
    assert mic.event_text({"type": "response.audio.delta", "audio": ""}) is None


def test_missing_sounddevice_exits_with_an_install_hint(mic, monkeypatch):
    monkeypatch.setitem(sys.modules, "sounddevice", None)  # import raises ImportError
    with pytest.raises(SystemExit) as exited:
        mic.import_sounddevice()
    assert "pip install sounddevice" in str(exited.value)


def test_unopenable_device_exits_with_a_device_hint(mic):
    class FakeSD:
        class InputStream:
            def __init__(self, **_):
                raise RuntimeError("Error querying device -1")

    with pytest.raises(SystemExit) as exited:
        mic.open_stream(FakeSD, "input", device=None)
    assert "--list-devices" in str(exited.value)
    assert "--input-device" in str(exited.value)


def test_device_arg_accepts_index_or_name(mic):
    assert mic.device_arg("3") == 3
    assert mic.device_arg("USB Mic") == "USB Mic"
    assert mic.device_arg(None) is None


# --- main() end to end, against a real server, with a fake sounddevice ----


class FakeSoundDevice:
    """Just enough of ``sounddevice``: a 48 kHz tone microphone and a recording speaker."""

    MIC_RATE = 48_000
    BLOCKS = 40  # 800 ms of 20 ms blocks

    def __init__(self):
        self.played: list[np.ndarray] = []
        sd = self

        class Stream:
            def __init__(self, samplerate, blocksize, callback, finished_callback=None, **_):
                self.rate, self.size, self.callback = samplerate, blocksize, callback
                self.finished = finished_callback
                self.running = threading.Event()
                self.thread = threading.Thread(target=self.run, daemon=True)

            def start(self):
                self.running.set()
                self.thread.start()

            def stop(self):
                self.running.clear()
                if self.thread is not threading.current_thread():
                    self.thread.join(5)

            def close(self):
                pass

        class InputStream(Stream):
            def run(self):
                for index in range(sd.BLOCKS):
                    if not self.running.is_set():
                        break
                    times = (index * self.size + np.arange(self.size)) / self.rate
                    tone = 0.3 * np.sin(2 * np.pi * 440 * times).astype(np.float32)
                    self.callback(tone[:, None], self.size, None, None)
                if self.finished:
                    self.finished()

        class OutputStream(Stream):
            def run(self):
                while self.running.is_set():
                    out = np.zeros((self.size, 1), np.float32)
                    self.callback(out, self.size, None, None)
                    sd.played.append(out[:, 0].copy())
                    time.sleep(0.001)

        self.InputStream, self.OutputStream = InputStream, OutputStream

    def query_devices(self, device=None, kind=None):
        return {"default_samplerate": float(self.MIC_RATE)} if kind else "0 fake device"

    def check_output_settings(self, **_):
        pass


def test_main_streams_the_microphone_and_plays_the_answer(mic, tiny_ckpt, monkeypatch, capsys):
    from server_support import LiveServer

    from mlx_voicechat_plugin.server.app import create_app

    fake = FakeSoundDevice()
    monkeypatch.setitem(sys.modules, "sounddevice", fake)
    live = LiveServer(create_app(tiny_ckpt, alias="mic-voicechat"))
    try:
        assert mic.main([live.ws(), "--seed", "3", "--system-prompt", "Be brief."]) == 0
    finally:
        live.stop()
    out = capsys.readouterr().out
    assert "[ready: mic-voicechat]" in out
    assert out.rstrip().endswith("[done]")
    played = np.concatenate(fake.played)
    assert np.count_nonzero(played) > 0  # response.audio.delta reached the speaker


def test_list_devices_prints_the_device_table(mic, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sounddevice", FakeSoundDevice())
    assert mic.main(["--list-devices"]) == 0
    assert "fake device" in capsys.readouterr().out
