"""Running a plan: what happens on each rank.

- :mod:`~hapd.runtime.rewrite` — :func:`distribute`: an exported program and a plan →
  the fx module one rank runs;
- :mod:`~hapd.runtime.adapters` — :data:`~hapd.runtime.adapters.ADAPTERS`: the ops whose
  rule needs more than the local op, keyed on (op name, rule name);
- :mod:`~hapd.runtime.check` — :func:`~hapd.runtime.check.check` (``hapd check``): one
  step of the 1-rank distributed program against eager ``program.module()``;
- :mod:`~hapd.runtime.gradsync` — :class:`~hapd.runtime.gradsync.GradSync`: summing
  replicated parameters' gradients over ranks during backward;
- :mod:`~hapd.runtime.collectives` — uneven collectives between layouts, as autograd
  functions;
- :mod:`~hapd.runtime.distributed` — :func:`~hapd.runtime.distributed.init_distributed`:
  joining the job (the process group and this rank's device).

The benchmark worker and baselines built on it live in :mod:`hapd.harness`.
"""
