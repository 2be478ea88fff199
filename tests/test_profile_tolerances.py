"""Quantized stages agree with the same weights dequantized, per stage, on the medium fixture.

Each quantized profile is run against its exact dequantization
(:func:`~mlx_voicechat_plugin.testing.fixtures.dequantized_checkpoint`: float32
weights holding ``scale * q + bias``, what the quantized kernels compute with),
through ``compare`` (the float stages on one question; the LLM, EAR-TTS backbone
and MoG head teacher-forced on the same tokens). The tolerances, and why
(docs/checkpoints.md):

- encoder, projection, EAR-TTS backbone, MoG logits: SNR >= 100 dB. A quantized
  matmul fed float32 activations computes with the exact affine values, so only
  the order of a float32 sum can differ (the MoG head's ``proj_mus`` blocks are
  dequantized in float32 for the same reason); on MLX's CPU backend they are
  bit-identical (infinite SNR).
- the LLM's text logits: SNR >= 35 dB. MLX's quantized embedding returns its
  rows in the scales' dtype (bf16), rounding each value once (at most 2**-9
  relative), as the reference's does (measured: about 42 dB, docs/checkpoints.md).
- ids are not bounded: a 40 dB logit difference can flip a near-tie, after which
  the sampled streams part (measured on a 3 s question: lean parting at frame 15,
  q8 at frame 26 of 51); the teacher-forced logits above are the measure.
"""

from __future__ import annotations

import pytest

from mlx_voicechat_plugin.cli.compare import compare_checkpoints
from mlx_voicechat_plugin.testing.fixtures import (
    cached_checkpoint,
    dequantized_checkpoint,
    make_question_wav,
)

EXACT_SNR_DB = 100.0
EMBEDDING_ROUNDING_SNR_DB = 35.0
TOLERANCES = {"mel": EXACT_SNR_DB, "encoder": EXACT_SNR_DB, "projection": EXACT_SNR_DB,
              "tts_backbone": EXACT_SNR_DB, "mog_logits": EXACT_SNR_DB,
              "llm_logits": EMBEDDING_ROUNDING_SNR_DB}
QUANTIZED_PROFILES = ("lean", "q8")  # between them every part at 4 and 8 bits
# 12 frames: every weight takes part from the first frame on, and the SNRs are of
# whole stages; a longer question costs the float32 twin's time, not coverage.
QUESTION_SECONDS, ANSWER_SECONDS = 0.75, 0.25


@pytest.fixture(scope="module", params=QUANTIZED_PROFILES)
def report(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    quantized = cached_checkpoint("medium", profile=request.param)
    twin = dequantized_checkpoint(quantized, root / "dequantized")
    question = make_question_wav(root / "q.wav", QUESTION_SECONDS, seed=1)
    return compare_checkpoints(twin, quantized, question, seed=1,
                               extra_decoding_seconds=ANSWER_SECONDS)


@pytest.mark.parametrize("stage", list(TOLERANCES))
def test_each_quantized_stage_agrees_with_its_dequantized_weights(report, stage):
    measured = report.stage(stage)
    assert measured.snr_db >= TOLERANCES[stage], measured


def test_the_dequantized_twin_holds_no_quantized_layer(tmp_path):
    import json

    twin = dequantized_checkpoint(cached_checkpoint("tiny", profile="lean"), tmp_path / "t")
    assert "quantization" not in json.loads((twin / "config.json").read_text())
