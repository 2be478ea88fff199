"""The speech codec: codes to 22.05 kHz waveform."""
