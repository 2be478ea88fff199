"""How a session's events and audio travel: below the dialects, knowing no protocol.

:mod:`.websocket` (frames in, typed messages out as JSON text, an ending as a
close code), :mod:`.memory` (both ends in one process, for tests), the
WebSocket's bounded :mod:`.outbox` and the socket-level :mod:`.guard`. A
transport's shape is :class:`~..connection.Transport`.
"""
