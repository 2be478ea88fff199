"""OpenAI Realtime GA, at ``/openai/v1/realtime`` and over WebRTC calls: :mod:`.dialect`
(:class:`~.dialect.GADialect`), the session object and its config (:mod:`.config`),
its responses and what they keep (:mod:`.responses`, :mod:`.records`), conversation items
(:mod:`.items`), audio formats (:mod:`.audio`) and a WebRTC track's playback
(:mod:`.playback`). Importing a helper module loads no other (nor FastAPI).
"""
