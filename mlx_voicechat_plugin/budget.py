"""The memory budget: what the model and its sessions may use, and what the loader does with it.

``load(path, memory_budget=GIB)`` (and ``--memory-budget GIB`` on every
command) names the bytes the weights and the sessions may take; by default the
device's: Metal's recommended working set
(``mx.device_info()["max_recommended_working_set_size"]``, about 10.7 GiB on a
16 GB Mac), a CUDA device's memory, or this machine's RAM on the CPU.

A :class:`MemoryPlan` is made from the loaded (still lazy) model before any
weight is copied:

- ``stored``: the weights as the checkpoint stores them;
- ``hold_extra``: what the float32 copies of ``loader.F32_HOLD_PREFIXES``
  would add (a speed choice: no per-call upcast of bf16 weights; exact either
  way, since MLX upcasts bf16 to the float32 activations it multiplies);
- ``session``: one session's state at its largest, from the config: the KV
  rings of a default session (:data:`~.runtime.options.DEFAULT_CONTEXT_SECONDS`
  of context, allocated whole at its first frame), which is where a session's
  memory above the weights goes (docs/memory.md has the measured split);
- ``margin``: :data:`MARGIN_FRACTION` of the budget, for the allocator's
  transients and what the estimate leaves out.

The float32 copies are held only where ``stored + hold_extra + session +
margin`` fits the budget; otherwise the weights are used as stored, and so
are the tables derived from them that would otherwise get float32 copies
(the EAR-TTS codebooks, the RNNT LSTM's weights: ``Model.holds_f32``). A
checkpoint whose ``stored + session`` does not fit at all is refused, naming
the profile (:mod:`.profiles`) that would. What is left after the weights and
the margin (:attr:`MemoryPlan.left`) is what the server sizes its sessions
against. On Metal the weights' memory is wired as mlx-lm wires it
(``mx.set_wired_limit``), within the budget.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

logger = logging.getLogger(__name__)

GIB = 2**30
# Share of the budget kept free of the planned weights and session.
MARGIN_FRACTION = 0.1


def device_memory() -> tuple[int, str]:
    """The default budget in bytes and where it comes from."""
    info = mx.device_info()
    for key, source in (("max_recommended_working_set_size", "Metal's recommended working set"),
                        ("total_memory", "the CUDA device's memory"),
                        ("memory_size", "the device's memory")):
        value = info.get(key)
        if isinstance(value, int) and value > 0 and (key != "memory_size"
                                                     or mx.default_device() != mx.cpu):
            return value, source
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"


def budget_bytes(memory_budget: float | None) -> tuple[int, str]:
    """``memory_budget`` (GiB) in bytes, or the device's; a bad value names the field."""
    if memory_budget is None:
        return device_memory()
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) \
            or not math.isfinite(memory_budget) or memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of GiB, got {memory_budget!r}")
    return int(memory_budget * GIB), "--memory-budget"


class BudgetExceeded(ValueError):
    """The checkpoint's weights and one session do not fit the memory budget."""


def session_bytes(config: Any) -> int:
    """One default session's KV rings at their largest (see the module docstring)."""
    from .runtime.options import DEFAULT_CONTEXT_SECONDS
    from .runtime.reservation import ConversationShape, context_frames, kv_bytes

    shape = ConversationShape(0, 0, context_frames(DEFAULT_CONTEXT_SECONDS, config.frame_duration))
    return kv_bytes(config, shape, None)


