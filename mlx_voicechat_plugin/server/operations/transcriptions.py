"""A file transcription's request, read and checked on the event loop before any inference.

The request shape is OpenAI's (and SGLang-Omni's for this model family):
multipart with ``file`` and optional ``model``, ``language``,
``response_format``, ``temperature``, ``prompt``, ``max_new_tokens`` and
``stream``. Every parameter is checked before any inference; a bad one is a
400 whose ``error.param`` names it (:class:`RequestError`). The body is read
up to ``max_upload_bytes`` (413 past it) and the file decoded by the host's
audio reader to mono 16 kHz (at most ``max_transcription_seconds``). Its
header is read first: a sample rate outside :data:`MIN_RATE` to
:data:`MAX_RATE` or a WAV format code the reader does not decode is a 400, so
decoding and resampling cost what the audio's duration says, and a file that
decodes to no audio is a 400 too. The
route that runs it as an engine job is :mod:`..routes.transcriptions`.
"""

from __future__ import annotations

import io
import logging
import struct
from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from ...quoting import brief

logger = logging.getLogger(__name__)

TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
TRANSLATIONS_PATH = "/v1/audio/translations"
RESPONSE_FORMATS = ("json", "verbose_json", "text")
STREAM_FORMATS = ("json", "text")
FORM_SLACK_BYTES = 64 * 1024  # the form's other fields and part headers, past the file
MAX_FIELDS = 32
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no", "")
SAMPLE_RATE = 16_000
# The sample rates an upload may declare: telephony's lowest to the highest studio
# rate (a 1 Hz header would make the resampler's work millions of times its audio).
MIN_RATE, MAX_RATE = 8_000, 384_000
# WAV format codes the reader decodes (0xFFFE: extensible, its subformat one of these).
WAV_FORMATS = {1: "PCM", 3: "IEEE float", 6: "A-law", 7: "mu-law"}
WAV_EXTENSIBLE = 0xFFFE


class RequestError(Exception):
    """A client mistake answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str = "invalid_request"):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": "invalid_request_error",
                 "param": self.param, "code": self.code}
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse({"error": error}, self.status, headers=headers)


def _bad(param: str, message: str) -> RequestError:
    return RequestError(400, message, param)


@dataclass(frozen=True)
class TranscriptionRequest:
    data: bytes
    response_format: str = "json"
    max_new_tokens: int | None = None
    stream: bool = False


def _field(form: Any, name: str) -> str | None:
    value = form.get(name)
    if value is None:
        return None
    if isinstance(value, UploadFile):
        raise _bad(name, f"{name} must be a form field, not a file")
    return value.strip()


def parse_form(form: Any, file_data: bytes | None, served: tuple[str, ...],
               language: str) -> TranscriptionRequest:
    """Check every parameter (in the order documented); a 400 names the first bad one."""
    if file_data is None:
        raise _bad("file", "file is required: the audio to transcribe, as a multipart file")
    model = _field(form, "model")
    if model and model not in served:
        raise _bad("model", f"model {brief(model)} is not served here; this server serves "
                            f"{brief(served[0])} (or omit model)")
    lang = _field(form, "language")
    if lang and lang.lower() not in ("auto", language):
        raise _bad("language", f"language must be 'auto' or {language!r} (the checkpoint's "
                               f"language), got {brief(lang)}")
    fmt = (_field(form, "response_format") or "json").lower()
    if fmt not in RESPONSE_FORMATS:
        raise _bad("response_format", "response_format must be one of "
                   f"{', '.join(RESPONSE_FORMATS)}, got {brief(fmt)}")
    temperature = _field(form, "temperature")
    if temperature:
        try:
            value = float(temperature)
        except ValueError:
            value = None
        if value != 0.0:
            raise _bad("temperature", "temperature must be 0: decoding is greedy, got "
                       f"{brief(temperature)}")
    if _field(form, "prompt"):
        raise _bad("prompt", "prompt is not supported: the RNNT decoder takes no text prompt")
    limit = _field(form, "max_new_tokens")
    max_new_tokens = None
    if limit:
        try:
            max_new_tokens = int(limit)
        except ValueError:
            max_new_tokens = 0
        if max_new_tokens < 1:
            raise _bad("max_new_tokens", "max_new_tokens must be a positive integer, got "
                       f"{brief(limit)}")
    stream_text = (_field(form, "stream") or "").lower()
    if stream_text not in TRUE + FALSE:
        raise _bad("stream", f"stream must be true or false, got {brief(stream_text)}")
    stream = stream_text in TRUE
    if stream and fmt not in STREAM_FORMATS:
        raise _bad("stream", f"stream=true supports response_format {' or '.join(STREAM_FORMATS)}, "
                   f"got {fmt}")
    return TranscriptionRequest(file_data, fmt, max_new_tokens, stream)


def wav_rate(data: bytes) -> int | None:
    """A WAV file's declared sample rate (``None``: not a WAV, or no ``fmt`` chunk);
    a format code the reader does not decode is a 400."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    position = 12
    while position + 8 <= len(data):
        chunk, size = data[position:position + 4], struct.unpack_from("<I", data, position + 4)[0]
        if chunk == b"fmt " and position + 16 <= len(data):
            code, _, rate = struct.unpack_from("<HHI", data, position + 8)
            if code == WAV_EXTENSIBLE and position + 34 <= len(data):
                code = struct.unpack_from("<H", data, position + 32)[0]  # the subformat
            if code not in WAV_FORMATS:
                raise _bad("file", f"file is a WAV with format code {code:#06x}; this server "
                                   f"decodes {', '.join(WAV_FORMATS.values())} WAV files")
            return rate
        position += 8 + size + (size & 1)
    return None


