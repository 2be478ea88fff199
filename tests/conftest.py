"""Shared fixtures: synthetic checkpoints built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_voicechat_plugin.testing.fixtures import make_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _remember_in_a_temporary_directory(tmp_path_factory: pytest.TempPathFactory) -> None:
    """What loads remember (probe verdicts, warm starts) goes to this run's own directory,
    never the user's cache (servers started as subprocesses inherit it)."""
    import os

    from mlx_voicechat_plugin.models.remembered import ENV_CACHE_DIR

    os.environ[ENV_CACHE_DIR] = str(tmp_path_factory.mktemp("remembered"))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny fixture checkpoint (bf16), laid out key for key like the reference."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny")


@pytest.fixture(scope="session")
def tiny_q4_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with its language model quantized to 4 bits."""
    root = tmp_path_factory.mktemp("ckpt")
    return make_checkpoint(root / "tiny-q4", "tiny", quantize_bits=4)


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small fixture checkpoint (real Nemotron-H layer mix, benchmark widths)."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "small", "small")


@pytest.fixture(scope="session")
def tiny_q8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with its language model quantized to 8 bits."""
    root = tmp_path_factory.mktemp("ckpt")
    return make_checkpoint(root / "tiny-q8", "tiny", quantize_bits=8)


@pytest.fixture(scope="module")
def tiny_model(tiny_ckpt: Path):
    """The tiny checkpoint loaded, its vocabulary spelled for the TTS (one per test module)."""
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    model.create_session(processor)
    return model


@pytest.fixture(scope="module")
def tiny_start(tiny_model):
    """The tiny model's warm start (:class:`~mlx_voicechat_plugin.runtime.timeline.WarmStart`)."""
    from mlx_voicechat_plugin.runtime.warm_start import WarmStart

    return WarmStart.of(tiny_model)


@pytest.fixture(scope="session", params=["tiny", "tiny-q4"])
def parity_ckpt(request: pytest.FixtureRequest, tiny_ckpt: Path, tiny_q4_ckpt: Path) -> Path:
    """Each checkpoint flavour that network parity must hold for."""
    return {"tiny": tiny_ckpt, "tiny-q4": tiny_q4_ckpt}[request.param]


@pytest.fixture(scope="session")
def loaded_pair(parity_ckpt: Path):
    """``(ours, reference)`` as ``(model, processor)`` pairs on the same checkpoint."""
    from mlx_vlm.utils import load as reference_load

    from mlx_voicechat_plugin import load

    return load(parity_ckpt), reference_load(str(parity_ckpt))


@pytest.fixture(scope="session")
def question_audio():
    """Two seconds of the deterministic synthetic question at 16 kHz."""
    import mlx.core as mx

    from mlx_voicechat_plugin.testing.fixtures import question_signal

    return mx.array(question_signal(2.0))


@pytest.fixture(autouse=True)
def _compile_stays_enabled():
    """The CLI's compile policy switches mx.compile process-wide; undo it after each test."""
    yield
    import mlx.core as mx

    mx.enable_compile()