@dataclass(frozen=True)
class MemoryPlan:
    """What the weights and one session take of the budget, and whether float32 is held."""

    budget: int
    source: str
    stored: int
    hold_extra: int
    session: int
    hold_f32: bool

    @property
    def margin(self) -> int:
        return int(self.budget * MARGIN_FRACTION)

    @property
    def weights(self) -> int:
        """The weights resident as planned."""
        return self.stored + (self.hold_extra if self.hold_f32 else 0)

    @property
    def left(self) -> int:
        """What the sessions may use: the budget less the weights and the margin."""
        return max(self.budget - self.weights - self.margin, 0)

    def sessions_that_fit(self) -> int:
        return self.left // self.session if self.session > 0 else 0

    def describe(self) -> str:
        held = ("float32 copies held (+%.2f GiB)" % (self.hold_extra / GIB) if self.hold_f32
                else "weights used as stored (float32 copies would add %.2f GiB)"
                % (self.hold_extra / GIB))
        return (f"memory budget {self.budget / GIB:.2f} GiB ({self.source}): weights "
                f"{self.weights / GIB:.2f} GiB, {held}; a session's KV rings "
                f"{self.session / GIB:.2f} GiB; {self.left / GIB:.2f} GiB left for sessions "
                f"after a {MARGIN_FRACTION:.0%} margin")


def plan_memory(config: Any, stored: int, hold_extra: int, memory_budget: float | None,
                hold_f32: bool | None = None) -> MemoryPlan:
    """The plan for weights of ``stored`` bytes (``hold_extra`` more held in float32).

    ``hold_f32``: force the choice (``None``: the budget decides). Raises
    :class:`BudgetExceeded`, naming a profile that fits, when even the stored
    weights and one session do not fit.
    """
    budget, source = budget_bytes(memory_budget)
    session = session_bytes(config)
    if stored + session > budget:
        raise BudgetExceeded(_refusal(config, stored, session, budget, source))
    fits = stored + hold_extra + session + int(budget * MARGIN_FRACTION) <= budget
    plan = MemoryPlan(budget, source, stored, hold_extra, session,
                      fits if hold_f32 is None else hold_f32)
    logger.info("%s", plan.describe())
    return plan


def _refusal(config: Any, stored: int, session: int, budget: int, source: str) -> str:
    needed = (stored + session) / GIB
    message = (f"memory_budget: this checkpoint needs {needed:.2f} GiB (weights "
               f"{stored / GIB:.2f} GiB and a session {session / GIB:.2f} GiB), more than "
               f"the {budget / GIB:.2f} GiB budget ({source})")
    sizes = profile_sizes(config)
    fitting = [name for name, size in sizes.items() if size + session <= budget]
    if fitting:
        best = max(fitting, key=sizes.__getitem__)
        return (f"{message}; the {best!r} profile ({sizes[best] / GIB:.2f} GiB of weights) "
                f"fits: mlx-voicechat convert SRC OUT --profile {best}")
    smallest = min(sizes, key=sizes.__getitem__)
    return (f"{message}; no profile fits (the smallest, {smallest!r}, needs "
            f"{(sizes[smallest] + session) / GIB:.2f} GiB)")


def profile_sizes(config: Any, names: Sequence[str] | None = None) -> dict[str, int]:
    """Each profile's weight bytes for ``config``, from the model's shapes (no weight
    is drawn): quantized layers at their bits plus bfloat16 scales and biases per
    group, every other floating parameter bfloat16, buffers at their dtype."""
    from mlx.utils import tree_flatten

    from .models.model import Model
    from .profiles import PROFILES, plan_layers

    model = Model(config)
    params = dict(tree_flatten(model.parameters()))
    modules = {path: int(m.weight.shape[-1]) for path, m in model.named_modules()
               if hasattr(m, "to_quantized") and hasattr(m, "weight")}
    sizes = {}
    for name in names or list(PROFILES):
        plans = plan_layers(name, modules)
        total = 0
        for key, value in params.items():
            module, _, leaf = key.rpartition(".")
            plan = plans.get(module)
            if leaf == "weight" and plan is not None and plan.quantized:
                groups = value.size // plan.group_size
                total += value.size * plan.format.bits // 8 + 2 * groups * 2
            elif mx.issubdtype(value.dtype, mx.floating):
                total += value.size * 2
            else:
                total += value.nbytes
        sizes[name] = total
    return sizes


