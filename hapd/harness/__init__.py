"""The benchmark and training harness: the scripts that train hapd's benchmark models
with a plan or with a PyTorch baseline and time them. It is built on the library
(:mod:`hapd.train`, :mod:`hapd.spmd`, :mod:`hapd.compiler`, :mod:`hapd.models`) and never imported by
it; ``worker.py``, ``ddp.py``, ``fsdp.py`` and ``python -m hapd.worker|ddp|fsdp`` are
its entry points.

- :mod:`~hapd.harness.training` — the training harness shared by the worker and the
  baselines (flags, synthetic batches, the timed loop, timing lines);
- :mod:`~hapd.harness.worker` — ``worker.py`` / ``python -m hapd.worker``: a model
  trained with a hapd plan;
- :mod:`~hapd.harness.ddp` — ``ddp.py`` / ``python -m hapd.ddp``: the DP-EV and DP-CP
  baselines;
- :mod:`~hapd.harness.fsdp` — ``fsdp.py`` / ``python -m hapd.fsdp``: the fully sharded
  data-parallel baseline (PyTorch FSDP2);
- :mod:`~hapd.harness.memtrack` — :class:`~hapd.harness.memtrack.LiveTensorBytes`: the
  peak tensor memory of a training step, on CPU as on GPU.
"""
