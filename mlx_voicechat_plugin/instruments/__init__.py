"""Measurement instruments for benches and tests, never on a session's path.

:mod:`.kernels` counts the kernels an evaluation launches and a step's host
work (:class:`~.kernels.KernelCounter`, :func:`~.kernels.host_work`);
:mod:`.syncs` counts host synchronisations (:class:`~.syncs.HostSyncCounter`,
used by a profiled frame: ``MLX_VOICECHAT_PROFILE``); :mod:`.matmuls`
records matrix products by shape; :mod:`.eval_patch` is how they see
``mx.eval`` (patched only while one is active). The runtime imports none of
them at module level (``tests/test_import_graph.py``).
"""
