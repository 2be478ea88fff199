"""The RNNT prediction network's one-step LSTM, and what its tries derive from the weights.

:func:`lstm_step` is one time step of a stacked ``nn.LSTM`` with the layer's
own operations, order and rounding, without its per-call reshapes. Two things
are made once per set of weights and shared by every session of a decoder
(outside the module tree): float32 transposed copies of bf16 weights for the
products that run in float32 (:func:`held_lstm`), and the first layer's
input part of every symbol's embedding, a table a try gathers from instead of
embedding and multiplying (:func:`symbol_inputs`, used where a probe finds its
rows' bits); :func:`shared_derived` keeps both.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.stt.models.nemotron_asr.rnnt import PredictNetwork

from ..remembered import ProbeVerdicts
from ..weight_layout import RowMajorLSTM, layouts_agree, row_major


# Per LSTM layer: ``Wx`` and ``Wh`` in float32, stored transposed (``weight_layout``).
Held = list[tuple[mx.array, mx.array]]


def held_lstm(lstm: list[nn.LSTM]) -> Held | None:
    """Float32, transposed copies of each layer's weights, for the products that run in
    float32 (a bf16 layer meeting the float32 state); ``None`` where the layout would
    change their bits (:func:`~.weight_layout.layouts_agree`)."""
    if not layouts_agree(mx.float32):
        return None
    held = [(row_major(layer.Wx.astype(mx.float32)), row_major(layer.Wh.astype(mx.float32)))
            for layer in lstm]
    mx.eval(held)
    return held


# The attribute of a decoder that holds what its tries derive from its weights: the
# memo lives and dies with the decoder (outside its module tree: not a parameter).
_DERIVED = "_voicechat_derived"


class Derived:
    """What a decoder's greedy tries derive from its weights: ``held``, :func:`held_lstm` of
    its LSTM (``None`` with ``hold_f32`` ``False``: the memory plan holds no float32
    copies), and ``inputs``, its :func:`symbol_inputs` (probed, or the probe's verdict read
    from ``verdicts``); with the weight arrays they were made of."""

    def __init__(self, decoder: PredictNetwork, sources: list[mx.array], hold_f32: bool,
                 verdicts: ProbeVerdicts):
        self.sources, self.hold_f32 = sources, hold_f32
        self.held = held_lstm(decoder.prediction["dec_rnn"].lstm) if hold_f32 else None
        self.inputs = symbol_inputs(decoder, self.held, verdicts)


def shared_derived(decoder: PredictNetwork, verdicts: ProbeVerdicts,
                   hold_f32: bool = True) -> Derived:
    """``decoder``'s :class:`Derived`, made once per set of weights (again when any weight
    it reads, or ``hold_f32``, changed) and kept while the decoder lives, so sessions
    share one copy."""
    lstm = decoder.prediction["dec_rnn"].lstm
    sources = [w for layer in lstm for w in (layer.Wx, layer.Wh, layer.bias)]
    sources.append(decoder.prediction["embed"].weight)
    cached = getattr(decoder, _DERIVED, None)
    if cached is None or cached.hold_f32 != hold_f32 or any(
            a is not b for a, b in zip(cached.sources, sources)):
        cached = Derived(decoder, sources, hold_f32, verdicts)
        setattr(decoder, _DERIVED, cached)
    return cached


def _affine(c: mx.array | None, x: mx.array, w: mx.array, w32: mx.array | None) -> mx.array:
    """``mx.addmm(c, x, w.T)`` (``x @ w.T`` without ``c``), rounded as that op rounds.

    When the op runs in float32 (any operand is) and ``w32`` is given, the product
    takes ``w32`` and ``c`` is added after it, which is what float32 ``addmm`` on
    the stored layout does (``weight_layout``); otherwise the op itself runs.
    """
    if w32 is not None and mx.float32 in (x.dtype, w.dtype, None if c is None else c.dtype):
        y = x @ w32.T
        return y if c is None else y + c
    return x @ w.T if c is None else mx.addmm(c, x, w.T)


def _held(w32: mx.array | None, *operands: mx.array) -> bool:
    """Whether :func:`_affine` takes the held float32 product for these operands."""
    return w32 is not None and mx.float32 in [o.dtype for o in operands]


def lstm_step(lstm: list[nn.LSTM], x: mx.array, h: list[mx.array], c: list[mx.array],
              held: Held | None = None, projected: mx.array | None = None):
    """One time step of a stacked ``nn.LSTM``: ``x`` [B, in] -> (top output, h, c).

    The same operations, in the same order and rounding, as the layer's own
    ``__call__`` (``nn.LSTM``, or :class:`~.weight_layout.RowMajorLSTM`) on a
    one-step sequence, without its per-call reshapes and stacking; ``held``
    (:func:`held_lstm`) serves the float32 products without converting the
    weights every call. ``projected``: the first layer's input part
    (:func:`input_part` of ``x``) when the caller has it already (``x`` is then
    not read).
    """
    new_h, new_c = [], []
    for index, (layer, hidden, cell) in enumerate(zip(lstm, h, c)):
        wx32, wh32 = _weights32(layer, held, index)
        first = projected if index == 0 and projected is not None else \
            input_part(layer, x, wx32)
        # Then _affine(first, hidden, Wh). Where that takes the held float32
        # product, its add goes gate by gate into the gates' fused kernel
        # (``hw + first``, each element as _affine adds it), and so does the
        # input part's when it was held too, instead of whole-vector adds.
        parts = first if isinstance(first, list) else mx.split(first, 4, axis=-1)
        if _held(wh32, hidden, layer.Wh, parts[0]):
            hw = mx.split(hidden @ wh32.T, 4, axis=-1)
            i, f, g, o = (hw[k] + parts[k] for k in range(4))
        else:  # (gate parts are float32 and held with wh32: they take the branch above)
            i, f, g, o = mx.split(_affine(first, hidden, layer.Wh, wh32), 4, axis=-1)
        i, f, g, o = mx.sigmoid(i), mx.sigmoid(f), mx.tanh(g), mx.sigmoid(o)
        cell = f * cell + i * g
        hidden = o * mx.tanh(cell)
        new_h.append(hidden)
        new_c.append(cell)
        x = hidden
    return x, new_h, new_c


def _weights32(layer: nn.LSTM, held: Held | None, index: int) -> tuple[Any, Any]:
    if held is not None:
        return held[index]
    # A RowMajorLSTM's float32 weights are already transposed.
    return (layer.Wx, layer.Wh) if isinstance(layer, RowMajorLSTM) else (None, None)


def input_part(layer: nn.LSTM, x: mx.array, wx32: mx.array | None) -> mx.array | list[mx.array]:
    """``_affine(bias, x, Wx)``, the part of a layer's gates that reads its input: one
    array, or, where it takes the held float32 product, its four gates' parts (the
    adds then fuse into the gates' kernel)."""
    if _held(wx32, x, layer.Wx, layer.bias):
        xw = mx.split(x @ wx32.T, 4, axis=-1)
        bias = mx.split(layer.bias, 4, axis=-1)
        return [xw[k] + bias[k] for k in range(4)]
    return _affine(layer.bias, x, layer.Wx, wx32)