def fit_sessions(plan: MemoryPlan, max_sessions: int,
                 max_state_bytes: int | None) -> tuple[int, int, str]:
    """``(max_sessions, max_state_bytes, line)`` fitted to what ``plan`` leaves: no more
    sessions than :meth:`MemoryPlan.sessions_that_fit` (at least one, which the
    load has checked fits), and a state budget of what is left
    (:attr:`MemoryPlan.left`; a given one no larger). The pool then measures a
    session's fixed state once at start-up, on a probe stream of a few frames
    (:meth:`~.runtime.reservation.Reservations.fixed_bytes`)."""
    fit = max(plan.sessions_that_fit(), 1)
    sessions = min(max_sessions, fit)
    state = max(plan.left if max_state_bytes is None else min(max_state_bytes, plan.left), 1)
    if max_state_bytes is None:
        bound = f"within {state} bytes of session state (--max-state-bytes unset: what is left)"
    else:
        lowered = "; lowered to what is left" if state < max_state_bytes else ""
        bound = (f"within {state} bytes of session state (--max-state-bytes "
                 f"{max_state_bytes}{lowered})")
    line = (f"{plan.describe()}: up to {sessions} session(s) (--max-sessions {max_sessions}"
            f"{'; fewer fit' if sessions < max_sessions else ''}), {bound}")
    return sessions, state, line


# /v1/audio/transcriptions' default bounds at their least: OpenAI's per-file limit
# (25 MiB, what its clients expect) and ten minutes of audio.
UPLOAD_FLOOR_BYTES = 25 * 2**20
TRANSCRIPTION_FLOOR_SECONDS = 600.0
# At most this many times the floors (an hour of audio, 150 MiB a file).
TRANSCRIPTION_MAX_SCALE = 6.0
# The decoded PCM the host holds for a file: float32 at 16 kHz (3.84 MB a minute).
PCM_BYTES_PER_SECOND = 16_000 * 4
# Share of what the plan leaves the sessions (MemoryPlan.left) that the file
# transcriptions in flight may hold on the host.
TRANSCRIPTION_SHARE = 0.05


def transcription_host_bytes(upload_bytes: int, seconds: float) -> int:
    """What one file transcription holds on the host at most: the upload (two copies
    while it is parsed) and its decoded PCM (the device's share is constant:
    the streaming encoder's windows, whatever the file's length)."""
    return 2 * upload_bytes + int(seconds * PCM_BYTES_PER_SECOND)


def transcription_bounds(plan: MemoryPlan | None, in_flight: int) -> tuple[int, float]:
    """The default ``(max_upload_bytes, max_transcription_seconds)`` of a file
    transcription: the floors (25 MiB, 600 s) scaled so that ``in_flight`` of them
    hold at most :data:`TRANSCRIPTION_SHARE` of what ``plan`` leaves, never below
    the floors and at most :data:`TRANSCRIPTION_MAX_SCALE` times them. Without a
    plan (a model loaded by a caller's own loader): the floors."""
    if plan is None:
        return UPLOAD_FLOOR_BYTES, TRANSCRIPTION_FLOOR_SECONDS
    each = plan.left * TRANSCRIPTION_SHARE / max(in_flight, 1)
    floor = transcription_host_bytes(UPLOAD_FLOOR_BYTES, TRANSCRIPTION_FLOOR_SECONDS)
    scale = min(max(each / floor, 1.0), TRANSCRIPTION_MAX_SCALE)
    return int(UPLOAD_FLOOR_BYTES * scale), TRANSCRIPTION_FLOOR_SECONDS * scale


def wire(plan: MemoryPlan) -> None:
    """On Metal, wire up to the budget (as mlx-lm wires the recommended working set), so
    the weights are not paged out between frames; a no-op elsewhere."""
    if not mx.metal.is_available():
        return
    recommended = mx.device_info().get("max_recommended_working_set_size")
    limit = min(plan.budget, recommended) if isinstance(recommended, int) else plan.budget
    mx.set_wired_limit(limit)
    logger.info("wired limit set to %.2f GiB", limit / GIB)
