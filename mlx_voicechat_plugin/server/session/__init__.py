"""The session layer: one client's session, in no transport and no dialect.

- :mod:`.session`: :class:`~.session.Session`, the engine's sink and the dialects'
  one way to the engine; its clocks, its links, its release.
- :mod:`.lifecycle`: its two states (engine side, link side), moved only by it.
- :mod:`.peers`: what it talks to by their shapes (its link, its watcher).
- :mod:`.replay`: its numbered events, kept for a resume.
- :mod:`.resume`: resume tokens, and who may take a detached session.
- :mod:`.client_calls`: the tool calls the client runs, on their clocks.

The dialects sit above it and the engine below; it imports no transport.
"""
