"""A whole file is transcribed in bounded memory: the peak does not grow with its length.

Each length runs in its own process (the MLX peak is per process), through
``bench.transcribe``'s memory mode; the suite uses lengths past the encoder's
windows (70 frames, 5.6 s) that stay quick here, the docs give 1, 4 and 10 minutes.
"""

from __future__ import annotations

from bench.transcribe import measure_in_processes, spread

SECONDS = [8.0, 48.0]  # both past the encoder's filled windows; 6x the frames


def test_the_peak_memory_of_a_file_transcription_does_not_grow_with_its_length(
        tiny_ckpt, tmp_path):
    rows = measure_in_processes(tiny_ckpt, SECONDS, tmp_path)
    assert [row["frames"] for row in rows] == [100, 600]
    assert spread(rows) < 0.10, rows
