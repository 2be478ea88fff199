"""Perception: log-mel, the cache-aware FastConformer and the projection to the LLM."""
