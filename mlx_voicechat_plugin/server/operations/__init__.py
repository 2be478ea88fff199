"""Operating a replica: graceful drain, the balancer's view (``/health``, the agent-check),
and file transcriptions (``/v1/audio/transcriptions``)."""
