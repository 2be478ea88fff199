"""Operating a replica, on the event loop: graceful drain, the balancer's view (``/health``,
the agent-check), and file transcriptions' requests (``/v1/audio/transcriptions``)."""
