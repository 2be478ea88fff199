"""The HTTP and WebSocket routes, one router per concern, run on the event loop.

``access`` is what every route checks (the API key, a browser's ``Origin``);
``realtime`` the WebSocket routes of the dialects, ``transcriptions``
``/v1/audio/transcriptions``, ``status`` ``/health`` and ``/metrics``,
``models`` the served model (``/v1/models``) and the 501s for what a text
model would serve, ``browser`` the microphone page, ``calls`` WebRTC calls
and ``client_secrets`` their ephemeral keys, ``live_sessions`` GPT-Live's
WebRTC sessions. Each router is made from
what it needs, given as arguments; :func:`..app.create_app` wires them.
"""
