"""Measuring a cluster into a profile (:mod:`hapd.profile`): it runs collectives, so it
sits above :mod:`hapd.spmd`.

- :mod:`~hapd.profiler.machine` — this machine's devices: memory, a linear probe of speed
  (torch is imported inside its functions);
- :mod:`~hapd.profiler.local` — the profile of a job given none: its devices as they are;
- :mod:`~hapd.profiler.measure` — what every rank measures: FLOP/s, memory, collective
  times;
- :mod:`~hapd.profiler.driver` — ``hapd profile`` / ``python -m hapd.profiler``: the driver
  and CLI (starts the ranks, loads the measuring code only when it runs);
- :mod:`~hapd.profiler.rank_script` — the rank program of ``python -m launcher profile``.
"""
