"""The kernel counter (instruments/kernels.py) counts what was evaluated, not what was declared.

Known small graphs give known counts: every non-view primitive once, views
not at all, a compiled elementwise chain once per call, nothing for arrays
already evaluated; one planted extra primitive changes the count by one. A
pool step of the tiny fixture is counted too, and its evaluations do not grow
with the batch.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.instruments.kernels import KernelCounter, graph_primitives, kernel_count


def _graph(extra: bool = False):
    a = mx.arange(12, dtype=mx.float32).reshape(3, 4)  # Arange; Reshape is a view
    b = a @ a.T  # Transpose (view), Matmul
    c = mx.exp(b) + 1.0  # Exp, Add (the scalar's Broadcast is a view)
    if extra:
        c = mx.sin(c)  # the planted extra primitive
    return c.sum(axis=-1)  # Sum, then a Squeeze (view)


def test_a_known_graph_gives_its_known_count():
    with KernelCounter() as counter:
        mx.eval(_graph())
    assert counter.evaluations == 1 and counter.calls == ["eval"]
    views = {"Reshape", "Transpose", "Broadcast", "Squeeze"}  # seen, but not kernels
    assert {n for n in counter.primitives if n not in views} == \
        {"Arange", "Matmul", "Exp", "Add", "Sum"}, counter.primitives
    assert all(counter.primitives[v] == 1 for v in views)
    assert counter.kernels == 5


@pytest.mark.parametrize("extra", [False, True])
def test_a_planted_primitive_is_counted(extra):
    with KernelCounter() as counter:
        mx.eval(_graph(extra))
    # Fails (by design) when the planted primitive is not seen.
    assert counter.kernels == 5 + int(extra)


def test_a_compiled_chain_counts_once_per_call():
    chain = mx.compile(lambda x: mx.tanh(mx.exp(x) * 2.0 + x))
    x = mx.ones((8,))
    mx.eval(x)
    with KernelCounter() as counter:
        mx.eval(chain(x), chain(x + 1.0))
    assert counter.kernels == 3, counter.primitives  # two fused calls and the Add
    assert sum(n for k, n in counter.primitives.items() if k.startswith("Compiled")) == 2


def test_evaluated_arrays_and_repeat_reads_are_not_evaluations():
    a = mx.arange(4) * 2
    with KernelCounter() as counter:
        b = a + 1  # ``a`` is still lazy: Arange, Multiply, Add
        mx.async_eval(b)  # synchronous while counting: later reads find nothing to do
        mx.eval(b)
        b.tolist()
        np.array(b)
        (b * 3).sum().item()  # Multiply, Sum
    assert counter.calls == ["async_eval", "item"]
    assert counter.evaluations == 2 and counter.kernels == 5


def test_counter_restores_mlx_and_ignores_other_threads():
    originals = (mx.eval, mx.async_eval, mx.array.item, np.array)
    seen = []
    with KernelCounter() as counter:
        worker = threading.Thread(target=lambda: seen.append(mx.eval(mx.ones(3) + 1)))
        worker.start()
        worker.join()
        with pytest.raises(RuntimeError):
            KernelCounter().__enter__()
    assert counter.evaluations == 0
    assert (mx.eval, mx.async_eval, mx.array.item, np.array) == originals


def test_graph_primitives_of_nothing_pending_is_empty():
    a = mx.ones(3) * 2
    mx.eval(a)
    assert graph_primitives(a) == {} and kernel_count(graph_primitives([a, []])) == 0


def test_a_pool_step_is_counted_and_its_evaluations_do_not_grow_with_n(tiny_ckpt):
    from bench.kernels import count_steps
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    voicechat = model.create_session(processor)
    # A first run memoizes the subword embeddings of the tokens row 0 says (a new
    # token's embedding is computed once per model), so both counts below see them.
    # Most steps cost the same, a few a few hundred kernels more; a median of two
    # is their mean (one heavy step outweighed two rows' work), of four a steady step.
    count_steps(voicechat, 1, warm_frames=8, frames=2)
    one = count_steps(voicechat, 1, warm_frames=8, frames=4)
    three = count_steps(voicechat, 3, warm_frames=8, frames=4)
    assert one["kernels"]["min"] > 100 and one["matmuls"]["min"] > 0
    assert three["kernels"]["median"] >= one["kernels"]["median"]
    assert three["evaluations"]["max"] <= one["evaluations"]["max"]


def test_nodes_count_views_too():
    with KernelCounter() as counter:
        mx.eval(_graph())
    assert counter.nodes == counter.kernels + counter.views == 9  # 5 kernels, 4 views
    assert counter.snapshot()["nodes"] == 9


def test_host_ms_counts_the_threads_cpu_work_not_its_waits():
    """A planted piece of host work moves the figure; a wait (as for MLX's own
    threads computing) does not."""
    import time

    from mlx_voicechat_plugin.instruments.kernels import host_ms

    def work() -> None:
        sum(i * i for i in range(400_000))

    base = host_ms(lambda: None)
    planted = host_ms(work)
    waited = host_ms(lambda: time.sleep(0.2))
    assert planted > base + 2.0, (base, planted)
    assert waited < 100.0, waited  # 200 ms of wall, little CPU


def test_the_host_bench_sets_the_plugin_beside_the_reference(tiny_ckpt):
    """``bench.host``: both sides stepped frame by frame, host CPU per frame and the
    counts of each, as ratios plugin / reference."""
    from mlx_vlm.utils import load as reference_load

    from bench.host import side_by_side
    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.testing.fixtures import question_signal

    model, processor = load(tiny_ckpt)
    ref, ref_processor = reference_load(str(tiny_ckpt))
    frame = model.config.frame_samples
    report = side_by_side(model.create_session(processor), ref.create_session(ref_processor),
                          question_signal(2.0), frame, warm=4, frames=2, rounds=2)
    assert len(report["host_ratio_rounds"]) == 2 and report["host_ratio"] > 0
    for key in ("kernels", "nodes", "views", "evaluations"):
        assert report[key]["plugin"] > 0 and report[key]["reference"] > 0, key
    assert report["nodes"]["plugin"] > report["kernels"]["plugin"]


def test_thread_waits_counts_the_threads_blocks_not_its_work():
    """A planted run of waits moves the count by at least one a wait; CPU work alone
    does not block (where the system counts per thread)."""
    from mlx_voicechat_plugin.instruments.kernels import thread_waits

    if thread_waits() is None:
        pytest.skip("this system does not count context switches per thread")
    event = threading.Event()
    before = thread_waits()
    for _ in range(20):
        event.wait(0.001)
    planted = thread_waits() - before
    before = thread_waits()
    sum(i * i for i in range(200_000))
    working = thread_waits() - before
    assert planted >= 20, planted
    assert working <= 2, working


def test_the_host_bench_reports_waits_per_frame(tiny_ckpt):
    """``bench.host`` gives each side's waits per frame beside its host CPU."""
    from mlx_vlm.utils import load as reference_load

    from bench.host import side_by_side
    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.instruments.kernels import thread_waits
    from mlx_voicechat_plugin.testing.fixtures import question_signal

    model, processor = load(tiny_ckpt)
    ref, ref_processor = reference_load(str(tiny_ckpt))
    report = side_by_side(model.create_session(processor), ref.create_session(ref_processor),
                          question_signal(2.0), model.config.frame_samples, warm=4, frames=2,
                          rounds=1)
    if thread_waits() is None:
        assert report["waits"] == {"plugin": None, "reference": None}
    else:
        assert all(report["waits"][side] >= 0 for side in ("plugin", "reference"))