def symbol_inputs(decoder: PredictNetwork, held: Held | None, verdicts: ProbeVerdicts,
                  rows: tuple[int, ...] = (1, 2, 8, 32)) -> mx.array | None:
    """The first LSTM layer's input part of every symbol's embedding, ``[V, 4H]``: a try
    gathers its row instead of embedding the symbol and multiplying it. ``None``
    where a table row would not be the bits the product gives for that symbol in
    a batch of ``rows`` (probed for every symbol: one product per batch, 4.4 s of a
    full-size session's start on a CPU). Like the fused-projection probe's, the
    verdict depends on the device's kernels for these shapes and dtypes, not on
    the values: ``verdicts`` (:class:`~.remembered.ProbeVerdicts`) remembers it."""
    embed, lstm = decoder.prediction["embed"], decoder.prediction["dec_rnn"].lstm
    layer, (wx32, _) = lstm[0], _weights32(lstm[0], held, 0)

    def part(ids: mx.array) -> mx.array:
        first = input_part(layer, embed(ids), wx32)
        return mx.concatenate(first, axis=-1) if isinstance(first, list) else first

    symbols = embed.weight.shape[0]
    table = part(mx.arange(symbols))
    mx.eval(table)
    key = "|".join(str(p) for p in (
        "symbol-inputs", rows, embed.weight.dtype, tuple(embed.weight.shape), type(layer).__name__,
        layer.Wx.dtype, tuple(layer.Wx.shape), None if layer.bias is None else layer.bias.dtype,
        None if wx32 is None else (wx32.dtype, tuple(wx32.shape))))
    verdict = verdicts.verdict(key, lambda: _rows_agree(part, table, symbols, rows))
    verdicts.save()  # writes only when a verdict is new
    return table if verdict else None


def _rows_agree(part: Callable[[mx.array], mx.array], table: mx.array, symbols: int,
                rows: tuple[int, ...]) -> bool:
    for count in rows:
        batches = [mx.arange(s, min(s + count, symbols)) for s in range(0, symbols, count)]
        if not mx.array_equal(mx.concatenate([part(ids) for ids in batches]), table).item():
            return False
    return True
