"""``python -m conformance.diff CKPT WAV --stream``: the streaming paths side by side.

Stages: streaming encoder output (per frame, 1e-5), text ids, function ids,
codes (exact) and our streamed waveform against the offline decode of the
same codes (exact). The reference's own streamed waveform is not a target:
it is 8 samples late and drops the last 8 samples (conformance/README.md).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from .diff import FLOAT_TOLERANCE, StageDiff, compare


def run_stream_pair(
    checkpoint: str | Path,
    audio: str | Path | mx.array,
    *,
    system_prompt: str | None = None,
    seed: int = 0,
    extra_decoding_seconds: float = 3.0,
    chunk: int = 1280,
) -> list[StageDiff]:
    from mlx_vlm.utils import load as reference_load

    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.runtime.audio import load_waveform
    from mlx_voicechat_plugin.runtime.events import AssistantTextDelta, Audio, FunctionDelta

    (model, processor), (ref, ref_processor) = load(checkpoint), reference_load(str(checkpoint))
    rate = model.config.input_sample_rate
    signal = np.array(load_waveform(audio, rate))
    signal = np.concatenate([signal, np.zeros(round(extra_decoding_seconds * rate), np.float32)])

    ours = model.create_session(processor).create_streaming_session(system_prompt=system_prompt, seed=seed)
    theirs = ref.create_session(ref_processor).create_streaming_session(system_prompt=system_prompt, seed=seed)
    frame = model.config.frame_samples
    events, ref_events = [], []
    for start in range(0, len(signal) - frame + 1, frame):
        piece = signal[start : start + frame]
        events += ours.push_audio(piece)
        ref_events += theirs.push_audio(mx.array(piece))
    events += ours.flush(pad_partial=False)
    ref_events += theirs.flush(pad_partial=False)

    codes = np.stack([e.audio_codes for e in events if isinstance(e, Audio) and e.audio_codes.size])
    ref_codes = np.stack([np.array(e.audio_codes) for e in ref_events if e.kind == "audio"])
    text = [e.token_id for e in events if isinstance(e, AssistantTextDelta)]
    ref_text = [e.token_id for e in ref_events if e.kind == "assistant_text_delta"]
    function = [e.token_id for e in events if isinstance(e, FunctionDelta)]
    ref_function = [e.token_id for e in ref_events if e.kind == "function_delta"]
    samples = np.concatenate([e.samples for e in events if isinstance(e, Audio)])
    decoded = np.array(model.tts_model.audio_codec.decode(mx.array(codes.T[None]))[0, 0])

    # Encoder: fresh perception streams over the same frames.
    from mlx_voicechat_plugin.models.perception.perception_stream import PerceptionStream, push_frames

    stream_a = PerceptionStream(model.stt_model.perception, model.config)
    probe = ref.create_session(ref_processor).create_streaming_session()
    enc, ref_enc = [], []
    for start in range(0, len(signal) - frame + 1, frame):
        piece = np.asarray(signal[start : start + frame], dtype=np.float32)
        _, encoded = push_frames([stream_a], [piece])
        mx.eval(encoded, *stream_a.state)
        enc.append(np.array(encoded))
        ref_enc.append(np.array(probe._perception_step(mx.array(piece))[1]))
    return [
        compare("encoder", np.concatenate(enc), np.concatenate(ref_enc), FLOAT_TOLERANCE["encoder"]),
        compare("text_ids", text, ref_text, None),
        compare("function_ids", function, ref_function, None),
        compare("codes", codes, ref_codes, None),
        compare("waveform", samples, decoded, 0.0),
        compare("transcript", [ours.transcript == theirs._rnnt.text], [True], None),
    ]