def test_evaluation_time_counts_only_what_runs_inside_an_evaluation():
    """Host work planted inside an evaluating call (a large graph evaluated) lands in the
    clock; the same work done in Python outside any evaluation does not, and neither do
    other threads' evaluations."""
    from mlx_voicechat_plugin.instruments.kernels import EvaluationTime

    def big_graph():
        x = mx.ones((64,))
        for _ in range(3000):  # many small nodes: the evaluation's own host work
            x = x * 1.0001 + 0.5
        return x

    with EvaluationTime() as clock:
        sum(i * i for i in range(400_000))  # outside: Python only
        outside_only = clock.ms
        graph = big_graph()
        mx.eval(graph)
        np.array(mx.ones((3,)) + 1)  # a host read evaluates too
        other = threading.Thread(target=lambda: mx.eval(big_graph()))
        other.start()
        other.join()
    assert outside_only == 0.0 and clock.calls == 2, (outside_only, clock.calls)
    assert clock.ms > 1.0, clock.ms
    assert mx.eval is not None and not hasattr(mx.eval, "__wrapped__")  # put back on leaving


def test_rnnt_tries_counts_the_graphs_queued_by_tries_on_its_thread(tiny_ckpt):
    """The later tries count once per frame that queued them (a first try emitted, read
    from the frame's own symbols), the first tries once per frame; another thread's
    tries are not counted, and leaving puts the greedy's call back."""
    import threading

    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.instruments.rnnt_tries import RNNTTries
    from mlx_voicechat_plugin.models.rnnt.rnnt import GreedyRNNT, RNNTCarry, RNNTFrame

    model, processor = load(tiny_ckpt)
    greedy = model.create_session(processor).new_rnnt_state().greedy
    width = model.config.audio_config.encoder.d_model
    original = GreedyRNNT.__call__
    emitted = 0
    with RNNTTries() as tries:
        for scale in (0.0, 1.0, -3.0, 7.0):
            carry = RNNTCarry.merge([greedy.initial(mx.float32) for _ in range(2)])
            frame = RNNTFrame(greedy, carry, mx.full((2, 1, width), scale))
            mx.eval(frame.arrays)
            mx.eval(frame.rest())
            emitted += any(s[0] != greedy.blank_id for s in frame.symbols())
        other = threading.Thread(target=lambda: mx.eval(greedy(
            mx.ones((1, 1, width)), RNNTCarry.merge([greedy.initial(mx.float32)]), 1)))
        other.start()
        other.join()
    assert GreedyRNNT.__call__ is original
    assert 0 < emitted < 4, emitted  # both kinds of frame were seen
    assert tries.first == 4 and tries.later == emitted
    assert tries.by_tries == ({1: 4, greedy.max_symbols - 1: emitted} if emitted else {1: 4})
