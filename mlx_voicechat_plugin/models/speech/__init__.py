"""EAR-TTS: the speech codes of each frame from the text channel."""
