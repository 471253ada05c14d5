"""The user's API: :func:`hapd.parallelize` and the modules users train, where a job's
plan comes from, the data loaders, mixed-length steps, ``hapd check`` and telemetry.

From the ground floor up:

- :mod:`~hapd.train.check` — :func:`~hapd.train.check.check` (``hapd check``): one
  step of the 1-rank distributed program against eager ``program.module()``;
- :mod:`~hapd.train.data` — :func:`hapd.loader` and the uneven samplers;
- :mod:`~hapd.train.mixed_length` — :func:`hapd.mixed_loader`: sequences of any length
  packed into rows from a pool of shapes, split over ranks by cost;
- :mod:`~hapd.train.precision` — a plan's precision at run time: the forward under
  ``torch.autocast`` to its dtype;
- :mod:`~hapd.train.scaler` — :class:`hapd.GradScaler`: fp16 loss scaling whose inf check
  spans every rank;
- :mod:`~hapd.train.telemetry` — a module's per-training-step times for the launcher,
  progress and logs;
- :mod:`~hapd.train.programs` — a model's other programs (eval forward, other batch
  sizes): :class:`~hapd.train.programs.Recipe`, :func:`~hapd.train.programs.aligned_force`;
- :mod:`~hapd.train.plan_source` — where a job's plan comes from
  (:func:`~hapd.train.plan_source.obtain_plan`: given, the daemon, or rank 0);
- :mod:`~hapd.train.parallel_module` — :class:`~hapd.train.parallel_module.ParallelModule`,
  the module users train;
- :mod:`~hapd.train.pipeline_module` — the module users train when the plan is a
  pipeline;
- :mod:`~hapd.train.parallelize` — :func:`hapd.parallelize`.

The benchmark worker and baselines built on it live in :mod:`hapd.harness`.
"""
