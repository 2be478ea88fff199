"""NVIDIA's VoiceChat protocol (NeMo-Speech.cpp's), at ``/nvidia/v1/realtime``:
:mod:`.dialect` (:class:`~.dialect.NvidiaDialect`), the client messages and session
configuration (:mod:`.messages`) and the server events (:mod:`.events`).
"""
