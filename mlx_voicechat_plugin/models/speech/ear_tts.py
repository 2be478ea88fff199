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

A frame is :meth:`EarTTS.backbone_step` then :meth:`EarTTS.generate_codes`
over ``B`` independent sessions (one session is ``B = 1``). Exactness
contract: row by row, every output is bit-identical to that session run
alone, and every session's state (its backbone caches, its key stream) ends
exactly where its own frame leaves it, so sessions may join and leave the
batch between frames. This holds because

- every fixed-shape op (linears, norms, MLPs, embeddings, the MoG networks,
  the RVQ distances) runs once over all rows, and those ops are row-wise
  exact on MLX's CPU backend (a row's result does not depend on the other
  rows of the batch);
- the attention core (cache update and SDPA) runs per session, on that
  session's own cache objects at its own offset; caches are never padded to
  a common length (padding would change the reduction order);
- RoPE takes one offset per row;
- each random draw is taken per session from its own key, in the shape and
  order of the session alone (:func:`~.mog_head.draw`).

``tests/test_batched_tts.py`` checks the contract bit for bit. On other
backends a batched matmul may tile differently than a one-row one; run the
tests there before relying on it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.cache import KVCache, RotatingKVCache
from mlx_vlm.models.gemma3.language import Gemma3Model, TextConfig as GemmaConfig

from ...config import TTSConfig
from ..kv_arena import ArenaAttention, KVArena
from .layers import GatedFusion
from .mog_head import KeyRows, KeyStream, MoGHead, draw, next_key, take_keys
from .rvq import CodebookTables, rvq_assign, rvq_block, unmasking_schedule
from .gemma_step import GemmaStep
from .subword import CharAwareSubwordEncoder


Cache = list[Any]


GUIDED_ROWS = 2  # [cond; uncond] rows per session


_BACKBONE_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "query_pre_attn_scalar",
    "sliding_window", "sliding_window_pattern", "rope_global_base_freq", "rope_local_base_freq",
)


