"""``POST /v1/audio/transcriptions``: a file's transcript from perception and the RNNT,
run as an engine job (:mod:`..engine.jobs`); the route runs on the event loop.

The request is read and checked first (:mod:`..operations.transcriptions`);
at most ``max_transcriptions_in_flight`` are admitted at once (429 past it).
With ``stream=true`` the response is server-sent events while the file is
decoded: ``transcript.text.delta`` events (``delta``), then one
``transcript.text.done`` (``text``), as OpenAI streams a transcription.
``POST /v1/audio/translations`` is a 400: the model transcribes only.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..engine.thread import Engine
from ..limits import ServerLimits
from ..operations.transcriptions import (
    FORM_SLACK_BYTES, TRANSCRIPTIONS_PATH, TRANSLATIONS_PATH, RequestError,
    TranscriptionRequest, decode_audio, parse_form, parse_multipart, read_body,
)
from .access import Access

logger = logging.getLogger(__name__)


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode("utf-8")


def transcriptions_router(engine: Engine, served: tuple[str, ...], limits: ServerLimits,
                          access: Access, prefix: str = "") -> APIRouter:
    """``{prefix}/v1/audio/transcriptions`` and the ``/v1/audio/translations`` refusal.

    ``served`` are the model names a request may give; ``access`` checks the
    ``Authorization`` header and a browser's ``Origin`` (a foreign page may
    post a multipart form without a CORS preflight; it is refused before any
    work, as on ``/v1/realtime``).
    """
    router = APIRouter(prefix=prefix)

    def respond(result: Any, request: TranscriptionRequest, language: str) -> Response:
        if request.response_format == "text":
            return PlainTextResponse(result.text + "\n")
        body: dict[str, Any] = {"text": result.text}
        if request.response_format == "verbose_json":
            body = {"task": "transcribe", "language": language,
                    "duration": round(result.duration, 3), "text": result.text}
        return JSONResponse(body)

    def stream_response(future: asyncio.Future, cancel: Any,
                        deltas: asyncio.Queue) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            try:
                while True:
                    getting = asyncio.ensure_future(deltas.get())
                    await asyncio.wait({getting, future}, return_when=asyncio.FIRST_COMPLETED)
                    if not getting.done():
                        getting.cancel()
                        break
                    for delta in getting.result():
                        yield _sse({"type": "transcript.text.delta", "delta": delta.delta})
                # Deltas were posted before the reply: drain them, then the result.
                while not deltas.empty():
                    for delta in deltas.get_nowait():
                        yield _sse({"type": "transcript.text.delta", "delta": delta.delta})
                try:
                    result = future.result()
                except Exception as exc:
                    yield _sse({"type": "error", "error": {
                        "message": str(exc) or type(exc).__name__, "type": "server_error",
                        "param": None, "code": "inference_error"}})
                    return
                yield _sse({"type": "transcript.text.done", "text": result.text})
            finally:
                cancel.set()  # a client that left stops the job at its next step

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def transcriptions(request: Request) -> Response:
        if not access.authorized(request.headers.get("authorization")):
            return RequestError(401, "missing or invalid API key", None,
                                "invalid_api_key").response()
        if not access.origin_ok(request.headers.get("origin")):
            return RequestError(403, "origin not allowed", None, "origin_not_allowed").response()
        if not engine.ready or engine.admission.draining:
            message = ("the model failed to load" if engine.load_error is not None
                       else "the server is shutting down" if engine.admission.draining
                       else "the model is not loaded yet")
            return RequestError(503, message, None, "server_busy").response()
        if not engine.transcriptions.try_admit(limits.max_transcriptions_in_flight):
            engine.metrics.transcriptions_refused.inc()
            return RequestError(429, f"{limits.max_transcriptions_in_flight} transcriptions "
                                     "are already in flight (--max-transcriptions-in-flight); "
                                     "retry later", None, "rate_limit_exceeded").response()
        submitted = False
        try:
            max_upload, max_seconds = limits.transcription_limits(engine.memory_plan)
            body = await read_body(request, max_upload + FORM_SLACK_BYTES)
            form, data = await parse_multipart(request, body, max_upload)
            language = engine.language
            parsed = parse_form(form, data, served, language)
            audio = await asyncio.to_thread(decode_audio, parsed.data,
                                            max_seconds)
            loop = asyncio.get_running_loop()
            deltas: asyncio.Queue = asyncio.Queue()
            def post_deltas(step: list[Any]) -> None:  # engine thread: UserTranscriptDeltas
                loop.call_soon_threadsafe(deltas.put_nowait, step)

            future, cancel = engine.submit_transcription(
                audio, on_delta=post_deltas if parsed.stream else None,
                max_new_tokens=parsed.max_new_tokens)
            submitted = True  # the engine releases the slot when the job ends
            if parsed.stream:
                return stream_response(future, cancel, deltas)
            try:
                result = await future
            except Exception as exc:
                return RequestError(500, str(exc) or type(exc).__name__, None,
                                    "inference_error").response()
            finally:
                cancel.set()
            logger.info("transcribed %.2f s of audio", result.duration)
            return respond(result, parsed, language)
        except RequestError as error:
            logger.info("transcription refused (%d): %s", error.status, error.message)
            return error.response()
        finally:
            if not submitted:
                engine.transcriptions.ended()

    async def translations(request: Request) -> Response:
        return RequestError(400, "this model transcribes only: translations are not "
                                 f"supported; use {prefix}{TRANSCRIPTIONS_PATH}", None,
                            "unsupported").response()

    router.add_api_route(TRANSCRIPTIONS_PATH, transcriptions, methods=["POST"])
    router.add_api_route(TRANSLATIONS_PATH, translations, methods=["POST"])
    return router
