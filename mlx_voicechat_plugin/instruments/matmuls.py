"""Counting matrix products by shape: which ones a CUDA GPU would run through cuBLASLt.

On MLX's CUDA backend (0.32, ``backend/cuda/matmul.cpp``) a float product
whose left operand has one row (or whose right operand has one column) is a
gemv kernel node; one with more rows goes through cuBLASLt, which rebuilds its
descriptors and runs a heuristic query on every call, a host cost a kernel
count does not show. Quantized products run ``qmv`` only at one row
(``qmm`` past it). :class:`MatmulShapes` records, on the CPU, every product
issued from Python while it is active, with the row count the backend sees:

- ``b`` of at most two dimensions: MLX folds ``a``'s leading dimensions into
  the rows (``ops.cpp`` flattens ``a``), so ``rows = prod(a.shape[:-1])``:
  ``(2, 1, K) @ (K, N)`` has two rows;
- a batched ``b``: ``rows = a.shape[-2]`` per batch entry:
  ``(H, 1, D) @ (H, D, W)`` has one;
- quantized products: ``rows = prod(x.shape[:-1])`` (on Hopper ``qmv`` needs
  one row and one batch entry); the gathers: ``a.shape[-2]``.

A float product is *wide* when ``rows > 1`` and ``N > 1`` (no gemv form);
a quantized one when ``rows > 1``. ``addmm`` is counted apart as well: in the
CUDA source read for issue 44 a product with a bias epilogue skips the gemv
path at any row count (the count says how many there are, not that they are
slow). Gemv also needs ``K % 32 == 0`` and a matching transpose there; those
are layout details this shape count leaves out.

Every product is labelled by its nearest caller in this package, mlx_vlm or
mlx_audio (``module:function``), a leaf layer's own method and the shared
helpers and blocks (:data:`PASS_THROUGH`) passed over (the label names the model part that called
the linear layer). Entry points patched while active:
``mx.matmul``, ``mx.addmm``, ``mx.array.__matmul__`` (and ``__rmatmul__``/
``__imatmul__`` where MLX has them), ``mx.quantized_matmul``,
``mx.gather_mm``, ``mx.gather_qmm``. Only calls from the thread that entered
count; nothing is patched outside the block. A call into an ``mx.compile``'d
function replays its trace without Python, so its products are not seen:
count with compile off (:func:`~.compile_policy.suspended`), as
``bench.kernels`` does. ``mx.fast`` kernels (attention, norms) are not
products here.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from .eval_patch import install, patched_by

logger = logging.getLogger(__name__)

CALLER_PACKAGES = ("mlx_voicechat_plugin", "mlx_vlm", "mlx_audio")
# Shared helpers and blocks products pass through: a label names what called them.
PASS_THROUGH = ("mlx_voicechat_plugin.models.fused", "mlx_voicechat_plugin.models.weight_layout",
                "mlx_voicechat_plugin.models.speech.layers")

_lock = threading.Lock()  # one instrument at a time checks and patches


@dataclass(frozen=True)
class Product:
    """One matrix product as the CUDA backend would see it."""

    op: str  # the entry point: matmul, addmm, __matmul__, quantized_matmul, ...
    kind: str  # "float" or "quantized"
    dtype: str
    rows: int
    columns: int  # N, the output's last dimension
    caller: str

    @property
    def wide(self) -> bool:
        """No one-row kernel form: a float product with rows > 1 and N > 1, or a
        quantized one with rows > 1."""
        if self.kind == "quantized":
            return self.rows > 1
        return self.rows > 1 and self.columns > 1


def float_rows(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> int:
    """The rows (M) of ``a @ b`` as MLX's backend sees them (leading dims folded
    into M when ``b`` is a matrix, one batch entry's rows when it is batched)."""
    if len(a_shape) < 2:
        return 1
    if len(b_shape) <= 2:
        return math.prod(a_shape[:-1])
    return a_shape[-2]


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(getattr(value, "shape", ()))


def _dtype(value: Any) -> str:
    return str(getattr(value, "dtype", "?")).rpartition(".")[2]


def _columns(out: Any) -> int:
    shape = _shape(out)
    return shape[-1] if len(shape) >= 2 else 1


def _float_product(a: Any, b: Any, out: Any) -> tuple[int, int]:
    columns = _shape(b)[-1] if len(_shape(b)) >= 2 else 1
    return float_rows(_shape(a), _shape(b)), columns


def _quantized_product(x: Any, out: Any) -> tuple[int, int]:
    shape = _shape(x)
    return (math.prod(shape[:-1]) if len(shape) >= 2 else 1), _columns(out)