def sliding_windows(config: TTSConfig) -> list[int | None]:
    """Each backbone layer's own attention window in positions (``None``: a global layer)."""
    return [None if (i + 1) % config.sliding_window_pattern == 0 else config.sliding_window
            for i in range(config.num_hidden_layers)]


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
        # vocab_size: Gemma3Model insists on one; its embedding is removed.
        backbone = GemmaConfig(model_type="gemma3_text", vocab_size=1,
                               **{name: getattr(config, name) for name in _BACKBONE_FIELDS})
        self.backbone = Gemma3Model(backbone, scale_inputs_embeds=False)
        del self.backbone.embed_tokens  # inputs are always fused embeddings
        self.bos_emb = mx.zeros((dims,))
        self.null_emb = mx.zeros((dims,))
        self.embed_code = nn.Linear(latent, dims, bias=False)
        self.embed_subword = CharAwareSubwordEncoder(config.character_encoder, dims)
        self.gated_fusion_audio_text = GatedFusion(dims, config.num_quantizers, config.rms_norm_eps)
        self.audio_prompt_projection_W = mx.zeros((dims, dims))
        self.mog_head = MoGHead(dims, latent, config.mog_head)
        self.rvq_embs = mx.zeros((config.num_quantizers, config.codebook_size, latent))
        # Each codebook's first row in the flattened [Q * C, latent] table: a constant
        # (made once, not an arange every depth pass; private, so not a weight).
        self._code_offsets = mx.arange(config.num_quantizers, dtype=mx.int32) * config.codebook_size
        mx.eval(self._code_offsets)
        # Codebooks decided per depth pass.
        self._schedule = unmasking_schedule(
            config.num_quantizers, config.num_iterations, config.exponent
        )
        self._compiled_depth: Any = None
        self._codebooks: CodebookTables | None = None
        # Whether the codebook tables get float32 copies (the memory plan's choice:
        # ``Model.prepare`` sets it).
        self.hold_f32 = True
        self._masked: dict[tuple, mx.array] = {}  # (B, T) -> all-mask codes, see _masked_codes
        self._backbone_step: GemmaStep | None = None
        self.arena_attention = ArenaAttention()  # a setting: batched or per-row cores

    def set_vocabulary(self, vocabulary: Mapping[str, int]) -> None:
        self.embed_subword.set_vocabulary(vocabulary)

    def make_cache(self) -> Cache:
        """Rotating caches on sliding-window layers, full caches on global ones (the warm-up's;
        a bounded context continues them as rings, :func:`~.context.bound_all`)."""
        return [
            KVCache() if s is None else RotatingKVCache(max_size=s, keep=0)
            for s in sliding_windows(self.config)
        ]

    def embed_codes(self, codes: mx.array, flat: mx.array | None = None) -> mx.array:
        """Codes [B, T, Q] -> summed codebook latents [B, T, latent], float32.

        One gather over the flattened codebooks (``flat``: them already flattened,
        :class:`CodebookTables`' view); ``mask_code`` (or any id past the codebook)
        contributes zero.
        """
        q, size, latent = self.rvq_embs.shape  # the config's (strict loading checks shapes)
        valid = codes < size
        index = mx.where(valid, codes, 0).astype(mx.int32) + self._code_offsets
        rows = (self.rvq_embs.reshape(q * size, latent) if flat is None else flat)[index]
        rows = mx.where(valid[..., None], rows, 0)
        return rows.astype(mx.float32).sum(axis=-2)

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
    ) -> tuple[mx.array, Cache]:
        """Prefill with the speaker prompt; returns hidden ``[2B, T, dims]`` and a new cache.

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
        prompt = (audio @ self.audio_prompt_projection_W if prompt_latent is None
                  else prompt_latent.astype(audio.dtype))
        audio = mx.where(before_start[..., None], prompt, audio)
        audio = audio + starts[..., None] * self.bos_emb
        cache = self.make_cache()
        text = self._with_uncond(self.embed_subword(subword_ids, subword_mask))
        return self._run_backbone(audio, text, cache), cache

    def generate_codes(self, hidden: mx.array, rngs: Sequence[KeyStream] | Any = None,
                       top_p: Sequence[float | None] | None = None) -> mx.array:
        """Depth loop of ``B`` sessions: guided hidden ``[2B, T, dims]`` -> codes ``[B, T, Q]`` int32.

        ``hidden`` is laid out ``[cond_0 .. cond_{B-1}; uncond_0 .. uncond_{B-1}]``
        (:meth:`backbone_step`'s layout). With one key stream per session the
        fixed-shape loop runs as one compiled graph: each stream's two keys per
        deciding depth pass are taken up front, in the order the loop consumes
        them (per pass: component sample, then noise), and row ``b``
        draws from ``rngs[b]``'s keys only, so its codes and its stream end as
        that session run alone leaves them. ``rngs`` may instead be a batch's
        stacked keys (not a list: ``len`` rows, ``take(n)`` giving ``[B, n, 2]``).
        Without key streams the draws come from MLX's global random state, in the
        same order.

        ``top_p``: each session's nucleus (``None``, or a row's ``None``: the
        config's ``top_p``), an input of the compiled loop, so a row's codes
        are the same beside rows of any other nucleus. Without key streams
        every row takes the config's.
        """
        if rngs is None:
            return self._depth_loop(hidden, None)
        if not rngs or hidden.shape[0] != GUIDED_ROWS * len(rngs):
            raise ValueError(
                f"generate_codes: hidden has {hidden.shape[0]} rows, "
                f"expected {GUIDED_ROWS} per session for {len(rngs)} key streams"
            )
        count = 2 * sum(1 for decided in self._schedule if decided)  # passes that decide
        if not isinstance(rngs, (list, tuple)):
            keys = rngs.take(count)  # a batch's stacked keys: one computation
        elif len(rngs) == 1:
            keys = take_keys(rngs[0], count)[None]
        else:
            keys = mx.stack([take_keys(rng, count) for rng in rngs])
        if self._compiled_depth is None:
            # The module state is an input, so later weight updates are seen.
            self._compiled_depth = mx.compile(self._compiled_loop, inputs=self.state)
        masked = self._masked_codes(hidden.shape[0] // GUIDED_ROWS, hidden.shape[1])
        default = self.config.top_p
        nucleus = mx.array([default if p is None else p
                            for p in (top_p or [None] * len(rngs))], dtype=mx.float32)
        if nucleus.shape[0] != len(rngs):
            raise ValueError(f"generate_codes: {nucleus.shape[0]} top_p values for {len(rngs)} sessions")
        return self._compiled_depth(hidden, keys, masked, nucleus,
                                    *self._codebook_tables().arrays())

    def _compiled_loop(self, hidden: mx.array, keys: mx.array, masked: mx.array,
                       top_p: mx.array, *books: Any) -> mx.array:
        return self._depth_loop(hidden, KeyRows(keys), books, masked, top_p)

    def _masked_codes(self, batch: int, length: int) -> mx.array:
        """``[batch, length, Q]`` int32 codes all ``mask_code``: where the depth loop
        starts, made once per shape (an input of the compiled loop, not a fill
        every frame)."""
        if (batch, length) not in self._masked:
            # Lazy: the first frame that reads it fills it, within its own evaluation
            # (no host sync of its own); later frames read the filled array.
            self._masked[(batch, length)] = mx.full(
                (batch, length, self.config.num_quantizers), self.config.mask_code, mx.int32)
        return self._masked[(batch, length)]

    def _codebook_tables(self) -> CodebookTables:
        # Built once (``prepare``, at load) and again after ``update``; not
        # keyed by array identity: the compiled depth loop takes the module
        # state as input and hands back new array objects after its trace.
        if self._codebooks is None:
            self._codebooks = CodebookTables(self.rvq_embs, self.hold_f32)
        return self._codebooks

    def prepare(self) -> None:
        """One-time tables derived from the loaded weights (``load`` calls it), and the
        compiled backbone step, whose RoPE forms are probed on the device when it is
        made (here, not inside a session's first speaking frame)."""
        self._codebooks = CodebookTables(self.rvq_embs, self.hold_f32)
        self.gemma_step()

    def forget_derived(self) -> None:
        """Drop what was computed from the weights (they are being replaced)."""
        self._codebooks = None

    def update(self, parameters: dict, strict: bool = True) -> "EarTTS":
        self.forget_derived()
        return super().update(parameters, strict=strict)

    def _depth_loop(
        self,
        hidden: mx.array,
        rng: KeyStream | None,
        codebooks: tuple[Any, ...] | None = None,
        codes: mx.array | None = None,
        top_p: mx.array | None = None,
    ) -> mx.array:
        config = self.config
        half = hidden.shape[0] // 2
        # [cond; uncond] as two halves: each pass adds the same code embedding to
        # both with one broadcast add (the adds ``embedded + cond`` and
        # ``embedded + uncond``, without a concatenation).
        guided = hidden.reshape(2, half, *hidden.shape[1:])
        if codes is None:  # all undecided
            codes = self._masked_codes(half, hidden.shape[1])
        done = 0
        for count in self._schedule:
            if count == 0:
                continue
            flat = None if codebooks is None else codebooks[-1]
            embedded = self.embed_code(self.embed_codes(codes, flat))
            mu, logs = self.mog_head(
                (embedded + guided).reshape(hidden.shape),
                guidance_scale=config.guidance_scale,
                top_p=config.top_p if top_p is None else top_p,
                key=next_key(rng),
            )
            noise = draw(mx.random.normal, mu.shape, next_key(rng))
            latent = mu + mx.exp(logs) * noise * config.noise_scale
            rows = latent.reshape(-1, latent.shape[-1])  # 2-D matmuls, no reshapes
            if codebooks is None:
                picked = mx.stack(rvq_assign(rows, self.rvq_embs[done : done + count]), axis=-1)
            else:
                tables, norms, transposed = CodebookTables.pick(codebooks, rows.dtype)
                span = slice(done, done + count)
                one_product = rows.dtype == mx.float32 and self._codebook_tables().one_product
                picked = rvq_block(rows, tables[span], norms[span], transposed[span],
                                   one_product=one_product)
            block = picked.astype(mx.int32).reshape(*latent.shape[:-1], count)
            codes = mx.concatenate(
                [codes[..., :done], block, codes[..., done + count :]], axis=-1
            )
            done += count
        return codes

    def backbone_step(
        self,
        previous: mx.array,
        text: mx.array,
        caches: Sequence[Cache],
        text_ids: Sequence[int] | None = None,
        arenas: Sequence[KVArena] | None = None,
    ) -> mx.array:
        """One backbone position of ``B`` sessions at any positions: ``[cond; uncond]``
        hidden ``[2B, 1, dims]`` (session ``b`` owns rows ``b`` and ``B + b``).

        ``previous`` ``[B, 1, Q]`` (each session's previous codes), ``text``
        ``[B, 1]`` (its current text token), ``caches[b]`` session ``b``'s
        backbone caches, which it reads at its own offset and advances.
        ``text_ids``: the same tokens as host integers when the caller already
        has them; the memoized subword embeddings are then used without
        reading ``text`` back (a host sync). Sessions on the compiled path
        (:class:`GemmaStep`, every one :meth:`~GemmaStep.ready`) run as one
        batch; otherwise each runs alone through the plain backbone, laid out
        the same. Every session's rows equal that session run alone.
        ``arenas``: the sessions' rings as their batch stacked them, one per layer
        (every session one position; ``caches`` then hold no arrays).
        """
        sessions = len(caches)
        if sessions == 0:
            raise ValueError("backbone_step: caches is empty (need one per session)")
        if previous.ndim != 3 or previous.shape[:2] != (sessions, 1):
            raise ValueError(
                f"backbone_step: previous must be [{sessions}, 1, Q], got {list(previous.shape)}"
            )
        if text.shape != (sessions, 1):
            raise ValueError(f"backbone_step: text must be [{sessions}, 1], got {list(text.shape)}")
        if text_ids is None:
            text_ids = text[:, 0].tolist()
        if len(text_ids) != sessions:
            raise ValueError(
                f"backbone_step: text_ids has {len(text_ids)} ids for {sessions} sessions"
            )
        cond = [self.embed_subword.token(int(i)) for i in text_ids]
        step = self.gemma_step()
        if arenas is not None or all(step.ready(previous, cache) for cache in caches):
            layers = arenas if arenas is not None else [list(c) for c in zip(*caches)]
            return step(layers, GUIDED_ROWS, previous, self._with_uncond(mx.concatenate(cond)))
        # Off the compiled path (the stack would need a mask): each session
        # alone through the plain backbone, interleaved as the batch.
        rows = [
            self._run_backbone(self.embed_code(self.embed_codes(previous[b : b + 1])),
                               self._with_uncond(cond[b]), caches[b])[:, None]
            for b in range(sessions)
        ]
        joined = mx.concatenate(rows, axis=1)  # [2, B, 1, dims]
        return joined.reshape(-1, *joined.shape[2:])

    def gemma_step(self) -> GemmaStep:
        """The compiled one-position backbone step (built on first use)."""
        if self._backbone_step is None:
            self._backbone_step = GemmaStep(self.backbone, self._step_inputs, self.arena_attention)
        return self._backbone_step

    def _step_inputs(self, prev_codes: mx.array, text: mx.array) -> mx.array:
        """Fused backbone input of one step (the part of ``_run_backbone`` before the stack)."""
        return self._fuse(self.embed_code(self.embed_codes(prev_codes)), text)
