"""What a dialect's sessions did on the wire, in ``/metrics``, labelled by dialect.

The engine's figures (:mod:`.metrics`) count frames and steps; these count
what the clients sent and got, where a dialect keeps such counts (NVIDIA's
``session.end`` counters, :mod:`..dialects.nvidia.events`): audio received
and sent (seconds), audio messages dropped, frames stepped, and the time from
the end of the user's speech to the first non-silent output audio. They are
counted on the event loop as they happen, so a scrape sees a session live.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

LATENCY_BUCKETS = (0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)


class ClientMetrics:
    """The per-dialect wire counters of one engine's registry."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.received = Counter("voicechat_client_audio_received_seconds",
                                "Client audio accepted, in seconds", ["dialect"], registry=r)
        self.sent = Counter("voicechat_client_audio_sent_seconds",
                            "Output audio sent to clients, in seconds", ["dialect"], registry=r)
        self.dropped = Counter("voicechat_client_audio_chunks_dropped",
                               "Client audio messages refused or lost to a failed frame",
                               ["dialect"], registry=r)
        self.stepped = Counter("voicechat_client_frames_stepped",
                               "Model frames stepped for the dialect's sessions", ["dialect"],
                               registry=r)
        self.latency = Histogram("voicechat_client_response_latency_seconds",
                                 "End of the user's speech to the first non-silent output audio",
                                 ["dialect"], buckets=LATENCY_BUCKETS, registry=r)