def _gather_product(a: Any, out: Any) -> tuple[int, int]:
    shape = _shape(a)
    return (shape[-2] if len(shape) >= 2 else 1), _columns(out)


# entry point -> (owner, kind, how its rows and columns are read from (args, out))
_ENTRY_POINTS: dict[str, tuple[Any, str, Callable[[tuple, Any], tuple[int, int]]]] = {
    "matmul": (mx, "float", lambda args, out: _float_product(args[0], args[1], out)),
    "addmm": (mx, "float", lambda args, out: _float_product(args[1], args[2], out)),
    "__matmul__": (mx.array, "float", lambda args, out: _float_product(args[0], args[1], out)),
    "__rmatmul__": (mx.array, "float", lambda args, out: _float_product(args[1], args[0], out)),
    "__imatmul__": (mx.array, "float", lambda args, out: _float_product(args[0], args[1], out)),
    "quantized_matmul": (mx, "quantized", lambda args, out: _quantized_product(args[0], out)),
    "gather_mm": (mx, "float", lambda args, out: _gather_product(args[0], out)),
    "gather_qmm": (mx, "quantized", lambda args, out: _gather_product(args[0], out)),
}


def _in_leaf_layer(frame: Any) -> bool:
    """Whether ``frame`` is a method of a layer holding no sub-layers (a linear
    layer, a pointwise conv): its caller says which part of the model it is."""
    owner = frame.f_locals.get("self") if frame.f_code.co_argcount else None
    return isinstance(owner, nn.Module) and not owner.children()


def caller_label(skip: str = __name__) -> str:
    """``module:function`` of the nearest frame in :data:`CALLER_PACKAGES` (not
    ``skip``), passing over methods of leaf layers and the :data:`PASS_THROUGH`
    helpers (``HeldLinear.__call__`` is every product's; what called it is the
    model part)."""
    frame = inspect.currentframe()
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != skip and module.startswith(CALLER_PACKAGES) \
                and module not in PASS_THROUGH and not _in_leaf_layer(frame):
            code = frame.f_code
            return f"{module}:{getattr(code, 'co_qualname', code.co_name)}"
        frame = frame.f_back
    return "other"


class MatmulShapes:
    """Context manager: records every matrix product this thread issues, by shape.

    ``products`` lists them (:class:`Product`) until :meth:`reset`;
    :meth:`summary` counts them.
    """

    def __init__(self) -> None:
        self.products: list[Product] = []
        self._thread = 0
        self._saved: dict[tuple[Any, str], Callable] = {}

    def __enter__(self) -> "MatmulShapes":
        with _lock:
            if patched_by(mx.matmul, MatmulShapes):
                raise RuntimeError("a MatmulShapes is already active")
            self._thread = threading.get_ident()
            for name, (owner, kind, shape_of) in _ENTRY_POINTS.items():
                original = getattr(owner, name, None)
                if original is None:
                    continue
                self._saved[(owner, name)] = install(
                    owner, name, self._wrap(name, kind, shape_of, original), self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)
        self._saved.clear()

    def reset(self) -> None:
        self.products = []

    # --- counts ---------------------------------------------------------------

    @property
    def wide_float(self) -> list[Product]:
        return [p for p in self.products if p.kind == "float" and p.wide]

    @property
    def wide_quantized(self) -> list[Product]:
        return [p for p in self.products if p.kind == "quantized" and p.wide]

    def wide_callers(self) -> Counter:
        """The wide float products by caller label."""
        return Counter(p.caller for p in self.wide_float)

    def summary(self, top: int = 10) -> dict[str, Any]:
        """Counts so far, as plain values (``wide_callers``: the ``top`` callers)."""
        floats = [p for p in self.products if p.kind == "float"]
        return {"products": len(self.products), "float": len(floats),
                "quantized": len(self.products) - len(floats),
                "wide_float": len(self.wide_float), "wide_quantized": len(self.wide_quantized),
                "addmm": sum(p.op == "addmm" for p in floats),
                "wide_rows": dict(sorted(Counter(p.rows for p in self.wide_float).items())),
                "wide_callers": dict(self.wide_callers().most_common(top))}

    # --- recording ------------------------------------------------------------

    def _wrap(self, name: str, kind: str, shape_of: Callable[[tuple, Any], tuple[int, int]],
              original: Callable) -> Callable:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if threading.get_ident() == self._thread and isinstance(out, mx.array):
                rows, columns = shape_of(args, out)
                self.products.append(Product(name, kind, _dtype(out), rows, columns,
                                             caller_label()))
            return out

        return recorded
