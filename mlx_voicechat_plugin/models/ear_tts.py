"""EAR-TTS with residual vector quantization: text-conditioned speech codes, frame by frame.

Each 80 ms frame the Gemma-3 backbone reads the fusion of the previous frame's
codes (summed codebook embeddings) and the current subword embedding. A depth
loop then fills the frame's ``num_quantizers`` codebooks in ``num_iterations``
masked passes: the MoG head (with classifier-free guidance over a
``[cond; uncond]`` batch) samples a latent, and the next block of codebooks is
assigned to it by nearest-code RVQ.

Random draws per pass, in order: one ``uniform`` (Gumbel, shape
``[B, T, num_predictions]``) then one ``normal`` (latent noise, ``[B, T, latent]``),
both float32. Passes that decide no codebook (the schedule's leading zeros)
are skipped and draw nothing. Draws use MLX's global random state, or one key
each from an explicit :class:`KeyStream`, taken in the same order.

Many sessions' frames run as one batch with :meth:`EarTTS.backbone_step_batch`
and :meth:`EarTTS.generate_codes_batch` (``ear_tts_batch``), exact per session.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Protocol, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.cache import KVCache, RotatingKVCache
from mlx_vlm.models.gemma3.language import Gemma3Model, TextConfig as GemmaConfig

from ..config import TTSConfig
from .layers import OffsetRMSNorm
from . import ear_tts_batch
from .mog_head import Keys, MoGHead, draw
from .segments import GemmaStep
from .subword import CharAwareSubwordEncoder


Cache = list[Any]


class KeyStream(Protocol):
    """A source of PRNG keys, one per draw (e.g. ``runtime.rng.RandomStream``).

    A stream may also offer ``take(n)``: the next ``n`` keys stacked, in one call.
    """

    def next(self) -> mx.array: ...


class _KeyList:
    """Keys drawn in advance, handed out in order (inside a compiled graph)."""

    def __init__(self, keys: mx.array):
        self.keys = keys
        self.index = 0

    def next(self) -> mx.array:
        key = self.keys[self.index]
        self.index += 1
        return key


def _key(rng: Any) -> Keys:
    return None if rng is None else rng.next()


def unmasking_schedule(
    num_quantizers: int, num_iterations: int, exponent: float
) -> tuple[int, ...]:
    """Codebooks decided at each depth pass (sums to ``num_quantizers``).

    Pass ``i`` leaves ``ceil((1 - (i/n)**e)**(1/e) * Q)`` codebooks still masked
    before it runs; a pass decides the difference to the next one.
    """
    masked = [
        math.ceil(((1.0 - (i / num_iterations) ** exponent) ** (1.0 / exponent)) * num_quantizers)
        for i in range(num_iterations)
    ]
    return tuple(now - later for now, later in zip(masked, masked[1:] + [0]))


def codebook_norms(codebooks: mx.array) -> mx.array:
    """Squared norm of every code: ``[K, C, D]`` -> ``[K, C]``."""
    return (codebooks * codebooks).sum(axis=-1)


def rvq_assign(
    residual: mx.array,
    codebooks: mx.array | list[mx.array],
    norms: mx.array | list[mx.array] | None = None,
) -> list[mx.array]:
    """Greedy residual quantization of ``residual`` [..., D] by ``codebooks`` [K, C, D].

    ``codebooks`` may also be a list of ``[C, D]`` tables, with ``norms`` their
    :func:`codebook_norms` rows (computed here when not given). Returns one
    index array [...] per codebook, in order.
    """
    if norms is None:
        norms = codebook_norms(codebooks if isinstance(codebooks, mx.array) else mx.stack(codebooks))
    picked = []
    for k in range(len(codebooks)):
        table = codebooks[k]
        index = mx.argmin(norms[k] - 2.0 * (residual @ table.T), axis=-1)
        residual = residual - table[index]
        picked.append(index)
    return picked


class _CodebookTables:
    """Per-codebook ``[C, D]`` tables and their norms, evaluated once per weight array."""

    def __init__(self, rvq_embs: mx.array):
        self.source = rvq_embs
        norms = codebook_norms(rvq_embs)
        self.tables = [rvq_embs[k] for k in range(rvq_embs.shape[0])]
        self.norms = [norms[k] for k in range(rvq_embs.shape[0])]
        mx.eval(self.tables, self.norms)


class GatedFusion(nn.Module):
    """``norm(sigmoid(r) * (g * A(audio / Q) + (1 - g) * T(text)))``, ``g = sigmoid(gate)``."""

    def __init__(self, dims: int, num_codebooks: int, eps: float):
        super().__init__()
        self.num_codebooks = num_codebooks
        self.audio_proj = nn.Linear(dims, dims)
        self.text_proj = nn.Linear(dims, dims)
        self.gate = mx.zeros((dims,))
        self.residual_scale = mx.array(0.5)
        self.final_norm = OffsetRMSNorm(dims, eps)

    def __call__(self, audio: mx.array, text: mx.array) -> mx.array:
        audio = self.audio_proj(audio / self.num_codebooks)
        text = self.text_proj(text)
        gate = mx.sigmoid(self.gate).astype(audio.dtype)
        scale = mx.sigmoid(self.residual_scale).astype(audio.dtype)
        return self.final_norm(scale * (gate * audio + (1.0 - gate) * text))


def _backbone_config(config: TTSConfig) -> GemmaConfig:
    return GemmaConfig(
        model_type="gemma3_text",
        vocab_size=1,  # Gemma3Model insists on one; its embedding is removed.
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        query_pre_attn_scalar=config.query_pre_attn_scalar,
        sliding_window=config.sliding_window,
        sliding_window_pattern=config.sliding_window_pattern,
        rope_global_base_freq=config.rope_global_base_freq,
        rope_local_base_freq=config.rope_local_base_freq,
    )


class EarTTS(nn.Module):
    """RVQ EAR-TTS (checkpoint prefix ``tts_model.tts_model``); guidance is always on."""

    def __init__(self, config: TTSConfig):
        super().__init__()
        for flag in (
            "use_gated_fusion_for_text_audio",
            "use_subword_flag_emb",
            "use_bos_eos_emb",
        ):
            if not getattr(config, flag):
                raise ValueError(f"tts_config.{flag}=false is not supported")
        self.config = config
        dims, latent = config.hidden_size, config.latent_size
        self.backbone = Gemma3Model(_backbone_config(config), scale_inputs_embeds=False)
        del self.backbone.embed_tokens  # inputs are always fused embeddings
        self.bos_emb = mx.zeros((dims,))
        self.null_emb = mx.zeros((dims,))
        self.embed_code = nn.Linear(latent, dims, bias=False)
        self.embed_subword = CharAwareSubwordEncoder(config.character_encoder, dims)
        self.gated_fusion_audio_text = GatedFusion(dims, config.num_quantizers, config.rms_norm_eps)
        self.audio_prompt_projection_W = mx.zeros((dims, dims))
        self.mog_head = MoGHead(dims, latent, config.mog_head)
        self.rvq_embs = mx.zeros((config.num_quantizers, config.codebook_size, latent))
        self._schedule = unmasking_schedule(
            config.num_quantizers, config.num_iterations, config.exponent
        )
        self._compiled_depth = None
        self._compiled_depth_batch: Callable[..., mx.array] | None = None
        self._codebooks: _CodebookTables | None = None
        self._backbone_step: GemmaStep | None = None

    @property
    def schedule(self) -> tuple[int, ...]:
        """Codebooks decided per depth pass."""
        return self._schedule

    def set_vocabulary(self, vocabulary: Mapping[str, int]) -> None:
        self.embed_subword.set_vocabulary(vocabulary)

    def make_cache(self) -> Cache:
        """Rotating caches on sliding-window layers, full caches on global ones."""
        pattern = self.config.sliding_window_pattern
        return [
            KVCache()
            if (i + 1) % pattern == 0
            else RotatingKVCache(max_size=self.config.sliding_window, keep=0)
            for i in range(self.config.num_hidden_layers)
        ]

    def embed_codes(self, codes: mx.array) -> mx.array:
        """Codes [B, T, Q] -> summed codebook latents [B, T, latent], float32.

        One gather over the flattened codebooks; ``mask_code`` (or any id past
        the codebook) contributes zero.
        """
        q, size, latent = self.rvq_embs.shape
        valid = codes < size
        index = mx.where(valid, codes, 0).astype(mx.int32) + mx.arange(q, dtype=mx.int32) * size
        rows = self.rvq_embs.reshape(q * size, latent)[index]
        rows = mx.where(valid[..., None], rows, 0)
        return rows.astype(mx.float32).sum(axis=-2)

    def _text(self, subword_ids: mx.array, subword_mask: mx.array) -> mx.array:
        """Subword embeddings for the ``[cond; uncond]`` batch (uncond = ``null_emb``)."""
        return self._with_uncond(self.embed_subword(subword_ids, subword_mask))

    def _with_uncond(self, cond: mx.array) -> mx.array:
        return mx.concatenate([cond, mx.broadcast_to(self.null_emb, cond.shape)], axis=0)

    def _fuse(self, audio: mx.array, text: mx.array) -> mx.array:
        return self.gated_fusion_audio_text(mx.concatenate([audio, audio], axis=0), text)

    def _run_backbone(self, audio: mx.array, text: mx.array, cache: Cache) -> mx.array:
        return self.backbone(None, inputs_embeds=self._fuse(audio, text), cache=cache)

    def warmup(
        self,
        codes: mx.array,
        subword_ids: mx.array,
        subword_mask: mx.array,
        audio_mask: mx.array,
        prompt_latent: mx.array | None,
        cache: Cache | None = None,
    ) -> tuple[mx.array, Cache]:
        """Prefill with the speaker prompt; returns hidden ``[2B, T, dims]`` and the cache.

        Inputs are shifted one frame right (first frame: code 0). Frames before
        the first audio frame carry ``prompt_latent`` (or, without one, the
        code embedding through ``audio_prompt_projection_W``); the first audio
        frame gets ``bos_emb`` added.
        """
        shifted = mx.concatenate([mx.zeros_like(codes[:, :1]), codes[:, :-1]], axis=1)
        audio = self.embed_code(self.embed_codes(shifted))
        was_audio = mx.concatenate(
            [mx.zeros_like(audio_mask[:, :1]), audio_mask[:, :-1]], axis=1
        )
        starts = audio_mask & ~was_audio
        before_start = mx.cumsum(starts.astype(mx.int32), axis=1) == 0
        if prompt_latent is None:
            prompt = audio @ self.audio_prompt_projection_W
        else:
            prompt = prompt_latent.astype(audio.dtype)
        audio = mx.where(before_start[..., None], prompt, audio)
        audio = audio + starts[..., None] * self.bos_emb
        if cache is None:
            cache = self.make_cache()
        hidden = self._run_backbone(audio, self._text(subword_ids, subword_mask), cache)
        return hidden, cache

    def generate_codes(self, hidden: mx.array, rng: KeyStream | None = None) -> mx.array:
        """Depth loop: ``[cond; uncond]`` hidden [2B, T, dims] -> codes [B, T, Q] int32.

        With a key stream the fixed-shape loop runs as one compiled graph: its
        keys are drawn up front in the order the loop consumes them (per pass:
        component sample, then noise), so the codes are identical.
        """
        if rng is None:
            return self._depth_loop(hidden, None)
        keys = ear_tts_batch.take_keys(rng, 2 * self.depth_passes)
        if self._compiled_depth is None:
            # The module state is an input, so later weight updates are seen.
            self._compiled_depth = mx.compile(self._compiled_loop, inputs=self.state)
        books = self._codebook_tables()
        return self._compiled_depth(hidden, keys, books.tables, books.norms)

    def _compiled_loop(
        self, hidden: mx.array, keys: mx.array, tables: list[mx.array], norms: list[mx.array]
    ) -> mx.array:
        return self._depth_loop(hidden, _KeyList(keys), (tables, norms))

    def generate_codes_batch(self, hidden: mx.array, rngs: Sequence[KeyStream]) -> mx.array:
        """:meth:`generate_codes` for many sessions, each with its own key stream.

        ``hidden`` [2B, 1, dims] as :meth:`backbone_step_batch` lays it out;
        row ``b`` of the codes [B, 1, Q] and ``rngs[b]`` end bit-identical to
        ``generate_codes`` on session ``b`` alone (see ``ear_tts_batch``).
        """
        return ear_tts_batch.generate_codes_batch(self, hidden, rngs)

    def compiled_depth_batch(self) -> Callable[..., mx.array]:
        """The depth loop over per-session keys ``[B, count, 2]``, compiled (traced per B)."""
        if self._compiled_depth_batch is None:
            self._compiled_depth_batch = mx.compile(self._compiled_batch_loop, inputs=self.state)
        return self._compiled_depth_batch

    def _compiled_batch_loop(
        self, hidden: mx.array, keys: mx.array, tables: list[mx.array], norms: list[mx.array]
    ) -> mx.array:
        return self._depth_loop(hidden, ear_tts_batch.KeyRows(keys), (tables, norms))

    def codebook_arrays(self) -> tuple[list[mx.array], list[mx.array]]:
        """Per-codebook tables and norms, as the compiled depth loops take them."""
        books = self._codebook_tables()
        return books.tables, books.norms

    def _codebook_tables(self) -> _CodebookTables:
        # Built once (``prepare``, at load) and again after ``update``; not
        # keyed by array identity: the compiled depth loop takes the module
        # state as input and hands back new array objects after its trace.
        if self._codebooks is None:
            self._codebooks = _CodebookTables(self.rvq_embs)
        return self._codebooks

    def prepare(self) -> None:
        """One-time tables derived from the loaded weights (``load`` calls it)."""
        self._codebooks = _CodebookTables(self.rvq_embs)

    def update(self, parameters: dict, strict: bool = True) -> "EarTTS":
        self._codebooks = None  # derived from the weights being replaced
        return super().update(parameters, strict=strict)

    @property
    def depth_passes(self) -> int:
        """Depth passes that decide at least one codebook (5 of 8 for the release)."""
        return sum(1 for count in self._schedule if count)

    def _depth_loop(
        self,
        hidden: mx.array,
        rng: KeyStream | None,
        codebooks: tuple[list[mx.array], list[mx.array]] | None = None,
    ) -> mx.array:
        config = self.config
        if hidden.shape[0] % 2:
            raise ValueError("guided generation expects a [cond; uncond] batch")
        half = hidden.shape[0] // 2
        cond, uncond = hidden[:half], hidden[half:]
        codes = mx.full((*cond.shape[:2], config.num_quantizers), config.mask_code, mx.int32)
        done = 0
        for count in self._schedule:
            if count == 0:
                continue
            embedded = self.embed_code(self.embed_codes(codes))
            mu, logs = self.mog_head(
                mx.concatenate([embedded + cond, embedded + uncond], axis=0),
                guidance_scale=config.guidance_scale,
                top_p=config.top_p,
                key=_key(rng),
            )
            noise = draw(mx.random.normal, mu.shape, _key(rng))
            latent = mu + mx.exp(logs) * noise * config.noise_scale
            rows = latent.reshape(-1, latent.shape[-1])  # 2-D matmuls, no reshapes
            if codebooks is None:
                picked = rvq_assign(rows, self.rvq_embs[done : done + count])
            else:
                tables, norms = codebooks
                span = slice(done, done + count)
                picked = rvq_assign(rows, tables[span], norms[span])
            block = mx.stack(picked, axis=-1).astype(mx.int32).reshape(*latent.shape[:-1], count)
            codes = mx.concatenate(
                [codes[..., :done], block, codes[..., done + count :]], axis=-1
            )
            done += count
        return codes

    def step(
        self,
        prev_codes: mx.array,
        subword_ids: mx.array,
        cache: Cache,
        rng: KeyStream | None = None,
    ) -> mx.array:
        """One frame: previous codes [B, 1, Q] + current subword [B, 1] -> codes [B, 1, Q]."""
        return self.generate_codes(self.backbone_step(prev_codes, subword_ids, cache), rng)

    def backbone_step(
        self,
        prev_codes: mx.array,
        subword_ids: mx.array,
        cache: Cache,
        token_id: int | None = None,
    ) -> mx.array:
        """The backbone half of :meth:`step`: ``[cond; uncond]`` hidden [2B, 1, dims].

        ``token_id``: the one stream's text token as a host integer when the
        caller already has it; the memoized embedding is then used without
        reading ``subword_ids`` back (a host sync).
        """
        if token_id is None and subword_ids.shape == (1, 1):
            token_id = subword_ids.item()
        if token_id is not None:
            text = self._with_uncond(self.embed_subword.token(token_id))
        else:
            text = self._text(subword_ids, mx.ones(subword_ids.shape, dtype=mx.bool_))
        step = self.gemma_step()
        if step.ready(prev_codes, cache):
            return step(cache, prev_codes, text)
        return self._run_backbone(self.embed_code(self.embed_codes(prev_codes)), text, cache)

    def backbone_step_batch(
        self,
        previous: mx.array,
        text: mx.array,
        caches: Sequence[Cache],
        text_ids: Sequence[int],
    ) -> mx.array:
        """:meth:`backbone_step` for ``B`` sessions at any positions: hidden [2B, 1, dims].

        Rows ``b`` and ``B + b`` (``ear_tts_batch.session_rows``) are
        bit-identical to ``backbone_step(previous[b:b+1], text[b:b+1],
        caches[b], text_ids[b])``, and ``caches[b]`` ends as that call leaves it.
        """
        return ear_tts_batch.backbone_step_batch(self, previous, text, caches, text_ids)

    def gemma_step(self) -> GemmaStep:
        """The compiled one-position backbone step (built on first use)."""
        if self._backbone_step is None:
            self._backbone_step = GemmaStep(self.backbone, self._step_inputs)
        return self._backbone_step

    def _step_inputs(self, prev_codes: mx.array, text: mx.array) -> mx.array:
        """Fused backbone input of one step (the part of ``_run_backbone`` before the stack)."""
        return self._fuse(self.embed_code(self.embed_codes(prev_codes)), text)
