"""Character-aware subword encoder: the text conditioning of EAR-TTS.

Every subword token is spelled out in characters, run through a one-layer
T5Gemma encoder, mean-pooled over its characters and projected to the TTS
width. Two lookup tables then add "is continuation" and BOS/EOS flag
embeddings keyed by the subword id. The character vocabulary is derived from
the LLM tokenizer (:meth:`CharAwareSubwordEncoder.set_vocabulary`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping

import mlx.core as mx
import mlx.nn as nn

from ...config import CharacterEncoderConfig
from .layers import GatedMLP, OffsetRMSNorm

# Additive score of masked keys (finite, so fully masked rows stay finite).
_MASKED_SCORE = -1e30
# Single-token embeddings kept by ``CharAwareSubwordEncoder.token`` (least
# recently used first out); 4096 x 4 KiB at the released width.
TOKEN_MEMO_SIZE = 4096


class CharSelfAttention(nn.Module):
    """Bidirectional attention with RoPE, tanh logit soft-capping and a key mask."""

    def __init__(self, config: CharacterEncoderConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.query_pre_attn_scalar**-0.5
        self.softcap = config.attn_logit_softcapping
        dims, width = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(dims, self.n_heads * width, bias=False)
        self.k_proj = nn.Linear(dims, self.n_kv_heads * width, bias=False)
        self.v_proj = nn.Linear(dims, self.n_kv_heads * width, bias=False)
        self.o_proj = nn.Linear(self.n_heads * width, dims, bias=False)
        self.rope = nn.RoPE(width, traditional=False, base=config.rope_base)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        b, length, _ = x.shape
        return x.reshape(b, length, n, self.head_dim).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, key_mask: mx.array | None) -> mx.array:
        b, length, _ = x.shape
        q = self.rope(self._heads(self.q_proj(x), self.n_heads))
        k = self.rope(self._heads(self.k_proj(x), self.n_kv_heads))
        v = self._heads(self.v_proj(x), self.n_kv_heads)
        groups = self.n_heads // self.n_kv_heads
        if groups > 1:
            k = mx.repeat(k, groups, axis=1)
            v = mx.repeat(v, groups, axis=1)
        scores = (q @ k.swapaxes(-1, -2)) * self.scale
        scores = self.softcap * mx.tanh(scores / self.softcap)
        if key_mask is not None:
            scores = mx.where(key_mask[:, None, None, :], scores, _MASKED_SCORE)
        weights = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)
        out = (weights @ v).transpose(0, 2, 1, 3).reshape(b, length, -1)
        return self.o_proj(out)


class CharEncoderLayer(nn.Module):
    """Gemma-2 style sandwich-normed attention + MLP block."""

    def __init__(self, config: CharacterEncoderConfig):
        super().__init__()
        dims, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = CharSelfAttention(config)
        self.pre_self_attn_layernorm = OffsetRMSNorm(dims, eps)
        self.post_self_attn_layernorm = OffsetRMSNorm(dims, eps)
        self.mlp = GatedMLP(dims, config.intermediate_size)
        self.pre_feedforward_layernorm = OffsetRMSNorm(dims, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(dims, eps)

    def __call__(self, x: mx.array, key_mask: mx.array | None) -> mx.array:
        h = self.self_attn(self.pre_self_attn_layernorm(x), key_mask)
        x = x + self.post_self_attn_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class CharEncoder(nn.Module):
    """T5Gemma encoder stack; scales its input embeddings by ``sqrt(hidden)``."""

    def __init__(self, config: CharacterEncoderConfig):
        super().__init__()
        self.layers = [CharEncoderLayer(config) for _ in range(config.num_hidden_layers)]
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = config.hidden_size**0.5

    def __call__(self, embeds: mx.array, key_mask: mx.array | None) -> mx.array:
        x = embeds * mx.array(self.embed_scale, dtype=embeds.dtype)
        for layer in self.layers:
            x = layer(x, key_mask)
        return self.norm(x)


class SubwordFlagEmbedding(nn.Module):
    """Adds ``cont_emb[is_continuation[id]]``; ids past the table use ``pad_tensor``."""

    def __init__(self, vocab_size: int, dims: int):
        super().__init__()
        self.pad_tensor = mx.array(vocab_size, dtype=mx.int32)
        self.is_continuation = mx.zeros((vocab_size + 1,), dtype=mx.int32)
        self.cont_emb = nn.Embedding(2, dims)

    def __call__(self, x: mx.array, ids: mx.array) -> mx.array:
        last = self.is_continuation.shape[0] - 1
        ids = mx.where(ids >= last, self.pad_tensor, ids)
        return x + self.cont_emb(self.is_continuation[ids])


class BOSEOSEmbedding(nn.Module):
    """Adds ``special_emb[special_flags[id]]`` (0 plain, 1/2 BOS/EOS)."""

    def __init__(self, vocab_size: int, dims: int):
        super().__init__()
        # NeMo stores the largest vocabulary id, not the size, as its OOV index.
        self.pad_tensor = mx.array(vocab_size - 1, dtype=mx.int32)
        self.special_flags = mx.zeros((vocab_size,), dtype=mx.int32)
        self.special_emb = nn.Embedding(3, dims)

    def __call__(self, x: mx.array, ids: mx.array) -> mx.array:
        ids = mx.where(ids >= self.special_flags.shape[0], self.pad_tensor, ids)
        return x + self.special_emb(self.special_flags[ids])


class CharAwareSubwordEncoder(nn.Module):
    """Subword ids ``[B, T]`` -> embeddings ``[B, T, out_size]`` (dtype of ``embed_tokens``)."""

    def __init__(self, config: CharacterEncoderConfig, out_size: int):
        super().__init__()
        self.backbone = {"encoder": CharEncoder(config)}  # the checkpoint's path
        self.embed_tokens = nn.Embedding(config.char_vocab_size, config.hidden_size)
        self.proj_embedding = nn.Linear(config.hidden_size, out_size, bias=False)
        self.subword_flag_emb = SubwordFlagEmbedding(config.subword_vocab_size, config.hidden_size)
        self.bos_eos_emb = BOSEOSEmbedding(config.subword_vocab_size, config.hidden_size)
        self.char_pad_id = config.char_vocab_size - 1
        self._spelling: dict[int, tuple[int, ...]] | None = None
        # Least recently used out. A plain attribute, not a dict: a dict would become
        # part of the module's state tree, and compiled functions taking that state as
        # input would retrace whenever a token is added.
        self._memo = lru_cache(maxsize=TOKEN_MEMO_SIZE)(self._embed_token)

    def set_vocabulary(self, vocabulary: Mapping[str, int]) -> None:
        """Spell every token of ``vocabulary`` (``tokenizer.get_vocab()``) in char ids."""
        # Dense char ids: the tokenizer's single-character tokens in token-id order.
        singles = sorted((idx, token) for token, idx in vocabulary.items() if len(token) == 1)
        chars = {token: dense for dense, (_, token) in enumerate(singles)}
        expected = self.embed_tokens.weight.shape[0]
        if len(chars) + 1 != expected:
            raise ValueError(
                f"the tokenizer has {len(chars)} single-character tokens; with padding "
                f"that is {len(chars) + 1} character ids, but the checkpoint has {expected}"
            )
        self._spelling = {
            idx: tuple(chars[c] for c in token if c in chars)
            for token, idx in vocabulary.items()
        }
        self._memo.cache_clear()

    def token(self, token_id: int) -> mx.array:
        """``[1, 1, out_size]`` embedding of one token, memoized.

        The embedding depends on the token alone, so a frame whose text token
        was seen before (pad, most of a conversation) reuses the array the
        same call computed then: identical values, no character encoder run.
        """
        return self._memo(token_id)

    def _embed_token(self, token_id: int) -> mx.array:
        # Spelled from the host integer: no read-back of the id array.
        ids = mx.array([[token_id]], dtype=mx.int32)
        return self._embed(ids, self.spell([[token_id]], [[True]]))

    def spell(
        self, subword_ids: list[list[int]], subword_mask: list[list[bool]]
    ) -> tuple[list[tuple[int, ...]], list[int], list[int]]:
        """Spellings of the masked-in positions (host lists), in row-major order, with
        their (b, t)."""
        if self._spelling is None:
            raise RuntimeError("call set_vocabulary(tokenizer.get_vocab()) before TTS")
        words, rows, cols = [], [], []
        for b, (ids, keep) in enumerate(zip(subword_ids, subword_mask)):
            for t, (token, valid) in enumerate(zip(ids, keep)):
                if valid:
                    words.append(self._spelling.get(int(token), ()))
                    rows.append(b)
                    cols.append(t)
        return words, rows, cols

    def encode_words(self, words: list[tuple[int, ...]]) -> mx.array:
        """Mean-pooled, projected char-encoder states of ``words`` (non-empty batch)."""
        lengths_list = [len(w) for w in words]
        width = max(lengths_list)
        char_ids = mx.array(
            [list(w) + [self.char_pad_id] * (width - len(w)) for w in words], mx.int32
        )
        lengths = mx.array(lengths_list, mx.int32)
        key_mask = mx.arange(width)[None, :] < lengths[:, None]
        hidden = self.backbone["encoder"](self.embed_tokens(char_ids), key_mask)
        pooled = (hidden * key_mask[..., None]).sum(axis=1)
        pooled = pooled / mx.maximum(lengths[:, None], 1)
        return self.proj_embedding(pooled)

    def __call__(self, subword_ids: mx.array, subword_mask: mx.array | None = None) -> mx.array:
        if subword_mask is None:
            subword_mask = mx.ones(subword_ids.shape, dtype=mx.bool_)
        return self._embed(subword_ids, self.spell(subword_ids.tolist(), subword_mask.tolist()))

    def _embed(
        self,
        subword_ids: mx.array,
        spelled: tuple[list[tuple[int, ...]], list[int], list[int]],
    ) -> mx.array:
        out = mx.zeros(
            (*subword_ids.shape, self.proj_embedding.weight.shape[0]),
            dtype=self.embed_tokens.weight.dtype,
        )
        words, rows, cols = spelled
        # Positions without characters (or masked out) keep a zero text embedding.
        if any(words):
            projected = self.encode_words(words)
            out = out.at[mx.array(rows, mx.int32), mx.array(cols, mx.int32)].add(projected)
        out = self.subword_flag_emb(out, subword_ids)
        return self.bos_eos_emb(out, subword_ids)