def declared_rate(data: bytes) -> int | None:
    """The sample rate a WAV, FLAC or Ogg Vorbis header declares (``None``: unknown)."""
    import miniaudio

    rate = wav_rate(data)
    if rate is not None or data[:4] == b"RIFF":
        return rate
    probe = miniaudio.flac_get_info if data[:4] == b"fLaC" else \
        miniaudio.vorbis_get_info if data[:4] == b"OggS" else None
    try:
        return probe(data).sample_rate if probe is not None else None
    except Exception:  # the decoder says what is wrong with it
        return None


def decode_audio(data: bytes, max_seconds: float) -> np.ndarray:
    """The host's audio reader: any format it takes, as mono float32 at 16 kHz, its
    declared rate checked first (:func:`declared_rate`)."""
    from mlx_audio.audio_io import read

    if not data:
        raise _bad("file", "file is empty")
    rate = declared_rate(data)
    if rate is not None and not MIN_RATE <= rate <= MAX_RATE:
        raise _bad("file", f"file declares a sample rate of {rate} Hz; this server takes "
                           f"{MIN_RATE} to {MAX_RATE} Hz")
    try:
        samples, _ = read(io.BytesIO(data), dtype="float32", sample_rate=SAMPLE_RATE,
                          nchannels=1, duration=max_seconds + 0.5)
    except Exception as exc:
        raise _bad("file", "file could not be decoded as audio (WAV, FLAC, MP3, OGG, ...): "
                   f"{brief(str(exc))}") from None
    samples = np.asarray(samples, dtype=np.float32).reshape(-1)
    if not samples.shape[0]:
        raise _bad("file", "file holds no audio samples")
    if samples.shape[0] > round(max_seconds * SAMPLE_RATE):
        raise _bad("file", f"file holds more than {max_seconds:g} s of audio "
                           "(--max-transcription-seconds)")
    if not np.isfinite(samples).all():
        raise _bad("file", "file contains non-finite samples")
    return samples


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body of {declared} bytes exceeds the {limit}-byte "
                                "limit (--max-upload-bytes plus the form)", "file")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise RequestError(413, f"request body exceeds the {limit}-byte limit "
                                        "(--max-upload-bytes plus the form)", "file")
    except ClientDisconnect:  # gone, or closed by the body deadline (--body-timeout)
        raise RequestError(408, "the connection closed before the request body arrived",
                           "file") from None
    return bytes(body)


async def parse_multipart(request: Request, body: bytes, max_upload_bytes: int
                          ) -> tuple[Any, bytes | None]:
    """``(form, file bytes)``; the file part alone is bounded by ``max_upload_bytes``."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise _bad("file", "the request must be multipart/form-data with a file part")

    async def replay() -> AsyncIterator[bytes]:
        yield body

    try:
        form = await MultiPartParser(request.headers, replay(), max_files=1,
                                     max_fields=MAX_FIELDS).parse()
    except MultiPartException as exc:
        raise _bad("file", f"malformed multipart form: {exc.message}") from None
    upload = form.get("file")
    if upload is None:
        return form, None
    if not isinstance(upload, UploadFile):
        raise _bad("file", "file must be a multipart file part, not a text field")
    data = await upload.read()
    await upload.close()
    if len(data) > max_upload_bytes:
        raise RequestError(413, f"file of {len(data)} bytes exceeds the {max_upload_bytes}-byte "
                                "limit (--max-upload-bytes)", "file")
    return form, data
